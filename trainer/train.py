"""The training loop: truncated BPTT over byte streams (or a word tokenizer's ids), Adam with warm-up then linear
or cosine decay (or the AWD-LSTM's NT-ASGD with variable-length BPTT), gradient accumulation, best-checkpoint
keeping, resumable, JSON-lines log, and MS_g statistics at the end (Krause, thesis ch. 3, eq. 4.4 and sec. 4.6;
Merity et al. 2018, sec. 3-4; Rae et al. 2020, sec. 5.1; docs/algorithms.md §1-3, §5 and §7).

Word models (`tokenizer` {"kind": "words", ...}): the vocabulary is built from the training text (the same text
builds the same vocabulary, so a resumed run rebuilds it), the model's vocab_size is its size, and validation
reports bits per byte of the raw text (bits per word x words / bytes, so word and byte models compare) besides
perplexity. NT-ASGD (`optimizer` "ntasgd", trainer/ntasgd.py): SGD at the constant lr; each validation is a check
of the non-monotone trigger, and once averaging is on the model is validated and saved with the averaged weights.

Gradient accumulation (`accumulate` = A): the batch's B rows are split into A micro-batches of B / A rows, each
carrying its own rows' state, and the optimizer steps once on the sum of their losses / A: the same gradient as
one batch of B rows (every micro-batch has as many rows and positions, so the mean of their means is the batch's
mean), up to float summation order, in 1/A of the activation memory. Dropout aside: the masks are drawn per
micro-batch.

Precision: "bf16" runs the forward under autocast (CPU or CUDA); "auto" is bf16 where the device multiplies it
natively (`models.precision.native_bf16`: a CUDA GPU with bf16, a CPU with AVX-512 BF16 or AMX), else fp32. On a
CUDA device the float32 matmuls that remain run on TF32 tensor cores while training (restored afterwards).

One process, or N processes of a torch.distributed group (`torchrun -m trainer`, trainer/_dist.py): each process
takes batch_size / N of the batch's rows, DistributedDataParallel averages the gradients (so clipping sees the
global norm and every process takes the same Adam step), and rank 0 alone validates, logs and writes files while
the others wait at a barrier. The trajectory is that of one process with the whole batch, up to float summation
order (tests/trainer/test_distributed.py), except for dropout: each process draws its own masks.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import platform
import random
import signal
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, NamedTuple

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file
from tqdm import tqdm

from models.base import LanguageModel, State
from models.checkpoint import load_checkpoint, save_checkpoint
from models.precision import native_bf16
from models.registry import build_model, config_from_dict
from models.scoring import LN2, word_figures
from models.tokenizer import ByteTokenizer, Tokenizer, WordTokenizer
from trainer._dist import Group, current
from trainer.config import DTYPES, TrainConfig
from trainer.data import ByteStreams, read_bytes, read_corpus
from trainer.ntasgd import NTASGD, sample_seq_len
from trainer.stats import gradient_stats

__all__ = ["RESUMABLE_CHANGES", "CannotWrite", "StepResult", "TrainResult", "TrainingDiverged", "TrainingInterrupted",
           "default_dyneval", "evaluate_bpb", "has_resumable_state", "lr_at", "make_tokenizer", "train",
           "train_precision", "train_step"]

STATE_FILE = "trainer_state.safetensors"

# settings a resumed run may change: when to stop, log, validate and save, and what is computed after training; any
# other change (the model, the batch, the schedule, the seed, ...) would not continue the saved run, and is refused
RESUMABLE_CHANGES = frozenset({
    "max_steps", "max_minutes", "valid_every", "valid_bytes", "valid_streams", "log_every", "threads", "finetune_steps",
    "stats_batches", "stats_batch_size", "stats_segment", "adapter_units", "weights_dtype", "stats_dtype",
    "ship_training_only",
})


class TrainingInterrupted(Exception):
    """SIGINT or SIGTERM stopped a run after a step; its resumable state was saved first (`--resume` continues it)."""

    def __init__(self, signum: int, step: int, out: Path) -> None:
        self.signum, self.step, self.out = signum, step, out
        super().__init__(f"{signal.Signals(signum).name} at step {step}: the run's state is saved in {out / 'last'}; "
                         "continue it with --resume")


class TrainingDiverged(Exception):
    """The training loss became NaN or infinite (read at each log line): the weights are lost, and going on would
    only spend the rest of the budget. What was saved before (the best checkpoint, OUT/last) is kept."""

    def __init__(self, step: int, lr: float, out: Path) -> None:
        self.step, self.lr, self.out = step, lr, out
        super().__init__(f"the training loss became non-finite by step {step} (lr {lr:g}): train again with a lower "
                         f"--lr; what {out} held before is kept")


class CannotWrite(Exception):
    """A checkpoint or state file could not be written (disk full, permissions); what was there before is kept."""


class StepResult(NamedTuple):
    loss: torch.Tensor  # () the batch's training objective: its mean loss plus the auxiliary losses
    nll: torch.Tensor  # () the batch's mean next-byte loss alone (nats), comparable with validation
    grad_norm: torch.Tensor  # () the global gradient norm before clipping
    state: State  # the new state, detached


@dataclass
class TrainResult:
    out: Path
    best_valid_bpb: float
    steps: int
    seconds: float


def train_precision(precision: str, device: torch.device | str) -> str:
    """The precision training runs in on `device`: "fp32" or "bf16" ("auto": bf16 where the device multiplies it
    natively, else fp32)."""
    if precision == "auto":
        return "bf16" if native_bf16(torch.device(device)) else "fp32"
    return precision


def _autocast(precision: str, device: torch.device | str = "cpu") -> contextlib.AbstractContextManager[Any]:
    if train_precision(precision, device) == "bf16":
        return torch.autocast(torch.device(device).type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


@contextlib.contextmanager
def _tf32(device: torch.device) -> Iterator[None]:
    """TF32 tensor cores for float32 matmuls and convolutions on a CUDA device (10-bit mantissa products, float32
    sums: far below the noise of SGD); the process's settings are restored afterwards."""
    if device.type != "cuda":
        yield
        return
    before = (torch.get_float32_matmul_precision(), torch.backends.cudnn.allow_tf32)
    torch.set_float32_matmul_precision("high")
    torch.backends.cudnn.allow_tf32 = True
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(before[0])
        torch.backends.cudnn.allow_tf32 = before[1]


