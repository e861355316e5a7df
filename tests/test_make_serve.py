"""`make serve` installs what serving needs and nothing else (issue 38): Python packages (the torch pin, the server,
the SDK), no system packages (no apt-get, no sudo: a fresh machine needs neither to serve), no test tools; `make test`
then adds the test tools and the system packages its tests start. The Makefile is run for real, in a directory of
stubs: its python and adaptlm note their arguments, and apt-get, apt and sudo fail loudly."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
TORCH = re.search(r"^TORCH\s*:=\s*(\S+)", (ROOT / "Makefile").read_text(), re.M)
FORBIDDEN = ("apt-get", "apt", "sudo", "dpkg")


def _clean_env() -> dict[str, str]:
    """This environment but the server's settings and an outer make's flags (`make test` runs these tests)."""
    return {k: v for k, v in os.environ.items() if not k.startswith(("ADAPTLM_", "MAKE"))}


def _make(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    assert shutil.which("make"), "make is not installed"
    return subprocess.run(["make", "--no-print-directory", "-C", str(ROOT), *args], capture_output=True, text=True,
                          timeout=60, env=_clean_env() if env is None else env)


def _words(recipe: str) -> set[str]:
    return set(re.findall(r"[\w.-]+", recipe))


@pytest.fixture
def stubs(tmp_path: Path) -> tuple[Path, Path, dict[str, str]]:
    """A virtual environment whose python and adaptlm only note their arguments (the installs and the server are
    not what is tested here), a log, and an environment whose PATH finds the failing apt-get, apt, sudo first."""
    log = tmp_path / "calls.log"
    venv = tmp_path / "venv"
    bins = tmp_path / "stubs"
    for folder in (venv / "bin", bins):
        folder.mkdir(parents=True)
    for name in ("python", "adaptlm"):
        (venv / "bin" / name).write_text(f'#!/bin/sh\necho "{name} $*" >> "{log}"\n')
    for name in FORBIDDEN:
        (bins / name).write_text(f'#!/bin/sh\necho "FORBIDDEN {name} $*" >> "{log}"\necho "{name} called" >&2\n'
                                 "exit 97\n")
    for script in [*(venv / "bin").iterdir(), *bins.iterdir()]:
        script.chmod(0o755)
    env = _clean_env()
    env["PATH"] = f"{bins}{os.pathsep}{env.get('PATH', '')}"
    return venv, log, env


@pytest.mark.parametrize("store", ["memory", "redis://127.0.0.1:1/0"])
def test_make_serve_installs_python_packages_only(stubs: tuple[Path, Path, dict[str, str]], store: str) -> None:
    """A Redis store asked for installs nothing either: it is a Redis the operator runs (the server refuses to
    start, naming the address, when none answers there; tests/server/test_redis_store.py)."""
    venv, log, env = stubs
    env["ADAPTLM_SESSION_STORE"] = store
    r = _make("serve", f"VENV={venv}", env=env)
    assert r.returncode == 0, r.stdout + r.stderr
    calls = log.read_text().splitlines()
    assert not [c for c in calls if c.startswith("FORBIDDEN")], calls
    assert TORCH
    assert calls == [f"python -m pip install -q {TORCH.group(1)}",  # the CPU pin first, as the image does
                     "python -m pip install -q -e ./clients -e .",  # the server and its SDK, no extras
                     "adaptlm serve"]


def test_make_test_after_make_serve_adds_the_test_tools(stubs: tuple[Path, Path, dict[str, str]]) -> None:
    venv, log, env = stubs
    assert _make("serve", f"VENV={venv}", env=env).returncode == 0
    # what `make test` would run now (dry run: nothing is run): the runtime is installed, so only the test tools'
    # install, the system packages' check (which calls apt-get for what is missing) and the tests
    r = _make("-n", "test", f"VENV={venv}", env=env)
    assert r.returncode == 0, r.stderr
    installs = [line for line in r.stdout.splitlines() if "pip install" in line]
    assert installs == [f"{venv}/bin/python -m pip install -q -e ./clients -e '.[dev,loadtest]'"
                        "  # locust: `make loadtest` and its test"]
    assert "apt-get" in _words(r.stdout) and f"{venv}/bin/python -m pytest -q" in r.stdout.splitlines()


def test_make_test_on_a_fresh_clone_installs_the_packages_once(stubs: tuple[Path, Path, dict[str, str]]) -> None:
    """Without `make serve` before it, the runtime and the test tools come in one pip run after the torch pin: the
    server and the SDK are built, and the requirements resolved, once (not by the runtime's install, then again by
    the test tools'). Both setups are then done: `make serve` installs nothing more."""
    venv, log, env = stubs
    r = _make(f"VENV={venv}", f"{venv}/.installed-dev", env=env)  # `make install` but the system packages
    assert r.returncode == 0, r.stdout + r.stderr
    assert TORCH
    assert log.read_text().splitlines() == [f"python -m pip install -q {TORCH.group(1)}",
                                            "python -m pip install -q -e ./clients -e .[dev,loadtest]"]
    log.write_text("")
    assert _make("serve", f"VENV={venv}", env=env).returncode == 0
    assert log.read_text().splitlines() == ["adaptlm serve"]


def test_the_serve_recipes_name_no_system_package_tool(tmp_path: Path) -> None:
    """Every line `make serve` would run on a fresh clone (dry run, whatever the shell's branches would take), against
    `make test`'s, which do call apt-get: the check can see one."""
    serve = _make("-n", "serve", f"VENV={tmp_path / 'fresh'}")
    test = _make("-n", "test", f"VENV={tmp_path / 'fresh'}")
    assert serve.returncode == 0 and test.returncode == 0, serve.stderr + test.stderr
    assert not _words(serve.stdout) & set(FORBIDDEN), serve.stdout
    assert {"apt-get", "sudo"} <= _words(test.stdout)
    assert "dev" not in _words(serve.stdout) and "loadtest" not in _words(serve.stdout)
    assert "dev" in _words(test.stdout)
