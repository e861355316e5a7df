"""A per-session copy model mixed with the network: learns an exact repeat after one sighting (docs/algorithms.md §11).

Gradient steps on weights learn a new style slowly; a context model learns a header, a signature or an
identifier the first time it repeats. The best compressors (PPM's order-k statistics, PAQ's match model and its
context mixing) and predictive keyboards combine both; this module gives every session both.

History: the last `window` bytes the stream has read, the newest last (older bytes are forgotten, oldest first: the
memory per stream is fixed, 2 x window bytes plus the mixer). For each byte j of the history, `match[j]` is how
many bytes before j agree with the bytes just read (capped below 256); reading x updates it for every j at once
(the recurrence of a suffix match, vectorised over the history and the batch):

    match'[j] = [hist[j - 1] == x] * (1 + match[j - 1])

Predictions of the next byte, from the history as it is before that byte:
- counts of order k = 0..K: n_k[b] = #{j : match[j] >= k, hist[j] = b}, what followed the last k bytes each time
  they occurred (order 0: the history's byte counts): PPM's statistics without its escapes, exact;
- the match model: the byte after the most recent of the longest matches, l = max_j match[j] bytes long.

Mixer (log-linear, a product of experts; PAQ mixes bit predictions in the logistic domain, this is the same at the
level of bytes), one weight vector per bucket c(l) of the match length, learned online from the stream's own text:

    f = [log p_net, log(n_0 + a), log(n_1 + a), ..., log(n_K + a), onehot(match prediction)]     (F, V)
    log p_mix = log_softmax(w[c(l)] . f)
    after the byte y is read:   w[c] <- w[c] - lr (E_{p_mix}[f] - f[y])        (the gradient of -log p_mix(y))

A count feature without any occurrence is log(a) for every byte, a constant the softmax ignores: an unseen context
leaves the network alone. w = (1, 0, ..., 0) is p_mix = p_net; sessions start from the checkpoint's prior
(dyneval.json "copy" "weights", learned on held-out personal text by `python -m bench.copy_defaults`).

Score, then update: the prediction at position t reads only the inputs up to t; the history and the mixer learn a
byte when it arrives as the next input, so a call's last prediction waits in the state (`feat`, `bucket`) for the
next call's first input, and outputs depend only on the stream, not on how calls cut it.

Two paths. `mix` (observing and scoring a session's text) learns: history, counts and mixer weights change with
every byte. `CopyMemory.read` (sampling, the keyboard's word search, through `models.memory.MemoryMixed`) reads a
session's history and mixer without changing them (the search's branches share one session's, as they share its
adapter M): a hypothetical continuation keeps only the last 254 bytes it read (`branch_view`), and the match of
each slot whose predecessor is the new byte is measured backwards against them (the same lengths: a match is the
common suffix of the history before a slot and what was read; only at the window's oldest edge, whose earlier bytes
are gone, can it be shorter). A branch of the search costs 254 bytes, not a window.

Layout (batch B, window W, V = 256, F = K + 3 features, NB buckets): `hist` (B, W) uint8, `match` (B, W) uint8,
`fill` (B,) int64 bytes held, `uni` (B, V) float32 order-0 counts, `weights` (B, NB, F) float32, `feat` (B, F, V)
float32 the pending prediction's features, `bucket` (B,) int64 its weight set (-1: nothing pending). Work per byte
and row: a few passes over the W bytes.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import torch.nn.functional as F

from kernels.copy_scan import compiled, scan_frozen_ref, scan_ref
from models.base import State
from models.memory import RESTORED_LIMIT, Learned, Memory, MemorySettings, NoSettings, check_restored, register

if TYPE_CHECKING:
    from models.checkpoint import Checkpoint

__all__ = ["BUCKET_EDGES", "CONTEXT", "CopyConfig", "CopyMemory", "CopyModel", "STATS", "branch_view", "empty_view",
           "frozen_stats"]

# match-length buckets: the mixer's weight set for a match of l bytes is the last edge <= l (0: no match)
BUCKET_EDGES = (0, 1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 64)
STATS = ("hist", "fill", "uni", "weights")  # what the frozen path reads of a session (`CopyMemory.view`)
PAIRS = ("pairs_off", "pairs_pos")  # and, on a CPU with numba, the history's index by byte pair (`frozen_stats`)
_CAP = 254  # match lengths stop growing here (a uint8)
CONTEXT = 254  # bytes a search row keeps of what it read: its longest match
_UNI_LIMIT = float(1 << 20)  # order-0 counts are halved past this total


def _bounded(weights: torch.Tensor) -> torch.Tensor:
    """The mixer's weights kept within what a restore accepts (RESTORED_LIMIT): an import may start them at the
    limit, and a session stored past it could not be read back (learned weights stay far inside it)."""
    return weights.clamp(-RESTORED_LIMIT, RESTORED_LIMIT)


@dataclass(frozen=True)
class CopyConfig:
    """The copy model's settings (dyneval.json "copy"); `weights` the mixer's prior (NB x F nested lists)."""

    window: int = 16384  # bytes of history
    orders: int = 6  # K
    alpha: float = 0.0625  # a: count smoothing inside the log
    lr: float = 0.02  # the mixer's step
    weights: tuple[tuple[float, ...], ...] | None = None  # None: (1, 0, ..., 0) in every bucket

    def __post_init__(self) -> None:
        for name, (lo, hi) in {"window": (64, 1 << 22), "orders": (1, 64)}.items():
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
                raise ValueError(f"copy {name} must be a whole number in [{lo}, {hi}], not {value!r}")
        if self.window % 8:
            raise ValueError(f"copy window must be a multiple of 8 (the scan reads 8 slots at once), not {self.window}")
        for name in ("alpha", "lr"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) \
                    or value < 0 or (name == "alpha" and value == 0):
                raise ValueError(f"copy {name} must be a finite number {'> 0' if name == 'alpha' else '>= 0'}, "
                                 f"not {value!r}")
        if self.weights is not None:
            rows, shape = self.weights, (len(BUCKET_EDGES), self.features)
            numbers = [v for r in rows for v in r]
            if len(rows) != shape[0] or any(len(r) != shape[1] for r in rows) or not all(
                    isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v) for v in numbers):
                raise ValueError(f"copy weights must be {shape[0]} x {shape[1]} finite numbers")

    @property
    def features(self) -> int:
        return self.orders + 3

    @classmethod
    def from_dict(cls, data: Any) -> CopyConfig:
        """From dyneval.json's "copy" section; keys that name no setting (notes, provenance) are ignored."""
        if not isinstance(data, dict):
            raise ValueError("the copy section must be an object")
        known = {k: v for k, v in data.items() if k in cls.__dataclass_fields__}
        if isinstance(known.get("weights"), list):
            try:
                known["weights"] = tuple(tuple(r) for r in known["weights"])
            except TypeError:
                raise ValueError("copy weights must be a list of lists of numbers") from None
        for key in ("window", "orders"):
            if isinstance(known.get(key), float) and known[key].is_integer():
                known[key] = int(known[key])
        return cls(**known)

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"window": self.window, "orders": self.orders, "alpha": self.alpha, "lr": self.lr}
        if self.weights is not None:
            out["weights"] = [list(r) for r in self.weights]
        return out


