"""Training configuration: presets, config files (JSON or TOML) and flags, merged in that order."""

from __future__ import annotations

import dataclasses
import json
import math
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

__all__ = ["ARCH_PRESETS", "DTYPES", "OPTIMIZERS", "PRECISIONS", "PRESETS", "SCHEDULES", "TrainConfig",
           "load_config_file", "make_config"]

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
PRECISIONS = ("fp32", "bf16", "auto")
SCHEDULES = ("linear", "cosine")
OPTIMIZERS = ("adam", "ntasgd")
MAX_LR = 1e4  # the largest lr or lr_final accepted: larger ones overflow float32 in the optimizer step


@dataclass(frozen=True)
class TrainConfig:
    arch: str = "mlstm"
    model: dict[str, Any] = field(default_factory=dict)  # architecture config fields
    batch_size: int = 32  # independent contiguous streams, one per batch row
    bptt: int = 100  # truncated back-propagation length; state is carried across chunks
    lr: float = 1e-3  # Adam's peak learning rate, reached after warm-up and decayed to lr_final by max_steps
    lr_final: float = 1e-4
    warmup_steps: int = 0  # linear warm-up from lr / warmup_steps to lr
    # "linear" decay over all max_steps (the thesis' mLSTM setup, docs/algorithms.md §1) or "cosine" decay over the
    # steps after warm-up (the Compressive Transformer's setup, Rae et al. 2020, sec. 5.1; docs/algorithms.md §7)
    schedule: str = "linear"
    accumulate: int = 1  # micro-batches per optimizer step: the batch's rows split into this many, each with its state
    max_steps: int = 1000
    max_minutes: float = 0.0  # wall-clock stop (0: none)
    # what the schedules (learning rate, auxiliary losses) run on: "steps" (step / max_steps, reproducible) or
    # "budget" (the larger of step / max_steps and elapsed / max_minutes: the decay completes whichever budget ends
    # first, for a device whose speed is not known in advance; one process only)
    schedule_clock: str = "steps"
    # what max_minutes and the budget clock count: "wall" (elapsed time) or "cpu" (this process's CPU time, all its
    # threads: equal CPU budgets for runs that share a machine, e.g. several one-thread runs side by side)
    time_clock: str = "wall"
    clip: float = 1.0  # global gradient-norm clip
    # "fp32", "bf16" (matmuls under CPU/GPU autocast; cell state in fp32) or "auto": bf16 where the device multiplies
    # it natively (a CUDA GPU with bf16; a CPU with AVX-512 BF16 or AMX), else fp32 (models.precision.native_bf16)
    precision: str = "fp32"
    valid_every: int = 200
    valid_bytes: int = 0  # validate on the first N bytes of the validation text (0: all)
    valid_streams: int = 16
    seed: int = 1234
    log_every: int = 10
    stats_batches: int = 100  # MS_g: number of training batches (eq. 4.4)
    stats_batch_size: int = 32
    stats_segment: int = 20  # the dynamic-evaluation segment length for byte models (docs/algorithms.md §2)
    adapter_units: int = 0  # units at the adaptation site whose M gets MS_g (0: all hidden units)
    threads: int = 0  # torch threads (0: torch's default)
    weights_dtype: str = "float32"  # dtype of the shipped model.safetensors (loaded back as float32)
    # the shipped checkpoint keeps the training-only parameters (auxiliary heads; needed to train on from it): False
    # leaves them out of model.safetensors and stats.safetensors (config.json still lists them; loading fills them in)
    ship_training_only: bool = True
    # chance that a row starts afresh at a chunk (its state reset, its first input the stream-start token), so a
    # model whose state is a window or a memory also learns to predict from little context, as a new session or a
    # scored text does (0: rows are reset only at an epoch's start)
    reset_prob: float = 0.0
    stats_dtype: str = "float32"  # dtype of stats.safetensors (bfloat16 keeps fp32's range)
    # the tokenizer: {} bytes; {"kind": "words", "split": "words" | "whitespace", "max_size": N, "min_count": n} a
    # word vocabulary built from the training text (models/word_tokenizer.py), its size the model's vocab_size
    tokenizer: dict[str, Any] = field(default_factory=dict)
    # "adam" (warm-up and the schedule above), or "ntasgd": the AWD-LSTM's SGD at the constant lr with averaging
    # switched on by the non-monotone trigger over `nonmono` validations (docs/algorithms.md §5, trainer/ntasgd.py; the
    # logging interval is valid_every steps); checkpoints then keep the averaged weights
    optimizer: str = "adam"
    weight_decay: float = 0.0  # L2 of the ntasgd SGD (the AWD-LSTM's 1.2e-6)
    nonmono: int = 5
    # ntasgd: steps of the fine-tuning restart after max_steps (averaging restarted from the averaged weights, until
    # the same trigger fires again; AWD-LSTM sec. 5)
    finetune_steps: int = 0
    # each step's sequence length drawn around bptt (p = 0.95 bptt, else bptt / 2, then N(., 5)) and the learning
    # rate scaled by length / bptt (AWD-LSTM sec. 4.1); False: fixed chunks of bptt
    variable_bptt: bool = False
    # a checkpoint directory whose weights start the run (a warm start: fine-tuning, or more training of a shipped
    # model on a fresh schedule); its architecture, model settings and tokenizer must be this run's. "" : a fresh
    # initialisation. A resumed run continues from its own state and ignores it
    init_from: str = ""

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


