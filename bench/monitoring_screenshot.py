"""A screenshot of the monitoring under load, for docs/operations.md: one `adaptlm serve`, a real Prometheus
scraping it with deploy/prometheus's rules, the locust mix for `--seconds`, then the dashboard's key queries in
Prometheus's own graph page, captured by the system Chromium (playwright).

Grafana itself is not installable here (not in Debian's archive, PyPI or npm), so the picture is Prometheus's
view of the same series the Grafana dashboard (deploy/grafana/adaptlm.json) draws.

    python -m bench.monitoring_screenshot [--seconds 90] [--out docs/img/monitoring.png]
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.parse
from pathlib import Path

import httpx
import yaml
from playwright.sync_api import sync_playwright

from bench._common import DEFAULT_CHECKPOINT
from server.launch import free_port, stop, wait_ready

ROOT = Path(__file__).resolve().parent.parent
PANELS = [  # (query, what it shows): the dashboard's core, by its recording rules and raw series
    ("sum by (route) (adaptlm:http_requests:rate1m)", "request rate per route"),
    ("adaptlm:suggest_duration_seconds:p99_5m", "suggest p99"),
    ("adaptlm:time_to_first_token_seconds:p99_5m", "time to first token p99"),
    ("adaptlm_queue_depth", "queue depth"),
    ("adaptlm_active_sessions", "sessions"),
]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seconds", type=int, default=90)
    ap.add_argument("--out", type=Path, default=ROOT / "docs/img/monitoring.png")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        tmpd = Path(tmp)
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        log = open(tmpd / "server.log", "wb")  # noqa: SIM115
        server = subprocess.Popen([sys.executable, "-m", "adaptlm", "serve", "--checkpoint", str(DEFAULT_CHECKPOINT),
                                   "--host", "127.0.0.1", "--port", str(port)], stdout=log, stderr=subprocess.STDOUT)
        prom = None
        try:
            if not wait_ready(url, server, time.monotonic() + 300):
                raise SystemExit("the server did not start")
            config = yaml.safe_load((ROOT / "deploy/prometheus/prometheus.yml").read_text())
            config["global"] = {"scrape_interval": "2s", "evaluation_interval": "2s"}
            config["rule_files"] = [str(ROOT / "deploy/prometheus/adaptlm.rules.yml")]
            config["scrape_configs"][0]["static_configs"] = [{"targets": [f"127.0.0.1:{port}"]}]
            (tmpd / "prometheus.yml").write_text(yaml.safe_dump(config))
            prom_port = free_port()
            prom_url = f"http://127.0.0.1:{prom_port}"
            prom = subprocess.Popen([shutil.which("prometheus") or "/usr/bin/prometheus",
                                     f"--config.file={tmpd / 'prometheus.yml'}", f"--storage.tsdb.path={tmpd / 'data'}",
                                     f"--web.listen-address=127.0.0.1:{prom_port}"],
                                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                try:
                    if httpx.get(f"{prom_url}/-/ready", timeout=2).status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                time.sleep(0.5)
            subprocess.run([sys.executable, "-m", "loadtest.run", "--url", url, "--users", "8", "--run-time",
                            f"{args.seconds}s", "--out", str(tmpd / "loadtest")], check=False,
                           stdout=subprocess.DEVNULL)
            query = {}
            for i, (expr, _) in enumerate(PANELS):
                window = f"{max(2, args.seconds // 60 + 1)}m"
                query.update({f"g{i}.expr": expr, f"g{i}.tab": "0", f"g{i}.range_input": window})
            page_url = f"{prom_url}/graph?{urllib.parse.urlencode(query)}"
            with sync_playwright() as p:
                browser = p.chromium.launch(executable_path="/usr/bin/chromium", args=["--no-sandbox"])
                page = browser.new_page(viewport={"width": 1400, "height": 900})
                page.goto(page_url)
                page.add_style_tag(content="nav { display: none !important; }")  # fixed: it lands mid-page
                page.wait_for_timeout(5000)
                args.out.parent.mkdir(parents=True, exist_ok=True)
                page.screenshot(path=str(args.out), full_page=True)
                browser.close()
            print(f"wrote {args.out} ({', '.join(what for _, what in PANELS)})")
        finally:
            if prom is not None:
                stop(prom)
            stop(server)
            log.close()


if __name__ == "__main__":
    main()
