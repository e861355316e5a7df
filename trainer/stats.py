"""Global gradient statistics MS_g (thesis eq. 4.4; ALGORITHMS.md §2-3).

MS_g = mean over N_b training batches of the squared gradient, per parameter. For sparse dynamic
evaluation the adapter matrices M get the same statistic, taken at M = 0 (ALGORITHMS.md §3 decision).
Gradients are of the mean loss over a segment of `segment` tokens, the unit one dynamic-evaluation
update sees; the hidden state is carried between segments as in evaluation.
"""

from __future__ import annotations

import torch

from models.base import Adapter, LanguageModel
from trainer.data import ByteStreams

__all__ = ["gradient_stats"]


def gradient_stats(model: LanguageModel, data: bytes, *, batches: int, batch_size: int, segment: int,
                   adapter_units: int = 0) -> dict[str, torch.Tensor]:
    """-> {"param.<name>": MS_g, "adapter.<site>": MS_g of M (k, k)} for every parameter and site."""
    was_training = model.training
    model.eval()  # statistics of the model as it is evaluated: no dropout
    streams = ByteStreams(data, batch_size, segment)
    params = dict(model.named_parameters())
    sums = {n: torch.zeros_like(p) for n, p in params.items()}
    sites = {s.name: (adapter_units or s.dim) for s in model.adaptation_sites()}
    ref = next(iter(params.values()))
    adapter_sums = {n: torch.zeros(k, k, dtype=ref.dtype, device=ref.device) for n, k in sites.items()}
    state = model.init_state(batch_size)
    for step in range(batches):
        chunk, new_epoch = streams.chunk(step)
        if new_epoch:
            state = model.init_state(batch_size)
        chunk = chunk.to(ref.device)
        adapter = Adapter.zeros(sites, batch_size, dtype=ref.dtype, device=ref.device)
        for m in adapter.mats.values():
            m.requires_grad_(True)
        model.zero_grad(set_to_none=True)
        out = model(chunk[:, :-1], state, adapter)
        loss = -model.target_logprobs(out, chunk[:, 1:]).mean()  # the dynamic-evaluation loss (no auxiliary terms)
        loss.backward()
        for n, p in params.items():
            if p.grad is not None:
                sums[n] += p.grad.detach() ** 2  # eq. 4.4
        for n, m in adapter.mats.items():
            # the batch-mean gradient w.r.t. one shared M is the sum over rows of per-row gradients
            assert m.grad is not None
            adapter_sums[n] += m.grad.detach().sum(0) ** 2
        state = out.state.detach()
    model.zero_grad(set_to_none=True)
    model.train(was_training)
    stats = {f"param.{n}": s / batches for n, s in sums.items()}
    stats.update({f"adapter.{n}": s / batches for n, s in adapter_sums.items()})
    return stats
