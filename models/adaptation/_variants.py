"""Variants of a session's learned adaptation, one stream at a time, to be measured side by side
(`python -m bench.adapt_losses`; docs/benchmarks.md, "Adaptation: what a session gains").

A `VariantStream` reads a text as a session does (thesis fig. 4.1: score a segment with the current parameters, then
one gradient step on that segment's loss) and may adapt any of these, each with its own learning rate (per-part
rates):
- M of the h site, h' = h + M h on the first k units: the served session's adapter (Krause et al. 2018, sec. 6,
  sparse dynamic evaluation; thesis sec. 4.6), any k up to the site's size;
- a bias added to the output layer's logits (V numbers): what full dynamic evaluation does to `head.bias`;
- a low-rank update of the output matrix, logits += B (A^T h'), with A (H, r) a fixed orthonormal projection drawn
  from a seed (no state) and B (V, r) adapted: the projection of full dynamic evaluation's step on the output
  matrix onto r directions (a LoRA-style factor, as the low-rank updates Rannen-Triki et al. 2024 weigh against
  full online adaptation's cost).
Every part takes the RMS rule with decay towards the shipped weights (Krause et al. 2018, sec. 5; thesis eq. 4.7),
with the checkpoint's MS_g statistics for its step sizes: M's (k, k) block of "adapter.h", "param.head.bias" for the
bias, and for B the output matrix's statistic projected onto A's columns, sum_k A_kj^2 MS_W(i, k), where
MS_W = MS_v (|v_i| / g_i)^2 undoes the weight normalisation row by row.

`early` makes every rate larger at the start of a text, (1 + early * 2^(-bytes / early_bytes)) times: a session knows
least about its user at the start, when a larger step costs least (Titans, Behrouz et al. 2025, sec. 3.1, make the
step itself a function of the input; Sun et al. 2024, sec. 2, learn the test-time learning rate). Here it is a fixed
schedule.

The adaptation learns from the network's own scores, as the served session's does (`batch_step`); a copy model, when
given, is mixed into the scores after them, so one pass gives both the network's bits and the bits with the copy
model. With `mixed_loss` the parts learn instead from the loss of what is served, the network mixed with the copy
model: the mixture's gradient weighs each byte by how much the mixture still misses it (the copy model's mixer is
log-linear, models/copymodel.py).

The guards are the session's: an update that would make a parameter or the state non-finite is dropped, and
parameters under which a segment scores worse than DIVERGED_BITS a token are reset to the shipped ones (zero) and
the segment scored again.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from models.adaptation._config import DynEvalConfig
from models.adaptation._rules import UpdateRule
from models.adaptation._sparse import adapter_ms_g, eval_mode, finite_rows
from models.adaptation._step import usable_rows
from models.base import Adapter, LanguageModel, Output, State
from models.copymodel import CopyMemory, CopyModel
from models.memory import NoSettings

__all__ = ["VariantConfig", "VariantStream"]

_PROJECTION_SEED = 20260  # A of the low-rank output update: the same projection in every stream


@dataclass(frozen=True)
class VariantConfig:
    """One variant: which parts adapt and at what rates. The defaults are the served session's (dyneval.json
    "session": M of 256 units, eta 1e-4, lambda 1e-3, n = 20)."""

    units: int = 256  # k of M on the h site (0: no M)
    lr: float = 1e-4  # eta of M
    decay: float = 1e-3  # lambda of every part
    eps: float = 1.3774090912193061e-05
    segment: int = 20
    bias_lr: float = 0.0  # eta of the output bias (0: not adapted)
    out_rank: int = 0  # r of the low-rank output update (0: none; the output layer's input size: the whole matrix)
    out_lr: float = 0.0  # eta of B
    # B updates the weight-normalised direction v of the output matrix (W = g v / |v|, row norms kept at g: the
    # update turns each byte's output row without scaling its logits) instead of W itself
    out_norm: bool = False
    early: float = 0.0  # every rate (1 + early) times larger at the start, the excess halving every early_bytes
    early_bytes: int = 2000
    mixed_loss: bool = False  # learn from the loss of the network mixed with the copy model (as served), not its own

    def __post_init__(self) -> None:
        for name in ("lr", "decay", "eps", "bias_lr", "out_lr", "early"):
            value = getattr(self, name)
            if not (isinstance(value, int | float) and value >= 0 and value == value and value != float("inf")):
                raise ValueError(f"{name} must be finite and >= 0, not {value!r}")
        if self.decay > 1:
            raise ValueError(f"decay must be <= 1, not {self.decay}")
        for name in ("units", "segment", "out_rank", "early_bytes"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} must be a whole number >= 0, not {value!r}")
        if self.segment < 1 or self.early_bytes < 1:
            raise ValueError("segment and early_bytes must be >= 1")
        if self.out_rank and not self.out_lr:
            raise ValueError("a low-rank output update needs out_lr > 0")

    @classmethod
    def from_session(cls, section: DynEvalConfig, **overrides: Any) -> VariantConfig:
        """The variant that is a checkpoint's session settings, with `overrides` on top."""
        base = dict(units=section.adapter_units, lr=section.lr, decay=section.decay, eps=section.eps,
                    segment=section.segment)
        return cls(**(base | overrides))

    def state_bytes(self, hidden: int, vocab: int, element: int = 4) -> int:
        """Bytes of adapted state a stream keeps (A is drawn from a seed, so not kept)."""
        return element * (self.units ** 2 + (vocab if self.bias_lr else 0) + vocab * self.out_rank)


