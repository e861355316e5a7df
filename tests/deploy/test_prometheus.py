"""The monitoring assets in deploy/: promtool validates them, a real Prometheus scrapes a live server with
them and evaluates the rules, and every PromQL expression (rules and the Grafana dashboard) names only series
the server exports."""

from __future__ import annotations

import functools
import json
import re
import socket
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
PROMETHEUS = ROOT / "deploy" / "prometheus"
CONFIG = PROMETHEUS / "prometheus.yml"
RULES = PROMETHEUS / "adaptlm.rules.yml"
DASHBOARD = ROOT / "deploy" / "grafana" / "adaptlm.json"
RULE_TESTS = Path(__file__).resolve().parent / "rules_test.yml"  # promtool's unit tests of the rules
# Series the dashboards and rules must find once the server has had traffic.
KEY_SERIES = (
    "adaptlm_http_requests_total", "adaptlm_http_request_duration_seconds_bucket",
    "adaptlm_suggest_duration_seconds_bucket", "adaptlm_time_to_first_token_seconds_bucket",
    "adaptlm_inter_token_latency_seconds_bucket", "adaptlm_generated_tokens_total", "adaptlm_batch_rows_bucket",
    "adaptlm_queue_depth", "adaptlm_active_sessions", "adaptlm_session_store_bytes",
    "adaptlm_adaptation_updates_total", "adaptlm_session_evictions_total", "adaptlm_nonfinite_resets_total",
)
# Words of PromQL that look like metric names: functions, aggregations, operators, modifiers.
_PROMQL_WORDS = {
    "sum", "min", "max", "avg", "count", "stddev", "stdvar", "topk", "bottomk", "quantile", "count_values", "group",
    "by", "without", "on", "ignoring", "group_left", "group_right", "bool", "and", "or", "unless", "offset",
    "rate", "irate", "increase", "delta", "histogram_quantile", "max_over_time", "min_over_time",
    "avg_over_time", "sum_over_time", "vector", "scalar", "abs", "clamp_min", "clamp_max", "absent", "time",
}
SYNTHETIC = {"up"}  # series Prometheus itself adds to every target


def metric_names(expr: str) -> set[str]:
    """The metric (and recording rule) names a PromQL expression selects."""
    expr = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)  # strings (label values)
    expr = re.sub(r"\{[^}]*\}", " ", expr)  # label matchers
    expr = re.sub(r"\[[^\]]*\]", " ", expr)  # range and subquery windows
    expr = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", expr)  # label lists
    expr = re.sub(r"\$\{?\w+\}?", " ", expr)  # Grafana variables
    names = re.findall(r"(?<![\w:.])([A-Za-z_:][A-Za-z0-9_:]*)(?![\w:])(?!\s*\()", expr)
    return {name for name in names if name not in _PROMQL_WORDS}


def rule_groups() -> list[dict[str, Any]]:
    return list(yaml.safe_load(RULES.read_text())["groups"])


def rule_expressions() -> list[str]:
    return [str(rule["expr"]) for group in rule_groups() for rule in group["rules"]]


def recorded_names() -> set[str]:
    return {rule["record"] for group in rule_groups() for rule in group["rules"] if "record" in rule}


def dashboard_expressions() -> list[str]:
    dashboard = json.loads(DASHBOARD.read_text())
    return [target["expr"] for panel in dashboard["panels"] for target in panel.get("targets", [])]


def exported_series(url: str) -> set[str]:
    """Sample names in the server's /metrics (what PromQL selects: `x_total`, `x_bucket`, ...)."""
    return set(exported_labels(url))


def exported_labels(url: str) -> dict[str, set[str]]:
    """Sample name -> the label names its samples carry in the server's /metrics."""
    text = httpx.get(f"{url}/metrics", timeout=30).text
    labels: dict[str, set[str]] = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, rest = line.partition("{")
            name = name.split(" ", 1)[0]
            labels.setdefault(name, set()).update(re.findall(r'(\w+)="', rest.rsplit("}", 1)[0]) if rest else ())
    return labels


def used_labels(expr: str) -> tuple[dict[str, set[str]], set[str]]:
    """The labels an expression matches on, by series (`x{a="1"}` -> {x: {a}}), and those it groups by."""
    matched: dict[str, set[str]] = {}
    for name, matchers in re.findall(r"([A-Za-z_:][A-Za-z0-9_:]*)\{([^}]*)\}", expr):
        matched.setdefault(name, set()).update(re.findall(r"(\w+)\s*(?:=~|!~|!=|=)", matchers))
    grouped = {label.strip() for group in re.findall(r"\b(?:by|without|on|ignoring)\s*\(([^)]*)\)", expr)
               for label in group.split(",") if label.strip()}
    return matched, grouped