@torch.no_grad()
def evaluate_bpb(model: LanguageModel, data: bytes | torch.Tensor, streams: int = 16, chunk: int = 1000,
                 precision: str = "fp32") -> float:
    """Bits per byte of `data` split into `streams` contiguous rows (state carried along each row); given token ids
    (T,), bits per token. Under bf16 the figure is the served one: a frozen copy takes the model's inference path
    (the mLSTM keeps its output layer in float32 there; the training model under autocast would not)."""
    precision = train_precision(precision, next(model.parameters()).device)
    if precision == "bf16" and not model.frozen:
        model = model.trainable_copy().freeze()
    was_training = model.training
    model.eval()
    streams = max(1, min(streams, (len(data) - 1) // 2))
    rows = ByteStreams(data, streams, 1).rows.to(next(model.parameters()).device)  # (S, L)
    state = model.init_state(streams)
    total, count = 0.0, 0
    for start in range(0, rows.shape[1] - 1, chunk):
        piece = rows[:, start : start + chunk + 1]
        with _autocast(precision, rows.device):
            out = model(piece[:, :-1], state)
        state = out.state
        nll = -model.target_logprobs(out, piece[:, 1:]).double().sum()  # through the model (adaptive softmax)
        total += float(nll)
        count += piece[:, 1:].numel()
    model.train(was_training)
    return total / count / LN2


def progress_at(cfg: TrainConfig, step: int, seconds: float = 0.0) -> float:
    """The fraction of training done at `step` after `seconds`: step / max_steps, or under schedule_clock "budget"
    the larger of that and seconds / max_minutes (the schedules end with whichever budget runs out first)."""
    frac = step / cfg.max_steps
    if cfg.schedule_clock == "budget":
        frac = max(frac, seconds / (60 * cfg.max_minutes))
    return min(1.0, frac)


def lr_at(cfg: TrainConfig, step: int, seconds: float = 0.0) -> float:
    """The learning rate of optimizer step `step` (0-based): linear warm-up to `lr` over `warmup_steps`, then
    decay to `lr_final` at `max_steps`, linear over all steps (Krause, thesis ch. 3) or cosine over the steps after
    warm-up (the Compressive Transformer's, Rae et al. 2020, sec. 5.1; docs/algorithms.md §7). Under schedule_clock
    "budget" the decay runs on `progress_at` (warm-up still counts steps)."""
    if cfg.warmup_steps and step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    if cfg.schedule_clock == "budget":
        step = max(step, round(progress_at(cfg, step, seconds) * cfg.max_steps))
    if cfg.schedule == "cosine":
        frac = min(1.0, (step - cfg.warmup_steps) / max(1, cfg.max_steps - cfg.warmup_steps))
        return cfg.lr_final + (cfg.lr - cfg.lr_final) * 0.5 * (1.0 + math.cos(math.pi * frac))
    frac = min(1.0, step / max(1, cfg.max_steps))
    return cfg.lr + (cfg.lr_final - cfg.lr) * frac  # linear decay (thesis ch. 3 training setup)


def _warm_start(model: LanguageModel, tokenizer: Tokenizer, path: Path) -> dict[str, Any]:
    """Copy the weights of the checkpoint at `path` into `model` (a warm start, `TrainConfig.init_from`), which must
    have been built from the same model settings with the same tokenizer; ValueError naming what differs. Returns
    what the new checkpoint records of its parent: its name, weights hash and training (steps, seconds, data)."""
    ck = load_checkpoint(path, trainable=True)
    mine, theirs = model.config.to_dict(), ck.config.to_dict()
    if mine != theirs:
        diffs = ", ".join(f"{k} {mine.get(k)!r} here, {theirs.get(k)!r} there"
                          for k in sorted(set(mine) | set(theirs)) if mine.get(k) != theirs.get(k))
        raise ValueError(f"{path}: cannot start from its weights: other model settings ({diffs})")
    if tokenizer.to_dict() != ck.tokenizer.to_dict():
        raise ValueError(f"{path}: cannot start from its weights: its {ck.tokenizer.kind} tokenizer is not the one "
                         f"this run builds from its data ({tokenizer.kind}, {tokenizer.vocab_size} tokens)")
    with torch.no_grad():
        model.load_state_dict(ck.model.state_dict())
    trained = ck.meta.get("training", {})
    earlier = trained.get("init_from", {})
    return {"name": ck.name, "model_sha256": ck.model_hash,
            "steps": trained.get("steps"), "seconds": trained.get("seconds"), "data": trained.get("data"),
            # the whole lineage's optimizer steps and training seconds, this run's not counted
            "total_steps": (trained.get("steps") or 0) + (earlier.get("total_steps") or 0),
            "total_seconds": (trained.get("seconds") or 0.0) + (earlier.get("total_seconds") or 0.0)}


def make_tokenizer(cfg: TrainConfig, text: bytes) -> Tokenizer:
    """The run's tokenizer: bytes, or a word vocabulary built from the training text (`cfg.tokenizer`)."""
    settings = dict(cfg.tokenizer)
    if settings.pop("kind", "bytes") == "bytes":
        return ByteTokenizer()
    return WordTokenizer.build(text.decode("utf-8", errors="replace"), max_size=settings.get("max_size"),
                               min_count=settings.get("min_count", 1), split=settings.get("split", "words"))


def _reset_rows(model: LanguageModel, cfg: TrainConfig, step: int, chunk: torch.Tensor, state: State,
                group: Group, bos: int = ByteTokenizer.bos) -> tuple[torch.Tensor, State]:
    """Rows that start afresh at this chunk (`reset_prob`): a fresh state, and the stream-start token as first input.
    Drawn for the whole batch from (seed, step), each process taking its rows: the same rows however many processes
    train, and after a resume."""
    draw = torch.rand(cfg.batch_size, generator=torch.Generator().manual_seed(cfg.seed * 1_000_003 + step))
    share = chunk.shape[0]
    rows = (draw < cfg.reset_prob)[group.rank * share : (group.rank + 1) * share]  # (B,) this process's rows
    if not bool(rows.any()):
        return chunk, state
    rows = rows.to(chunk.device)
    chunk = chunk.clone()
    chunk[rows, 0] = bos  # what a new stream's first token follows (models/tokenizer.py)
    return chunk, model.init_state(share).where(rows, state)


def train_step(model: LanguageModel, opt: torch.optim.Optimizer | NTASGD, chunk: torch.Tensor, state: State, *,
               accumulate: int = 1, clip: float = 1.0, precision: str = "fp32",
               net: torch.nn.Module | None = None, lr_scale: float = 1.0) -> StepResult:
    """One optimizer step on `chunk` (B, T + 1) from `state` (B rows), in `accumulate` micro-batches of rows
    (module docstring). `net` is what runs the forward (a DistributedDataParallel wrapper; default `model`): it
    synchronises the gradients once, on the last micro-batch. The scalars stay on the device (no
    synchronisation). `lr_scale` is NT-ASGD's learning-rate factor for this step (variable-length BPTT; an
    optimizer's own learning rate is set by the caller)."""
    net = net if net is not None else model
    B = chunk.shape[0]
    if B % accumulate:
        raise ValueError(f"{B} rows cannot be split into {accumulate} equal micro-batches")
    rows = B // accumulate
    device = chunk.device
    opt.zero_grad(set_to_none=True)
    total = torch.zeros((), device=device)
    nll = torch.zeros((), device=device)
    states = []
    for j in range(accumulate):
        part = slice(j * rows, (j + 1) * rows)
        piece = chunk if accumulate == 1 else chunk[part]
        sub = state if accumulate == 1 else state.select(part)
        last = j == accumulate - 1
        no_sync = getattr(net, "no_sync", None)
        sync = contextlib.nullcontext() if last or no_sync is None else no_sync()
        with sync:
            with _autocast(precision, device):
                output = net(piece[:, :-1], sub)  # DDP: the backward averages the gradients over the processes
            loss = model.loss(output, piece[:, 1:])  # the model's own loss: its auxiliary losses included
            (loss / accumulate).backward()
        total += loss.detach() / accumulate
        nll += (loss.detach() - sum(a.detach() for a in output.aux.values())) / accumulate
        states.append(output.state.detach())  # carried across chunks, gradients truncated (TBPTT)
        del output, loss  # this micro-batch's activations go before the next one's
    # the gradients are already averaged over processes, so this is the global norm
    gnorm = torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
    if isinstance(opt, NTASGD):
        opt.step(lr_scale)
    else:
        opt.step()
    return StepResult(total, nll, gnorm, states[0] if accumulate == 1 else State.stack(states))


class _Signals:
    """SIGINT and SIGTERM set a flag that the loop reads after each step (it then saves and stops), instead of killing
    the process mid-step; a second SIGINT interrupts at once. Installed in the main thread of a one-process run only
    (the processes of a distributed run would each stop at a different step)."""

    def __init__(self, active: bool) -> None:
        self.active = active and threading.current_thread() is threading.main_thread()
        self.signum: int | None = None
        self._before: dict[int, Any] = {}

    def __enter__(self) -> _Signals:
        if self.active:
            for sig in (signal.SIGINT, signal.SIGTERM):
                self._before[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum: int, frame: Any) -> None:
        if self.signum is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.signum = signum

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._before.items():
            signal.signal(sig, handler)


@contextlib.contextmanager
def _writing(path: Path) -> Iterator[None]:
    """Errors writing `path` as CannotWrite (one line: the file and the reason)."""
    try:
        yield
    except (OSError, SafetensorError) as e:
        reason = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
        raise CannotWrite(f"{path}: cannot write ({reason}); the files written before are kept") from None


def has_resumable_state(path: str | Path) -> bool:
    """Whether `path` (a run's `last/`) holds a state to resume from."""
    return (Path(path) / STATE_FILE).is_file()


def _rng_key(kind: str, rank: int) -> str:
    return f"rng.{kind}" if rank == 0 else f"rng.{kind}.{rank}"


def _rng_states(device: torch.device) -> dict[str, torch.Tensor]:
    """This process's random generators (dropout masks): the CPU's, and its CUDA device's when it has one."""
    states = {"torch": torch.get_rng_state()}
    if device.type == "cuda":
        states["cuda"] = torch.cuda.get_rng_state(device)
    return states


def _save_trainer_state(path: Path, model: LanguageModel, opt: torch.optim.Adam | NTASGD,
                        state: dict[str, torch.Tensor], info: dict[str, Any],
                        rngs: list[dict[str, torch.Tensor]] | None = None) -> None:
    """Resumable state without pickle: tensors in safetensors, scalars as JSON in its header, so the state is one
    file, written to a temporary name and renamed into place: a run killed while saving keeps the state before.

    `state` is the hidden state of the whole batch (every process's rows, in rank order) and `rngs` every
    process's generators (default: this process's CPU generator), so each process restores its own."""
    path.mkdir(parents=True, exist_ok=True)
    tensors: dict[str, torch.Tensor] = {f"model.{k}": v.detach().clone() for k, v in model.state_dict().items()}
    names = {id(p): n for n, p in model.named_parameters()}
    if isinstance(opt, NTASGD):  # SGD without momentum keeps nothing; NT-ASGD its counters, logs and average
        nt = opt.state_dict()
        tensors.update({f"ntasgd.avg.{n}": a for n, a in (nt.pop("average") or {}).items()})
        nt.pop("optimizer")
        info["ntasgd"] = nt
    for p, st in (opt.state.items() if not isinstance(opt, NTASGD) else ()):
        n = names[id(p)]
        tensors[f"opt.{n}.exp_avg"] = st["exp_avg"]
        tensors[f"opt.{n}.exp_avg_sq"] = st["exp_avg_sq"]
        info.setdefault("opt_steps", {})[n] = float(st["step"])
    tensors.update({f"hidden.{k}": v.detach().cpu() for k, v in state.items()})
    for rank, states in enumerate(rngs or [{"torch": torch.get_rng_state()}]):
        tensors.update({_rng_key(kind, rank): t for kind, t in states.items()})
    tmp = path / f".{STATE_FILE}.tmp"
    try:
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp), metadata={"info": json.dumps(info)})
        tmp.replace(path / STATE_FILE)
    finally:
        tmp.unlink(missing_ok=True)
    (path / "trainer_state.json").unlink(missing_ok=True)  # an earlier version's second file: the header replaces it