def projection(hidden: int, rank: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A (H, r) with orthonormal columns, the same for every stream."""
    g = torch.Generator().manual_seed(_PROJECTION_SEED)
    q, _ = torch.linalg.qr(torch.randn(hidden, rank, generator=g, dtype=torch.float64))
    out: torch.Tensor = q.to(device, dtype)
    return out


def _rule(lr: float, decay: float, eps: float, ms_g: Mapping[str, torch.Tensor]) -> UpdateRule:
    return UpdateRule(DynEvalConfig(mode="sparse", rule="rms_decay", lr=lr, decay=decay, eps=eps), list(ms_g), ms_g)


class VariantStream:
    """One stream of a variant (module docstring): `step` scores a segment, then adapts on it."""

    def __init__(self, model: LanguageModel, config: VariantConfig, stats: Mapping[str, torch.Tensor],
                 copy: CopyModel | None = None) -> None:
        self.model, self.config = model, config
        ref = next(model.parameters())
        self.dtype, self.device = ref.dtype, ref.device
        head: Any = getattr(model, "head", None)  # the mLSTM's weight-normalised output layer (v, g, bias)
        if (config.bias_lr or config.out_rank) and head is None:
            raise ValueError(f"{type(model).__name__} has no output layer `head` to adapt")
        self.rules: dict[str, UpdateRule] = {}
        self.shapes: dict[str, tuple[int, ...]] = {}

        def ms(name: str) -> torch.Tensor:
            return stats[name].to(self.device, self.dtype)

        if config.units:
            sites = {s.name: config.units for s in model.adaptation_sites()}
            ms_g = {n: v.to(self.device, self.dtype) for n, v in adapter_ms_g(stats, sites).items()}
            self.rules["M"] = _rule(config.lr, config.decay, config.eps, {f"M.{n}": v for n, v in ms_g.items()})
            self.shapes |= {f"M.{n}": (k, k) for n, k in sites.items()}
        if config.bias_lr:
            self.rules["bias"] = _rule(config.bias_lr, config.decay, config.eps, {"bias": ms("param.head.bias")})
            self.shapes["bias"] = (head.bias.shape[0],)
        self.A: torch.Tensor | None = None
        if config.out_rank:
            v, g = head.v.detach(), head.g.detach()  # (V, H), (V,): weight-normalised W = g v / |v|
            # the statistic of the matrix B updates: v's own, or W's (MS_W = MS_v (|v_i| / g_i)^2)
            ms_w = ms("param.head.v") if config.out_norm else \
                ms("param.head.v") * ((v.norm(dim=1) / g) ** 2).unsqueeze(1)  # (V, H)
            if config.out_rank > v.shape[1]:
                raise ValueError(f"out_rank {config.out_rank} exceeds the output layer's {v.shape[1]} inputs")
            if config.out_rank == v.shape[1]:  # the whole matrix: B is W's own update, A the identity (not stored)
                self.rules["out"] = _rule(config.out_lr, config.decay, config.eps, {"B": ms_w})
            else:
                self.A = projection(v.shape[1], config.out_rank, self.dtype, self.device)  # (H, r)
                self.rules["out"] = _rule(config.out_lr, config.decay, config.eps, {"B": ms_w @ self.A ** 2})
            self.shapes["B"] = (v.shape[0], config.out_rank)
            # for out_norm: the shipped rows' norms, the output bias, and A^T v_i (|v_i + B_i A^T|^2 =
            # |v_i|^2 + 2 B_i . A^T v_i + |B_i|^2 with A's columns orthonormal)
            v = v.to(self.dtype)
            self.v_norm, self.g = v.norm(dim=1), g.to(self.dtype)
            self.v_a = v @ self.A if self.A is not None else v  # (V, r)
            self.head_bias = head.bias.detach().to(self.dtype)
        self.copy = CopyMemory(copy) if copy is not None else None
        self.reset()

    def reset(self) -> None:
        """A fresh stream: the initial state, every adapted part zero."""
        self.state = self.model.init_state(1)
        self.params = {n: torch.zeros(s, dtype=self.dtype, device=self.device) for n, s in self.shapes.items()}
        self.copy_state = self.copy.init(NoSettings(), self.device) if self.copy is not None else None
        self.pos = self.updates = self.dropped = self.resets = 0

    def _score(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, State, torch.Tensor]:
        """-> (log-dist (1, t, V) with gradients to the parameters, log p(y) (1, t), new state, mean loss)."""
        p = self.params
        mats = {n.removeprefix("M."): m.unsqueeze(0) for n, m in p.items() if n.startswith("M.")}
        out = self.model(x, self.state, Adapter(mats) if mats else None)
        logits = out.logits
        if "bias" in p:
            logits = logits + p["bias"]
        if "B" in p:
            assert out.hidden is not None
            update = (out.hidden @ self.A if self.A is not None else out.hidden) @ p["B"].t()  # (1, t, V)
            if self.config.out_norm:
                # W' h = g_i (v_i . h + B_i A^T h) / |v_i + B_i A^T|; v_i . h read back from the shipped logits
                b = p["B"]
                norm = (self.v_norm ** 2 + 2 * (b * self.v_a).sum(1) + (b * b).sum(1)).clamp(min=1e-12).sqrt()
                vh = (out.logits - self.head_bias) * (self.v_norm / self.g)
                logits = logits - out.logits + self.g * (vh + update) / norm + self.head_bias
            else:
                logits = logits + update
        log_dist = self.model.log_probs(Output(logits=logits, state=out.state))  # (1, t, V)
        lp = log_dist.gather(-1, y.unsqueeze(-1)).squeeze(-1)  # (1, t)
        return log_dist, lp, out.state, -lp.mean()

    def step(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """x, y: (1, t) inputs and targets -> (the network's log p(y) (t,), with the copy model mixed in (t,) or
        None), both scored before this segment's update."""
        with torch.inference_mode(False), torch.enable_grad(), eval_mode(self.model), \
                torch.autocast(x.device.type, enabled=False):
            for n, t in self.params.items():
                self.params[n] = t.detach().requires_grad_(True)
            log_dist, lp, state, loss = self._score(x, y)
            nonzero = any(bool(t.detach().any()) for t in self.params.values())
            if nonzero and not bool(usable_rows(lp.detach(), lp.new_tensor([lp.shape[1]]))[0]):
                # diverged: back to the shipped parameters, and the segment scored under them
                self.params = {n: torch.zeros_like(t).requires_grad_(True) for n, t in self.params.items()}
                self.resets += 1
                log_dist, lp, state, loss = self._score(x, y)
            mixed = None
            if self.copy is not None:  # the copy model scores the segment after the network, then learns it
                mask = torch.ones_like(y, dtype=torch.bool)
                dist, (self.copy_state,), _ = self.copy.learn(log_dist.detach(), x, y, mask, None, [self.copy_state])
                mixed = dist.gather(-1, y.unsqueeze(-1)).squeeze(-1)[0]
                if self.config.mixed_loss:
                    # the served loss, -log p_mix(y): through the mixer's log-linear product its gradient w.r.t. the
                    # network's logits is w_net (p_mix - onehot(y)) (w_net, the mixer's weight on log p_net, folded
                    # into the rate): the network's own gradient with p_mix in place of p_net, so a byte the copy model
                    # already predicts teaches the weights little
                    p_mix = dist.detach().exp().to(log_dist.dtype)
                    loss = (-lp + (p_mix * log_dist).sum(-1)).mean()
            names = list(self.params)
            grads = dict(zip(names, torch.autograd.grad(loss, [self.params[n] for n in names]), strict=True)) \
                if names else {}
        boost = 1.0 + self.config.early * 0.5 ** (self.pos / self.config.early_bytes)
        old = {n: t.detach() for n, t in self.params.items()}
        new: dict[str, torch.Tensor] = {}
        for rule in self.rules.values():
            new |= rule.step({n: old[n] for n in rule.names}, {n: boost * grads[n] for n in rule.names})
        state = state.detach()
        state_ok = bool(finite_rows(list(state.tensors.values()), 1).all())
        if names and state_ok and bool(finite_rows([t.unsqueeze(0) for t in new.values()], 1).all()):
            self.params = new
            self.updates += 1
        else:
            self.params = old
            self.dropped += int(bool(names))
        if state_ok:
            self.state = state
        self.pos += y.shape[1]
        net = lp.detach()[0]
        return net, mixed

    def run(self, inputs: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """A whole text (`Tokenizer.stream`'s inputs and targets, (T,)) from a fresh stream -> the log-probs of
        `step`, concatenated."""
        self.reset()
        n = self.config.segment
        nets, mixes = [], []
        for i in range(0, targets.numel(), n):
            net, mixed = self.step(inputs[None, i : i + n], targets[None, i : i + n])
            nets.append(net)
            if mixed is not None:
                mixes.append(mixed)
        return torch.cat(nets), torch.cat(mixes) if mixes else None