def test_metric_names_parser() -> None:
    expr = ('histogram_quantile(0.99, sum by (route, le) (rate(adaptlm_x_bucket{status=~"5..", a="b c"}[5m])))'
            ' / ignoring(le) sum(rate(adaptlm:y:rate1m[$__rate_interval])) > 0.9 * 256 or vector(0)')
    assert metric_names(expr) == {"adaptlm_x_bucket", "adaptlm:y:rate1m"}


def test_promtool_check_config_and_rules(promtool: str) -> None:
    config = subprocess.run([promtool, "check", "config", str(CONFIG)], capture_output=True, text=True)
    assert config.returncode == 0, config.stdout + config.stderr
    rules = subprocess.run([promtool, "check", "rules", str(RULES)], capture_output=True, text=True)
    assert rules.returncode == 0, rules.stdout + rules.stderr
    assert "SUCCESS" in rules.stdout


def test_rules_mean_what_the_runbook_says(promtool: str) -> None:
    """promtool's unit tests of the rules on synthetic series (tests/deploy/rules_test.yml): each alert fires when
    docs/operations.md says, and not otherwise (a burst long gone, an idle server, refusals of another kind)."""
    result = subprocess.run([promtool, "test", "rules", str(RULE_TESTS)], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    tested = {case["alertname"] for test in yaml.safe_load(RULE_TESTS.read_text())["tests"]
              for case in test.get("alert_rule_test", [])}
    alerts = {rule["alert"] for group in rule_groups() for rule in group["rules"] if "alert" in rule}
    assert alerts <= tested, f"alerts without a unit test in {RULE_TESTS.name}: {sorted(alerts - tested)}"


def test_every_expression_names_exported_series(live_url: str) -> None:
    exported = exported_series(live_url)
    for name in KEY_SERIES:
        assert name in exported, f"the server no longer exports {name}"
    known = exported | recorded_names() | SYNTHETIC
    expressions = rule_expressions() + dashboard_expressions()
    assert len(dashboard_expressions()) >= 20
    for expr in expressions:
        names = metric_names(expr)
        assert names, f"no series in {expr!r}"
        assert names <= known, f"{expr!r} names series the server does not export: {sorted(names - known)}"


def test_every_expression_uses_labels_the_series_have(live_url: str) -> None:
    labels = exported_labels(live_url)
    # a recording rule's series carry the labels it aggregates by
    for group in rule_groups():
        for rule in group["rules"]:
            if "record" in rule:
                labels[rule["record"]] = used_labels(str(rule["expr"]))[1]
    target = {"job", "instance"}  # added by Prometheus to every scraped series
    labels["up"] = set()
    for expr in rule_expressions() + dashboard_expressions():
        matched, grouped = used_labels(expr)
        for name, names in matched.items():
            missing = names - labels[name] - target
            assert not missing, f"{expr!r}: {name} has no label {sorted(missing)} in /metrics"
        available = set().union(*(labels[name] for name in metric_names(expr))) | target
        assert grouped <= available, f"{expr!r} groups by {sorted(grouped - available)}, which its series lack"


def test_dashboard_covers_the_issue_panels() -> None:
    text = " ".join(dashboard_expressions())
    for name in ("adaptlm_http_requests_total", "adaptlm_http_request_duration_seconds_bucket",
                 "adaptlm_suggest_duration_seconds_bucket", "adaptlm_time_to_first_token_seconds_bucket",
                 "adaptlm_generated_tokens_total", "adaptlm_batch_rows", "adaptlm_queue_depth",
                 "adaptlm_active_sessions", "adaptlm_session_store_bytes", "adaptlm_adaptation_updates_total",
                 "adaptlm_session_evictions_total", "adaptlm_nonfinite_resets_total",
                 "adaptlm_refused_requests_total"):  # by reason: 409 session_conflict is in no ratio
        assert name in text, f"no panel shows {name}"


# -- a real Prometheus ---------------------------------------------------------------------------------


@pytest.fixture
def prometheus(prometheus_binary: str, live_url: str, tmp_path: Path) -> Iterator[str]:
    """Prometheus on a free loopback port, scraping the live server every second with deploy's rules -> its URL."""
    target = live_url.removeprefix("http://")
    config = yaml.safe_load(CONFIG.read_text())
    config["global"] = {"scrape_interval": "1s", "evaluation_interval": "1s"}
    config["rule_files"] = [str(RULES)]
    config["scrape_configs"][0]["static_configs"] = [{"targets": [target]}]
    path = tmp_path / "prometheus.yml"
    path.write_text(yaml.safe_dump(config))
    for _ in range(3):  # the port is chosen, then bound by prometheus: another process may take it between
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        log = open(tmp_path / f"prometheus-{port}.log", "wb")  # noqa: SIM115
        process = subprocess.Popen([prometheus_binary, f"--config.file={path}",
                                    f"--storage.tsdb.path={tmp_path / 'data'}",
                                    f"--web.listen-address=127.0.0.1:{port}"],
                                   stdout=log, stderr=subprocess.STDOUT)
        url = f"http://127.0.0.1:{port}"
        try:
            deadline = time.monotonic() + 30
            while process.poll() is None and time.monotonic() < deadline:
                try:
                    if _http().get(f"{url}/-/ready", timeout=2).status_code == 200:
                        yield url
                        return
                except httpx.TransportError:
                    pass
                time.sleep(0.2)
        finally:
            if process.poll() is None:
                process.terminate()
                try:
                    process.wait(15)
                except subprocess.TimeoutExpired:
                    process.kill()
                    process.wait()
            log.close()
    raise RuntimeError(f"prometheus did not start (see the logs in {tmp_path})")


@functools.cache
def _http() -> httpx.Client:
    """One client for the polls and queries: `httpx.get` builds one, with its TLS context, each time (~40 ms of
    CPU)."""
    return httpx.Client(timeout=10)


def _query(prometheus: str, expr: str) -> list[dict[str, Any]]:
    answer = _http().get(f"{prometheus}/api/v1/query", params={"query": expr}).json()
    assert answer["status"] == "success", (expr, answer)
    return list(answer["data"]["result"])


def _until(check: Any, timeout: float, what: str, during: Any = None) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        found = check()
        if found:
            return found
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} within {timeout} s")
        if during is not None:
            during()
        time.sleep(0.5)


