"""The dynamic-evaluation update rules (thesis eq. 4.3-4.7; docs/algorithms.md §2).

Every rule has the form  theta <- theta - s * g + d * (theta_g - theta)  with s and d fixed for a whole
evaluation, so they are computed once from the config and MS_g and each step is two fused passes.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from models.adaptation._config import DynEvalConfig

__all__ = ["UpdateRule", "rms_norms"]

Coef = float | torch.Tensor
# a batch row of `UpdateRule.stack`: its rule and the shape of each of its tensors; None for a row that stays fixed
RowRule = tuple["UpdateRule", Mapping[str, tuple[int, ...]]] | None


def rms_norms(rms: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Thesis eq. 4.6 before its clip: RMSnorm = sqrt(MS_g) / mean(sqrt(MS_g)), the mean over every element of `rms`
    (sqrt(MS_g) by name), summed in float64."""
    total = sum(float(r.double().sum()) for r in rms.values())
    count = sum(r.numel() for r in rms.values())
    mean = total / count if total > 0 else 1.0
    return {n: r / mean for n, r in rms.items()}


class UpdateRule:
    """One configured rule over a fixed set of named tensors.

    `ms_g` maps each name to its MS_g (same shape as the tensor, or broadcastable to it: an adapter's
    (k, k) statistic serves a (B, k, k) batch). Only the RMS rules need it.
    """

    def __init__(self, config: DynEvalConfig, names: list[str], ms_g: Mapping[str, torch.Tensor] | None = None) -> None:
        self.names = list(names)
        self.scale: dict[str, Coef] = {}
        self.decay: dict[str, Coef] = {}
        lr, lam, eps = config.lr, config.decay, config.eps
        if config.rule in ("sgd", "sgd_decay"):
            for n in self.names:
                self.scale[n] = lr  # eq. 4.3 (plain SGD is eq. 4.3 with lambda = 0)
                self.decay[n] = lam if config.rule == "sgd_decay" else 0.0
            return
        missing = [n for n in self.names if ms_g is None or n not in ms_g]
        if missing:
            raise ValueError(f"rule {config.rule!r} needs MS_g statistics for {', '.join(missing[:5])}"
                             " (pass the checkpoint's stats)")
        assert ms_g is not None
        rms = {n: ms_g[n].sqrt() for n in self.names}
        for n in self.names:
            self.scale[n] = lr / (rms[n] + eps)  # eq. 4.5: eta / (sqrt(MS_g) + eps)
            self.decay[n] = lam
        if config.rule == "rms_decay" and lam > 0:
            norms = rms_norms(rms)  # eq. 4.6, then clipped to <= 1/lambda
            for n in self.names:
                norm = norms[n]
                if 1.0 / lam < torch.finfo(norm.dtype).max:  # a subnormal lambda clips nothing the dtype holds
                    norm = norm.clamp(max=1.0 / lam)
                self.decay[n] = lam * norm  # eq. 4.7: lambda * RMSnorm

    @classmethod
    def stack(cls, rows: Sequence[RowRule], shapes: Mapping[str, tuple[int, ...]], *,
              dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu") -> UpdateRule:
        """One rule over a batch of tensors `(B, *shapes[name])` whose row b steps exactly like its own rule.

        A row's coefficients fill the leading corner of its padded slot (e.g. a (k, k) adapter in the batch's
        (K, K)); the rest of the slot, and every coefficient of a None row, is 0, so padding and fixed rows
        keep their values through `step`. This lets streams with different sizes, learning rates and decays
        share one batched update. -> scale[name], decay[name]: (B, *shapes[name]).
        """
        scale: dict[str, Coef] = {}
        decay: dict[str, Coef] = {}
        for name, shape in shapes.items():
            s = torch.zeros(len(rows), *shape, dtype=dtype, device=device)  # (B, *shape)
            d = torch.zeros_like(s)
            for b, row in enumerate(rows):
                if row is None:
                    continue
                rule, own = row
                corner = tuple(slice(0, n) for n in own[name])
                s[b][corner] = rule.scale[name]
                d[b][corner] = rule.decay[name]
            scale[name], decay[name] = s, d
        stacked = cls.__new__(cls)
        stacked.names, stacked.scale, stacked.decay = list(shapes), scale, decay
        return stacked

    def step(self, theta: Mapping[str, torch.Tensor], grads: Mapping[str, torch.Tensor],
             start: Mapping[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
        """-> theta - s * g + d * (theta_g - theta) for every name; `start` is theta_g (None: theta_g = 0)."""
        out = {}
        with torch.no_grad():
            for n in self.names:
                p, s, d = theta[n], self.scale[n], self.decay[n]
                # one fused pass per term (addcmul may round once where p - s * g rounds twice)
                new = torch.addcmul(p, s, grads[n], value=-1.0) if isinstance(s, torch.Tensor) else p - s * grads[n]
                if isinstance(d, torch.Tensor) or d != 0.0:
                    if start is not None:
                        new = new + d * (start[n] - p)
                    else:
                        new = new.addcmul_(d, p, value=-1.0) if isinstance(d, torch.Tensor) else new - d * p
                out[n] = new
        return out