def _load_trainer_state(path: Path, model: LanguageModel, opt: torch.optim.Adam | NTASGD, group: Group | None = None,
                        device: torch.device | str = "cpu", check: Callable[[dict[str, Any]], None] | None = None,
                        ) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """-> (this process's rows of the hidden state, info); restores the weights, the optimizer (Adam's moments, or
    NT-ASGD's counters and average) and this process's RNG, after `check(info)` (which raises to refuse it)."""
    group = group or Group()
    state_file, info_file = path / STATE_FILE, path / "trainer_state.json"
    if not state_file.is_file():
        raise ValueError(f"{path}: nothing to resume (no {STATE_FILE})")
    try:
        tensors = load_file(str(state_file))
        with safe_open(str(state_file), "pt") as f:
            header = (f.metadata() or {}).get("info")
        info = json.loads(header if header is not None else info_file.read_text())  # the JSON file: earlier runs
    except (SafetensorError, OSError, ValueError) as e:
        raise ValueError(f"{state_file}: not a resumable state ({e})") from None
    if check is not None:
        check(info)
    saved_world = int(info.get("world_size", 1))
    if saved_world != group.world:
        raise ValueError(f"{path}: saved by {saved_world} process(es); resume it with {saved_world}, "
                         f"not {group.world} (each process restores its own random generator)")
    model.load_state_dict({k[6:]: v for k, v in tensors.items() if k.startswith("model.")})
    if isinstance(opt, NTASGD):
        if "ntasgd" not in info:
            raise ValueError(f"{path}: saved by a run with another optimizer than ntasgd")
        avg = {k[len("ntasgd.avg."):]: v for k, v in tensors.items() if k.startswith("ntasgd.avg.")}
        opt.load_state_dict({**info["ntasgd"], "average": avg or None, "optimizer": opt.optimizer.state_dict()})
    for n, p in model.named_parameters():
        if f"opt.{n}.exp_avg" in tensors and not isinstance(opt, NTASGD):
            opt.state[p] = {"step": torch.tensor(info["opt_steps"][n]),
                            "exp_avg": tensors[f"opt.{n}.exp_avg"].to(p.device),
                            "exp_avg_sq": tensors[f"opt.{n}.exp_avg_sq"].to(p.device)}
    torch.set_rng_state(tensors[_rng_key("torch", group.rank)])
    device = torch.device(device)
    if device.type == "cuda" and _rng_key("cuda", group.rank) in tensors:
        torch.cuda.set_rng_state(tensors[_rng_key("cuda", group.rank)], device)
    share = group.share(next(v for k, v in tensors.items() if k.startswith("hidden.")).shape[0])
    rows = slice(group.rank * share, (group.rank + 1) * share)
    hidden = {k[7:]: v[rows] for k, v in tensors.items() if k.startswith("hidden.")}
    return hidden, info


