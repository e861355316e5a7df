"""Distributed training (trainer/_dist.py, `torchrun -m trainer`) against one process: gloo on 2 CPU processes.

Two processes with batch B/2 each see the rows one process with batch B sees, and DDP averages their gradients,
so the runs differ only in float summation order (the mean loss and the gradients are summed in two halves).
Measured on a 2-core x86 CPU, tiny preset, 120 steps: train_bpb within 1.7e-7 relative at every step, weights and
MS_g within 2.2e-6 of each tensor's largest entry. The tolerances below are ~50x those figures.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from trainer.config import make_config
from trainer.train import train

DATA = Path(__file__).resolve().parent.parent / "data"
TRAIN, VALID = DATA / "train.txt", DATA / "valid.txt"
CRASH = Path(__file__).resolve().parent / "ddp_crash.py"
LOSS_RTOL = 1e-5  # train_bpb, relative, at every logged step
TENSOR_TOL = 1e-4  # weights and MS_g: |a - b| <= TENSOR_TOL * max |a| of the tensor, entry by entry


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _torchrun(args: list[str], *, ok: bool = True) -> subprocess.CompletedProcess[str]:
    """`torchrun --nproc_per_node 2` on loopback (one thread a process), bounded in time."""
    # ddp_crash.py runs as a script: the repository on its path, so that it imports this checkout's trainer (not
    # another one an editable install points at)
    root = str(Path(__file__).resolve().parents[2])
    path = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH", "")) if p)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo", "PYTHONPATH": path}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc_per_node", "2",
           "--master_addr", "127.0.0.1", "--master_port", str(_free_port()), *args]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)
    if ok:
        assert done.returncode == 0, done.stderr[-3000:]
    return done


def _flags(out: Path, config: Path, *extra: str) -> list[str]:
    return ["--preset", "tiny", "--config", str(config), "--data", str(TRAIN), "--valid", str(VALID),
            "--out", str(out), "--threads", "1", "--quiet", *extra]


def _in_process(cfg_layer: dict[str, Any], out: Path) -> None:
    threads = torch.get_num_threads()
    try:
        train(make_config("tiny", cfg_layer, {"threads": 1}), [TRAIN], out, valid_path=VALID, progress=False)
    finally:
        torch.set_num_threads(threads)


def _records(out: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (out / "train.jsonl").read_text().splitlines()]


def _files(out: Path) -> list[str]:
    return sorted(str(p.relative_to(out)) for p in out.rglob("*"))


def _assert_tensors_close(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for k in a:
        scale = float(a[k].abs().max())
        torch.testing.assert_close(b[k], a[k], rtol=0, atol=TENSOR_TOL * scale, msg=lambda m, k=k: f"{k}: {m}")


def test_two_processes_follow_one_process_with_the_same_global_batch(tmp_path: Path) -> None:
    # tiny: no dropout. 12 steps: a gradient that two processes did not average (or a row one of them missed)
    # moves train_bpb by far more than LOSS_RTOL at the second step already
    layer: dict[str, Any] = {"max_steps": 12, "valid_every": 4, "log_every": 1}
    config = tmp_path / "train.json"
    config.write_text(json.dumps(layer))
    _in_process(layer, tmp_path / "one")
    done = _torchrun(["-m", "trainer", *_flags(tmp_path / "two", config)])
    assert json.loads(done.stdout.strip().splitlines()[-1])["processes"] == 2  # rank 0 alone prints

    one, two = _records(tmp_path / "one"), _records(tmp_path / "two")
    # one writer: a second process writing the log would add its lines, and its files would show here
    assert len(two) == len(one) and _files(tmp_path / "two") == _files(tmp_path / "one")
    for a, b in zip(one, two, strict=True):
        assert a.keys() == b.keys() and a.get("step") == b.get("step")
        for key in ("train_bpb", "grad_norm", "valid_bpb"):
            if key in a:
                assert b[key] == pytest.approx(a[key], rel=LOSS_RTOL), (a["step"], key)
        if "lr" in a:
            assert b["lr"] == a["lr"]
    _assert_tensors_close(load_file(str(tmp_path / "one" / "model.safetensors")),
                          load_file(str(tmp_path / "two" / "model.safetensors")))
    _assert_tensors_close(load_file(str(tmp_path / "one" / "stats.safetensors")),
                          load_file(str(tmp_path / "two" / "stats.safetensors")))
    # the resumable state holds the whole batch's hidden state and each process's random generator
    state = load_file(str(tmp_path / "two" / "last" / "trainer_state.safetensors"))
    assert state["hidden.h"].shape[0] == make_config("tiny").batch_size
    assert {"rng.torch", "rng.torch.1"} <= state.keys()
    assert _state_info(tmp_path / "two" / "last")["world_size"] == 2


def _state_info(last: Path) -> dict[str, Any]:
    """The step, settings, ... of a resumable state: JSON in its safetensors header."""
    from safetensors import safe_open

    with safe_open(str(last / "trainer_state.safetensors"), "pt") as f:
        return dict(json.loads(f.metadata()["info"]))


def test_an_interrupted_two_process_run_resumes_where_an_uninterrupted_one_ends(tmp_path: Path) -> None:
    # dropout on: each process draws its own masks, so only restoring every process's own generator ends equal
    layer: dict[str, Any] = {"max_steps": 12, "valid_every": 4, "valid_bytes": 0,
                             "model": {"dropout_hidden": 0.2, "dropout_embed": 0.1}}
    config = tmp_path / "train.json"
    config.write_text(json.dumps(layer))
    _torchrun(["-m", "trainer", *_flags(tmp_path / "whole", config)])
    crashed = _torchrun([str(CRASH), "8", *_flags(tmp_path / "resumed", config)], ok=False)
    assert crashed.returncode != 0
    last = _state_info(tmp_path / "resumed" / "last")
    assert last["step"] == 4  # rank 0 died at step 8's validation, before saving step 8's state
    _torchrun(["-m", "trainer", *_flags(tmp_path / "resumed", config, "--resume")])
    whole = load_file(str(tmp_path / "whole" / "model.safetensors"))
    resumed = load_file(str(tmp_path / "resumed" / "model.safetensors"))
    for k in whole:
        torch.testing.assert_close(resumed[k], whole[k], rtol=0, atol=0)
    stats_w = load_file(str(tmp_path / "whole" / "stats.safetensors"))
    stats_r = load_file(str(tmp_path / "resumed" / "stats.safetensors"))
    for k in stats_w:
        torch.testing.assert_close(stats_r[k], stats_w[k], rtol=0, atol=0)
    # a state saved by 2 processes is not resumed by 1: its second random generator would be lost
    with pytest.raises(ValueError, match="saved by 2 process"):
        train(make_config("tiny", layer), [TRAIN], tmp_path / "resumed", valid_path=VALID, progress=False,
              resume=True)


def test_the_batch_must_divide_among_the_processes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    # the check itself, in this process as rank 0 of 2 (the group a torchrun of 2 joins): it refuses before any
    # collective call or file, so no second process is needed to see it; the other tests run real torchruns
    import trainer._dist
    import trainer.train
    from trainer.__main__ import main

    def two() -> trainer._dist.Group:
        return trainer._dist.Group(rank=0, world=2)

    monkeypatch.setattr(trainer._dist, "current", two)
    monkeypatch.setattr(trainer.train, "current", two)
    config = tmp_path / "train.json"
    config.write_text(json.dumps({"max_steps": 2}))
    threads = torch.get_num_threads()
    try:
        code = main(_flags(tmp_path / "out", config, "--batch-size", "15"))
    finally:
        torch.set_num_threads(threads)
    assert code == 2
    assert "batch_size 15 must be a multiple of the number of processes (2)" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_a_model_whose_schedule_drops_training_heads_trains_on_two_processes(tmp_path: Path) -> None:
    """The character transformer's intermediate classifiers stop getting gradients once the auxiliary-loss schedule
    drops them; DDP then needs `find_unused_parameters` or its second step fails. With gradient accumulation (the
    processes synchronise on the last micro-batch only)."""
    config = tmp_path / "train.json"
    config.write_text(json.dumps({"max_steps": 8, "valid_every": 4, "valid_bytes": 2000, "accumulate": 2}))
    _torchrun(["-m", "trainer", "--arch", "char-transformer", *_flags(tmp_path / "out", config)])
    assert (tmp_path / "out" / "model.safetensors").exists()
