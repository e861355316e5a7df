"""Global gradient statistics MS_g (Krause's thesis eq. 4.4; docs/algorithms.md §2-3).

MS_g = mean over N_b training batches of the squared gradient, per parameter. For sparse dynamic
evaluation the adapter matrices M get the same statistic, taken at M = 0, where the gradient with respect to M is
well defined (the thesis gives no statistic for M; docs/algorithms.md §3).
Gradients are of the mean loss over a segment of `segment` tokens, the unit one dynamic-evaluation
update sees; the hidden state is carried between segments as in evaluation.

Distributed (`group` of N processes, each with batch_size / N of the rows): the statistic is the square of
the batch-mean gradient, so the processes average their gradients first and square after; summing squared
per-process gradients would be another statistic (N times too small in expectation for independent rows).
"""

from __future__ import annotations

import torch

from models.base import Adapter, LanguageModel
from trainer._dist import Group
from trainer.data import ByteStreams

__all__ = ["gradient_stats"]


def gradient_stats(model: LanguageModel, data: bytes | torch.Tensor, *, batches: int, batch_size: int, segment: int,
                   adapter_units: int = 0, group: Group | None = None) -> dict[str, torch.Tensor]:
    """-> {"param.<name>": MS_g, "adapter.<site>": MS_g of M (k, k)} for every parameter but the training-only ones
    (auxiliary heads: dynamic evaluation's loss never reaches them) and every site.

    With `group`, this process takes its share of the batch's rows and the result is that of one process
    with the whole batch (up to float summation order), on every process.
    """
    group = group or Group()
    was_training = model.training
    model.eval()  # statistics of the model as it is evaluated: no dropout
    streams = ByteStreams(data, batch_size, segment, shard=(group.rank, group.world))
    batch_size = group.share(batch_size, "stats_batch_size")
    training_only = set(model.training_only_parameters())
    params = {n: p for n, p in model.named_parameters() if n not in training_only}
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
        grads = {n: p.grad.detach() for n, p in params.items() if p.grad is not None}
        # the batch-mean gradient w.r.t. one shared M is the sum over rows of per-row gradients
        adapter_grads = {n: m.grad.detach().sum(0) for n, m in adapter.mats.items() if m.grad is not None}
        assert adapter_grads.keys() == adapter.mats.keys()
        group.mean_([*grads.values(), *adapter_grads.values()])  # the whole batch's mean gradient, then square
        for n, g in grads.items():
            sums[n] += g ** 2  # eq. 4.4
        for n, g in adapter_grads.items():
            adapter_sums[n] += g ** 2
        state = out.state.detach()
    model.zero_grad(set_to_none=True)
    model.train(was_training)
    stats = {f"param.{n}": s / batches for n, s in sums.items()}
    stats.update({f"adapter.{n}": s / batches for n, s in adapter_sums.items()})
    return stats
