"""The SDK as its own distribution (`adaptlm-client`, clients/pyproject.toml): built from the source tree, installed
by pip into a new virtual environment with nothing else, where torch cannot be imported, and used there against a
live server: a session's whole life, and the examples of clients/README.md as written."""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
import tomllib
import venv
from pathlib import Path

import httpx
import pytest

from tests.clients.conftest import LiveServer

ROOT = Path(__file__).resolve().parents[2]
SDK = ROOT / "clients"
README_URL = "http://127.0.0.1:8000"


def _pip(*args: str | Path, timeout: float = 300) -> None:
    # without PYTHONPATH: a checkout on it (clients/ with a build's metadata) would read as installed to pip
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    r = subprocess.run([sys.executable, "-m", "pip", "--disable-pip-version-check", *map(str, args)],
                       capture_output=True, text=True, timeout=timeout, env=env)
    assert r.returncode == 0, r.stdout + r.stderr


@pytest.fixture(scope="module")
def sdk_python(tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest) -> Path:
    """The interpreter of a new virtual environment holding the SDK and what pip installs for it, nothing else."""
    tmp = tmp_path_factory.mktemp("sdk")
    cache = request.config.cache.mkdir("adaptlm-client")
    # The wheel of the code under test, built by this environment's setuptools (an isolated build would fetch
    # setuptools from the index every time) from a copy of the tree (a build writes beside its sources); kept under
    # the hash of the tree's files, so it is built again whenever one changes.
    files = sorted(p for p in SDK.rglob("*") if p.is_file() and not {"__pycache__", "build"} & set(p.parts)
                   and not any(part.endswith(".egg-info") for part in p.parts))
    tree = hashlib.sha256(sys.version.encode())
    for path in files:
        tree.update(str(path.relative_to(SDK)).encode() + b"\0" + path.read_bytes() + b"\0")
    dist = cache / f"sdk-{tree.hexdigest()[:16]}"
    if not dist.is_dir():
        source = tmp / "src"
        for path in files:
            (source / path.relative_to(SDK)).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(path, source / path.relative_to(SDK))
        _pip("wheel", "--no-deps", "--no-build-isolation", "-q", "-w", tmp / "dist", source)
        _publish(tmp / "dist", dist)
    (wheel,) = dist.glob("adaptlm_client-*.whl")
    # Its dependencies as wheels, fetched from the package index once per clients/pyproject.toml (about 15 s), so
    # that the install below resolves the SDK's declared requirements offline, against them only.
    key = hashlib.sha256((SDK / "pyproject.toml").read_bytes() + sys.version.encode()).hexdigest()[:16]
    wheels = cache / f"deps-{key}"
    if not wheels.is_dir():
        _pip("wheel", "-q", "-w", tmp / "deps", "--find-links", dist, wheel)
        (tmp / "deps" / wheel.name).unlink()  # the SDK's own comes from `dist`, of the tree as it is
        _publish(tmp / "deps", wheels)
    env = tmp / "env"
    venv.create(env, with_pip=False)  # this pip installs into it (`--python`): ensurepip would cost seconds
    python = env / "bin" / "python"
    _pip("--python", python, "install", "-q", "--no-compile", "--no-index", "--find-links", wheels, wheel)
    return python


def _publish(folder: Path, to: Path) -> None:
    """`folder` becomes `to` in one step (a rename), unless another run made `to` meanwhile."""
    staged = to.with_name(f"{to.name}.{os.getpid()}")
    shutil.move(folder, staged)
    try:
        staged.rename(to)
    except OSError:  # `to` exists now: the other run's is as good
        shutil.rmtree(staged)