def _check_resumable(path: Path, info: dict[str, Any], cfg: TrainConfig, data_sha256: str) -> None:
    """The saved run can be continued with `cfg` on this data: only RESUMABLE_CHANGES may differ (ValueError naming
    the others)."""
    saved, now = info.get("config", {}), cfg.to_dict()
    changed = sorted(k for k in set(saved) | set(now) if k not in RESUMABLE_CHANGES and saved.get(k) != now.get(k))
    if changed:
        diffs = "; ".join(f"{k} {json.dumps(saved.get(k))} -> {json.dumps(now.get(k))}" for k in changed)
        raise ValueError(f"{path}: saved by a run with other settings ({diffs}); resume it with the preset, config "
                         "file and flags it was started with")
    if info.get("data_sha256", data_sha256) != data_sha256:
        raise ValueError(f"{path}: saved by a run on other training data; resume it with the same --data files, in "
                         "the same order")


def _model_card(cfg: TrainConfig, meta: dict[str, Any], model: LanguageModel) -> str:
    m = meta["metrics"]
    t = meta["training"]
    schedule = cfg.schedule + (f" after {cfg.warmup_steps} warm-up steps" if cfg.warmup_steps else "")
    training_only = set(model.training_only_parameters())
    n_params = sum(p.numel() for p in model.parameters())
    n_aux = sum(p.numel() for n, p in model.named_parameters() if n in training_only)
    batch = f"{cfg.batch_size} streams" + (f" in {cfg.accumulate} micro-batches" if cfg.accumulate > 1 else "")
    words = cfg.tokenizer.get("kind") == "words"
    unit = "tokens" if words else "bytes"
    optimizer = (f"NT-ASGD: SGD {cfg.lr}" + (f", averaging from step {m['averaging_from_step']}"
                                            if m.get("averaging_from_step") is not None else ", never averaged")
                 if cfg.optimizer == "ntasgd" else f"Adam {cfg.lr} -> {cfg.lr_final} ({schedule})")
    lines = [
        f"# {meta['name']}: {'word' if words else 'byte'}-level {cfg.arch}", "",
        f"- Architecture: {cfg.arch} {json.dumps(meta['model_config'], sort_keys=True)}",
        f"- Parameters: {n_params:,}" + (f" ({n_params - n_aux:,} for inference; {n_aux:,} in training-only heads,"
                                          f" {'shipped' if cfg.ship_training_only else 'not shipped'})"
                                          if n_aux else ""),
        f"- Training data: {', '.join(t['data'])} ({t['train_bytes']:,} bytes)",
        f"- Validation: {t['valid'] or '(none)'} ({t['valid_bytes']:,} bytes)",
        *([f"- Tokenizer: words (models/word_tokenizer.py), split {cfg.tokenizer.get('split', 'words')!r}, "
           f"{getattr(model.config, 'vocab_size', 0):,} entries (the training text's commonest tokens, in "
           "config.json)"] if words else []),
        f"- Steps: {t['steps']} x {batch} x {cfg.bptt} {unit}; {optimizer}, clip {cfg.clip},"
        f" {t.get('precision', cfg.precision)}",
        f"- Training time: {t['seconds'] / 60:.1f} {'CPU-' if cfg.time_clock == 'cpu' else ''}min on {t['machine']}",
        *([f"- Warm start: the weights of `{p['name']}` ({p['model_sha256'][:12]}; {p['total_steps']} steps, "
           f"{p['total_seconds'] / 60:.1f} min of training before this run); this run's optimizer and schedule "
           f"started afresh"] if (p := t.get("init_from")) else []),
        f"- Stored as: weights {cfg.weights_dtype}, statistics {cfg.stats_dtype} (loaded as float32)",
        f"- Validation bits per byte (best checkpoint, whole validation file): {m.get('valid_bpb', float('nan')):.4f}",
        *([f"- Validation perplexity (per token, every punctuation mark and end of line counted): "
           f"{m['valid_perplexity']:.1f} ({m['valid_bits_per_word']:.3f} bits per word, {m['valid_words']:,} tokens)"]
          if words and "valid_perplexity" in m else []),
        f"- MS_g statistics: {cfg.stats_batches} training batches of {cfg.stats_batch_size} x {cfg.stats_segment}"
        f" {unit}, for every weight and the adapter matrix at M = 0", "",
        "Trained by `adaptlm train`; the full training configuration is in `config.json`.", "",
    ]
    return "\n".join(lines)


