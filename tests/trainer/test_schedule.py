"""The optimizer step's settings: learning-rate schedules, gradient accumulation, training precision."""

import math

import pytest
import torch

import models.precision
from models.base import LanguageModel
from models.registry import build_model, config_from_dict
from tests._training import DATA
from trainer.config import make_config
from trainer.data import ByteStreams
from trainer.train import lr_at, train_precision, train_step


def test_cosine_schedule_warms_up_then_decays_to_lr_final() -> None:
    cfg = make_config(None, {"schedule": "cosine", "lr": 1e-3, "lr_final": 1e-5, "warmup_steps": 10,
                             "max_steps": 110})
    assert lr_at(cfg, 0) == pytest.approx(1e-4)  # warm-up: lr (step + 1) / warmup_steps
    assert lr_at(cfg, 4) == pytest.approx(5e-4)
    assert lr_at(cfg, 9) == pytest.approx(1e-3)
    assert lr_at(cfg, 10) == pytest.approx(1e-3)  # the peak, where the cosine starts
    assert lr_at(cfg, 60) == pytest.approx((1e-3 + 1e-5) / 2)  # midpoint of the decay
    assert lr_at(cfg, 35) == pytest.approx(1e-5 + (1e-3 - 1e-5) * 0.5 * (1 + math.cos(math.pi / 4)))
    assert lr_at(cfg, 110) == pytest.approx(1e-5) and lr_at(cfg, 500) == pytest.approx(1e-5)
    lrs = [lr_at(cfg, s) for s in range(10, 111)]
    assert all(a >= b for a, b in zip(lrs, lrs[1:], strict=False))


