import math
from pathlib import Path
from typing import Any

import pytest
import torch

from models.checkpoint import load_checkpoint
from models.mlstm import MLSTM
from trainer.config import PRESETS, make_config
from trainer.data import ByteStreams
from trainer.stats import gradient_stats
from trainer.train import evaluate_bpb, train

DATA = Path(__file__).resolve().parent.parent / "data"
TRAIN, VALID = DATA / "train.txt", DATA / "valid.txt"


def test_byte_streams_are_contiguous_rows() -> None:
    data = bytes(range(256)) * 4
    s = ByteStreams(data, batch=4, bptt=10)
    a, first = s.chunk(0)
    b, _ = s.chunk(1)
    assert first and a.shape == (4, 11)
    assert torch.equal(a[:, -1], b[:, 0])  # chunk i+1 starts where chunk i's targets end
    assert bytes(a[1].tolist()) == data[256 : 256 + 11]  # row 1 starts a quarter into the corpus
    assert s.chunk(s.chunks_per_epoch)[1]


def test_tiny_preset_learns(tmp_path: Path) -> None:
    # 60 of the preset's 120 steps: about 4.5 bits per byte (seeds agree within 0.01), half a bit under the 5.0 asked
    cfg = make_config("tiny", {"max_steps": 60})
    torch.manual_seed(cfg.seed)
    from models.registry import build_model, config_from_dict

    untrained = build_model(config_from_dict({"arch": "mlstm", **cfg.model}))
    before = evaluate_bpb(untrained, VALID.read_bytes(), streams=4)
    result = train(cfg, [TRAIN], tmp_path / "ck", valid_path=VALID, progress=False)
    assert before > 7.5  # close to uniform: log2(256) = 8
    assert result.best_valid_bpb < before - 3.0  # the tiny preset must learn English byte statistics
    ck = load_checkpoint(tmp_path / "ck")
    assert ck.meta["metrics"]["valid_bpb"] == pytest.approx(result.best_valid_bpb)
    assert ck.meta["training_config"]["max_steps"] == cfg.max_steps
    assert "valid_bpb" in (tmp_path / "ck" / "train.jsonl").read_text()
    assert "Validation bits per byte" in ck.card
    assert ck.stats["adapter.h"].shape == (64, 64)


def _weights(path: Path) -> dict[str, torch.Tensor]:
    return load_checkpoint(path).model.state_dict()


SMALL: dict[str, Any] = {"max_steps": 12, "valid_every": 4, "valid_bytes": 2000, "stats_batches": 2,
                         "model": {"hidden": 16, "embed_dim": 8, "dropout_hidden": 0.2, "dropout_embed": 0.1}}


def test_same_seed_same_run(tmp_path: Path) -> None:
    cfg = make_config("tiny", SMALL)
    train(cfg, [TRAIN], tmp_path / "a", valid_path=VALID, progress=False)
    train(cfg, [TRAIN], tmp_path / "b", valid_path=VALID, progress=False)
    a, b = _weights(tmp_path / "a"), _weights(tmp_path / "b")
    assert all(torch.equal(a[k], b[k]) for k in a)
    c = make_config("tiny", SMALL, {"seed": 99})
    train(c, [TRAIN], tmp_path / "c", valid_path=VALID, progress=False)
    assert not torch.equal(_weights(tmp_path / "c")["head.v"], a["head.v"])


class _Interrupt(Exception):
    pass


def test_resume_reproduces_an_uninterrupted_run(tmp_path: Path) -> None:
    cfg = make_config("tiny", SMALL, {"valid_bytes": 0, "max_steps": 12})  # validation keeps improving

    def stop_at_8(record: dict[str, Any]) -> None:
        if record.get("step") == 8 and "valid_bpb" in record:
            raise _Interrupt

    train(cfg, [TRAIN], tmp_path / "whole", valid_path=VALID, progress=False)
    with pytest.raises(_Interrupt):
        train(cfg, [TRAIN], tmp_path / "resumed", valid_path=VALID, progress=False, on_log=stop_at_8)
    train(cfg, [TRAIN], tmp_path / "resumed", valid_path=VALID, progress=False, resume=True)
    whole, resumed = _weights(tmp_path / "whole"), _weights(tmp_path / "resumed")
    for k in whole:
        torch.testing.assert_close(resumed[k], whole[k], rtol=0, atol=0)


