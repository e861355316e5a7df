"""Fixtures shared by every test package. Keep it small: package-specific fixtures live beside their tests."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from tests._parallel import WORKER, Turns, built_once, run_folder

DATA = Path(__file__).resolve().parent / "data"

# Without CUDA the Triton kernels run in Triton's CPU interpreter. Triton fixes interpreted or compiled for the
# process when `triton.language` is first imported, which any earlier test may cause (torch itself can import
# triton), so the variable is set here, before any test module is imported. With CUDA the kernels compile for real.
if "TRITON_INTERPRET" not in os.environ and not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

# Servers under test (in-process and subprocesses, which inherit this) run in float32 unless a test asks for
# bfloat16: most tests compare the server's numbers with the library's exactly. The bf16 path has its own tests.
os.environ["ADAPTLM_PRECISION"] = "float32"

# Under pytest-xdist (`-n 3` on 2 cores) each worker runs one torch thread, and so do the servers and commands its
# tests start (they inherit the variable); more threads would spin and wait on a core another worker is using.
if WORKER is not None:
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)

_TURNS = pytest.StashKey[Turns]()


def pytest_configure(config: pytest.Config) -> None:
    folder = run_folder(Path(config.option.basetemp)) if config.option.basetemp else None
    if folder is not None:
        config.stash[_TURNS] = Turns(folder)
    if WORKER is None:
        # Once, before the workers start: the copy model's numba kernels compiled into numba's disk cache, which a
        # fresh clone lacks; otherwise each worker and server process that starts before the cache is written
        # compiles them itself (about 10 s of CPU each).
        from models.copymodel import CopyConfig, CopyModel

        CopyModel(CopyConfig()).warm_up()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    """Each test holds its turn (tests/_parallel.py's Turns) from its setup to its teardown."""
    turns = item.config.stash.get(_TURNS, None)
    if turns is None:
        return (yield)
    with turns.turn():
        return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Iterator[None]:
    """The call of a test marked `alone` runs while no other worker runs a test (its setup and teardown, fixtures
    included, run beside the others: what it times is in its call). Its wait for the others counts in its call's
    duration (`--durations`, junit), not in what the test itself times."""
    turns = item.config.stash.get(_TURNS, None)
    if turns is None or item.get_closest_marker("alone") is None:
        return (yield)
    with turns.alone():
        return (yield)


def _train_seed() -> int | None:
    """ADAPTLM_TEST_TRAIN_SEED (tests only): trains the tiny checkpoint from another seed, which stands in for
    another CPU (whose numerics give other weights from the same seed). The suite must pass with any seed."""
    value = os.environ.get("ADAPTLM_TEST_TRAIN_SEED", "")
    return int(value) if value else None


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A checkpoint directory of the `tiny` preset trained for 40 steps on tests/data (about a second)."""
    from tests._training import train_on_test_data
    from trainer.config import make_config

    overrides: dict[str, object] = {"max_steps": 40, "threads": 1}
    seed = _train_seed()
    if seed is not None:
        overrides["seed"] = seed
    return built_once(tmp_path_factory, "tiny_checkpoint",
                      lambda out: train_on_test_data(make_config("tiny", overrides), out))


@pytest.fixture(scope="session")
def other_weights_checkpoint(tiny_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny checkpoint with one weight nudged by another tool: the same architecture, other weights (another
    hash); its config.json's file hashes are dropped, as such a rewrite must (models/checkpoint.py)."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    out = tmp_path_factory.mktemp("other") / "tiny"
    shutil.copytree(tiny_checkpoint, out)
    weights = load_file(str(out / "model.safetensors"))
    weights["head.bias"] = weights["head.bias"] + 0.01
    save_file(weights, str(out / "model.safetensors"))
    config = json.loads((out / "config.json").read_text())
    del config["sha256"]
    (out / "config.json").write_text(json.dumps(config))
    return out


@pytest.fixture(scope="session")
def word_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny AWD-LSTM word checkpoint (issue 13), trained here: shared by the word-model tests (server, bench)."""
    from trainer.config import make_config
    from trainer.train import train

    # a few steps on one thread (all threads on a busy machine take minutes): enough to beat a uniform guess
    overrides = {"arch": "awd-lstm", "max_steps": 20, "valid_every": 20, "valid_bytes": 4000, "threads": 1,
                 "stats_batches": 1}
    return built_once(tmp_path_factory, "awd", lambda out: train(make_config("tiny", overrides), [DATA / "train.txt"],
                                                                 out, valid_path=DATA / "valid.txt", progress=False))


# The files are dealt to the workers in collection order (`--no-loadscope-reorder` in addopts), each worker taking
# its next file as it nears the end of the one it has; the order of the files only decides when they run. An `alone`
# test's call waits until the tests running on the other workers end (the others held back meanwhile), so the files
# with `alone` tests come first, where what runs beside them is their own short tests, then SHORT_FILES (files of
# many tests of a few seconds at most) while the last alone calls come, and only then LONG_FILES, longest first, so
# that no worker starts a long file when the others are nearly done (a long file right after the alone files, such
# as the Triton build's one test of a minute, would hold up an alone call that long, with two workers idle). An
# `alone` file ALONE_FILES does not name comes after those it names; the rest in path order. Times: a run's per-file
# time of setup, call and teardown on 3 workers and 2 cores, in seconds.
ALONE_FILES = (  # 60, 37, 21, 8, 19 s; the last two are dealt while the first three run
    "tests/server/test_suggest.py", "tests/reliability/test_redis_faults.py", "tests/server/test_hostile.py",
    "tests/server/test_cancel_everywhere.py", "tests/reliability/test_overload.py")
SHORT_FILES = (  # about 85 s in all, no test over 3 s
    "tests/models/test_branches.py", "tests/server/test_app.py", "tests/server/test_generate.py",
    "tests/kernels/test_batched_adapter.py", "tests/server/test_openai.py", "tests/server/test_engine_process.py",
    "tests/models/test_cache.py", "tests/server/test_word_model.py")
LONG_FILES = (  # 106 s down to 30 s
    "tests/server/test_session_import.py", "tests/kernels/test_compile.py", "tests/test_shipped_checkpoints.py",
    "tests/trainer/test_distributed.py", "tests/server/test_keyboard.py", "tests/test_cli.py",
    "tests/trainer/test_train.py", "tests/reliability/test_crash.py", "tests/server/test_shutdown.py",
    "tests/trainer/test_word_training.py", "tests/bench/test_keyboard.py", "tests/server/test_schema_fuzz.py",
    "tests/server/test_workers.py", "tests/test_cli_dyneval.py", "tests/kernels/test_attention.py",
    "tests/models/test_compressive.py", "tests/server/test_sessions.py", "tests/deploy/test_prometheus.py",
    "tests/models/test_char_transformer.py", "tests/test_cli_keysim.py", "tests/test_types.py",
    "tests/server/test_batching.py", "tests/server/test_suggest_reuse.py", "tests/bench/test_attention_variants.py",
    "tests/loadtest/test_locust_run.py", "tests/models/test_adaptive_transformer.py", "tests/models/test_suggest.py",
    "tests/deploy/test_replicas.py", "tests/clients/test_sdk_venv.py", "tests/server/test_redis_store.py",
    "tests/clients/test_typing.py")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The files with `alone` tests first, then SHORT_FILES, then LONG_FILES (see above). `gpu` tests need a
    CUDA device: skipped (with the reason) where there is none, so the default run stays green on a CPU-only
    machine; on a GPU machine `pytest -m gpu` runs them."""
    def file(item: pytest.Item) -> str:
        return item.nodeid.split("::", 1)[0]

    alone = {file(item) for item in items if item.get_closest_marker("alone") is not None}
    rank = {name: i for i, name in enumerate((*ALONE_FILES, *SHORT_FILES, *LONG_FILES))}
    items.sort(key=lambda item: (file(item) not in alone, rank.get(file(item), len(rank))))
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