def train(cfg: TrainConfig, data_paths: Sequence[str | Path], out: str | Path, *, valid_path: str | Path | None = None,
          resume: bool = False, name: str | None = None, progress: bool = True,
          on_log: Callable[[dict[str, Any]], None] | None = None,
          device: torch.device | str = "cpu") -> TrainResult:
    """Train `cfg` on `data_paths` on `device`, keeping the best checkpoint (by validation bits) in `out`.

    In a torch.distributed group every process calls this with the same arguments (and its own device);
    `cfg.batch_size` is the global batch, and `on_log` is called on rank 0 only."""
    with _tf32(torch.device(device)):
        return _Run(cfg, data_paths, Path(out), valid_path=valid_path, resume=resume, name=name, progress=progress,
                    on_log=on_log, device=torch.device(device)).run()


class _Run:
    """One call of `train`, phase by phase (`run`): the settings, the data, the model (and its DDP wrapper), the
    optimizer, the run's files (or the state it resumes from), the loop (a step, its log line, validation and the
    resumable state), and the final checkpoint with its statistics and model card. Each phase sets what the later
    ones read."""

    def __init__(self, cfg: TrainConfig, data_paths: Sequence[str | Path], out: Path, *,
                 valid_path: str | Path | None, resume: bool, name: str | None, progress: bool,
                 on_log: Callable[[dict[str, Any]], None] | None, device: torch.device) -> None:
        self.cfg, self.data_paths, self.out, self.valid_path = cfg, data_paths, out, valid_path
        self.resume, self.progress, self.on_log, self.device = resume, progress, on_log, device
        self.group = current()
        self.meta_base = {"name": name or out.name, "training_config": cfg.to_dict()}
        self.last = out / "last"
        self.log_path = out / "train.jsonl"
        self.log_file: IO[str] | None = None

    def run(self) -> TrainResult:
        self._check_settings()
        self._read_data()
        self._build_model()
        self._build_optimizer()
        elapsed = self._open()
        stop_reason = self._loop(elapsed)
        return self._finish(stop_reason)

    # -- before the first step -----------------------------------------------------------------------------------

    def _check_settings(self) -> None:
        """Settings this group of processes cannot run, refused before any work; the precision, threads and seed."""
        cfg, group = self.cfg, self.group
        self.local_batch = group.share(cfg.batch_size)
        if self.local_batch % cfg.accumulate:
            raise ValueError(f"each process's {self.local_batch} streams cannot be split into {cfg.accumulate} "
                             "micro-batches")
        if cfg.schedule_clock == "budget" and group.world > 1:
            raise ValueError("schedule_clock 'budget' runs in one process (each would read its own clock)")
        self.precision = train_precision(cfg.precision, self.device)
        group.share(cfg.stats_batch_size, "stats_batch_size")  # fail now, not after training
        if cfg.threads:
            torch.set_num_threads(cfg.threads)
        if cfg.optimizer == "ntasgd" and (group.world > 1 or cfg.accumulate > 1):
            raise ValueError("the ntasgd optimizer runs in one process, without accumulate")
        torch.manual_seed(cfg.seed)

    def _read_data(self) -> None:
        """The training and validation text, the tokenizer built from the training text, and this process's rows."""
        cfg = self.cfg
        self.train_bytes = read_corpus(self.data_paths)
        self.valid_bytes = read_bytes(self.valid_path) if self.valid_path else b""
        self.valid_slice = self.valid_bytes[: cfg.valid_bytes] if cfg.valid_bytes else self.valid_bytes
        self.tokenizer = make_tokenizer(cfg, self.train_bytes)
        words = self.words = self.tokenizer.reports_tokens
        # a word model sees ids; its validation figure is still bits per byte of the raw text (module docstring)
        encode = self.tokenizer.encode_tensor
        self.train_data: bytes | torch.Tensor = encode(self.train_bytes) if words else self.train_bytes
        self.valid_data: bytes | torch.Tensor = encode(self.valid_slice) if words else self.valid_slice
        if self.valid_slice and len(self.valid_data) < 2:
            raise ValueError(f"{self.valid_path}: too short to validate on ({len(self.valid_data)} "
                             f"{'tokens' if words else 'bytes'}; at least 2)")
        self.data_sha256 = hashlib.sha256(self.train_bytes).hexdigest()

    def _build_model(self) -> None:
        """The model (from `init_from`'s weights on a warm start), on the device, and what runs its forward: the model,
        or its DistributedDataParallel wrapper in a group of processes."""
        cfg, group, device = self.cfg, self.group, self.device
        try:
            model_cfg = config_from_dict({"arch": cfg.arch, **cfg.model,
                                          **({"vocab_size": self.tokenizer.vocab_size} if self.words else {})})
            model = build_model(model_cfg)
        except (TypeError, ValueError, RuntimeError) as e:  # e.g. a negative width: torch's RuntimeError
            raise ValueError(f"model settings {json.dumps(cfg.model)}: {str(e).splitlines()[0]}") from None
        warm = cfg.init_from and not self.resume
        self.parent = _warm_start(model, self.tokenizer, Path(cfg.init_from)) if warm else None
        self.model = model = model.to(device)
        model.train()
        self.net: torch.nn.Module = model
        if group.world > 1:
            # the same initial weights everywhere (DDP broadcasts rank 0's too); then each process its own dropout masks
            torch.manual_seed(cfg.seed + group.rank)
            # a model with training-only heads whose losses its schedule drops (the character transformer's
            # intermediate classifiers) leaves them without gradients from then on: DDP must be told to expect that
            self.net = torch.nn.parallel.DistributedDataParallel(
                model, device_ids=[device.index] if device.type == "cuda" else None,
                find_unused_parameters=bool(model.training_only_parameters()))

    def _build_optimizer(self) -> None:
        """This process's share of the training streams, and the optimizer: Adam, or NT-ASGD (`self.nt`)."""
        cfg, group = self.cfg, self.group
        self.streams = ByteStreams(self.train_data, cfg.batch_size, cfg.bptt, shard=(group.rank, group.world))
        self.opt: torch.optim.Adam | NTASGD
        if cfg.optimizer == "ntasgd":
            self.opt = NTASGD(self.model, lr=cfg.lr, nonmono=cfg.nonmono, interval=cfg.valid_every,
                              weight_decay=cfg.weight_decay)
        else:
            self.opt = torch.optim.Adam(self.model.parameters(), lr=cfg.lr)
        self.nt = self.opt if isinstance(self.opt, NTASGD) else None

    def _open(self) -> float:
        """Where the run starts: step 0 with a fresh state, or the saved state of `last/` (`resume`); rank 0 opens the
        log (a fresh run: new, and an earlier run's state is removed). -> the seconds already trained."""
        cfg, group, last = self.cfg, self.group, self.last
        self.step, self.best, elapsed, self.pos = 0, math.inf, 0.0, 0
        hidden: dict[str, torch.Tensor] | None = None
        if self.resume:
            hidden, info = _load_trainer_state(last, self.model, self.opt, group, self.device,
                                               check=lambda saved: _check_resumable(last, saved, cfg, self.data_sha256))
            self.step, self.best, elapsed = info["step"], info["best_valid_bpb"], info["seconds"]
            self.pos = info.get("bptt_pos", 0)
        if group.main:
            with _writing(self.out):
                self.out.mkdir(parents=True, exist_ok=True)
                if not self.resume:  # a fresh run: an earlier run's state and log there are not this run's
                    (last / STATE_FILE).unlink(missing_ok=True)
                    (last / "trainer_state.json").unlink(missing_ok=True)
                self.log_file = self.log_path.open("a" if self.resume else "w", encoding="utf-8")
        model = self.model
        self.state = model.init_state(self.local_batch) if hidden is None else type(model.init_state(1))(
            {k: v.to(self.device) for k, v in hidden.items()})
        return elapsed

    # -- the loop -----------------------------------------------------------------------------------------------

    def _loop(self, elapsed: float) -> str:
        """Steps until `max_steps` (and NT-ASGD's fine-tuning steps) or `max_minutes`; -> why it stopped. Raises
        TrainingDiverged at a non-finite training loss, and TrainingInterrupted after a signal (the state saved)."""
        cfg, group, model, nt = self.cfg, self.group, self.model, self.nt
        self.bar = tqdm(total=cfg.max_steps, initial=self.step, disable=not (self.progress and group.main),
                        unit="step", dynamic_ncols=True)
        self.clock = time.process_time if cfg.time_clock == "cpu" else time.monotonic  # elapsed "seconds", tokens/s
        self.t0 = self.clock() - elapsed
        window_t, window_tokens = self.clock(), 0
        stop_reason = "max_steps"
        total_steps = cfg.max_steps + (cfg.finetune_steps if nt is not None else 0)
        with _Signals(group.world == 1) as signals:
            while self.step < total_steps:
                if nt is not None and cfg.finetune_steps and self.step == cfg.max_steps and not nt.finetuning:
                    nt.restart()  # the fine-tuning restart (AWD-LSTM sec. 5): ASGD again from the averaged weights
                    self._log({"step": self.step, "finetune": True})
                if nt is not None and nt.finished:
                    stop_reason = "finetune_converged"
                    break
                chunk, scale = self._next_chunk()
                seconds = self.clock() - self.t0
                lr = cfg.lr * scale if nt is not None else lr_at(cfg, self.step, seconds) * scale
                if not isinstance(self.opt, NTASGD):  # NT-ASGD sets its own (the constant lr x scale, in train_step)
                    for param_group in self.opt.param_groups:
                        param_group["lr"] = lr
                model.set_training_progress(progress_at(cfg, self.step, seconds))  # schedules of auxiliary losses
                # loss and norm are read at logging: no sync a step
                result = train_step(model, self.opt, chunk, self.state, accumulate=cfg.accumulate, clip=cfg.clip,
                                    precision=self.precision, net=self.net, lr_scale=scale)
                self.state = result.state
                self.step += 1
                window_tokens += chunk[:, 1:].numel() * group.world
                self.bar.update(1)
                if self.step % cfg.log_every == 0:
                    now = self.clock()
                    tps = window_tokens / max(1e-9, now - window_t)
                    window_t, window_tokens = now, 0
                    nll_value = self._log_training(result, lr, tps, now)
                    if not math.isfinite(nll_value):  # every process read the same mean: all stop here
                        self._close()
                        raise TrainingDiverged(self.step, lr, self.out)
                time_up = bool(cfg.max_minutes) and self._seconds() > cfg.max_minutes * 60
                if cfg.max_minutes:
                    time_up = group.any(time_up, self.device)  # every process stops after the same step
                # validation (with a validation file) and the resumable state every valid_every steps and at the end;
                # the state alone after a signal, before stopping
                interrupted = signals.signum is not None
                checkpoint = self.step % cfg.valid_every == 0 or self.step in (cfg.max_steps, total_steps) or time_up
                if checkpoint or interrupted:
                    self._save_progress(validate=checkpoint)
                if interrupted:
                    assert signals.signum is not None
                    self._log({"step": self.step, "interrupted": signal.Signals(signals.signum).name,
                               "seconds": self._seconds()})
                    self._close()
                    raise TrainingInterrupted(signals.signum, self.step, self.out)
                if time_up:
                    stop_reason = "max_minutes"
                    break
        self.bar.close()
        return stop_reason

    def _next_chunk(self) -> tuple[torch.Tensor, float]:
        """The step's chunk (B, T + 1) of this process's rows, on the device, with the state reset where a stream
        starts afresh; and its learning-rate scale (its length / bptt under variable-length BPTT, else 1)."""
        cfg, streams = self.cfg, self.streams
        scale = 1.0
        if cfg.variable_bptt:  # AWD-LSTM sec. 4.1: the length drawn from (seed, step), so a resume draws the same
            length = sample_seq_len(cfg.bptt, random.Random(cfg.seed * 1_000_003 + self.step),
                                    max_len=streams.rows.shape[1] - 1)
            if self.pos + length + 1 > streams.rows.shape[1]:
                self.pos = 0
            chunk, new_epoch = streams.rows[:, self.pos : self.pos + length + 1], self.pos == 0
            self.pos += length
            scale = length / cfg.bptt
        else:
            chunk, new_epoch = streams.chunk(self.step)
        chunk = chunk.to(self.device, non_blocking=True)
        if new_epoch:
            self.state = self.model.init_state(self.local_batch)
        elif cfg.reset_prob:
            chunk, self.state = _reset_rows(self.model, cfg, self.step, chunk, self.state, self.group,
                                            self.tokenizer.bos)
        return chunk, scale

    def _log_training(self, result: StepResult, lr: float, tokens_per_s: float, now: float) -> float:
        """The log line of a step: the whole batch's mean losses, the next-byte loss (train_bpb) and, for a model with
        auxiliary losses, the objective they are part of (train_loss_bpb). -> the next-byte loss (nats)."""
        group = self.group
        nll_value = result.nll.item() if group.world == 1 else group.mean(result.nll)
        record: dict[str, Any] = {"step": self.step, "train_bpb": nll_value / LN2}
        if self.model.training_only_parameters():
            loss_value = result.loss.item() if group.world == 1 else group.mean(result.loss)
            record["train_loss_bpb"] = loss_value / LN2
        self.bar.set_postfix(train_bpb=f"{nll_value / LN2:.3f}", tok_s=f"{tokens_per_s:,.0f}")
        self._log({**record, "lr": lr, "grad_norm": float(result.grad_norm), "tokens_per_s": tokens_per_s,
                   "seconds": now - self.t0})
        return nll_value

    def _save_progress(self, validate: bool) -> None:
        """Validation (with a validation file, when `validate`) and the resumable state, by rank 0 while the others
        wait; every process gives its rows of the hidden state and its random generators."""
        group = self.group
        hidden_parts = group.gather({k: v.detach().cpu() for k, v in self.state.tensors.items()})
        rngs = group.gather(_rng_states(self.device))
        if group.main:
            if self.valid_slice and validate:
                self._validate()
            whole = {k: torch.cat([part[k] for part in hidden_parts]) for k in hidden_parts[0]}  # (B, ...)
            with _writing(self.last / STATE_FILE):
                _save_trainer_state(self.last, self.model, self.opt, whole,
                                    {"step": self.step, "best_valid_bpb": self.best, "seconds": self._seconds(),
                                     "world_size": group.world, "config": self.cfg.to_dict(), "bptt_pos": self.pos,
                                     "data_sha256": self.data_sha256}, rngs)
        group.barrier()  # the others wait for rank 0's validation and files

    def _validate(self) -> None:
        """Bits per byte of the validation slice (a word model: its bits per word x words / bytes); a better figure
        than any before saves the checkpoint. NT-ASGD: validated, and kept, with the averaged weights once averaging
        is on, and the figure is its trigger's check."""
        nt, words = self.nt, self.words
        with nt.averaged() if nt is not None else contextlib.nullcontext():
            per_token = evaluate_bpb(self.model, self.valid_data, self.cfg.valid_streams, precision=self.precision)
            vbpb = per_token * len(self.valid_data) / len(self.valid_slice) if words else per_token
            if vbpb < self.best:
                self.best = vbpb
                self._save_best(vbpb)
        record: dict[str, Any] = {"step": self.step, "valid_bpb": vbpb, "best_valid_bpb": self.best}
        if words:
            record["valid_ppl"] = word_figures(per_token, len(self.valid_data)).perplexity
        if nt is not None:
            if nt.check(vbpb) and not nt.finetuning:
                record["averaging_from_step"] = self.step
            record["averaging"] = nt.averaging
        self._log({**record, "seconds": self._seconds()})

    # -- after the last step ------------------------------------------------------------------------------------

    def _finish(self, stop_reason: str) -> TrainResult:
        """The best weights as shipped, their MS_g statistics on the training data (every process its share), and on
        rank 0 the whole validation file, the metadata and the model card, written into the checkpoint."""
        cfg, group, out = self.cfg, self.group, self.out
        seconds = self._seconds()
        if not self.valid_slice and group.main:
            self._save_best(math.nan)
        group.barrier()
        ckpt = load_checkpoint(out, trainable=True, device=self.device)  # the statistics take gradients of the weights
        best_model = ckpt.model
        weights_dtype = DTYPES[cfg.weights_dtype]
        with torch.no_grad():  # everything below is measured on the weights as shipped
            for p in best_model.parameters():
                p.copy_(p.to(weights_dtype).to(p.dtype))
        stats = gradient_stats(best_model, self.train_data, batches=cfg.stats_batches, batch_size=cfg.stats_batch_size,
                               segment=cfg.stats_segment, adapter_units=cfg.adapter_units, group=group)
        if not group.main:
            group.barrier()  # rank 0 validates and writes the checkpoint
            best_bpb = group.broadcast(None)
            return TrainResult(out=out, best_valid_bpb=best_bpb, steps=self.step, seconds=seconds)
        metrics: dict[str, Any] = {"best_step": ckpt.meta["metrics"]["step"], "stop_reason": stop_reason,
                                   **self._final_validation(best_model)}
        if self.nt is not None:
            metrics["averaging_from_step"] = self.nt.switched_at
        meta = {**self.meta_base, "metrics": metrics, "training": self._training_record(seconds)}
        card = _model_card(cfg, {**meta, "model_config": cfg.model}, self.model)
        with _writing(out):
            save_checkpoint(out, best_model, stats=stats, meta=meta, card=card, dyneval=default_dyneval(cfg, stats),
                            weights_dtype=weights_dtype, stats_dtype=DTYPES[cfg.stats_dtype],
                            training_only=cfg.ship_training_only, tokenizer=self.tokenizer)
        self._log({"done": True, "steps": self.step, "seconds": seconds, **metrics})
        assert self.log_file is not None
        self.log_file.close()
        best_bpb = float(metrics.get("valid_bpb", self.best))
        if group.world > 1:
            group.barrier()
            group.broadcast(best_bpb)
        return TrainResult(out=out, best_valid_bpb=best_bpb, steps=self.step, seconds=seconds)

    def _final_validation(self, best_model: LanguageModel) -> dict[str, Any]:
        """The best weights' figures on the whole validation file (none without one)."""
        if not self.valid_bytes:
            return {}
        whole_valid = self.tokenizer.encode_tensor(self.valid_bytes) if self.words else self.valid_bytes
        per_token = evaluate_bpb(best_model, whole_valid, self.cfg.valid_streams)
        metrics: dict[str, Any] = {
            "valid_bpb": per_token * len(whole_valid) / len(self.valid_bytes) if self.words else per_token,
            "valid_streams": self.cfg.valid_streams}
        if self.words:
            figures = word_figures(per_token, len(whole_valid))
            metrics.update({"valid_bits_per_word": figures.bits_per_word, "valid_perplexity": figures.perplexity,
                            "valid_words": figures.tokens})
        return metrics

    def _training_record(self, seconds: float) -> dict[str, Any]:
        """The checkpoint's account of its training: data, steps, time, machine, precision, parent."""
        group, device = self.group, self.device
        machine = f"{platform.machine()}, {torch.get_num_threads()} threads"
        if device.type == "cuda":
            machine = f"{torch.cuda.get_device_name(device)} ({machine})"
        if group.world > 1:
            machine += f", {group.world} processes ({device.type})"
        return {
            "data": [Path(p).name for p in self.data_paths], "train_bytes": len(self.train_bytes),
            **({"train_words": len(self.train_data), "vocab_size": self.tokenizer.vocab_size} if self.words else {}),
            "valid": Path(self.valid_path).name if self.valid_path else None, "valid_bytes": len(self.valid_bytes),
            "steps": self.step, "seconds": seconds, "machine": machine, "device": device.type,
            "precision": self.precision, "torch": torch.__version__,
            **({"init_from": self.parent} if self.parent else {}),
        }

    # -- the run's files ----------------------------------------------------------------------------------------

    def _log(self, record: dict[str, Any]) -> None:
        """A line of train.jsonl (rank 0; the others log nothing), and `on_log`'s call."""
        if self.log_file is None:
            return
        with _writing(self.log_path):
            self.log_file.write(json.dumps(record) + "\n")
            self.log_file.flush()
        if self.on_log:
            self.on_log(record)

    def _save_best(self, valid_bpb: float) -> None:
        meta = {**self.meta_base, "metrics": {"valid_bpb_slice": valid_bpb, "step": self.step}}
        with _writing(self.out):
            save_checkpoint(self.out, self.model, meta=meta, card="# (training in progress)\n",
                            tokenizer=self.tokenizer)

    def _seconds(self) -> float:
        """Seconds trained (on `time_clock`), a resumed run's earlier ones included."""
        return self.clock() - self.t0

    def _close(self) -> None:
        """The progress bar and the log closed, before an exception ends the run."""
        self.bar.close()
        if self.log_file is not None:
            self.log_file.close()


