from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from server.settings import DEFAULT_CHECKPOINT, Settings, ignored_variables


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    import os

    for name in list(os.environ):
        if name.startswith("ADAPTLM_"):
            monkeypatch.delenv(name)


def test_defaults() -> None:
    s = Settings()
    assert s.checkpoint == DEFAULT_CHECKPOINT
    assert DEFAULT_CHECKPOINT == Path(__file__).resolve().parents[2] / "checkpoints" / "default"
    assert (s.host, s.port, s.max_text_bytes, s.log_level, s.api_keys) == ("127.0.0.1", 8000, 1_000_000, "info", ())
    assert s.max_body_bytes >= s.max_text_bytes
    assert s.keep_alive_s == 75  # longer than clients keep idle connections (httpx 5 s, nginx 60 s)
    assert s.precision == "auto"  # bf16 recurrent matmuls where the hardware has them (models/precision.py)


def test_reads_the_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("ADAPTLM_CHECKPOINT", str(tmp_path))
    monkeypatch.setenv("ADAPTLM_PORT", "9001")
    monkeypatch.setenv("ADAPTLM_LOG_LEVEL", "DEBUG")
    monkeypatch.setenv("ADAPTLM_API_KEYS", " k1, k2 ,,")
    s = Settings()
    assert (s.checkpoint, s.port, s.log_level) == (tmp_path, 9001, "debug")
    assert [k.get_secret_value() for k in s.api_keys] == ["k1", "k2"]
    assert "k1" not in repr(s)


def test_init_overrides_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ADAPTLM_PORT", "9001")
    assert Settings(port=9002).port == 9002


@pytest.mark.parametrize("port", ["0", "65536", "-1", "http", ""])
def test_rejects_an_invalid_port_from_the_environment(monkeypatch: pytest.MonkeyPatch, port: str) -> None:
    monkeypatch.setenv("ADAPTLM_PORT", port)
    with pytest.raises(ValidationError) as info:
        Settings()
    assert info.value.errors()[0]["loc"] == ("port",)


@pytest.mark.parametrize("overrides", [
    {"log_level": "loud"},
    {"max_text_bytes": 0},
    {"max_text_bytes": 100, "max_body_bytes": 99},
    {"unknown_setting": 1},
    {"session_snapshot": "s.zip", "session_store": "redis://localhost:6379/0"},  # Redis keeps its own sessions
    {"suggest_budget_ms": -1}, {"suggest_budget_ms": float("nan")},
    {"precision": "fp8"}, {"precision": "float16"},
    {"attention_tuning": "fast"}, {"attention_tuning": "tiles=v1"}, {"attention_tuning": "splits=-1"},
    {"kernels": "cuda"}, {"kernels": "fast"},
])
def test_rejects_invalid_settings(overrides: dict[str, object]) -> None:
    with pytest.raises(ValidationError):
        Settings(**overrides)  # type: ignore[arg-type]


def test_is_frozen() -> None:
    with pytest.raises(ValidationError):
        Settings().port = 1


def test_session_store(monkeypatch: pytest.MonkeyPatch) -> None:
    assert Settings().session_store == "memory"
    monkeypatch.setenv("ADAPTLM_SESSION_STORE", "redis://:secret@127.0.0.1:6390/3")
    s = Settings()
    assert str(s.session_store) == "redis://:secret@127.0.0.1:6390/3" and "secret" not in repr(s)
    assert str(Settings(session_store="redis://cache").session_store) == "redis://cache:6379/0"  # type: ignore[arg-type]


@pytest.mark.parametrize("store", ["", "redis", "Memory", "http://host:6379/0", "redis://host:99999/0",
                                   "redis://host:6379/cache", "unix:///tmp/redis.sock"])
def test_rejects_an_invalid_session_store(monkeypatch: pytest.MonkeyPatch, store: str) -> None:
    monkeypatch.setenv("ADAPTLM_SESSION_STORE", store)
    with pytest.raises(ValidationError) as info:
        Settings()
    assert info.value.errors()[0]["loc"][0] == "session_store"