def test_gradient_stats_cover_every_weight_and_the_adapter() -> None:
    torch.manual_seed(0)
    from models.mlstm import MLSTMConfig

    model = MLSTM(MLSTMConfig(hidden=12, embed_dim=4))
    stats = gradient_stats(model, TRAIN.read_bytes()[:5000], batches=3, batch_size=4, segment=10)
    for n, p in model.named_parameters():
        assert stats[f"param.{n}"].shape == p.shape
        assert bool((stats[f"param.{n}"] >= 0).all())
    assert stats["adapter.h"].shape == (12, 12) and float(stats["adapter.h"].sum()) > 0
    # eq. 4.4 by hand for one batch: MS_g of the head bias is the squared batch-mean gradient
    one = gradient_stats(model, TRAIN.read_bytes()[:5000], batches=1, batch_size=4, segment=10)
    x = torch.frombuffer(bytearray(TRAIN.read_bytes()[:5000]), dtype=torch.uint8).long()
    rows = x[: (len(x) // 4) * 4].view(4, -1)[:, :11]
    model.zero_grad()
    out = model(rows[:, :-1], model.init_state(4))
    torch.nn.functional.cross_entropy(out.logits.reshape(-1, 256), rows[:, 1:].reshape(-1)).backward()
    assert model.head.bias is not None and model.head.bias.grad is not None
    torch.testing.assert_close(one["param.head.bias"], model.head.bias.grad ** 2)


def test_presets_and_bad_settings() -> None:
    assert set(PRESETS) == {"tiny", "default"}
    with pytest.raises(ValueError, match="unknown preset"):
        make_config("huge")
    with pytest.raises(ValueError, match="unknown training setting"):
        make_config("tiny", {"learning_rate": 1.0})
    with pytest.raises(ValueError, match="precision"):
        make_config("tiny", {"precision": "int4"})
    with pytest.raises(ValueError, match="batch_size"):
        make_config("tiny", {"batch_size": 0})
    assert math.isclose(make_config("tiny", {"lr": 0.5}).lr, 0.5)


def test_a_signal_stops_after_a_step_with_the_state_saved_and_resume_continues_it(tmp_path: Path) -> None:
    """SIGTERM (or Ctrl-C) mid-run, without a validation file: the run saves its state after the step it is in and
    stops; --resume then ends with the weights of an uninterrupted run."""
    import os
    import signal

    from trainer.train import TrainingInterrupted

    cfg = make_config("tiny", SMALL, {"log_every": 1})
    train(cfg, [TRAIN], tmp_path / "whole", progress=False)

    def term_at_6(record: dict[str, Any]) -> None:
        if record.get("step") == 6 and "train_bpb" in record:
            os.kill(os.getpid(), signal.SIGTERM)

    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(TrainingInterrupted) as stopped:
        train(cfg, [TRAIN], tmp_path / "resumed", progress=False, on_log=term_at_6)
    assert stopped.value.step == 6 and stopped.value.signum == signal.SIGTERM
    assert signal.getsignal(signal.SIGTERM) is before  # the run's handler is gone
    log = (tmp_path / "resumed" / "train.jsonl").read_text()
    assert '"interrupted": "SIGTERM"' in log
    train(cfg, [TRAIN], tmp_path / "resumed", progress=False, resume=True)
    whole, resumed = _weights(tmp_path / "whole"), _weights(tmp_path / "resumed")
    for k in whole:
        torch.testing.assert_close(resumed[k], whole[k], rtol=0, atol=0)


def test_a_failed_save_keeps_the_state_before_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Disk full while saving the resumable state: CannotWrite, no temporary file left, and the state saved before
    still resumes to the uninterrupted run's weights."""
    import errno

    import trainer.train as train_module
    from trainer.train import CannotWrite

    cfg = make_config("tiny", SMALL)
    train(cfg, [TRAIN], tmp_path / "whole", valid_path=VALID, progress=False)
    real_save, saves = train_module.save_file, []

    def full_at_second(tensors: dict[str, torch.Tensor], path: str, metadata: dict[str, str] | None = None) -> None:
        if Path(path).name.startswith(".trainer_state"):
            saves.append(path)
            if len(saves) == 2:
                Path(path).write_bytes(b"partial")
                raise OSError(errno.ENOSPC, "No space left on device")
        real_save(tensors, path, metadata=metadata)

    monkeypatch.setattr(train_module, "save_file", full_at_second)
    with pytest.raises(CannotWrite, match="No space left on device"):
        train(cfg, [TRAIN], tmp_path / "resumed", valid_path=VALID, progress=False)
    monkeypatch.undo()
    assert [p.name for p in (tmp_path / "resumed" / "last").iterdir()] == ["trainer_state.safetensors"]
    train(cfg, [TRAIN], tmp_path / "resumed", valid_path=VALID, progress=False, resume=True)
    whole, resumed = _weights(tmp_path / "whole"), _weights(tmp_path / "resumed")
    for k in whole:
        torch.testing.assert_close(resumed[k], whole[k], rtol=0, atol=0)


def test_resume_refuses_other_settings_or_data_and_allows_more_steps(tmp_path: Path) -> None:
    cfg = make_config("tiny", SMALL, {"max_steps": 4})
    train(cfg, [TRAIN], tmp_path / "ck", progress=False)
    with pytest.raises(ValueError, match=r"other settings \(batch_size 16 -> 8\)"):
        train(make_config("tiny", SMALL, {"max_steps": 4, "batch_size": 8}), [TRAIN], tmp_path / "ck",
              progress=False, resume=True)
    with pytest.raises(ValueError, match="model"):
        train(make_config("tiny", {"max_steps": 4}), [TRAIN], tmp_path / "ck", progress=False, resume=True)
    with pytest.raises(ValueError, match="other training data"):
        train(cfg, [VALID], tmp_path / "ck", progress=False, resume=True)
    assert train(make_config("tiny", SMALL, {"max_steps": 8}), [TRAIN], tmp_path / "ck", progress=False,
                 resume=True).steps == 8


def test_a_validation_text_too_short_is_refused_before_training(tmp_path: Path) -> None:
    (tmp_path / "v.txt").write_bytes(b"a")
    with pytest.raises(ValueError, match="too short to validate on"):
        train(make_config("tiny", SMALL), [TRAIN], tmp_path / "ck", valid_path=tmp_path / "v.txt", progress=False)
    assert not (tmp_path / "ck").exists()  # refused before anything was written


def test_impossible_model_settings_are_a_value_error(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="model settings"):
        train(make_config("tiny", {"model": {"hidden": -4}}), [TRAIN], tmp_path / "ck", progress=False)


def test_a_loss_that_becomes_non_finite_stops_the_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # a run whose loss became NaN (a too-high lr in half precision, say) stops at the next log line with one error,
    # instead of spending the rest of its budget on lost weights; what was saved before stays
    import trainer.train as tt
    from trainer.cli import run_command

    real, steps = tt.train_step, [0]

    def diverging(*args: Any, **kwargs: Any) -> Any:
        result = real(*args, **kwargs)
        steps[0] += 1
        return result._replace(nll=torch.tensor(math.nan)) if steps[0] > 12 else result

    monkeypatch.setattr(tt, "train_step", diverging)
    cfg = make_config("tiny", {"max_steps": 200, "log_every": 5, "valid_every": 10, "threads": 1})
    out = tmp_path / "ck"
    with pytest.raises(tt.TrainingDiverged, match="non-finite by step 15 .*lower --lr") as e:
        train(cfg, [DATA / "valid.txt"], out, progress=False)
    assert e.value.step == 15 and steps[0] == 15  # it stopped at the first log line after the NaN
    assert (out / "last" / tt.STATE_FILE).is_file()  # step 10's state is kept
    assert run_command("trainer", lambda: train(cfg, [DATA / "valid.txt"], tmp_path / "again", progress=False)) == 1


def test_init_from_starts_at_the_parent_weights_and_records_the_lineage(tiny_checkpoint: Path, tmp_path: Path) -> None:
    import json

    from tests._training import train_on_test_data

    parent = load_checkpoint(tiny_checkpoint)
    parent_bpb = parent.meta["metrics"]["valid_bpb"]
    # what the warm start alone gives (an lr of 1e-9 moves nothing), validated on the same text as the parent
    child = tmp_path / "child"
    train_on_test_data(make_config("tiny", {"init_from": str(tiny_checkpoint), "max_steps": 4, "lr": 1e-9,
                                            "lr_final": 1e-9, "valid_every": 2, "stats_batches": 2}), child)
    ck = load_checkpoint(child)
    for k, v in parent.model.state_dict().items():
        torch.testing.assert_close(ck.model.state_dict()[k], v, rtol=0, atol=1e-6)
    assert ck.meta["metrics"]["valid_bpb"] == pytest.approx(parent_bpb, abs=1e-4)
    lineage = ck.meta["training"]["init_from"]
    assert lineage["model_sha256"] == parent.model_hash and lineage["steps"] == 40 and lineage["total_steps"] == 40
    assert "Warm start" in ck.card and parent.model_hash[:12] in ck.card
    # a grandchild counts the whole lineage; a fresh run from scratch has no init_from
    grandchild = tmp_path / "grandchild"
    train_on_test_data(make_config("tiny", {"init_from": str(child), "max_steps": 2, "stats_batches": 2}), grandchild)
    meta = json.loads((grandchild / "config.json").read_text())
    assert meta["training"]["init_from"]["total_steps"] == 44
    assert "init_from" not in parent.meta["training"]


def test_init_from_refuses_other_model_settings_before_writing(tiny_checkpoint: Path, tmp_path: Path) -> None:
    from trainer.__main__ import main

    out = tmp_path / "out"
    code = main(["--preset", "tiny", "--data", str(TRAIN), "--out", str(out), "--init-from",
                 str(tiny_checkpoint), "--config", str(_write(tmp_path / "wide.json", {"model": {"hidden": 96}})),
                 "--quiet"])
    assert code == 2 and not out.exists()
    code = main(["--preset", "tiny", "--data", str(TRAIN), "--out", str(out), "--init-from",
                 str(tmp_path / "nowhere"), "--quiet"])
    assert code == 2 and not out.exists()


def _write(path: Path, obj: dict[str, Any]) -> Path:
    import json

    path.write_text(json.dumps(obj))
    return path
