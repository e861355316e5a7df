"""deploy/compose.yaml's topology without containers: two `adaptlm serve` replicas on loopback ports sharing a real
redis-server (run with compose's Redis settings), behind a real nginx run with the balancer configuration compose
and Kubernetes use (deploy/nginx/adaptlm.conf.template, filled in as the nginx image does: bench/_replicas.py, which
bench.capacity --replicas shares). A session keeps to one replica; a session observed once through the other replica
and back is served as stored, not as the first replica's copy; when that replica is killed (SIGKILL) its session
moves to the other and keeps adapting exactly as a single server given the same acknowledged observes; an observe in
flight on the dying replica answers 502 and leaves the session as it was. And compose.yaml's structure, which no
container engine checks here."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import torch
import yaml
from safetensors.torch import load

from bench._replicas import COMPOSE, compose, compose_redis, nginx_balancer
from bench._replicas import binary as shared_binary
from server.launch import free_port, stop, wait_ready
from server.settings import Settings

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
TEXTS = ["It is a truth universally acknowledged, that a single man in possession",
         " of a good fortune, must be in want of a wife. However little known",
         " the feelings or views of such a man may be on his first entering",
         " a neighbourhood, this truth is so well fixed in the minds of the",
         " surrounding families, that he is considered the rightful property"]


def binary(name: str, *dirs: str) -> str:
    try:
        return shared_binary(name, *dirs)
    except RuntimeError as e:
        pytest.fail(str(e), pytrace=False)


# -- compose.yaml ------------------------------------------------------------------------------------------------


def test_compose_topology() -> None:
    spec = compose()
    services = spec["services"]
    assert set(services) == {"redis", "adaptlm-1", "adaptlm-2", "balancer", "prometheus", "grafana"}
    fields = set(Settings.model_fields)
    for name in ("adaptlm-1", "adaptlm-2"):
        replica = services[name]
        assert replica["build"]["context"] == ".." and (COMPOSE.parent / ".." / "Dockerfile").exists()
        assert "ports" not in replica, "replicas are reached through the balancer (and scraped directly)"
        env = replica["environment"]
        assert all(k.startswith("ADAPTLM_") for k in env)
        assert {k.removeprefix("ADAPTLM_").lower() for k in env} <= fields
        assert env["ADAPTLM_SESSION_STORE"] == "redis://redis:6379/0", "replicas share their sessions through Redis"
        assert replica["depends_on"]["redis"]["condition"] == "service_healthy"
    # Redis: persistent, and never evicting on its own (docs/architecture.md)
    command = services["redis"]["command"]
    assert command[command.index("--appendonly") + 1] == "yes"
    assert command[command.index("--maxmemory-policy") + 1] == "noeviction"
    assert any(v.endswith(":/data") for v in services["redis"]["volumes"])
    assert set(spec["volumes"]) >= {"redis-data", "prometheus-data", "grafana-data"}
    # the balancer: the shared template, both replicas, the published API port
    balancer = services["balancer"]
    assert "./nginx/adaptlm.conf.template:/etc/nginx/templates/adaptlm.conf.template:ro" in balancer["volumes"]
    assert balancer["ports"] == [f"{balancer['environment']['BALANCER_PORT']}:8000"]
    servers = re.findall(r"server (\S+):(\d+)", balancer["environment"]["BALANCER_SERVERS"])
    assert servers == [("adaptlm-1", "8000"), ("adaptlm-2", "8000")]
    assert services["adaptlm-1"]["expose"] == [str(Settings().port)]  # the image's ADAPTLM_PORT
    # Prometheus scrapes each replica with the shipped rules; Grafana is provisioned with the dashboard
    prometheus = services["prometheus"]
    assert "./prometheus:/etc/prometheus:ro" in prometheus["volumes"]
    config_name = next(a for a in prometheus["command"] if a.startswith("--config.file=")).rsplit("/", 1)[1]
    scrape = yaml.safe_load((DEPLOY / "prometheus" / config_name).read_text())
    assert scrape["scrape_configs"][0]["static_configs"][0]["targets"] == ["adaptlm-1:8000", "adaptlm-2:8000"]
    assert scrape["rule_files"] == ["adaptlm.rules.yml"]
    grafana = services["grafana"]["volumes"]
    assert "./grafana/adaptlm.json:/var/lib/grafana/dashboards/adaptlm.json:ro" in grafana
    for mount in (*services["balancer"]["volumes"], *prometheus["volumes"], *grafana):
        source = mount.split(":", 1)[0]
        assert not source.startswith(".") or (DEPLOY / source).exists(), mount


def test_compose_prometheus_config_is_valid() -> None:
    promtool = binary("promtool", "/usr/bin")
    result = subprocess.run([promtool, "check", "config", str(DEPLOY / "prometheus" / "prometheus.compose.yml")],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


# -- the topology without containers ------------------------------------------------------------------------------


@dataclass
class Replica:
    url: str
    address: str  # as nginx's $upstream_addr names it
    process: subprocess.Popen[bytes]


@contextmanager
def run_server(checkpoint: Path, log: Path, env: dict[str, str]) -> Iterator[Replica]:
    port = free_port()
    with open(log, "ab") as out:
        process = subprocess.Popen([sys.executable, "-m", "adaptlm", "serve", "--host", "127.0.0.1", "--port",
                                    str(port), "--checkpoint", str(checkpoint)], stdout=out,
                                   stderr=subprocess.STDOUT, env={**os.environ, **env, "ADAPTLM_PRECISION": "float32"})
        try:
            yield Replica(f"http://127.0.0.1:{port}", f"127.0.0.1:{port}", process)
        finally:
            stop(process)


@dataclass
class Topology:
    balancer: str
    replicas: list[Replica]
    single: str  # a server of its own (memory store, in this process): the replay


@pytest.fixture(scope="module")
def topology(tiny_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Topology]:
    """The topology, for this file's tests in their order: the last kills a replica."""
    from tests.server.conftest import serve

    tmp_path = tmp_path_factory.mktemp("replicas")
    with ExitStack() as stack:
        store = stack.enter_context(compose_redis(tmp_path))
        env = {"ADAPTLM_SESSION_STORE": store}
        servers = [stack.enter_context(run_server(tiny_checkpoint, tmp_path / f"replica-{i}.log", env))
                   for i in (1, 2)]
        # the replay's server needs no process of its own (none is killed): the same app in this process, while
        # the replicas start
        single = stack.enter_context(serve(Settings(checkpoint=tiny_checkpoint, precision="float32")))
        for server in servers:  # started together, waited for together
            assert wait_ready(server.url, server.process, time.monotonic() + 120), f"not ready: {server.url}"
        balancer = stack.enter_context(nginx_balancer(tmp_path, [s.address for s in servers]))
        yield Topology(balancer, servers, single.url)