def test_attention_tuning(monkeypatch: pytest.MonkeyPatch) -> None:
    from kernels.attention import Tuning

    assert Settings().attention_tuning == "" and Tuning.parse(Settings().attention_tuning) == Tuning()
    monkeypatch.setenv("ADAPTLM_ATTENTION_TUNING", "splits=0")
    assert Tuning.parse(Settings().attention_tuning) == Tuning(splits=0)
    monkeypatch.setenv("ADAPTLM_ATTENTION_TUNING", "splits=0,warps=8")
    with pytest.raises(ValidationError, match="warps=8"):
        Settings()


def test_kernels(monkeypatch: pytest.MonkeyPatch) -> None:
    # ADAPTLM_KERNELS is checked at start by the dispatcher's own rule: unknown values, and triton where it cannot
    # run (no CUDA device here), are settings errors rather than a failure when the model loads
    import torch

    assert Settings().kernels == "auto" and Settings(kernels="Reference").kernels == "Reference"
    monkeypatch.setenv("ADAPTLM_KERNELS", "bogus")
    with pytest.raises(ValidationError, match="auto, triton or reference"):
        Settings()
    if not torch.cuda.is_available():
        monkeypatch.setenv("ADAPTLM_KERNELS", "triton")
        with pytest.raises(ValidationError, match="ADAPTLM_KERNELS=triton, but"):
            Settings()


def test_a_misspelt_variable_is_said_at_start_up(tiny_checkpoint: Path, serve_app: Any,
                                                  monkeypatch: pytest.MonkeyPatch,
                                                  caplog: pytest.LogCaptureFixture) -> None:
    """pydantic-settings reads the variables it knows: ADAPTLM_MAX_SESSION=10 applied nothing, silently."""
    assert ignored_variables({"ADAPTLM_MAX_SESSION": "10", "ADAPTLM_MAX_SESSIONS": "5", "ADAPTLM_API_KEY": "k",
                              "ADAPTLM_LOADTEST_USERS": "3", "ADAPTLM_BOGUS": "1", "HOME": "/root"}) == [
        "ADAPTLM_BOGUS is not a setting of the server and is ignored",
        "ADAPTLM_MAX_SESSION is not a setting of the server and is ignored (did you mean ADAPTLM_MAX_SESSIONS?)"]
    monkeypatch.setenv("ADAPTLM_MAX_SESSION", "10")
    with caplog.at_level(logging.WARNING, logger="server.app"), serve_app(Settings(checkpoint=tiny_checkpoint)):
        pass
    assert "ADAPTLM_MAX_SESSION is not a setting of the server and is ignored (did you mean ADAPTLM_MAX_SESSIONS?)" \
        in caplog.text


def test_model_threads(monkeypatch: pytest.MonkeyPatch) -> None:
    """One torch thread unless told otherwise: ADAPTLM_THREADS first, then OMP_NUM_THREADS (torch read it)."""
    import torch

    from server.app import model_threads

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert model_threads(Settings()) == 1
    monkeypatch.setenv("ADAPTLM_THREADS", "3")
    assert model_threads(Settings()) == 3
    monkeypatch.delenv("ADAPTLM_THREADS")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    assert model_threads(Settings()) == torch.get_num_threads()
    for bad in ("0", "-1", "two"):
        monkeypatch.setenv("ADAPTLM_THREADS", bad)
        with pytest.raises(ValidationError, match="threads"):
            Settings()


def test_the_engine_runs_on_the_threads_set(tiny_checkpoint: Path) -> None:
    import torch

    from server.app import start_engine

    before = torch.get_num_threads()
    try:
        engine = start_engine(Settings(checkpoint=tiny_checkpoint, threads=2))
        try:
            assert torch.get_num_threads() == 2
        finally:
            engine.stop()
            engine.store.close()
    finally:
        torch.set_num_threads(before)
