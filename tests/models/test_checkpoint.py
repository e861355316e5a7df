import json
import pickle
import shutil
from pathlib import Path

import pytest
import torch

from models.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from models.mlstm import MLSTM, MLSTMConfig
from models.word_tokenizer import WordTokenizer


@pytest.fixture
def saved(tmp_path: Path) -> tuple[MLSTM, Path]:
    torch.manual_seed(0)
    model = MLSTM(MLSTMConfig(hidden=16, embed_dim=8))
    stats = {f"param.{n}": torch.rand_like(p) for n, p in model.named_parameters()}
    stats["adapter.h"] = torch.rand(16, 16)
    out = save_checkpoint(tmp_path / "ck", model, stats=stats, dyneval={"lr": 1e-4}, meta={"name": "t"}, card="# t\n")
    return model, out


def test_round_trip_is_bit_exact(saved: tuple[MLSTM, Path]) -> None:
    model, path = saved
    ck = load_checkpoint(path)
    assert ck.config == model.config
    for (k, a), (k2, b) in zip(model.state_dict().items(), ck.model.state_dict().items(), strict=True):
        assert k == k2 and torch.equal(a, b)
    x = torch.randint(0, 256, (2, 11))
    assert ck.model.frozen and not any(p.requires_grad for p in ck.model.parameters())  # loaded for inference
    model.freeze()  # the same (inference) path on both sides: equal bit for bit on any CPU
    assert torch.equal(model(x, model.init_state(2)).logits, ck.model(x, ck.model.init_state(2)).logits)
    assert ck.dyneval == {"lr": 1e-4}
    assert ck.tokenizer.kind == "bytes" and json.loads((path / "config.json").read_text())["tokenizer"] == "bytes"
    assert load_checkpoint(path, trainable=True).model.w_mh.v.requires_grad
    assert ck.name == "t"
    assert len(ck.model_hash) == 64
    assert set(ck.stats) == {f"param.{n}" for n, _ in model.named_parameters()} | {"adapter.h"}


@pytest.mark.parametrize("name", ["config.json", "model.safetensors", "stats.safetensors", "dyneval.json",
                                  "MODEL_CARD.md"])
def test_missing_file_is_named(saved: tuple[MLSTM, Path], name: str) -> None:
    _, path = saved
    (path / name).unlink()
    with pytest.raises(CheckpointError, match=name.replace(".", r"\.")):
        load_checkpoint(path)


def test_tampered_weights_refused(saved: tuple[MLSTM, Path]) -> None:
    _, path = saved
    raw = bytearray((path / "model.safetensors").read_bytes())
    raw[10:40] = b"\xff" * 30  # corrupt the header
    (path / "model.safetensors").write_bytes(bytes(raw))
    with pytest.raises(CheckpointError, match="model.safetensors"):
        load_checkpoint(path)


