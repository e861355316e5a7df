"""deploy/compose.yaml's topology without containers, on loopback: a redis-server run with compose's Redis settings
and nginx run with the balancer configuration compose and Kubernetes use (deploy/nginx/adaptlm.conf.template,
filled in as the nginx image does), in front of replicas started elsewhere (`server.launch.serving`). What
tests/deploy/test_replicas.py and `bench.capacity --replicas` share. No torch: it only starts processes."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from string import Template
from typing import Any

import redis
import yaml

from server.launch import free_port, serving, stop, wait_ready

__all__ = ["COMPOSE", "TEMPLATE", "binary", "compose", "compose_redis", "nginx_balancer", "render",
           "replicas_on_loopback"]

ROOT = Path(__file__).resolve().parent.parent
COMPOSE = ROOT / "deploy" / "compose.yaml"
TEMPLATE = ROOT / "deploy" / "nginx" / "adaptlm.conf.template"


def compose() -> dict[str, Any]:
    return dict(yaml.safe_load(COMPOSE.read_text()))


def render(template: str, **values: str) -> str:
    """The template with its ${BALANCER_*} placeholders filled in, as the nginx image's envsubst does (only the
    variables it is given: nginx's own $variables stay). ValueError unless `values` names exactly its placeholders."""
    placeholders = set(re.findall(r"\$\{(BALANCER_\w+)\}", template))
    if placeholders != set(values):
        raise ValueError(f"the template's placeholders are {sorted(placeholders)}, given {sorted(values)}")
    return Template(template).safe_substitute(values)


def binary(name: str, *dirs: str) -> str:
    """The path of the program `name` (on PATH, or in one of `dirs`). RuntimeError if it is not installed."""
    found = shutil.which(name) or next((f"{d}/{name}" for d in dirs if os.access(f"{d}/{name}", os.X_OK)), None)
    if found is None:
        raise RuntimeError(f"{name} is not installed: run `make test` (it installs the system packages)")
    return found


@contextmanager
def compose_redis(directory: Path) -> Iterator[str]:
    """redis-server on a free loopback port with compose's settings (its `command`: persistent, never evicting), its
    files in `directory`, until the block ends -> its URL."""
    args = compose()["services"]["redis"]["command"][1:]
    port = free_port()
    process = subprocess.Popen([binary("redis-server", "/usr/bin"), *args, "--port", str(port), "--bind",
                                "127.0.0.1", "--dir", str(directory), "--logfile", str(directory / "redis.log")],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        client = redis.Redis(port=port, socket_connect_timeout=1)
        deadline = time.monotonic() + 15
        while True:
            try:
                client.ping()
                break
            except redis.ConnectionError:
                if process.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"redis-server did not start (see {directory / 'redis.log'})") from None
                time.sleep(0.05)
        policy = client.config_get("maxmemory-policy")["maxmemory-policy"]
        client.close()
        if policy != "noeviction":
            raise RuntimeError(f"compose's Redis evicts ({policy}): sessions would be lost")
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        stop(process, 10)


@contextmanager
def nginx_balancer(directory: Path, upstreams: list[str]) -> Iterator[str]:
    """A Debian nginx in the foreground with the shared balancer configuration in front of `upstreams` (each
    "host:port"), everything under `directory`, until the block ends (then nginx's graceful stop) -> its URL."""
    port = free_port()
    servers = " ".join(f"server {u} max_fails=1 fail_timeout=10s;" for u in upstreams)
    (directory / "adaptlm.conf").write_text(render(TEMPLATE.read_text(), BALANCER_PORT=f"127.0.0.1:{port}",
                                                   BALANCER_SERVERS=servers))
    temp = "\n".join(f"    {kind}_temp_path {directory / kind};" for kind in ("client_body", "proxy", "fastcgi",
                                                                             "uwsgi", "scgi"))
    # As root, the workers would switch to `nobody`, who cannot enter a private temporary directory.
    user = "user root;\n" if os.geteuid() == 0 else ""
    (directory / "nginx.conf").write_text(
        f"{user}daemon off;\nworker_processes 1;\npid {directory / 'nginx.pid'};\n"
        f"error_log {directory / 'error.log'} info;\nevents {{ worker_connections 1024; }}\n"
        f"http {{\n    access_log {directory / 'access.log'};\n{temp}\n    include {directory / 'adaptlm.conf'};\n}}\n")
    process = subprocess.Popen([binary("nginx", "/usr/sbin"), "-p", str(directory), "-c",
                                str(directory / "nginx.conf"), "-e", str(directory / "error.log")],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        if not wait_ready(url, process, time.monotonic() + 30):
            raise RuntimeError(f"nginx did not start: {(directory / 'error.log').read_text()[-2000:]}")
        yield url
    finally:
        process.send_signal(signal.SIGQUIT)  # nginx's graceful stop
        try:
            process.wait(10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


@contextmanager
def replicas_on_loopback(checkpoint: str | Path, replicas: int, directory: Path,
                         env: dict[str, str] | None = None) -> Iterator[tuple[str, str]]:
    """`replicas` `adaptlm serve` of `checkpoint` (`env` laid over this environment) sharing one Redis session store
    (`compose_redis`) behind the balancer (`nginx_balancer`), everything under `directory` (the replicas' logs
    `replica-N.log`), until the block ends; then all are stopped, the balancer first -> (the balancer's URL, the
    store's URL)."""
    if replicas < 1:
        raise ValueError(f"replicas must be at least 1, not {replicas}")
    with ExitStack() as stack:
        store = stack.enter_context(compose_redis(directory))
        served = [stack.enter_context(serving(checkpoint, directory / f"replica-{n}.log",
                                              {**(env or {}), "ADAPTLM_SESSION_STORE": store}))
                  for n in range(1, replicas + 1)]
        url = stack.enter_context(nginx_balancer(directory, [s.url.removeprefix("http://") for s in served]))
        yield url, store
