"""The trainer's word-level path (issue 13): a word vocabulary built from the training text, the AWD-LSTM trained
with NT-ASGD and variable-length BPTT, the checkpoint carrying its tokenizer, and scoring that reports bits per word
and perplexity beside bits per byte of the raw text."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch

from models.adaptation import DynEvalConfig, evaluate
from models.checkpoint import load_checkpoint
from models.word_tokenizer import WordTokenizer
from tests._cli import run_cli
from trainer.config import make_config
from trainer.train import evaluate_bpb, train

ROOT = Path(__file__).resolve().parent.parent.parent
DATA = ROOT / "tests" / "data"
TRAIN, VALID = DATA / "train.txt", DATA / "valid.txt"


@pytest.fixture(scope="module")
def word_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("awd") / "ck"
    train(make_config("tiny", {"arch": "awd-lstm"}), [TRAIN], out, valid_path=VALID, progress=False)
    return out


def test_a_word_model_trains_and_its_checkpoint_keeps_the_vocabulary(word_checkpoint: Path) -> None:
    ck = load_checkpoint(word_checkpoint)
    tok = ck.tokenizer
    assert isinstance(tok, WordTokenizer) and tok.vocab_size == 2000 == ck.model.config.vocab_size
    # the vocabulary is the training text's, most frequent first
    counts = WordTokenizer.build(TRAIN.read_text(encoding="utf-8"))
    assert tok.to_dict()["vocab"][4:50] == counts.to_dict()["vocab"][4:50]
    metrics = ck.meta["metrics"]
    valid = VALID.read_bytes()
    words = len(tok.encode(valid))
    assert metrics["valid_words"] == words
    assert metrics["valid_perplexity"] == pytest.approx(2 ** metrics["valid_bits_per_word"])
    assert metrics["valid_bpb"] == pytest.approx(metrics["valid_bits_per_word"] * words / len(valid))
    untrained = math.log2(tok.vocab_size)
    assert metrics["valid_bits_per_word"] < untrained - 1.5  # it learned the commonest words (uniform: 10.97)
    log = [json.loads(line) for line in (word_checkpoint / "train.jsonl").read_text().splitlines()]
    checks = [r for r in log if "valid_bpb" in r and "done" not in r]
    assert len(checks) == 3 and all("averaging" in r and "valid_ppl" in r for r in checks)
    # MS_g for the sparse site of the last layer (the default site; tied, so embedding-sized: 16), over word ids
    assert ck.stats["adapter.h1"].shape == (16, 16) and float(ck.stats["adapter.h1"].sum()) > 0


def test_scoring_a_word_model_reports_words_and_bytes(word_checkpoint: Path) -> None:
    text = VALID.read_text(encoding="utf-8")[:3000]
    r = run_cli("score", "--checkpoint", str(word_checkpoint), "--json", "-", stdin=text.encode())
    assert r.returncode == 0, r.stderr
    out: dict[str, Any] = json.loads(r.stdout)
    ck = load_checkpoint(word_checkpoint)
    assert out["tokens"] == len(ck.tokenizer.encode(text)) and out["bytes"] == len(text.encode())
    assert out["bits_per_word"] == pytest.approx(out["bits"] / out["tokens"])
    assert out["bits_per_byte"] == pytest.approx(out["bits"] / out["bytes"])
    assert out["perplexity"] == pytest.approx(2 ** out["bits_per_word"])
    # the same figure as the trainer's validation (one stream here, 4 there: close, not equal)
    ids = ck.tokenizer.encode_tensor(text)
    assert out["bits_per_word"] == pytest.approx(evaluate_bpb(ck.model, ids, streams=1), rel=0.05)


def test_dynamic_evaluation_adapts_a_word_model(word_checkpoint: Path) -> None:
    ck = load_checkpoint(word_checkpoint)
    text = (VALID.read_bytes()[:2500]) * 2  # a repeat: adaptation must lower the second copy's cost
    static = evaluate(ck.model, text, DynEvalConfig(mode="static"), tokenizer=ck.tokenizer)
    assert static.tokens == len(ck.tokenizer.encode(text)) and static.bytes == len(text)
    for mode, lr in (("sparse", 1e-2), ("full", 1e-3)):
        adapted = evaluate(ck.model, text, DynEvalConfig(mode=mode, rule="sgd", lr=lr, segment=10), stats=ck.stats,
                           tokenizer=ck.tokenizer)
        assert adapted.tokens == static.tokens
        assert adapted.bits < static.bits, mode


def test_word_settings_are_checked() -> None:
    with pytest.raises(ValueError, match="tokenizer must be"):
        make_config("tiny", {"arch": "awd-lstm", "tokenizer": {"kind": "sentencepiece"}})
    with pytest.raises(ValueError, match="optimizer must be one of"):
        make_config("tiny", {"arch": "awd-lstm", "optimizer": "lamb"})
    with pytest.raises(ValueError, match="settings of the ntasgd optimizer"):
        make_config("tiny", {"finetune_steps": 10})


class _Interrupt(Exception):
    pass


def test_an_interrupted_ntasgd_run_resumes_exactly(tmp_path: Path) -> None:
    """NT-ASGD's counters, logs and average, and variable-length BPTT's position, are part of the trainer's state:
    a run stopped after its second validation and resumed ends with the weights of one that never stopped. The
    trigger (nonmono 0: the first validation worse than the best so far) is made to fire on the way by a high lr."""
    cfg = make_config("tiny", {"arch": "awd-lstm", "nonmono": 0, "lr": 40.0, "max_steps": 60, "valid_every": 10,
                               "finetune_steps": 20, "valid_bytes": 4000})

    def stop_at_40(record: dict[str, Any]) -> None:
        if record.get("step") == 40 and "valid_bpb" in record:
            raise _Interrupt

    whole_log: list[dict[str, Any]] = []
    train(cfg, [TRAIN], tmp_path / "whole", valid_path=VALID, progress=False, on_log=whole_log.append)
    with pytest.raises(_Interrupt):
        train(cfg, [TRAIN], tmp_path / "resumed", valid_path=VALID, progress=False, on_log=stop_at_40)
    train(cfg, [TRAIN], tmp_path / "resumed", valid_path=VALID, progress=False, resume=True)
    assert any("averaging_from_step" in r for r in whole_log)  # the trigger fired, so the average was resumed too
    assert any(r.get("finetune") for r in whole_log)
    whole, resumed = load_checkpoint(tmp_path / "whole").model.state_dict(), \
        load_checkpoint(tmp_path / "resumed").model.state_dict()
    for k in whole:
        assert torch.equal(whole[k], resumed[k]), k


def test_adaptlm_tune_and_eval_work_on_a_word_model(word_checkpoint: Path, tmp_path: Path) -> None:
    """The neural cache over words (window in words) and sparse dynamic evaluation, tuned and evaluated by the CLI;
    eval reports bits per word and perplexity."""
    import shutil

    ck = tmp_path / "ck"
    shutil.copytree(word_checkpoint, ck)
    valid = str(VALID)
    for mode in ("cache", "sparse"):
        r = run_cli("tune", "--checkpoint", str(ck), "--valid", valid, "--bytes", "3000", "--mode", mode,
                    "--cache-window", "200", "--max-trials", "6")
        assert r.returncode == 0, r.stderr
    dyneval = json.loads((ck / "dyneval.json").read_text())
    assert dyneval["cache"]["valid_bpb"] <= dyneval["cache"]["valid_static_bpb"]
    r = run_cli("eval", "--checkpoint", str(ck), valid, "--limit", "3000", "--mode", "static,cache,sparse", "--json")
    assert r.returncode == 0, r.stderr
    by_mode = {rec["mode"]: rec for rec in json.loads(r.stdout)}  # one record per mode
    assert set(by_mode) == {"static", "cache", "sparse"}
    for rec in by_mode.values():
        assert rec["perplexity"] == pytest.approx(2 ** rec["bits_per_word"])
        assert rec["bits_per_byte"] == pytest.approx(rec["bits"] / rec["bytes"])
    assert by_mode["cache"]["bits_per_byte"] == pytest.approx(dyneval["cache"]["valid_bpb"])


def test_a_word_model_generates_words(word_checkpoint: Path) -> None:
    """Sampling reads the checkpoint's tokenizer: max_tokens counts words, the prompt and the text are the prompt's
    kept tokens and the sampled words' own text (token healing), and a seed repeats it (CLI and library alike)."""
    from models.sampling import SamplingParams, Stepper

    ck = load_checkpoint(word_checkpoint)
    stepper = Stepper(ck.model.eval(), SamplingParams(max_tokens=12, temperature=1.0, seed=3), tokenizer=ck.tokenizer)
    stepper.prefill(b"It was a")
    steps = []
    while stepper.finish_reason is None:
        steps.append(stepper.step())
    assert len(steps) == 12 and stepper.finish_reason == "length"
    text = "".join(s.text for s in steps)
    kept, _ = ck.tokenizer.heal(b"It was a")  # token healing: " a" may be the start of " and", held back
    assert "It was a" + text == kept.decode() + ck.tokenizer.decode([s.token for s in steps])
    r = run_cli("generate", "--checkpoint", str(word_checkpoint), "--prompt", "It was a", "--max-tokens", "12",
                "--seed", "3", "--temperature", "1.0")
    assert r.returncode == 0, r.stderr
    assert r.stdout == text + "\n"  # the CLI ends its output with a newline