PRESETS: dict[str, dict[str, Any]] = {
    # seconds on a CPU: for tests and smoke runs
    "tiny": {
        "model": {"hidden": 64, "embed_dim": 16, "dropout_hidden": 0.0},
        "batch_size": 16, "bptt": 32, "lr": 3e-3, "lr_final": 1e-3, "max_steps": 120, "valid_every": 40,
        "valid_streams": 4, "stats_batches": 4, "stats_batch_size": 8, "log_every": 20,
    },
    # the shipped model: sized by bits-per-byte per training minute on a 2-core CPU
    # (docs/notes/2026-11-benchmarks-history.md, "Choosing the size")
    # one thread: on 2 cores a second thread bought little and left no core for anything else
    "default": {
        "model": {"hidden": 768, "embed_dim": 128, "dropout_hidden": 0.05, "dropout_embed": 0.0},
        "batch_size": 64, "bptt": 100, "lr": 2e-3, "lr_final": 1e-4, "warmup_steps": 100,
        "max_steps": 4000, "max_minutes": 110, "precision": "bf16", "threads": 1,
        "valid_every": 250, "valid_bytes": 100_000, "valid_streams": 32,
        "stats_batches": 100, "stats_batch_size": 32, "log_every": 10,
        "weights_dtype": "float16", "stats_dtype": "bfloat16",
    },
}