def upstream(response: httpx.Response) -> str:
    """The replica that answered (nginx lists every one it tried; the last answered)."""
    return response.headers["X-Upstream"].split(",")[-1].strip()


def observe(client: httpx.Client, sid: str, text: str) -> httpx.Response:
    response = client.post(f"/v1/sessions/{sid}/observe", json={"text": text})
    assert response.status_code == 200, response.text
    return response


def tensors(client: httpx.Client, sid: str) -> dict[str, torch.Tensor]:
    response = client.get(f"/v1/sessions/{sid}/state")
    assert response.status_code == 200, response.text
    return load(response.content)


def test_a_session_that_moves_and_comes_back_is_served_as_stored(topology: Topology) -> None:
    """A session kept by one replica (A, the balancer's choice: A holds it) observes once through the other (B,
    addressed directly: A is not told); back on A, every read and write is of B's record, not of A's copy: the
    stats, a score and the state after one more observe are those of one server given the same observes."""
    assert all(r.process.poll() is None for r in topology.replicas), "runs while both replicas serve"
    probe = {"text": TEXTS[4]}
    with httpx.Client(base_url=topology.single, timeout=120) as single:  # the reference: one server, never moved
        replay = single.post("/v1/sessions", json={}).json()["id"]
        for text in TEXTS[:2]:
            observe(single, replay, text)
        expected_stats = single.get(f"/v1/sessions/{replay}").json()["stats"]
        expected_bits = single.post("/v1/score", json={**probe, "session_id": replay}).json()["bits"]
        observe(single, replay, TEXTS[2])
        expected_last = single.get(f"/v1/sessions/{replay}").json()["stats"]
        expected = tensors(single, replay)
    with httpx.Client(base_url=topology.balancer, timeout=120) as lb:
        for _ in range(20):  # a session that its home replica created: the other never held a copy of it
            created = lb.post("/v1/sessions", json={})
            assert created.status_code == 201, created.text
            sid = created.json()["id"]
            if upstream(created) == upstream(lb.get(f"/v1/sessions/{sid}")):
                break
        home = upstream(observe(lb, sid, TEXTS[0]))
        assert home == upstream(created)
        a = next(r for r in topology.replicas if r.address == home)
        b = next(r for r in topology.replicas if r is not a)
        probe["session_id"] = sid
        before = lb.post("/v1/score", json=probe, headers={"X-Session-Id": sid})  # A reads its own copy
        assert before.status_code == 200 and upstream(before) == home
        with httpx.Client(base_url=b.url, timeout=120) as direct:
            observe(direct, sid, TEXTS[1])  # on B: A's copy is now stale
        info = lb.get(f"/v1/sessions/{sid}")
        assert upstream(info) == home and info.json()["stats"] == expected_stats  # bytes, updates, bits: exact
        score = lb.post("/v1/score", json=probe, headers={"X-Session-Id": sid})
        assert upstream(score) == home and score.json()["bits"] == expected_bits != before.json()["bits"]
        assert upstream(observe(lb, sid, TEXTS[2])) == home  # A writes over B's revision
        assert lb.get(f"/v1/sessions/{sid}").json()["stats"] == expected_last
        served = tensors(lb, sid)
    assert served.keys() == expected.keys()
    for name in expected:
        assert torch.equal(served[name], expected[name]), name