def test_truncated_weights_refused(saved: tuple[MLSTM, Path]) -> None:
    _, path = saved
    raw = (path / "model.safetensors").read_bytes()
    (path / "model.safetensors").write_bytes(raw[: len(raw) // 2])
    with pytest.raises(CheckpointError, match="model.safetensors"):
        load_checkpoint(path)


class _Boom:
    def __reduce__(self) -> tuple[object, tuple[str]]:
        return (print, ("unpickled!",))


def test_pickle_is_never_loaded(saved: tuple[MLSTM, Path], capsys: pytest.CaptureFixture[str]) -> None:
    model, path = saved
    torch.save({"state": model.state_dict(), "boom": _Boom()}, path / "model.safetensors")
    (path / "stats.safetensors").write_bytes(pickle.dumps(_Boom()))
    with pytest.raises(CheckpointError, match="model.safetensors"):
        load_checkpoint(path)
    shutil.copy(path / "stats.safetensors", path / "model.safetensors")
    with pytest.raises(CheckpointError, match="model.safetensors"):
        load_checkpoint(path)
    assert "unpickled" not in capsys.readouterr().out


def test_nan_weights_refused(saved: tuple[MLSTM, Path]) -> None:
    model, path = saved
    with torch.no_grad():
        model.head.bias.fill_(float("nan"))  # type: ignore[union-attr]
    save_checkpoint(path, model)
    with pytest.raises(CheckpointError, match="non-finite"):
        load_checkpoint(path)


def test_other_architecture_and_bad_config(saved: tuple[MLSTM, Path]) -> None:
    _, path = saved
    cfg_path = path / "config.json"
    cfg = json.loads(cfg_path.read_text())
    with pytest.raises(CheckpointError, match="expected 'transformer'"):
        load_checkpoint(path, expect_arch="transformer")
    cfg["model"]["arch"] = "awd_lstm_v9"
    cfg_path.write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="unknown architecture"):
        load_checkpoint(path)
    cfg["model"] = {"arch": "mlstm", "hidden": 32, "embed_dim": 8}
    cfg_path.write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="shape"):
        load_checkpoint(path)
    cfg["model"] = {"arch": "mlstm", "hidden": 16, "embed_dim": 8, "layers": 3}
    cfg_path.write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="unknown mlstm config fields: layers"):
        load_checkpoint(path)
    cfg_path.write_text("{not json")
    with pytest.raises(CheckpointError, match="config.json: not valid JSON"):
        load_checkpoint(path)


def test_wrong_values_in_present_files_are_checkpoint_errors(saved: tuple[MLSTM, Path]) -> None:
    """Files that are there but wrong raise CheckpointError naming the file once (the CLI's one line), never a
    TypeError from building the model or a UnicodeDecodeError from the card."""
    _, path = saved
    cfg = json.loads((path / "config.json").read_text())
    (path / "dyneval.json").write_text("[1]")
    with pytest.raises(CheckpointError) as e:
        load_checkpoint(path)
    assert str(e.value) == f"{path / 'dyneval.json'}: expected a JSON object"
    (path / "dyneval.json").write_text("{}")
    (path / "MODEL_CARD.md").write_bytes(b"\xff\xfe card")
    with pytest.raises(CheckpointError, match="MODEL_CARD.md: not UTF-8"):
        load_checkpoint(path)
    (path / "MODEL_CARD.md").write_text("# card\n")
    cfg["model"]["hidden"] = "wide"
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="config.json: "):
        load_checkpoint(path)


def test_not_a_directory(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="not a checkpoint directory"):
        load_checkpoint(tmp_path / "nope")


def test_dyneval_is_parsed_once_into_typed_settings(saved: tuple[MLSTM, Path]) -> None:
    _, path = saved
    sections = {"sparse": {"rule": "sgd", "lr": 0.01, "segment": 10, "adapter_units": 8},
                "session": {"rule": "sgd", "lr": 0.002, "cache_weight": 0.25}, "full": {"rule": "sgd"}}
    (path / "dyneval.json").write_text(json.dumps(sections))
    ck = load_checkpoint(path)
    assert ck.dyneval.session.lr == 0.002 and ck.dyneval.session.mode == "sparse" and ck.dyneval.cache_weight == 0.25
    assert ck.dyneval.config("sparse").segment == 10 and ck.dyneval.config("dynamic").mode == "full"
    assert ck.dyneval["sparse"]["lr"] == 0.01  # still reads as the file it was parsed from
    for bad, match in ((dict(sections, sparse={"rule": "adam"}), "sparse"),
                       (dict(sections, session={"cache_weight": 2}), "cache_weight"),
                       (dict(sections, full=[1]), "full")):
        (path / "dyneval.json").write_text(json.dumps(bad))
        with pytest.raises(CheckpointError, match=match):
            load_checkpoint(path)


def test_an_unknown_tokenizer_is_refused(saved: tuple[MLSTM, Path]) -> None:
    _, path = saved
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "tokenizer": "sentencepiece"}))
    with pytest.raises(CheckpointError, match="unknown tokenizer 'sentencepiece'"):
        load_checkpoint(path)