def test_linear_schedule_is_unchanged() -> None:
    """The mLSTM presets' schedule (and every config saved before `schedule` existed): linear over all steps."""
    cfg = make_config("default")
    assert cfg.schedule == "linear"
    assert lr_at(cfg, 0) == pytest.approx(cfg.lr / cfg.warmup_steps)
    assert lr_at(cfg, cfg.warmup_steps) == pytest.approx(cfg.lr + (cfg.lr_final - cfg.lr) * cfg.warmup_steps
                                                         / cfg.max_steps)
    assert lr_at(cfg, cfg.max_steps // 2) == pytest.approx((cfg.lr + cfg.lr_final) / 2)
    assert lr_at(cfg, cfg.max_steps) == pytest.approx(cfg.lr_final)


def _model(arch: str) -> LanguageModel:
    torch.manual_seed(0)
    model = {"mlstm": {"hidden": 24, "embed_dim": 8, "dropout_hidden": 0.0},
             "char-transformer": {"d_model": 16, "n_layer": 2, "n_head": 2, "d_ff": 32, "context": 12}}[arch]
    return build_model(config_from_dict({"arch": arch, **model})).train()


@pytest.mark.parametrize("arch", ["mlstm", "char-transformer"])
def test_accumulation_equals_one_big_batch(arch: str) -> None:
    """Rows split into micro-batches, each with its own rows' state, give the big batch's gradient, Adam step and
    new state (fp32, up to float summation order); the character transformer's auxiliary losses included.

    Plain SGD steps: Adam's first step is lr * g / |g| entry by entry, which turns float noise into whole steps where
    the exact gradient is 0 (the attention's key biases: softmax ignores a shift shared by every key)."""
    streams = ByteStreams((DATA / "train.txt").read_bytes()[:20_000], 8, 10)
    results = []
    for accumulate in (1, 4):
        model = _model(arch)
        model.set_training_progress(0.0)  # every auxiliary loss live
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        state = model.init_state(8)
        grads: dict[str, torch.Tensor] = {}
        for step in range(2):  # the second step starts from a carried state
            chunk, _ = streams.chunk(step)
            before = {n: p.detach().clone() for n, p in model.named_parameters()}
            loss, nll, gnorm, state = train_step(model, opt, chunk, state, accumulate=accumulate, clip=1e9)
            assert (nll < loss) == (arch == "char-transformer")  # the auxiliary losses, on top
            grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
            assert any(not torch.equal(before[n], p) for n, p in model.named_parameters())
        results.append((loss, nll, gnorm, grads, dict(model.named_parameters()), state))
    (loss1, nll1, norm1, grads1, params1, state1), (loss4, nll4, norm4, grads4, params4, state4) = results
    torch.testing.assert_close(loss4, loss1, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(nll4, nll1, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(norm4, norm1, rtol=1e-5, atol=1e-6)
    assert grads1.keys() == grads4.keys()
    for n in grads1:
        torch.testing.assert_close(grads4[n], grads1[n], rtol=1e-4, atol=1e-7)
        torch.testing.assert_close(params4[n], params1[n], rtol=0, atol=1e-6)
    for k, v in state1.tensors.items():
        torch.testing.assert_close(state4.tensors[k], v, rtol=1e-5, atol=1e-6)


def test_accumulation_must_divide_the_batch() -> None:
    with pytest.raises(ValueError, match="multiple of accumulate"):
        make_config("tiny", {"batch_size": 16, "accumulate": 3})
    with pytest.raises(ValueError, match="accumulate must be positive"):
        make_config("tiny", {"accumulate": 0})
    assert make_config("tiny", {"accumulate": 4}).accumulate == 4


def test_precision_auto_is_bf16_only_where_the_device_multiplies_it(monkeypatch: pytest.MonkeyPatch) -> None:
    cpu = torch.device("cpu")
    assert train_precision("fp32", cpu) == "fp32" and train_precision("bf16", cpu) == "bf16"
    monkeypatch.setattr(models.precision, "_cpu_flags", lambda: frozenset({"avx512f"}))
    assert train_precision("auto", cpu) == "fp32"  # bf16 would be emulated there: slower than fp32
    monkeypatch.setattr(models.precision, "_cpu_flags", lambda: frozenset({"avx512f", "avx512_bf16"}))
    if torch.backends.mkldnn.is_available():  # type: ignore[no-untyped-call]
        assert train_precision("auto", cpu) == "bf16"
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: True)
    assert train_precision("auto", torch.device("cuda")) == "bf16"
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: False)
    assert train_precision("auto", torch.device("cuda")) == "fp32"
    assert make_config("tiny", {"precision": "auto"}).precision == "auto"
    with pytest.raises(ValueError, match="precision must be one of fp32, bf16, auto"):
        make_config("tiny", {"precision": "fp16"})


def test_bad_schedule_and_warmup() -> None:
    with pytest.raises(ValueError, match="schedule must be one of linear, cosine"):
        make_config("tiny", {"schedule": "step"})
    with pytest.raises(ValueError, match="warmup_steps"):
        make_config("tiny", {"warmup_steps": -1})


def _presets() -> list[tuple[str, str]]:
    from trainer.config import ARCH_PRESETS, PRESETS

    return [("mlstm", p) for p in PRESETS] + [("char-transformer", p) for p in ARCH_PRESETS["char-transformer"]]


@pytest.mark.parametrize(("arch", "preset"), _presets())
def test_every_preset_builds_its_model(arch: str, preset: str) -> None:
    cfg = make_config(preset, {"arch": arch})
    with torch.device("meta"):
        model = build_model(config_from_dict({"arch": arch, **cfg.model}))
    assert sum(p.numel() for p in model.parameters()) > 0
    if arch == "char-transformer":
        assert cfg.schedule == "cosine"


def test_gpu_and_small_presets_ship_at_most_10_mb() -> None:
    """Shipped weights: float16, training-only heads left out (they are listed in config.json)."""
    for preset in ("small", "gpu"):
        cfg = make_config(preset, {"arch": "char-transformer"})
        with torch.device("meta"):
            model = build_model(config_from_dict({"arch": cfg.arch, **cfg.model}))
        aux = set(model.training_only_parameters())
        shipped = sum(p.numel() for n, p in model.named_parameters() if cfg.ship_training_only or n not in aux)
        assert cfg.weights_dtype == "float16" and shipped * 2 <= 10_000_000, (preset, shipped)


def test_preset_names_are_per_architecture() -> None:
    with pytest.raises(ValueError, match="preset 'gpu' has no settings for mlstm"):
        make_config("gpu")
    with pytest.raises(ValueError, match="unknown preset 'huge'"):
        make_config("huge", {"arch": "char-transformer"})


def test_budget_clock_ends_the_decay_with_whichever_budget_runs_out_first() -> None:
    from trainer.train import progress_at

    cfg = make_config(None, {"lr": 1e-3, "lr_final": 1e-5, "warmup_steps": 10, "schedule": "cosine",
                             "max_steps": 110, "max_minutes": 2.0, "schedule_clock": "budget"})
    assert progress_at(cfg, 20, 0.0) == pytest.approx(20 / 110)  # steps ahead of the clock
    assert progress_at(cfg, 20, 60.0) == pytest.approx(0.5)  # the clock ahead: half of 2 minutes
    assert progress_at(cfg, 20, 500.0) == 1.0
    assert lr_at(cfg, 5, 100.0) == pytest.approx(6e-4)  # warm-up counts steps whatever the clock says
    assert lr_at(cfg, 20, 60.0) == pytest.approx(lr_at(cfg, 55))  # half the budget: the step half-way (55 of 110)
    assert lr_at(cfg, 20, 120.0) == pytest.approx(1e-5)
    steps = make_config(None, {"lr": 1e-3, "lr_final": 1e-5, "warmup_steps": 10, "schedule": "cosine",
                               "max_steps": 110, "max_minutes": 2.0})
    assert lr_at(steps, 20, 120.0) == pytest.approx(lr_at(steps, 20))  # the default clock ignores time
    with pytest.raises(ValueError, match="needs max_minutes"):
        make_config(None, {"schedule_clock": "budget"})
    with pytest.raises(ValueError, match="schedule_clock"):
        make_config(None, {"schedule_clock": "wall"})


@pytest.mark.parametrize("time_clock", ["wall", "cpu"])
def test_time_clock_counts_wall_or_this_process_cpu_time(tmp_path, time_clock: str) -> None:
    """time_clock "cpu": max_minutes and the budget clock count this process's CPU time, so a run that waits (a
    machine shared with other runs) gets the same budget; "wall" counts the waits. Each log record sleeps 0.3 s."""
    import time

    from trainer.train import train

    cfg = make_config("tiny", {"max_steps": 8, "log_every": 1, "valid_every": 100, "time_clock": time_clock,
                               "max_minutes": 10.0, "threads": 1, "stats_batches": 1, "stats_batch_size": 2})
    records: list[dict] = []
    t0 = time.monotonic()
    train(cfg, [DATA / "train.txt"], tmp_path / "ck", progress=False,
          on_log=lambda r: (records.append(r), time.sleep(0.3)))
    wall = time.monotonic() - t0
    seconds = [r["seconds"] for r in records if "train_bpb" in r]
    assert len(seconds) == 8 and seconds == sorted(seconds)
    slept = 0.3 * 7  # the sleeps between the first and the last step's record
    if time_clock == "wall":
        assert seconds[-1] - seconds[0] >= slept
    else:
        assert seconds[-1] - seconds[0] < slept / 2 < wall
    assert ("CPU-min" in (tmp_path / "ck" / "MODEL_CARD.md").read_text()) == (time_clock == "cpu")
    with pytest.raises(ValueError, match="time_clock"):
        make_config(None, {"time_clock": "gpu"})


def test_reset_rows_start_afresh_with_the_stream_start_token() -> None:
    """reset_prob: the drawn rows get a fresh state and the stream-start token as first input, the others keep
    theirs; the draw depends on (seed, step) only, so every process of a distributed run agrees on it."""
    from trainer._dist import Group
    from trainer.train import _reset_rows

    cfg = make_config("tiny", {"arch": "char-transformer", "reset_prob": 0.5, "batch_size": 8})
    model = build_model(config_from_dict({"arch": cfg.arch, **cfg.model})).eval()
    chunk = ByteStreams(DATA.joinpath("train.txt").read_bytes(), 8, 16).chunk(3)[0]  # (8, 17)
    with torch.no_grad():
        state = model(chunk[:, :-1], model.init_state(8)).state
    new_chunk, new_state = _reset_rows(model, cfg, 7, chunk, state, Group())
    fresh = model.init_state(8)
    reset = [b for b in range(8) if torch.equal(new_state.tensors["mask"][b], fresh.tensors["mask"][b])]
    assert 0 < len(reset) < 8  # p = 0.5 over 8 rows, at this step
    for b in range(8):
        if b in reset:
            assert new_chunk[b, 0] == ord("\n") and torch.equal(new_chunk[b, 1:], chunk[b, 1:])
            assert all(torch.equal(new_state.tensors[k][b], fresh.tensors[k][b]) for k in fresh.tensors)
        else:
            assert torch.equal(new_chunk[b], chunk[b])
            assert all(torch.equal(new_state.tensors[k][b], state.tensors[k][b]) for k in fresh.tensors)
    again_chunk, _ = _reset_rows(model, cfg, 7, chunk, state, Group())
    assert torch.equal(again_chunk, new_chunk)  # (seed, step) decides
    with pytest.raises(ValueError, match="reset_prob"):
        make_config(None, {"reset_prob": 1.0})