# Per-architecture presets: for an architecture named here, `preset` picks these settings instead of PRESETS' (the
# model fields differ between architectures); a preset it does not name is refused.
ARCH_PRESETS: dict[str, dict[str, dict[str, Any]]] = {
    "char-transformer": {
        # seconds on a CPU: for tests and smoke runs (window 64 bytes, chunks of 32 slide through it)
        "tiny": {
            "model": {"d_model": 64, "n_layer": 3, "n_head": 2, "d_ff": 256, "context": 64},
            "batch_size": 16, "bptt": 32, "lr": 1e-3, "lr_final": 3e-4, "warmup_steps": 10, "schedule": "cosine",
            "max_steps": 120, "valid_every": 40,
            "valid_streams": 4, "stats_batches": 4, "stats_batch_size": 8, "log_every": 20,
        },
        # about 90 minutes on the 2-core CPU with one thread, like the default mLSTM (docs/benchmarks.md): 3.42M
        # inference parameters (6.8 MB in float16; the 0.46M of the training-only heads are not shipped), ~5,700
        # tokens/s in bf16 (this CPU has AVX-512 BF16: 2.4x its fp32 speed), so 13,000 steps x 2,048 bytes is ~27M
        # bytes, ~2.8 epochs of the default's 9.6 MB; the schedules run on the budget clock (whichever of max_steps
        # and max_minutes ends first)
        "small": {
            "model": {"d_model": 256, "n_layer": 4, "n_head": 4, "d_ff": 1024, "context": 128, "dropout": 0.05},
            "batch_size": 32, "bptt": 64, "lr": 1e-3, "lr_final": 2e-5, "warmup_steps": 200, "schedule": "cosine",
            "max_steps": 12_000, "max_minutes": 90, "schedule_clock": "budget", "precision": "auto",
            "reset_prob": 0.032, "threads": 1,
            "valid_every": 500, "valid_bytes": 100_000, "valid_streams": 32,
            "stats_batches": 100, "stats_batch_size": 32, "log_every": 20,
            "weights_dtype": "float16", "stats_dtype": "bfloat16", "ship_training_only": False,
        },
        # rows start afresh about every 2,000 bytes (reset_prob = bptt / 2000): served text often starts cold
        # a few minutes on one H100/H200, shipped as checkpoints/char-transformer: the whole checkpoint within 10 MB
        # (float16 weights + bfloat16 MS_g statistics, 2 bytes each a parameter), so 2.06M inference parameters: 4
        # blocks of width 192 (3 heads of 64, the Triton attention's head size), the paper's window of 256 bytes
        # (0.37M in training-only heads, not shipped); bf16 autocast, cosine decay on the budget clock (the decay
        # ends with max_minutes on a device of unknown speed)
        "gpu": {
            "model": {"d_model": 192, "n_layer": 4, "n_head": 3, "d_ff": 768, "context": 256, "dropout": 0.1},
            "batch_size": 128, "bptt": 128, "lr": 2e-3, "lr_final": 2e-5, "warmup_steps": 200, "schedule": "cosine",
            "max_steps": 20_000, "max_minutes": 15, "schedule_clock": "budget", "precision": "auto",
            "reset_prob": 0.064, "valid_every": 500, "valid_bytes": 200_000, "valid_streams": 64,
            "stats_batches": 100, "stats_batch_size": 32, "log_every": 50,
            "weights_dtype": "float16", "stats_dtype": "bfloat16", "ship_training_only": False,
        },
    },
    "awd-lstm": {
        # seconds on a CPU: for tests and smoke runs; a word vocabulary of the training text's 2,000 commonest tokens,
        # NT-ASGD (trigger over 2 validations) with variable-length BPTT, the paper's clip
        "tiny": {
            "model": {"emb_size": 16, "hidden_size": 32, "layers": 2, "dropout": 0.1, "dropouth": 0.1,
                      "dropouti": 0.1, "dropoute": 0.0, "wdrop": 0.2},
            "tokenizer": {"kind": "words", "split": "words", "max_size": 2000},
            "optimizer": "ntasgd", "lr": 5.0, "nonmono": 2, "variable_bptt": True, "clip": 0.25,
            "batch_size": 8, "bptt": 20, "max_steps": 60, "valid_every": 20, "valid_streams": 4,
            "stats_batches": 4, "stats_batch_size": 8, "stats_segment": 10, "log_every": 20,
        },
    },
    "adaptive-transformer": {
        # seconds on a CPU: for tests and smoke runs; the awd-lstm tiny's vocabulary (2,000 commonest tokens), bands
        # of 200 / 400 / 1,400 words of dimension 32 / 8 / 2, tied; a window of 32 words, Adam with cosine decay
        "tiny": {
            "model": {"d_model": 32, "n_layer": 2, "n_head": 2, "d_ff": 64, "context": 32, "cutoffs": [0.1, 0.3],
                      "dropout": 0.1},
            "tokenizer": {"kind": "words", "split": "words", "max_size": 2000},
            "batch_size": 8, "bptt": 20, "lr": 3e-3, "lr_final": 1e-3, "warmup_steps": 5, "schedule": "cosine",
            "max_steps": 60, "valid_every": 20, "valid_streams": 4,
            "stats_batches": 4, "stats_batch_size": 8, "stats_segment": 10, "log_every": 20,
        },
        # shipped as checkpoints/words (make words-checkpoint): 55 minutes on the 2-core CPU with one thread (~8
        # epochs), the whole checkpoint within 10 MB (float16 weights + bfloat16 MS_g statistics): a vocabulary of the
        # mix's 24,000 commonest tokens (98% of its running words) in bands of 2,400 / 7,200 / 14,400 words of
        # dimension 192 / 48 / 12, tied; 3 blocks of width 192, a window of 64 words
        "small": {
            "model": {"d_model": 192, "n_layer": 3, "n_head": 3, "d_ff": 512, "context": 64, "cutoffs": [0.1, 0.4],
                      "dropout": 0.2},
            "tokenizer": {"kind": "words", "split": "words", "max_size": 24_000},
            "batch_size": 16, "bptt": 64, "lr": 2e-3, "lr_final": 1e-4, "warmup_steps": 100, "schedule": "cosine",
            "max_steps": 20_000, "max_minutes": 55, "schedule_clock": "budget", "precision": "auto", "threads": 1,
            "reset_prob": 0.02, "valid_every": 500, "valid_bytes": 100_000, "valid_streams": 16,
            "stats_batches": 100, "stats_batch_size": 32, "stats_segment": 20, "log_every": 20,
            "weights_dtype": "float16", "stats_dtype": "bfloat16",
        },
    },
    "compressive": {
        # seconds on a CPU: for tests and smoke runs (segments of 32 = bptt; 32 fine + 16 compressed slots at c = 2)
        "tiny": {
            "model": {"d_model": 64, "n_layer": 3, "n_head": 2, "d_ff": 256, "segment": 32, "mem_len": 32,
                      "cmem_len": 16, "rate": 2},
            "batch_size": 16, "bptt": 32, "lr": 1e-3, "lr_final": 3e-4, "max_steps": 120, "valid_every": 40,
            "valid_streams": 4, "stats_batches": 4, "stats_batch_size": 8, "log_every": 20,
        },
        # the CPU budget of the default mLSTM (about 90 minutes, one thread): width 256, 4 blocks, segment = bptt 64,
        # 64 fine + 32 compressed slots at c = 2 (attention over 160 keys), clip 0.1 (paper)
        "small": {
            "model": {"d_model": 256, "n_layer": 4, "n_head": 4, "d_ff": 1024, "segment": 64, "mem_len": 64,
                      "cmem_len": 32, "rate": 2, "dropout": 0.05},
            "batch_size": 32, "bptt": 64, "lr": 1e-3, "lr_final": 2e-5, "warmup_steps": 200, "schedule": "cosine",
            "max_steps": 12_000, "max_minutes": 90, "schedule_clock": "budget", "clip": 0.1, "precision": "auto",
            "reset_prob": 0.032, "threads": 1, "valid_every": 500, "valid_bytes": 100_000, "valid_streams": 32,
            "stats_batches": 100, "stats_batch_size": 32, "log_every": 20,
            "weights_dtype": "float16", "stats_dtype": "bfloat16",
        },
        # a few minutes on one H100/H200, shipped as checkpoints/compressive: within 10 MB like the character
        # transformer's (2.2M parameters, the conv compressor included: it compresses at inference); segment = bptt
        # 192, 192 fine + 192 compressed slots at the paper's c = 3 (attention over 576 keys, 1,344 bytes of context
        # after the compressed memory fills); clip 0.1 and warm-up then cosine (paper), on the budget clock
        "gpu": {
            "model": {"d_model": 192, "n_layer": 4, "n_head": 3, "d_ff": 640, "segment": 192, "mem_len": 192,
                      "cmem_len": 192, "rate": 3, "dropout": 0.1},
            "batch_size": 128, "bptt": 192, "lr": 2e-3, "lr_final": 2e-5, "warmup_steps": 200, "schedule": "cosine",
            "max_steps": 20_000, "max_minutes": 15, "schedule_clock": "budget", "clip": 0.1, "precision": "auto",
            "reset_prob": 0.1, "valid_every": 500, "valid_bytes": 200_000, "valid_streams": 64,
            "stats_batches": 100, "stats_batch_size": 32, "log_every": 50,
            "weights_dtype": "float16", "stats_dtype": "bfloat16",
        },
    },
}