def branch_view(copy: State) -> State:
    """What a search row carries (`CopyMemory.branch_state`) of a stream whose copy-model state is `copy` (the
    learning path's): the last CONTEXT bytes it read and how many of them are real."""
    hist, fill = copy.tensors["hist"], copy.tensors["fill"]
    return State({"ctx": hist[:, -CONTEXT:].contiguous(), "ctxlen": fill.clamp(max=CONTEXT)})


def empty_view(batch: int, device: torch.device | str) -> State:
    """`branch_view` of rows that have read nothing (or have no copy model): `CopyMemory.read` gives them the network
    alone, and their states stack with other rows'."""
    return State({"ctx": torch.zeros(batch, CONTEXT, dtype=torch.uint8, device=device),
                  "ctxlen": torch.zeros(batch, dtype=torch.long, device=device)})


def frozen_stats(copy: State) -> State:
    """What the frozen path (`CopyModel.mix_frozen`, `CopyMemory.read`) reads of copy states: STATS, and where the fused
    kernel serves (CPU tensors, numba) the history's slots indexed by the byte pair that ends at each, which the
    kernel needs. Built in one pass over the window (~0.2 ms for 32 KB; 384 KB while it lives), so a keyboard
    search or a generation builds it once and each of its steps reads only the slots that can match."""
    stats = {k: copy.tensors[k] for k in STATS}
    fused = compiled() if stats["hist"].device.type == "cpu" else None
    if fused is None:
        return State(stats)
    hist, fill = stats["hist"].contiguous(), stats["fill"].contiguous()
    off = torch.empty(hist.shape[0], 256 * 256 + 1, dtype=torch.int32)
    pos = torch.zeros(hist.shape, dtype=torch.int32)
    fused[2](hist.numpy(), fill.numpy(), off.numpy(), pos.numpy())
    return State({**stats, "pairs_off": off, "pairs_pos": pos})


