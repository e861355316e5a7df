"""Loading the model: the checkpoint, what it tells about itself (`ModelInfo`) and the session settings its
dyneval.json allows (`SessionLimits`)."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path

import torch

from kernels import _dispatch as kernel_dispatch
from kernels import kernel_implementation
from models.adaptation import CacheConfig, DynEvalConfig
from models.checkpoint import Checkpoint, load_checkpoint
from models.device import resolve_device
from models.precision import resolve_precision
from models.tokenizer import ByteTokenizer, Tokenizer
from server.engine._kernel_check import check_model

__all__ = ["Loaded", "ModelInfo", "SessionLimits", "load_model", "session_settings"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SessionLimits:
    """The checkpoint's sparse dynamic-evaluation settings that sessions start from (dyneval.json "session",
    else "sparse")."""

    lr: float
    decay: float
    adapter_size: int  # default k
    max_adapter_size: int  # the adaptation sites' units (and the statistics' coverage)
    rule: str
    eps: float
    segment: int
    cache_weight: float = 0.0  # the word cache's weight in suggestions (dyneval.json "session" "cache_weight")
    neural_cache: bool = False  # sessions mix in the neural cache unless they say (dyneval.json "session")
    cache: CacheConfig = field(default_factory=CacheConfig)  # its window, theta, lam (dyneval.json "cache")
    # the memory the session API's flat `lr` and `decay` (and the session answer's) name: the checkpoint's default
    # weight-learning memory (`models.memory.weight_learner`), known once the memories are built (SessionService.load)
    learner: str = "adapter"


@dataclass(frozen=True)
class ModelInfo:
    name: str
    model_hash: str  # sha256 of the weights
    created: int  # unix time the weights were written
    path: Path
    kernel: str = "reference"  # the kernels' implementation on the model's device (a metric label)
    kernel_check: str = ""  # why the Triton kernels failed their start-up check here ("": they passed, or no check)
    precision: str = "float32"  # what "auto" resolved to on this device (a metric label)
    sessions: SessionLimits | None = None  # None: this checkpoint cannot adapt sessions
    sessions_unavailable: str = ""  # why not
    # what a token is: bytes (ids are byte values) or words (models/word_tokenizer.py); its ids' texts and counts
    tokenizer: Tokenizer = field(default_factory=ByteTokenizer)


@dataclass(frozen=True)
class Loaded:
    ckpt: Checkpoint
    info: ModelInfo
    base: DynEvalConfig | None  # the sparse settings the update rules derive from (None: unreadable)

    @property
    def device(self) -> torch.device:
        return next(self.ckpt.model.parameters()).device


def load_model(path: Path, precision: str, device: str = "auto") -> Loaded:
    """Load the checkpoint at `path` onto `device` (models/device.py; "auto": CUDA when present); raises
    CheckpointError on a bad one, ValueError on a device that is not here. `precision` may be "auto". A word
    model (tokenizer kind "words") has sessions too: they keep the observed text whose words may still change pending
    (`server/engine/_text.py`)."""
    ckpt = load_checkpoint(path, device=resolve_device(device))
    weights = path / "model.safetensors"
    limits, base, why = session_settings(ckpt)
    kernel, kernel_check = serving_kernels(ckpt)
    info = ModelInfo(name=ckpt.name, model_hash=ckpt.model_hash, created=int(weights.stat().st_mtime), path=path,
                     kernel=kernel, kernel_check=kernel_check, precision=resolve_precision(
                         precision, ckpt.device, bf16_model=ckpt.model.bf16_inference),
                     sessions=limits, sessions_unavailable=why, tokenizer=ckpt.tokenizer)
    return Loaded(ckpt, info, base)


def serving_kernels(ckpt: Checkpoint) -> tuple[str, str]:
    """-> (the kernels' implementation the model serves with, why the Triton kernels failed their check or "").
    The process's choice (kernels/_dispatch.py) on CUDA, once the Triton kernels have given the references' outputs
    on this very model (`check_model`); else the references, for the process (a model on the CPU runs the reference
    whatever the choice)."""
    if ckpt.device.type != "cuda" or kernel_implementation() != "triton":
        return "reference", ""
    problem = check_model(ckpt.model, ckpt.tokenizer.vocab_size)
    if problem is None:
        log.info("kernels: the Triton kernels give the references' outputs on %s", ckpt.name)
        return "triton", ""
    log.error("kernels: the Triton kernels cannot serve %s on this device (%s); serving with the references",
              ckpt.name, problem)
    kernel_dispatch.use("reference")
    return "reference", problem


def session_settings(ckpt: Checkpoint) -> tuple[SessionLimits | None, DynEvalConfig | None, str]:
    """The checkpoint's sparse settings and what limits them, or why sessions cannot work with it; and the
    sparse settings themselves once they are known valid for this model (text steps use their segment)."""
    # "session": serving defaults for users' own text, when the checkpoint has them; else "sparse",
    # the settings tuned on the validation book (in-domain text wants far smaller steps)
    base = ckpt.dyneval.session  # parsed and validated with the checkpoint
    sites = ckpt.model.adaptation_sites()
    if not sites:
        return None, None, f"{type(ckpt.model).__name__} has no adaptation sites"
    units = min(s.dim for s in sites)
    if base.rule in ("rms", "rms_decay"):
        stats = [ckpt.stats.get(f"adapter.{s.name}") for s in sites]
        if any(t is None for t in stats):
            return None, None, (f"the checkpoint has no adapter statistics (MS_g) for the {base.rule!r} rule; "
                                "train it to the end (or collect them) to serve sessions")
        units = min([units, *(min(t.shape) for t in stats if t is not None)])
    # the settings' k, else the sites' own default (`Site.adapter_size`), within what the sites and statistics cover
    default = min(base.adapter_units or min(s.adapter_size() for s in sites), units)
    return SessionLimits(lr=base.lr, decay=base.decay, adapter_size=default, max_adapter_size=units,
                         rule=base.rule, eps=base.eps, segment=base.segment,
                         cache_weight=ckpt.dyneval.cache_weight, neural_cache=ckpt.dyneval.neural_cache,
                         cache=ckpt.dyneval.cache), base, ""