def load_config_file(path: str | Path) -> dict[str, Any]:
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except OSError as e:
        raise ValueError(f"{p}: cannot read config file ({e.strerror})") from None
    try:
        data = tomllib.loads(text) if p.suffix == ".toml" else json.loads(text)
    except (tomllib.TOMLDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{p}: not valid {'TOML' if p.suffix == '.toml' else 'JSON'} ({e})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{p}: expected a table/object of settings")
    return data


def _check_types(settings: dict[str, Any]) -> None:
    """Each setting of the type TrainConfig declares (an int where it says int; a float may be given as an int), and
    every number finite: a config file's "8" or 1.5 steps, or a flag's nan, is refused here, not deep in training."""
    kinds = {f.name: f.type for f in dataclasses.fields(TrainConfig)}
    for name, value in settings.items():
        kind = kinds[name]
        if kind == "int":
            ok = isinstance(value, int) and not isinstance(value, bool)
        elif kind == "float":
            ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
        elif kind == "bool":
            ok = isinstance(value, bool)
        elif kind == "str":
            ok = isinstance(value, str)
        else:  # model, tokenizer: tables
            ok = isinstance(value, dict)
        if not ok:
            what = {"int": "an integer", "float": "a finite number", "bool": "true or false", "str": "a string"}
            raise ValueError(f"{name} must be {what.get(kind, 'a table of settings')}, not {value!r}")


def make_config(preset: str | None = None, *layers: dict[str, Any]) -> TrainConfig:
    """Preset, then each layer (config file, flags) on top; `model` dicts merge key by key."""
    every = {*PRESETS, *(name for table in ARCH_PRESETS.values() for name in table)}
    if preset is not None and preset not in every:
        raise ValueError(f"unknown preset {preset!r}; choose from {', '.join(sorted(every))}")
    merged: dict[str, Any] = {"model": {}}
    names = {f.name for f in dataclasses.fields(TrainConfig)}
    arch = next((layer["arch"] for layer in reversed(layers) if "arch" in layer), TrainConfig.arch)
    base: dict[str, Any] = {}
    if preset:
        table = ARCH_PRESETS.get(arch, PRESETS)
        if preset not in table:
            raise ValueError(f"preset {preset!r} has no settings for {arch}; choose from {', '.join(table)}")
        base = table[preset]
    for layer in ([base] if preset else []) + list(layers):
        unknown = sorted(set(layer) - names)
        if unknown:
            raise ValueError(f"unknown training setting(s): {', '.join(unknown)}")
        for k, v in layer.items():
            if k == "model":
                if not isinstance(v, dict):
                    raise ValueError("'model' must be a table of architecture settings")
                merged["model"] = {**merged["model"], **v}
            else:
                merged[k] = v
    _check_types(merged)
    cfg = TrainConfig(**merged)
    for name in ("weights_dtype", "stats_dtype"):
        if getattr(cfg, name) not in DTYPES:
            raise ValueError(f"{name} must be one of {', '.join(DTYPES)}")
    if cfg.precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {', '.join(PRECISIONS)}, not {cfg.precision!r}")
    if not 0.0 <= cfg.reset_prob < 1.0:
        raise ValueError("reset_prob must be in [0, 1)")
    if cfg.schedule_clock not in ("steps", "budget"):
        raise ValueError(f"schedule_clock must be 'steps' or 'budget', not {cfg.schedule_clock!r}")
    if cfg.time_clock not in ("wall", "cpu"):
        raise ValueError(f"time_clock must be 'wall' or 'cpu', not {cfg.time_clock!r}")
    if cfg.schedule_clock == "budget" and not cfg.max_minutes:
        raise ValueError("schedule_clock 'budget' needs max_minutes")
    if cfg.schedule not in SCHEDULES:
        raise ValueError(f"schedule must be one of {', '.join(SCHEDULES)}, not {cfg.schedule!r}")
    for name in ("batch_size", "bptt", "max_steps", "valid_every", "valid_streams", "stats_segment", "accumulate",
                 "log_every", "stats_batches", "stats_batch_size", "lr", "clip"):
        if getattr(cfg, name) <= 0:
            raise ValueError(f"{name} must be positive, not {getattr(cfg, name)!r}")
    for name in ("warmup_steps", "max_minutes", "valid_bytes", "threads", "adapter_units", "lr_final"):
        if getattr(cfg, name) < 0:
            raise ValueError(f"{name} must be >= 0, not {getattr(cfg, name)!r}")
    for name in ("lr", "lr_final"):  # far above any rate that trains (NT-ASGD's SGD runs at 5-30), inside float32
        if getattr(cfg, name) > MAX_LR:
            raise ValueError(f"{name} must be <= {MAX_LR:g}, not {getattr(cfg, name)!r}")
    if cfg.optimizer not in OPTIMIZERS:
        raise ValueError(f"optimizer must be one of {', '.join(OPTIMIZERS)}, not {cfg.optimizer!r}")
    if cfg.optimizer != "ntasgd" and (cfg.finetune_steps or cfg.weight_decay):
        raise ValueError("finetune_steps and weight_decay are settings of the ntasgd optimizer")
    if cfg.finetune_steps < 0 or cfg.nonmono < 0 or cfg.weight_decay < 0:
        raise ValueError("finetune_steps, nonmono and weight_decay must be >= 0")
    kind = cfg.tokenizer.get("kind", "bytes")
    if kind not in ("bytes", "words") or set(cfg.tokenizer) - {"kind", "split", "max_size", "min_count"}:
        raise ValueError(f"tokenizer must be {{}} (bytes) or {{'kind': 'words', 'split', 'max_size', 'min_count'}}, "
                         f"not {cfg.tokenizer!r}")
    if cfg.batch_size % cfg.accumulate:
        raise ValueError(f"batch_size {cfg.batch_size} must be a multiple of accumulate ({cfg.accumulate})")
    return cfg