def default_dyneval(cfg: TrainConfig, stats: dict[str, torch.Tensor]) -> dict[str, Any]:
    """Untuned starting values; `adaptlm tune` replaces them with validation-tuned ones.

    Decision: eps is 1% of the mean RMS gradient (sqrt MS_g) of what adapts, so that entries whose
    MS_g is ~0 (e.g. embedding rows of bytes absent from the statistics batches) cannot take steps
    10^4 times larger than the rest.
    """
    def eps_for(prefix: str) -> float:
        rms = [v.float().sqrt().mean() for k, v in stats.items() if k.startswith(prefix)]
        return float(torch.stack(rms).mean()) * 0.01 if rms else 1e-8

    # Decision: the default sparse adapter is the largest multiple of 64 units whose k x k matrix stays
    # within 2% of the model's parameters (thesis sec. 4.6 adapted 0.5%), capped by the site's size.
    n_params = sum(v.numel() for k, v in stats.items() if k.startswith("param."))
    site = max((v.shape[0] for k, v in stats.items() if k.startswith("adapter.")), default=0)
    units = cfg.adapter_units or min(site, max(64, int((0.02 * n_params) ** 0.5) // 64 * 64))
    return {
        "tuned": False,
        "full": {"rule": "rms_decay", "lr": 1e-4, "decay": 2e-3, "eps": eps_for("param."),
                 "segment": cfg.stats_segment},
        "sparse": {"rule": "rms_decay", "lr": 1e-3, "decay": 2e-3, "eps": eps_for("adapter."),
                   "segment": cfg.stats_segment, "adapter_units": units},
        "cache": {"window": 2000, "theta": 1.0, "lam": 0.1},
    }