def test_a_session_keeps_adapting_across_a_replica_failure(topology: Topology) -> None:
    with httpx.Client(base_url=topology.balancer, timeout=120) as lb:
        created = lb.post("/v1/sessions", json={})
        assert created.status_code == 201, created.text
        sid = created.json()["id"]
        acknowledged: list[str] = []
        # every request naming the session goes to one replica: the path's id, or the X-Session-Id header
        homes = {upstream(observe(lb, sid, text)) for text in TEXTS[:3]}
        acknowledged += TEXTS[:3]
        homes.add(upstream(lb.get(f"/v1/sessions/{sid}")))
        homes.add(upstream(lb.post("/v1/score", json={"text": "the truth", "session_id": sid},
                                   headers={"X-Session-Id": sid})))
        assert len(homes) == 1, homes
        home = next(r for r in topology.replicas if r.address in homes)
        other = next(r for r in topology.replicas if r is not home)

        # An observe in flight when its replica dies: nginx does not send the POST again (it may have adapted the
        # session), the client gets 502; the store is written when the observe commits, so the session stays as
        # after its last acknowledged observe.
        long_text = (TEXTS[3] * 4000)[:200_000]
        result: dict[str, httpx.Response] = {}
        in_flight = threading.Thread(target=lambda: result.setdefault(
            "r", lb.post(f"/v1/sessions/{sid}/observe", json={"text": long_text})))
        in_flight.start()
        time.sleep(1.0)
        home.process.kill()  # SIGKILL: no drain, no goodbye
        home.process.wait()
        in_flight.join(120)
        if result["r"].status_code == 200:  # done before the kill (a very fast machine): it was acknowledged
            acknowledged.append(long_text)
        else:
            assert result["r"].status_code == 502, result["r"].text

        # the other replica takes the session over, with what the store holds
        for text in TEXTS[3:]:
            assert upstream(observe(lb, sid, text)) == other.address
            acknowledged.append(text)
        info = lb.get(f"/v1/sessions/{sid}")
        assert info.status_code == 200 and upstream(info) == other.address
        stats = info.json()["stats"]
        assert stats["bytes_observed"] == sum(len(t.encode()) for t in acknowledged)
        served = tensors(lb, sid)
        # a body over the server's limit (8 MiB) is refused by the server in the API's error shape, not by nginx
        big = lb.post("/v1/score", content=b'{"text": "' + b"a" * (8 * 1024 * 1024) + b'"}',
                      headers={"Content-Type": "application/json"})
        assert big.status_code == 413 and big.json()["error"]["type"], big.text[:300]

    # a single server given the same acknowledged observes ends in the same state
    with httpx.Client(base_url=topology.single, timeout=120) as single:
        replay = single.post("/v1/sessions", json={}).json()["id"]
        for text in acknowledged:
            observe(single, replay, text)
        expected = tensors(single, replay)
        expected_stats = single.get(f"/v1/sessions/{replay}").json()["stats"]
    assert served.keys() == expected.keys()
    for name in expected:
        assert torch.equal(served[name], expected[name]), name
    assert stats == expected_stats
