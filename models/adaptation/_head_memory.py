"""Output-row adaptation as a session memory: each session adapts the direction of every row of the output layer.

The mLSTM's output layer is weight-normalised, W_i = g_i v_i / |v_i| (Salimans and Kingma 2016, sec. 2). A session
keeps a delta D on v, and scores with W'_i = g_i (v_i + D_i) / |v_i + D_i|: each token's output row turns towards
the user's text while its length g_i stays the shipped one, so no update can scale a logit beyond g_i |h|. D learns
by Krause et al.'s dynamic evaluation (Krause et al. 2018, sec. 3: score a segment, then one gradient step on its
loss), with their RMS rule and decay towards the shipped weights (sec. 5; thesis eq. 4.5-4.7; `UpdateRule`):
D <- D - eta g / (sqrt(MS_g) + eps) - lambda RMSnorm D, with MS_g the checkpoint's statistic of v
("param.head.v"). Issue 34's phase 1 (docs/benchmarks.md) found this part keeps most of full dynamic evaluation's
gain at a fraction of its cost: the gradient needs only the hidden states the network hands its output layer, not a
backward through the network.

It is a distribution memory: `learn` takes the network's log-distribution and hidden states h' of a segment (after
the sparse adapter M, when a session has both), tilts them by W' h' - W h' (the network's distribution becomes the
adapted output layer's), and steps D on the segment's loss, every session's rows in one batched call. It sits
before the copy model in the registry, so the copy model mixes into the adapted distribution. Its state is D as
"delta" (1, V, H) in bfloat16 (half the bytes; it is read into float32 for every step, and the step is float32);
its settings are the session's rate and decay, the default from the checkpoint's dyneval.json "head" section (off
without one). The guard is the session's (`models.adaptation._step`): an update that would make D non-finite is
dropped; a segment that scores worse than DIVERGED_BITS a token under D resets D to zero, and the segment is scored
under the shipped output layer.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch
from pydantic import Field

from models.adaptation._adapter_memory import MAX_SESSION_LR
from models.adaptation._config import DynEvalConfig
from models.adaptation._rules import UpdateRule, rms_norms
from models.adaptation._sparse import finite_rows
from models.adaptation._step import usable_rows
from models.base import LanguageModel, State
from models.memory import Learned, Memory, MemorySettings, check_restored, register

if TYPE_CHECKING:
    from models.checkpoint import Checkpoint

__all__ = ["STATE_DTYPE", "HeadMemory", "HeadSettings"]

STATE_DTYPE = torch.bfloat16  # D as stored: 2 bytes a number
_RULE_CACHE = 64  # update rules kept, by (lr, decay)


class HeadSettings(MemorySettings):
    lr: float = Field(ge=0, le=MAX_SESSION_LR, allow_inf_nan=False,
                      description="Learning rate eta of the output rows' delta.")
    decay: float = Field(ge=0, le=1, allow_inf_nan=False,
                         description="Decay lambda of the delta towards the shipped output layer at each step.")


@register
class HeadMemory(Memory):
    """The output rows' delta (module docstring)."""

    name = "head"
    kind = "distribution"
    settings_type = HeadSettings
    needs_hidden = True
    learns_weights = True

    def __init__(self, model: LanguageModel, ms_v: torch.Tensor, eps: float,
                 default: HeadSettings | None = None) -> None:
        head: Any = getattr(model, "head", None)  # `build` checked it is there
        ref = next(model.parameters())
        # float32 copies of the shipped layer (float64 for a float64 network): the steps' arithmetic
        self.dtype = torch.promote_types(ref.dtype, torch.float32)
        self.v = head.v.detach().to(self.dtype)  # (V, H)
        self.g = head.g.detach().to(self.dtype)  # (V,)
        self.inv_norm = 1.0 / self.v.norm(dim=1)  # (V,)
        self.ms_v = ms_v.to(ref.device, self.dtype)  # (V, H)
        self.eps, self.default = eps, default
        self._rules: dict[tuple[float, float], UpdateRule] = {}
        self._parts: tuple[torch.Tensor, torch.Tensor] | None = None  # (`_rms_parts`)

    @classmethod
    def build(cls, ckpt: Checkpoint) -> HeadMemory | None:
        head = getattr(ckpt.model, "head", None)
        v, g = getattr(head, "v", None), getattr(head, "g", None)
        ms_v = ckpt.stats.get("param.head.v")
        # a weight-normalised output layer of its own (not tied to the embedding), and its statistic for the rule
        if not isinstance(v, torch.Tensor) or not isinstance(g, torch.Tensor) or ms_v is None \
                or ms_v.shape != v.shape:
            return None
        section = ckpt.dyneval.get("head")
        default = None
        if isinstance(section, Mapping) and section:
            try:
                default = HeadSettings(lr=float(section["lr"]), decay=float(section["decay"]))
            except (KeyError, TypeError, ValueError) as e:
                raise ValueError(f"section 'head' needs a valid lr and decay: {e}") from None
        return cls(ckpt.model, ms_v, ckpt.dyneval.session.eps, default)

    def defaults(self) -> HeadSettings | None:
        return self.default

    def init(self, settings: MemorySettings, device: torch.device) -> State:
        assert isinstance(settings, HeadSettings)
        # the session's rate and decay ride in the state ("rate" (1, 2) float64), as `learn` sees only states
        return State({"delta": torch.zeros(1, *self.v.shape, dtype=STATE_DTYPE, device=device),
                      "rate": torch.tensor([[settings.lr, settings.decay]], dtype=torch.float64, device=device)})

    def export(self, state: Any) -> tuple[dict[str, torch.Tensor], Any]:
        return {"delta": state.tensors["delta"].detach().to("cpu").contiguous()}, None  # the rate is in the settings

    def restore(self, settings: MemorySettings, tensors: dict[str, torch.Tensor], meta: Any,
                device: torch.device) -> State:
        # any finite D is safe to serve (the rows' lengths stay g), so the shared limit is the only bound
        template = self.init(settings, device)
        check_restored(self.name, tensors, {"delta": template.tensors["delta"]})
        return State({"delta": tensors["delta"].to(device), "rate": template.tensors["rate"]})

    def rule(self, lr: float, decay: float) -> UpdateRule:
        """The RMS rule with decay (Krause et al. 2018, sec. 5; thesis eq. 4.7) of a session's rate and decay."""
        key = (lr, decay)
        rule = self._rules.get(key)
        if rule is None:
            cfg = DynEvalConfig(mode="sparse", rule="rms_decay", lr=lr, decay=decay, eps=self.eps)
            rule = UpdateRule(cfg, ["delta"], {"delta": self.ms_v})
            if len(self._rules) >= _RULE_CACHE:
                self._rules.clear()
            self._rules[key] = rule
        return rule

    # -- the adapted output layer ---------------------------------------------------------------------------------

    def _tilt(self, log_dist: torch.Tensor, hidden: torch.Tensor, delta: torch.Tensor,
              ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        """log p (B, T, V) of the output layer with rows u_i = v_i + D_i: log_dist (B, T, V), hidden h' (B, T, H),
        delta D (B, V, H), all in `self.dtype`. The logits change by g_i (u_i . h / |u_i| - v_i . h / |v_i|) (the bias
        is the shipped one); log-softmax renormalises. -> (log p, what `_gradient` reuses: u, |u|, u . h)."""
        vh = hidden @ self.v.t()  # (B, T, V)
        uh = vh + torch.bmm(delta, hidden.transpose(1, 2)).transpose(1, 2)  # (B, T, V) u_i . h
        u = self.v.unsqueeze(0) + delta  # (B, V, H)
        norm = u.norm(dim=2).clamp(min=1e-12)  # (B, V)
        shift = self.g * (uh / norm.unsqueeze(1) - vh * self.inv_norm)  # (B, T, V)
        return torch.log_softmax(log_dist + shift, -1), (u, norm, uh)

    def _gradient(self, out: torch.Tensor, targets: torch.Tensor, weight: torch.Tensor, hidden: torch.Tensor,
                  saved: tuple[torch.Tensor, torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """d loss / d D (B, V, H) for loss = -sum_b,t weight_bt log p_bt(y_bt), by hand: autograd's backward through
        the norm makes several more passes over the (B, V, H) deltas, which are most of a step's cost.
        With c = weight (p - onehot(y)) the gradient of the logits, z_i = g_i u_i . h / |u_i| and u_i = v_i + D_i:
        dL/dD_i = sum_t a_ti h_t - (sum_t a_ti u_i . h_t / |u_i|^2) u_i, with a_ti = c_ti g_i / |u_i|."""
        u, norm, uh = saved
        c = out.exp()  # (B, T, V)
        c.scatter_add_(-1, targets.unsqueeze(-1), -torch.ones_like(targets, dtype=c.dtype).unsqueeze(-1))
        a = c * weight.unsqueeze(-1) * (self.g / norm).unsqueeze(1)  # (B, T, V)
        grad = torch.bmm(a.transpose(1, 2), hidden)  # (B, V, H)
        coef = (a * uh).sum(1) / (norm * norm)  # (B, V)
        return grad.addcmul_(coef.unsqueeze(-1), u, value=-1.0)

    def learn(self, log_dist: torch.Tensor, inputs: torch.Tensor, targets: torch.Tensor, mask: torch.Tensor,
              hidden: torch.Tensor | None, states: Sequence[Any]) -> Learned:
        assert hidden is not None, "the head memory needs Output.hidden"
        B = len(states)
        with torch.no_grad(), torch.autocast(log_dist.device.type, enabled=False):
            base = log_dist.to(self.dtype)  # (B, T, V)
            h = hidden.to(self.dtype)  # (B, T, H)
            old = torch.cat([s.tensors["delta"] for s in states]).to(self.dtype)  # (B, V, H)
            lengths = mask.sum(1)  # (B,)
            m = mask.to(self.dtype)
            out, saved = self._tilt(base, h, old)  # scored with D before this segment's update (no peek)
            lp = out.gather(-1, targets.unsqueeze(-1)).squeeze(-1) * m  # (B, T), 0 on padding
            # the divergence guard: a row whose segment scores unusably under a nonzero D starts again from zero
            bad = ~usable_rows(lp, lengths)  # (B,)
            # on a CPU the second pass only when a row is bad; on a GPU always (no read back from the device a step)
            cpu = _reads_back(old.device)
            if not cpu or bool(bad.any()):
                bad &= (old.reshape(B, -1) != 0).any(1)
                old = torch.where(bad.view(B, 1, 1), torch.zeros_like(old), old)
                out, saved = self._tilt(base, h, old)
            # sum over rows of each row's mean segment loss: row b's gradient is its own segment's (as `sparse_step`)
            weight = m / lengths.clamp(min=1).to(m.dtype).unsqueeze(1)  # (B, T)
            grad = self._gradient(out, targets, weight, h, saved)
            rates = torch.cat([s.tensors["rate"] for s in states])  # (B, 2): each row's (lr, decay)
            if cpu:  # the rows of each rule in one pass, with the rule's (V, H) coefficients
                new = self._step([self.rule(lr, decay) for lr, decay in rates.tolist()], old, grad)
            else:  # each row's coefficients made on the device from its rates (no read back of them)
                new = self._step_rates(rates, old, grad)
            # a row with no tokens, or whose update would be non-finite, keeps its D; on a CPU the where() (a pass
            # over every row's delta) only when a row is refused, on a GPU always (cheaper than the host
            # synchronisation)
            scored = lengths > 0
            finite = finite_rows([new], B)  # (B,)
            take = scored & finite
            if not cpu or not bool(take.all()):
                new = torch.where(take.view(B, 1, 1), new, old)
            stored = new.to(STATE_DTYPE)
            # per row: the update applied, refused as non-finite, D reset by the divergence guard (`bad` is all
            # False unless a row was reset)
            steps = torch.stack([take, scored & ~finite, bad], 1).to(torch.int64)  # (B, 3)
        result = out.to(torch.promote_types(log_dist.dtype, torch.float32))
        # each row's state a view of the batch's (a session's record owns a copy: `SessionModel.observed`)
        return Learned(result, [State({"delta": stored[j : j + 1], "rate": s.tensors["rate"]})
                                for j, s in enumerate(states)], steps)

    def _step_rates(self, rates: torch.Tensor, old: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
        """`_step` with each row's rule made from its rates (B, 2) (lr, decay) where they are: the same arithmetic as
        `UpdateRule` (thesis eq. 4.5-4.7), its coefficients (B, V, H) instead of one (V, H) per rule."""
        B = old.shape[0]
        lr, lam = rates[:, 0], rates[:, 1]  # (B,) float64, as a rule's Python floats
        inv, norm = self._rms_parts()
        scale = inv * lr.to(inv.dtype).view(B, 1, 1)  # eq. 4.5: eta / (sqrt(MS_g) + eps)
        # eq. 4.6-4.7: lambda * RMSnorm, RMSnorm clipped to <= 1/lambda (1/0 = inf, and a subnormal lambda's past the
        # dtype's range: nothing clipped; a lambda of 0 gives no decay)
        cap = (1.0 / lam).to(norm.dtype).view(B, 1, 1)
        decay = lam.to(norm.dtype).view(B, 1, 1) * torch.minimum(norm, cap)
        return torch.addcmul(old, scale, grad, value=-1.0).addcmul_(decay, old, value=-1.0)

    def _rms_parts(self) -> tuple[torch.Tensor, torch.Tensor]:
        """1 / (sqrt(MS_g) + eps) and RMSnorm before its clip, (V, H) each, as `UpdateRule` computes them."""
        if self._parts is None:  # (once, at the first step)
            rms = self.ms_v.sqrt()
            # `lr / t` is `t.reciprocal() * lr` in torch
            self._parts = ((rms + self.eps).reciprocal(), rms_norms({"head": rms})["head"])
        return self._parts

    def _step(self, rules: Sequence[UpdateRule], old: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
        """One rule step of every row, each with its own rule: the rows of one rule in one pass."""
        groups: dict[int, list[int]] = {}
        for j, rule in enumerate(rules):
            groups.setdefault(id(rule), []).append(j)
        if len(groups) == 1:  # the common case, every session at the default: no gather and scatter
            return rules[0].step({"delta": old}, {"delta": grad})["delta"]
        new = torch.empty_like(old)
        for rows in groups.values():
            rule = rules[rows[0]]
            index = torch.tensor(rows, device=old.device)
            part = rule.step({"delta": old[index]}, {"delta": grad[index]})["delta"]
            new[index] = part
        return new

    # -- searches and sampling -------------------------------------------------------------------------------------

    def view(self, state: Any) -> torch.Tensor:
        """The change of the session's output matrix, W' - W (V, H), with W'_i = g_i u_i / |u_i| and W_i = g_i v_i /
        |v_i|: built once per record, so that a search's every step costs one product with it."""
        u = self.v + state.tensors["delta"][0].to(self.dtype)  # (V, H)
        w: torch.Tensor = u * (self.g / u.norm(dim=1).clamp(min=1e-12)).unsqueeze(1) \
            - self.v * (self.g * self.inv_norm).unsqueeze(1)
        return w

    def read(self, log_dist: torch.Tensor, tokens: torch.Tensor, hidden: torch.Tensor | None,
             branch: State | None, views: Sequence[Any], index: torch.Tensor) -> tuple[torch.Tensor, State | None]:
        assert hidden is not None, "the head memory needs Output.hidden"
        with torch.no_grad(), torch.autocast(log_dist.device.type, enabled=False):
            h = hidden.to(self.dtype)  # (B, T, H)
            base = log_dist.to(self.dtype)
            rows_of = index.tolist()
            runs = _runs(rows_of)
            if runs is not None and -1 not in rows_of:
                # every row of a session, each session's rows together (a search's rounds): its rows' product into
                # their place, one log-softmax for the batch (row by row the same numbers as one per session)
                logits = torch.empty_like(base)
                for s, a, z in runs:
                    torch.matmul(h[a:z], views[s].t(), out=logits[a:z])  # (b, T, V) W' h - W h
                out = torch.log_softmax(logits.add_(base), -1)
            else:
                out = base.clone()
                for s in sorted(set(rows_of) - {-1}):  # the rows of each session, one product
                    rows = torch.tensor([b for b, r in enumerate(rows_of) if r == s]).to(log_dist.device,
                                                                                          non_blocking=True)
                    # the logits change from W h to W' h (the bias is the shipped one); a row of no session (-1)
                    # keeps its distribution
                    shift = h[rows] @ views[s].t()  # (b, T, V)
                    out[rows] = torch.log_softmax(base[rows] + shift, -1)
        return out.to(torch.promote_types(log_dist.dtype, torch.float32)), None


def _reads_back(device: torch.device) -> bool:
    """`learn` reads a step's rates and flags back to the host to choose its passes: on a CPU, where that costs
    nothing and spares passes, not on a GPU, where it would wait for the device."""
    return device.type == "cpu"


def _runs(rows_of: list[int]) -> list[tuple[int, int, int]] | None:
    """(session, first row, end) of each run of rows of one session, or None where a session's rows are apart."""
    runs: list[tuple[int, int, int]] = []
    start = 0
    for b in range(1, len(rows_of) + 1):
        if b == len(rows_of) or rows_of[b] != rows_of[start]:
            runs.append((rows_of[start], start, b))
            start = b
    return runs if len({s for s, _, _ in runs}) == len(runs) else None