def test_a_word_tokenizer_is_loaded_and_must_fit_the_model(saved: tuple[MLSTM, Path]) -> None:
    """config.json's word vocabulary comes back as the checkpoint's tokenizer; one whose size is not the model's
    vocabulary is refused, naming both sizes."""
    _, path = saved
    config = json.loads((path / "config.json").read_text())
    vocab = WordTokenizer.build(["a b c\n"]).to_dict()
    (path / "config.json").write_text(json.dumps({**config, "tokenizer": vocab}))
    with pytest.raises(CheckpointError, match=r"words tokenizer has 7 tokens, the model 256"):
        load_checkpoint(path)
    words = [f"w{i}" for i in range(256 - 4)]  # 4 specials + 252 words: the byte model's 256 ids
    fitting = WordTokenizer.build([" ".join(words) + "\n"], split="whitespace")
    assert fitting.vocab_size == 256
    (path / "config.json").write_text(json.dumps({**config, "tokenizer": fitting.to_dict()}))
    assert load_checkpoint(path).tokenizer == fitting


@pytest.mark.parametrize("name", ["model.safetensors", "stats.safetensors"])
def test_files_of_two_saves_are_refused(tmp_path: Path, name: str) -> None:
    """A save killed between two renames leaves one file of a later save beside an earlier save's config.json:
    the loader refuses it instead of serving weights with statistics (or a config) they were not saved with."""
    torch.manual_seed(0)
    model = MLSTM(MLSTMConfig(hidden=16, embed_dim=8))
    stats = {f"param.{n}": torch.rand_like(p) for n, p in model.named_parameters()}
    first = save_checkpoint(tmp_path / "a", model, stats=stats)
    with torch.no_grad():
        model.w_mh.v.add_(1.0)  # the later save's weights differ
    later = save_checkpoint(tmp_path / "b", model, stats={k: v + 1 for k, v in stats.items()})
    assert load_checkpoint(first) and load_checkpoint(later)  # each save alone loads
    shutil.copy(later / name, first / name)  # the later save got this far, then died
    with pytest.raises(CheckpointError, match=rf"{name.replace('.', '[.]')}: not the file config.json was saved"):
        load_checkpoint(first)


def test_the_same_tensors_make_the_same_files_and_an_old_checkpoint_loads(saved: tuple[MLSTM, Path],
                                                                          tmp_path: Path) -> None:
    """config.json holds the tensor files' hashes, and the same tensors make the same files; a checkpoint saved
    before the hashes has none and is not checked (the shipped ones)."""
    model, path = saved
    stats = load_checkpoint(path).stats
    again = save_checkpoint(tmp_path / "again", model, stats=stats, dyneval={"lr": 1e-4}, meta={"name": "t"},
                            card="# t\n")
    for name in ("config.json", "model.safetensors", "stats.safetensors"):
        assert (again / name).read_bytes() == (path / name).read_bytes(), name
    config = json.loads((path / "config.json").read_text())
    config["sha256"]["stats.safetensors"] = "0" * 64
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="stats[.]safetensors: not the file config.json was saved with"):
        load_checkpoint(path)
    del config["sha256"]
    (path / "config.json").write_text(json.dumps(config))
    assert load_checkpoint(path).config.arch == "mlstm"


def test_a_lexicon_is_loaded_when_present_and_refused_when_broken(saved: tuple[MLSTM, Path]) -> None:
    _, path = saved
    assert load_checkpoint(path).lexicon is None  # absent: no prior
    (path / "lexicon.txt").write_text("whale\nsea\n", encoding="utf-8")
    lexicon = load_checkpoint(path).lexicon
    assert lexicon is not None and lexicon.listed == 2 and lexicon.known("Whale")
    (path / "lexicon.txt").write_text("whale\nnot one word\n", encoding="utf-8")
    with pytest.raises(CheckpointError, match="lexicon.txt"):
        load_checkpoint(path)