class CopyModel:
    """The copy model and mixer of one configuration (module docstring); per-stream state in a `State`."""

    def __init__(self, config: CopyConfig, vocab_size: int = 256) -> None:
        if vocab_size > 256:
            raise ValueError("the copy model reads bytes: a vocabulary of at most 256 tokens")
        self.config = config
        self.vocab = vocab_size
        lut = torch.zeros(256, dtype=torch.long)
        for i, edge in enumerate(BUCKET_EDGES):
            lut[edge:] = i
        self._bucket_of = lut  # match length -> weight set
        # log(c + alpha) of every whole count c <= window, for the fused kernels
        self._logtab = np.log(np.arange(config.window + 1, dtype=np.float64) + config.alpha).astype(np.float32)
        if config.weights is not None:
            self._prior = torch.tensor(config.weights, dtype=torch.float32)  # (NB, F)
        else:
            self._prior = torch.zeros(len(BUCKET_EDGES), config.features)
            self._prior[:, 0] = 1.0

    def init_state(self, batch: int, device: torch.device | str = "cpu") -> State:
        c = self.config
        W, V, Fn, NB = c.window, self.vocab, c.features, len(BUCKET_EDGES)
        return State({
            "hist": torch.zeros(batch, W, dtype=torch.uint8, device=device),
            "match": torch.zeros(batch, W, dtype=torch.uint8, device=device),
            "fill": torch.zeros(batch, dtype=torch.long, device=device),
            "uni": torch.zeros(batch, V, device=device),
            "weights": self._prior.to(device).expand(batch, NB, Fn).clone(),
            "feat": torch.zeros(batch, Fn, V, device=device),
            "bucket": torch.full((batch,), -1, dtype=torch.long, device=device),
        })

    def warm_up(self, device: torch.device | str = "cpu") -> None:
        """Run both paths once on one byte: on a CPU this compiles the numba kernels (about 2 s each the first time
        on a machine, then read from numba's cache), which a server does at start-up rather than in its first
        observe and first keystroke."""
        state = self.init_state(1, device)
        lp = torch.full((1, 1, self.vocab), -math.log(self.vocab), device=device)
        x = torch.zeros(1, 1, dtype=torch.long, device=device)
        _, state = self.mix(lp, x, state)
        view = branch_view(state)
        self.mix_frozen(lp, x, view.tensors["ctx"], view.tensors["ctxlen"], frozen_stats(state),
                        torch.zeros(1, dtype=torch.long, device=device))

    def check_state(self, state: State) -> None:
        """ValueError unless a session's `state` (batch 1) has this model's layout and values it could have made (an
        import is user input: an index out of range or a tensor of another shape would be read out of bounds by the
        compiled kernels, inside a batch of other sessions)."""
        t = state.tensors
        # order-0 counts are halved once their total passes _UNI_LIMIT: no entry reaches twice that
        check_restored("copy", t, self.init_state(1).tensors, limits={"uni": 2 * _UNI_LIMIT})
        if bool((t["fill"] < 0).any() | (t["fill"] > self.config.window).any() | (t["uni"] < 0).any()
                | (t["match"] > _CAP + 1).any()
                | (t["bucket"] < -1).any() | (t["bucket"] >= len(BUCKET_EDGES)).any()):
            raise ValueError("copy-model state out of range")

    # -- the two paths ------------------------------------------------------------------------------------------

    @torch.no_grad()
    def mix(self, log_net: torch.Tensor, inputs: torch.Tensor, state: State,
            mask: torch.Tensor | None = None) -> tuple[torch.Tensor, State]:
        """Score and learn. log_net (B, T, V) the network's log-probabilities after each input, inputs (B, T), mask
        (B, T) True on a prefix of each row -> (log p_mix (B, T, V) float32, the state after each row's last real
        input). Padding positions get log_net and change nothing."""
        T = log_net.shape[1]
        out = log_net.float().clone()  # (B, T, V)
        fused = compiled() if log_net.device.type == "cpu" else None
        if fused is not None:  # the same step as `_learn`, fused into one numba kernel (kernels/copy_scan.py)
            return self._learn_fused(fused[0], state, inputs, out, mask)
        if mask is None or bool(mask.all()):
            groups = [(None, T)]
        else:  # right-padded rows: the rows of each length run together (usually one length)
            lengths = mask.sum(1)
            groups = [((lengths == n).nonzero().squeeze(1), int(n)) for n in torch.unique(lengths).tolist() if n > 0]
        s = dict(state.tensors)
        for rows, n in groups:
            part = s if rows is None else {k: v[rows] for k, v in s.items()}
            mixed, part = self._learn(part, inputs[:, :n] if rows is None else inputs[rows, :n],
                                      out[:, :n] if rows is None else out[rows, :n])
            if rows is None:
                out[:, :n], s = mixed, part
            else:
                out[rows, :n] = mixed
                s = {k: v.index_copy(0, rows, part[k]) for k, v in s.items()}
        return out, State(s | {"weights": _bounded(s["weights"])})

    def _learn_fused(self, kernel: Any, state: State, inputs: torch.Tensor, out: torch.Tensor,
                     mask: torch.Tensor | None) -> tuple[torch.Tensor, State]:
        c, s = self.config, state.tensors
        B, T = inputs.shape
        lengths = mask.sum(1) if mask is not None else torch.full((B,), T, dtype=torch.long)
        new = {k: v.clone().contiguous() for k, v in s.items() if k != "hist"}
        ext = torch.cat([s["hist"], inputs.to(torch.uint8)], 1).contiguous()  # (B, W + T)
        hist = torch.empty_like(s["hist"])
        lp = out.clone()
        kernel(ext.numpy(), lengths.numpy(), new["match"].numpy(), new["fill"].numpy(), new["uni"].numpy(),
               new["weights"].numpy(), new["feat"].numpy(), new["bucket"].numpy(), lp.numpy(), out.numpy(),
               hist.numpy(), c.orders, c.alpha, c.lr, self._bucket_of.numpy(), _UNI_LIMIT, self._logtab)
        new["weights"] = _bounded(new["weights"])
        return out, State({"hist": hist, **new})

    def _learn(self, s: dict[str, torch.Tensor], inputs: torch.Tensor,
               lp: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """`mix` over rows of one length: inputs (B, T), lp (B, T, V)."""
        c = self.config
        B, T = inputs.shape
        W = c.window
        rows = torch.arange(B, device=inputs.device)
        x8 = inputs.to(torch.uint8)  # (B, T)
        ext = torch.cat([s["hist"], x8], 1)  # (B, W + T): the history of step t is ext[:, t + 1 : t + 1 + W]
        match, fill, uni, weights = s["match"].clone(), s["fill"], s["uni"].clone(), s["weights"].clone()
        feat, bucket = s["feat"], s["bucket"]
        out = torch.empty_like(lp)
        for t in range(T):
            x = inputs[:, t]
            # 1. the mixer learns from its pending prediction, whose target x now is
            pending = bucket >= 0  # (B,)
            if bool(pending.any()):
                b = bucket.clamp(min=0)
                w = weights[rows, b]  # (B, F)
                p = torch.softmax(torch.einsum("bf,bfv->bv", w, feat), -1)  # (B, V)
                grad = torch.einsum("bfv,bv->bf", feat, p) - feat[rows, :, x]  # (B, F) E_p[f] - f[y]
                weights[rows, b] = w - c.lr * grad * pending.unsqueeze(1).to(grad.dtype)
            # 2. x joins the history: the match recurrence over the old window, in place (kernels.copy_scan); the
            # empty slots of a history still filling never match
            counts, best = scan_ref(ext, t, match, x, (W - fill).clamp(min=0), c.orders)
            full = (fill >= W).to(uni.dtype)  # (B,) the oldest byte leaves
            uni[rows, ext[:, t].long()] -= full
            uni[rows, x] += 1
            fill = (fill + 1).clamp(max=W)
            # 3. predict the next byte
            feat, bucket = self._features(ext[:, t + 1 : t + 1 + W], counts, best, uni, lp[:, t])
            out[:, t] = self._mixture(weights[rows, bucket], feat)
        if bool((uni.sum(1) > _UNI_LIMIT).any()):
            uni = torch.where(uni.sum(1, keepdim=True) > _UNI_LIMIT, uni / 2, uni)
        return out, {"hist": ext[:, T:].contiguous(), "match": match, "fill": fill, "uni": uni, "weights": weights,
                     "feat": feat, "bucket": bucket}

    @torch.no_grad()
    def mix_frozen(self, log_net: torch.Tensor, inputs: torch.Tensor, ctx: torch.Tensor, ctxlen: torch.Tensor,
                   stats: State, index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Score without learning: row b reads the history and mixer of `stats` row index[b] (rows share a
        session's; -1: no copy model, the row gets log_net, as it does from a session that has read nothing: the
        prior's no-match weights would flatten the network's distribution, and widen a keyboard search, on no
        evidence), and keeps only the last bytes it read, `ctx` (B, C) with `ctxlen` (B,) of them real (a keyboard
        branch costs C bytes, not a window). The history does not take
        the inputs: the match of the slot after each slot whose byte is x is measured backwards against ctx.
        `stats` comes from `frozen_stats` (built here when it lacks the pair index the fused kernel reads).
        log_net (B, T, V), inputs (B, T) -> (log p_mix (B, T, V) float32, ctx, ctxlen after the inputs)."""
        out = log_net.float().clone()  # (B, T, V)
        st = stats.tensors
        ctx, ctxlen = ctx.clone().contiguous(), ctxlen.clone().contiguous()  # a cursor's own stay as they were
        fused = compiled() if log_net.device.type == "cpu" else None
        if fused is not None:  # the loop below fused into one numba kernel (kernels/copy_scan.py)
            if not all(k in st for k in PAIRS):
                st = frozen_stats(stats).tensors
            fused[1](st["hist"].contiguous().numpy(), st["fill"].contiguous().numpy(),
                     st["pairs_off"].contiguous().numpy(), st["pairs_pos"].contiguous().numpy(),
                     index.contiguous().numpy(),
                     ctx.numpy(), ctxlen.numpy(), inputs.to(torch.uint8).contiguous().numpy(),
                     log_net.float().contiguous().numpy(), out.numpy(), st["uni"].contiguous().numpy(),
                     st["weights"].contiguous().numpy(), self.config.orders, self.config.alpha,
                     self._bucket_of.numpy(), self._logtab)
            return out, ctx, ctxlen
        B = inputs.shape[0]
        index = index.to(log_net.device, non_blocking=True)
        alone = (index < 0) | (st["fill"][index.clamp(min=0)] == 0)  # (B,) no copy model, or it has read nothing
        index = index.clamp(min=0)
        hist = st["hist"]  # (S, W), read through index
        uni, weights = st["uni"][index], st["weights"][index]  # (B, V), (B, NB, F)
        rows = torch.arange(B, device=inputs.device)
        for t in range(inputs.shape[1]):
            ctx = torch.cat([ctx[:, 1:], inputs[:, t : t + 1].to(torch.uint8)], 1)  # (B, C)
            ctxlen = (ctxlen + 1).clamp(max=ctx.shape[1])
            counts, best = scan_frozen_ref(hist, st["fill"], index, ctx, ctxlen, self.config.orders)
            cand = hist[index[rows], (best % hist.shape[1]).clamp(min=0)]  # (B,) the match's next byte
            feat, bucket = self._features(None, counts, best, uni, out[:, t], cand)
            out[:, t] = self._mixture(weights[rows, bucket], feat)
        if bool(alone.any()):
            out = torch.where(alone.view(-1, 1, 1), log_net.float(), out)
        return out, ctx, ctxlen

    def _features(self, hist: torch.Tensor | None, counts: torch.Tensor, best: torch.Tensor, uni: torch.Tensor,
                  lp: torch.Tensor, pred: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The scan's counts by exact level (B, K+1, V) and best match (B,) (kernels.copy_scan), uni (B, V), the
        network's lp (B, V), and the match's next byte `pred` (B,) or the history (B, W) to read it from ->
        (features (B, F, V), bucket (B,))."""
        V = self.vocab
        B = counts.shape[0]
        counts, best = counts.to(lp.device, lp.dtype), best.to(lp.device)
        n = counts.flip(1).cumsum(1).flip(1)[:, 1:, :V]  # (B, K, V) n_k = occurrences of order >= k
        W = self.config.window
        ell = torch.where(best >= 0, best // W, 0)  # (B,)
        if pred is None:
            assert hist is not None
            pred = hist[torch.arange(B, device=hist.device), (best % W).clamp(min=0)]
        onehot = F.one_hot(pred.long(), V).to(lp.dtype) * (ell > 0).unsqueeze(1).to(lp.dtype)  # (B, V)
        a = self.config.alpha
        feat = torch.cat([lp.unsqueeze(1), torch.log(uni + a).unsqueeze(1), torch.log(n + a),
                          onehot.unsqueeze(1)], 1)  # (B, F, V)
        return feat, self._bucket_of.to(lp.device)[ell.clamp(max=255)]

    @staticmethod
    def _mixture(w: torch.Tensor, feat: torch.Tensor) -> torch.Tensor:
        """w (B, F), feat (B, F, V) -> log p_mix (B, V)."""
        return torch.log_softmax(torch.einsum("bf,bfv->bv", w, feat), -1)


_LAST_STACK: list[tuple[list[State], dict[int, int], State]] = []  # the last stack of sessions' statistics: what
# it was made of, each one's place in it (by identity), the stack


def _stacked(stats: list[State], index: torch.Tensor) -> tuple[State, torch.Tensor]:
    """`State.stack(stats)` and `index` (B,) into it (-1: none), reused while the sessions stacked are among the last
    stack's (the index then mapped to their places in it): a keyboard search stacks its sessions' statistics (~420 KB
    each with their index) every round, the rounds of the same typists' searches stack the same ones, or fewer as
    searches end. One state is its own stack. Views are never changed in place (a session's observe makes new ones)
    and the cache holds them, so identity is enough."""
    if len(stats) == 1:
        return stats[0], index
    if _LAST_STACK:
        made, places, stacked = _LAST_STACK[0]
        at = [places.get(id(s), -1) for s in stats]
        if all(i >= 0 and made[i] is s for i, s in zip(at, stats, strict=True)):
            if at == list(range(len(made))):
                return stacked, index
            return stacked, torch.tensor([*at, -1], device=index.device)[index]  # -1 stays -1 (the last entry)
    stacked = State.stack(stats)
    _LAST_STACK[:] = [(list(stats), {id(s): i for i, s in enumerate(stats)}, stacked)]
    return stacked, index


@register
class CopyMemory(Memory):
    """The copy model as a session memory (module docstring): on for every session where the checkpoint's
    dyneval.json has a "copy" section, unless a session turns it off."""

    name = "copy"
    kind = "distribution"

    def __init__(self, model: CopyModel) -> None:
        self.model = model

    @classmethod
    def build(cls, ckpt: Checkpoint) -> CopyMemory | None:
        config = ckpt.dyneval.copy
        if config is None or ckpt.tokenizer.vocab_size > 256:
            return None
        return cls(CopyModel(config, ckpt.tokenizer.vocab_size))

    def defaults(self) -> MemorySettings:
        return NoSettings()

    def warm_up(self, device: torch.device) -> None:
        self.model.warm_up(device)

    def init(self, settings: MemorySettings, device: torch.device) -> State:
        return self.model.init_state(1, device)

    def restore(self, settings: MemorySettings, tensors: dict[str, torch.Tensor], meta: Any,
                device: torch.device) -> State:
        if not tensors:  # an export from a server without a copy model starts one afresh
            return self.init(settings, device)
        state = State({k: v.to(device) for k, v in tensors.items()})
        self.model.check_state(state)
        return state

    def learn(self, log_dist: torch.Tensor, inputs: torch.Tensor, targets: torch.Tensor, mask: torch.Tensor,
              hidden: torch.Tensor | None, states: Sequence[Any]) -> Learned:
        mixed, after = self.model.mix(log_dist, inputs, State.stack(list(states)), mask)
        return Learned(mixed, [after.select(j) for j in range(len(states))])

    def view(self, state: Any) -> State:
        return frozen_stats(state)

    def branch_state(self, state: Any, batch: int, device: torch.device) -> State:
        if state is None:
            return empty_view(batch, device)
        view = branch_view(state)
        return view if batch == 1 else State({k: v.expand(batch, *v.shape[1:]) for k, v in view.tensors.items()})

    def read(self, log_dist: torch.Tensor, tokens: torch.Tensor, hidden: torch.Tensor | None,
             branch: State | None, views: Sequence[Any], index: torch.Tensor) -> tuple[torch.Tensor, State | None]:
        if branch is None:
            raise ValueError("a search row of a session with a copy model carries its last bytes (`branch_state`)")
        stats, index = _stacked(list(views), index)
        mixed, ctx, ctxlen = self.model.mix_frozen(log_dist, tokens, branch.tensors["ctx"], branch.tensors["ctxlen"],
                                                   stats, index)
        return mixed, State({"ctx": ctx, "ctxlen": ctxlen})
