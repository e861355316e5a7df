"""Checkpoint directories (docs/architecture.md, "Checkpoints"): never unpickled, validated on load.

    config.json         {"format": 1, "model": {arch, ...}, "training": {...}, "metrics": {...}}
    model.safetensors   weights
    stats.safetensors   MS_g per weight ("param.<name>") and per adapter site ("adapter.<site>")
    dyneval.json        dynamic-evaluation settings (eta, lambda, eps, segment, ...), parsed into DynEvalSettings
  config.json's "tokenizer" names the tokenizer (absent: bytes, as every checkpoint before it was saved).
    MODEL_CARD.md       human-readable card
    lexicon.txt         optional: the training text's words, one a line (models/lexicon.py), the dictionary prior
                        of a byte model's keyboard suggestions; absent: no prior. Not covered by "sha256" (a word
                        list ties to no weights: `python -m trainer.lexicon` writes or rewrites it at any time)

A save writes every file to a temporary name and renames it into place, config.json last, whose "sha256" holds the
SHA-256 of model.safetensors and stats.safetensors as saved. The loader hashes the files (the weights' hash is the
`model_hash` it computes anyway): a save killed between two renames leaves weights or statistics of one save beside
the config of another, and the loader refuses that mix instead of serving weights with the MS_g of other weights (or
with another save's settings). A checkpoint without "sha256" (saved before it) is not checked; to keep tensors that
another tool rewrote, delete it.

Training-only parameters (a model's auxiliary heads, `LanguageModel.training_only_parameters`) are listed in
config.json's "training_only_parameters". A checkpoint saved with `training_only=False` leaves them out of
model.safetensors ("training_only_parameters_shipped": false) to ship fewer bytes; the loader then fills them with
zeros: inference never reads them, and nothing trains on from a shipped checkpoint (training resumes from its own
trainer state).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from models._skeleton import skeleton
from models.adaptation import DynEvalSettings
from models.base import LanguageModel, ModelConfig
from models.lexicon import LEXICON_FILE, Lexicon
from models.registry import build_model, config_from_dict
from models.tokenizer import ByteTokenizer, Tokenizer, tokenizer_from_dict

__all__ = ["CHECKPOINT_FILES", "Checkpoint", "CheckpointError", "load_checkpoint", "save_checkpoint"]

FORMAT_VERSION = 1
CHECKPOINT_FILES = ("config.json", "model.safetensors", "stats.safetensors", "dyneval.json", "MODEL_CARD.md")


class CheckpointError(ValueError):
    """A checkpoint directory is missing, incomplete, corrupt or of another architecture."""


@dataclass
class Checkpoint:
    model: LanguageModel
    config: ModelConfig
    meta: dict[str, Any]  # config.json minus the model config
    stats: dict[str, torch.Tensor]
    dyneval: DynEvalSettings
    model_hash: str  # sha256 of model.safetensors: ties sessions and exports to these weights
    path: Path | None = None
    card: str = field(default="", repr=False)
    tokenizer: Tokenizer = field(default_factory=ByteTokenizer)
    lexicon: Lexicon | None = field(default=None, repr=False)  # lexicon.txt, if the directory has one

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def name(self) -> str:
        return str(self.meta.get("name") or (self.path.name if self.path else "model"))


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def save_checkpoint(directory: str | Path, model: LanguageModel, *, stats: dict[str, torch.Tensor] | None = None,
                    dyneval: Mapping[str, Any] | None = None, meta: dict[str, Any] | None = None,
                    card: str = "", weights_dtype: torch.dtype = torch.float32,
                    stats_dtype: torch.dtype = torch.float32, tokenizer: Tokenizer | None = None,
                    training_only: bool = True) -> Path:
    """Write every checkpoint file; files are written to temporary names and renamed into place. `training_only`
    False leaves the training-only parameters (and their statistics) out (module docstring)."""
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    config = {"format": FORMAT_VERSION, "model": model.config.to_dict(), **(meta or {}),
              "tokenizer": (tokenizer or ByteTokenizer()).to_dict()}
    dropped: set[str] = set()
    if model.training_only_parameters():  # which weights are not inference parameters (the model's docstring)
        config["training_only_parameters"] = model.training_only_parameters()
        config["training_only_parameters_shipped"] = training_only
        if not training_only:
            dropped = set(model.training_only_parameters())
    weights = {k: v.detach().to("cpu", weights_dtype).contiguous() for k, v in model.state_dict().items()
               if k not in dropped}
    stats_t = {k: v.detach().to("cpu", stats_dtype).contiguous() for k, v in (stats or {}).items()
               if k.removeprefix("param.") not in dropped}
    header = {"format": str(FORMAT_VERSION)}  # one key: safetensors writes its metadata in no fixed order
    hashes: dict[str, str] = {}
    config["sha256"] = hashes  # filled as the tensor files are written; config.json goes last (module docstring)
    staged: dict[str, Callable[[Path], object]] = {
        "model.safetensors": lambda p: save_file(weights, str(p), metadata=header),
        "stats.safetensors": lambda p: save_file(stats_t, str(p), metadata=header),
        "dyneval.json": lambda p: p.write_text(json.dumps(dict(dyneval or {}), indent=2, sort_keys=True) + "\n"),
        "MODEL_CARD.md": lambda p: p.write_text(card or "# Model card\n\n(no card written)\n"),
        "config.json": lambda p: p.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n"),
    }
    for name, write in staged.items():
        tmp = out / f".{name}.tmp"
        write(tmp)
        if name.endswith(".safetensors"):
            hashes[name] = _sha256(tmp)
        tmp.replace(out / name)
    return out


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise CheckpointError(f"{path}: missing")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{path}: expected a JSON object")
    return data


def _read_tensors(path: Path) -> dict[str, torch.Tensor]:
    if not path.is_file():
        raise CheckpointError(f"{path}: missing")
    try:
        tensors = load_file(str(path))
    except (SafetensorError, OSError, ValueError, RuntimeError) as e:
        raise CheckpointError(f"{path}: not a valid safetensors file ({e})") from None
    for k, v in tensors.items():
        if v.is_floating_point() and not bool(torch.isfinite(v).all()):
            raise CheckpointError(f"{path}: tensor {k!r} holds non-finite values")
    return tensors


def load_checkpoint(directory: str | Path, *, expect_arch: str | None = None,
                    device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32,
                    trainable: bool = False) -> Checkpoint:
    """Load and validate a checkpoint directory onto `device`; every problem raises CheckpointError naming the
    file. The model is frozen for inference (`LanguageModel.freeze`) unless `trainable`."""
    d = Path(directory)
    if not d.is_dir():
        raise CheckpointError(f"{d}: not a checkpoint directory")
    cfg_path = d / "config.json"
    meta = _read_json(cfg_path)
    if meta.get("format") != FORMAT_VERSION:
        raise CheckpointError(f"{cfg_path}: unsupported format {meta.get('format')!r} (expected {FORMAT_VERSION})")
    if not isinstance(meta.get("model"), dict):
        raise CheckpointError(f"{cfg_path}: no 'model' object")
    try:
        config = config_from_dict(meta.pop("model"))
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"{cfg_path}: {e}") from None
    try:
        tokenizer = tokenizer_from_dict(meta.pop("tokenizer", None))
    except ValueError as e:
        raise CheckpointError(f"{cfg_path}: {e}") from None
    if tokenizer.vocab_size != config.vocab_size:
        raise CheckpointError(f"{cfg_path}: the {tokenizer.kind} tokenizer has {tokenizer.vocab_size} tokens, "
                              f"the model {config.vocab_size}")
    if expect_arch is not None and config.arch != expect_arch:
        raise CheckpointError(f"{cfg_path}: architecture {config.arch!r}, expected {expect_arch!r}")

    weights_path = d / "model.safetensors"
    weights = _read_tensors(weights_path)
    stats_path = d / "stats.safetensors"
    stored_stats = _read_tensors(stats_path)
    saved = meta.pop("sha256", None)  # the files' hashes when they were saved (absent: saved before it)
    model_hash = _sha256(weights_path)
    for path, digest in (weights_path, model_hash), (stats_path, _sha256(stats_path)):
        if isinstance(saved, dict) and saved.get(path.name) not in (None, digest):
            raise CheckpointError(f"{path}: not the file config.json was saved with (a save was interrupted, or the "
                                  "file was replaced): save the checkpoint again")
    try:
        with skeleton():  # no initial values to overwrite (models/_skeleton.py)
            model = build_model(config)
    except (TypeError, ValueError) as e:  # a field of the wrong type or out of range (config_from_dict names them)
        raise CheckpointError(f"{cfg_path}: cannot build the {config.arch} model ({e})") from None
    expected = {k: v.shape for k, v in model.state_dict().items()}
    missing = sorted(set(expected) - set(weights))
    extra = sorted(set(weights) - set(expected))
    if missing and set(missing) <= set(model.training_only_parameters()):
        # left out when it was saved (module docstring): never read by inference; zeros stand in
        weights.update({k: torch.zeros(expected[k]) for k in missing})
        missing = []
    if missing or extra:
        raise CheckpointError(f"{weights_path}: does not match the {config.arch} config "
                              f"(missing {missing[:5]}, unexpected {extra[:5]})")
    for k, shape in expected.items():
        if weights[k].shape != shape:
            raise CheckpointError(f"{weights_path}: {k!r} has shape {tuple(weights[k].shape)}, "
                                  f"config says {tuple(shape)}")
    if any(b.is_meta for b in model.buffers()):
        # buffers the state dict does not carry (a causal mask, position tables) would stay on meta: build the
        # model for real on the device, then copy the weights in
        with torch.device(device):
            model = build_model(config).to(dtype)
        model.load_state_dict({k: v.to(device, dtype) for k, v in weights.items()})
    else:
        model.load_state_dict({k: v.to(device, dtype) for k, v in weights.items()}, assign=True)
    model.eval()
    if not trainable:
        model.freeze()

    stats = {k: v.to(device, dtype) for k, v in stored_stats.items()}
    params = dict(model.named_parameters())
    for k, v in stats.items():
        if k.startswith("param.") and (k[6:] not in params or params[k[6:]].shape != v.shape):
            raise CheckpointError(f"{stats_path}: statistics {k!r} match no parameter of the model")
    dyneval_json = _read_json(d / "dyneval.json")  # its own CheckpointError names the file
    try:
        dyneval = DynEvalSettings(dyneval_json)
    except ValueError as e:
        raise CheckpointError(f"{d / 'dyneval.json'}: {e}") from None
    card_path = d / "MODEL_CARD.md"
    if not card_path.is_file():
        raise CheckpointError(f"{card_path}: missing")
    try:
        card = card_path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise CheckpointError(f"{card_path}: not UTF-8 text (byte {e.start})") from None
    lexicon_path = d / LEXICON_FILE
    try:
        lexicon = Lexicon.read(lexicon_path) if lexicon_path.is_file() else None
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{lexicon_path}: {e}") from None
    return Checkpoint(model=model, config=config, meta=meta, stats=stats, dyneval=dyneval,
                      model_hash=model_hash, path=d, card=card, tokenizer=tokenizer, lexicon=lexicon)