def _run(python: Path, code: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    # -I: no PYTHONPATH (a checkout's packages), no user site, not the current directory; only the environment
    r = subprocess.run([python, "-I", "-c", code], cwd=cwd, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    return r


SESSION_SCRIPT = """
    import asyncio, importlib.metadata, importlib.util, json, pathlib, sys
    import adaptlm_client
    from adaptlm_client import AsyncClient, Client, NotFoundError

    url, text = sys.argv[1], sys.argv[2]
    out = {"missing": [m for m in ("torch", "numpy", "server", "models", "adaptlm") if importlib.util.find_spec(m)
                       is None],
           "sdk": adaptlm_client.__file__, "version": importlib.metadata.version("adaptlm-client"),
           "typed": (pathlib.Path(adaptlm_client.__file__).parent / "py.typed").is_file(),
           "loaded": sorted(m for m in ("torch", "numpy") if m in sys.modules)}
    with Client(url, timeout=60) as client:
        session = client.create_session(initial_text="Dear Sir,")
        observed = session.observe(text)
        out["observed"] = [observed.bytes, observed.bits, observed.static_bits]
        s = session.suggest("Thank you for the rep", k=3)
        out["suggest"] = [s.prefix, [w.text for w in s.completions]]
        out["score"] = [session.score("The house is", adapt=False).bits, client.score("The house is").bits]
        out["stats_bytes"] = session.get().stats.bytes_observed
        session.delete()
        try:
            client.get_session(session.id)
        except NotFoundError as e:
            out["after_delete"] = [e.status, e.type, e.param]

    async def async_score():
        async with AsyncClient(url, timeout=60) as client:
            return (await client.score("The house is")).bits
    out["async_score"] = asyncio.run(async_score())
    print(json.dumps(out))
"""


def test_the_sdk_alone_runs_a_session_without_torch(sdk_python: Path, live: LiveServer, tmp_path: Path) -> None:
    text = "Thank you for the report. I will send the report tomorrow.\n"
    code = f"import sys; sys.argv[1:] = {[live.url, text]!r}\n" + textwrap.dedent(SESSION_SCRIPT)
    out = json.loads(_run(sdk_python, code, tmp_path).stdout)
    # nothing of the server's distribution, and none of its heavy dependencies, can even be found there
    assert out["missing"] == ["torch", "numpy", "server", "models", "adaptlm"] and out["loaded"] == []
    assert Path(out["sdk"]).is_relative_to(sdk_python.parent.parent)  # the installed copy, not the checkout's
    assert out["typed"]  # PEP 561's marker installed: an application's mypy reads the SDK's types
    assert out["version"] == tomllib.loads((SDK / "pyproject.toml").read_text())["project"]["version"]
    n = len(text.encode())
    assert out["observed"][0] == n and out["observed"][1] > 0 and out["observed"][2] > 0
    assert out["stats_bytes"] == n + len(b"Dear Sir,")
    prefix, words = out["suggest"]
    assert prefix == "rep" and len(words) <= 3 and all(w.startswith("rep") for w in words)
    # the unadapted score read there is the server's own number, as the raw API gives it here
    raw = httpx.post(f"{live.url}/v1/score", json={"text": "The house is"}, timeout=60).json()["bits"]
    assert out["score"][1] == out["async_score"] == pytest.approx(raw)
    assert out["after_delete"] == [404, "not_found_error", "session_id"]


def test_the_readme_examples_run_as_written(sdk_python: Path, live: LiveServer, tmp_path: Path) -> None:
    """clients/README.md's Python blocks, in order in one process, against the live server (its URL for the
    README's): each runs to its end, none raises."""
    blocks = re.findall(r"```python\n(.*?)```", (SDK / "README.md").read_text(), re.S)
    assert len(blocks) >= 5  # a first request, a session, keyboard suggestions, errors and retries, async
    code = "\n".join(blocks)
    assert README_URL in code
    _run(sdk_python, code.replace(README_URL, live.url), tmp_path)


def test_the_server_pins_the_sdk_of_its_own_version() -> None:
    """The server's wire models are the SDK's (server/protocol.py re-exports adaptlm_client.protocol): its
    distribution requires exactly the SDK version beside it, and packages no copy of it."""
    server = tomllib.loads((ROOT / "pyproject.toml").read_text())
    sdk = tomllib.loads((SDK / "pyproject.toml").read_text())["project"]
    assert f"adaptlm-client=={sdk['version']}" in server["project"]["dependencies"]
    assert not any("client" in p for p in server["tool"]["setuptools"]["packages"]["find"]["include"])
    assert {re.match(r"[\w.-]+", d)[0] for d in sdk["dependencies"]} <= {"httpx", "anyio", "pydantic"}  # type: ignore[index]