def test_prometheus_scrapes_the_server_and_evaluates_the_rules(prometheus: str, live_url: str,
                                                               send_traffic: Callable[[str], None]) -> None:
    def target_up() -> bool:
        targets = _http().get(f"{prometheus}/api/v1/targets").json()["data"]["activeTargets"]
        return any(t["labels"]["job"] == "adaptlm" and t["health"] == "up" for t in targets)

    _until(target_up, 30, "the target is up")
    assert _query(prometheus, 'up{job="adaptlm"}')[0]["value"][1] == "1"
    for name in KEY_SERIES:
        _until(lambda name=name: _query(prometheus, name), 15, f"{name} is scraped")
    # rates need two scrapes with traffic between them; the rules run every second
    for name in ("adaptlm:http_requests:rate1m", "adaptlm:http_errors:ratio_rate5m",
                 "adaptlm:http_request_duration_seconds:p99_5m", "adaptlm:suggest_duration_seconds:p99_5m",
                 "adaptlm:time_to_first_token_seconds:p99_5m", "adaptlm:queue_depth:max5m"):
        _until(lambda name=name: _query(prometheus, name), 30, f"the recording rule {name} has a value",
               during=lambda: send_traffic(live_url))
    ratio = float(_query(prometheus, "adaptlm:http_errors:ratio_rate5m")[0]["value"][1])
    assert ratio == 0.0  # no 5xx: a number (not "no data"), so the alert can see it
    groups = _http().get(f"{prometheus}/api/v1/rules").json()["data"]["groups"]
    rules = [rule for group in groups for rule in group["rules"]]
    assert len(rules) == len(rule_expressions())
    for rule in rules:
        assert rule["health"] == "ok", rule
    active = {rule["name"]: rule["state"] for rule in rules
              if rule["type"] == "alerting" and rule["state"] != "inactive"}
    # A latency alert may be pending: a handful of suggestions on a busy machine (the first one cold) can have a p99
    # over 100 ms, which is this machine's speed, not a fault; it would need 10 minutes of it to fire.
    unexpected = {name: state for name, state in active.items() if (name, state) != ("AdaptlmSuggestSlow", "pending")}
    assert unexpected == {}, f"alerts fire on a healthy server: {unexpected}"
    # every dashboard query is valid PromQL to this Prometheus
    for expr in dashboard_expressions():
        _query(prometheus, expr.replace("$__rate_interval", "1m"))
