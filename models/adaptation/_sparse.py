"""Sparse dynamic evaluation (thesis sec. 4.6, eq. 4.8; docs/algorithms.md §3): one batched step over B streams.

Only the adapter matrices M (theta_g = 0) adapt, one per stream and site. Because M_b touches only row b,
the gradient of (sum over rows of each row's mean segment loss) w.r.t. M_b is exactly row b's own, so
one forward/backward serves every stream. Rows are right-padded: `mask` (B, n) is True on a prefix of
each row, and each row's new state is the one after its own last real token.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import NamedTuple

import torch

from models.adaptation._config import DynEvalConfig
from models.adaptation._rules import UpdateRule
from models.base import Adapter, LanguageModel, Output, State

__all__ = ["ScoreStep", "SparseStep", "adapter_ms_g", "score_step", "sparse_step"]

ForwardFn = Callable[[torch.Tensor, State, Adapter | None], Output]


class SparseStep(NamedTuple):
    logprobs: torch.Tensor  # (B, n) natural-log p(target), scored BEFORE the update; 0 on padding
    state: State  # detached; a row whose new state was non-finite keeps its previous one
    adapter: Adapter  # detached; a failed row, or one with no tokens, keeps its previous M
    failed: torch.Tensor  # (B,) bool: rows whose new M or state was non-finite (update dropped)
    log_dist: torch.Tensor  # (B, n, V) the model's log-distribution at every position (detached)
    hidden: torch.Tensor | None  # (B, n, H) h' fed to the output layer (detached), for the neural cache


class ScoreStep(NamedTuple):
    logprobs: torch.Tensor  # (B, n) natural-log p(target); 0 on padding
    state: State  # each row's state after its own last real token
    log_dist: torch.Tensor | None = None  # (B, n, V) with `keep_dist`
    hidden: torch.Tensor | None = None  # (B, n, H) with `keep_dist`, if the model gives it


@contextlib.contextmanager
def eval_mode(model: LanguageModel) -> Iterator[None]:
    """No dropout while scoring; the caller's mode is restored."""
    was_training = model.training
    if not was_training:  # already evaluating (the usual case inside evaluate_many): skip the module walk
        yield
        return
    model.eval()
    try:
        yield
    finally:
        model.train(was_training)


def row_mask(mask: torch.Tensor, shape_like: torch.Tensor) -> torch.Tensor:
    """(B,) bool -> broadcastable against a (B, ...) tensor."""
    return mask.view(-1, *([1] * (shape_like.dim() - 1)))


def forward_rows(forward: ForwardFn, inputs: torch.Tensor, lengths: torch.Tensor, state: State,
                 adapter: Adapter | None, row_lengths: Sequence[int] | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor | None, State]:
    """Run right-padded rows: inputs (B, T), lengths (B,) -> logits (B, T, V), hidden (B, T, H) or None,
    and the state of each row after its own last real token (rows of length 0 keep `state`).

    The time axis is cut at each distinct row length (usually none: one forward call). `row_lengths`, the same
    lengths as host integers, spares reading them back from the device."""
    T = inputs.shape[1]
    cuts = sorted({int(c) for c in (row_lengths if row_lengths is not None else lengths.tolist())} | {T})
    logits, hidden = [], []
    final = state
    current, start = state, 0
    for cut in cuts:
        if cut == start:
            continue
        out = forward(inputs[:, start:cut], current, adapter)
        logits.append(out.logits)
        if out.hidden is not None:
            hidden.append(out.hidden)
        current, start = out.state, cut
        if len(cuts) == 1:  # every row is full length (the common case): nothing to pick
            final = current
            break
        final = current.where(lengths == cut, final)  # rows that end at this cut take its state
    hs = torch.cat(hidden, 1) if len(hidden) == len(logits) else None
    return torch.cat(logits, 1), hs, final


def finite_rows(tensors: list[torch.Tensor], batch: int) -> torch.Tensor:
    """(B,) bool: every value of the row is finite. A row sum is NaN or inf whenever one value is (and,
    harmlessly, when finite values are big enough to overflow it): 25x cheaper than isfinite().all()."""
    sums = torch.stack([t.reshape(batch, -1).sum(1) for t in tensors])  # (len(tensors), B)
    return torch.isfinite(sums).all(0)


def adapter_ms_g(stats: Mapping[str, torch.Tensor], sites: Mapping[str, int]) -> dict[str, torch.Tensor]:
    """MS_g of each site's k-unit adapter from a checkpoint's stats: the top-left (k, k) block of
    "adapter.<site>" (at M = 0 the gradient of M_ij does not depend on the other units, so the block is
    exactly the statistic of a smaller adapter)."""
    out = {}
    for name, k in sites.items():
        full = stats.get(f"adapter.{name}")
        if full is None:
            raise ValueError(f"no MS_g statistics for adapter site {name!r} (stats key 'adapter.{name}')")
        if full.shape[0] < k or full.shape[1] < k:
            raise ValueError(f"MS_g for site {name!r} covers {full.shape[0]} units, the adapter needs {k}")
        out[name] = full[:k, :k]
    return out


def sparse_sites(model: LanguageModel, adapter_units: int = 0) -> dict[str, int]:
    """Each adaptation site's adapter size k for `adapter_units` (0: each site's default); ValueError when the
    model has no sites or asks more units than a site has."""
    sites = model.adaptation_sites()
    if not sites:
        raise ValueError(f"{type(model).__name__} has no adaptation sites: sparse mode needs one")
    for s in sites:
        if adapter_units > s.dim:
            raise ValueError(f"adapter_units {adapter_units} exceeds site {s.name!r} of {s.dim} units")
    return {s.name: s.adapter_size(adapter_units) for s in sites}


def sparse_rule(model: LanguageModel, config: DynEvalConfig,
                stats: Mapping[str, torch.Tensor] | None) -> tuple[dict[str, int], UpdateRule]:
    """The sparse rule's set-up, in one place (offline evaluation, the keyboard simulator and the server's
    sessions): each site's adapter size for `config.adapter_units`, the MS_g of its (k, k) block from a
    checkpoint's `stats` when the rule needs them (eq. 4.5-4.7), and the `UpdateRule`. -> (sites, rule)."""
    sites = sparse_sites(model, config.adapter_units)
    ms_g = None
    if config.rule in ("rms", "rms_decay"):
        if stats is None:
            raise ValueError(f"rule {config.rule!r} needs the checkpoint's MS_g statistics (stats)")
        ref = next(model.parameters())
        ms_g = {k: v.to(ref.device, ref.dtype) for k, v in adapter_ms_g(stats, sites).items()}
    return sites, UpdateRule(config, list(sites), ms_g)


def sparse_step(model: LanguageModel, inputs: torch.Tensor, targets: torch.Tensor, mask: torch.Tensor,
                state: State, adapter: Adapter, ms_g: Mapping[str, torch.Tensor] | None = None,
                config: DynEvalConfig | None = None, *, rule: UpdateRule | None = None,
                row_lengths: Sequence[int] | None = None) -> SparseStep:
    """Score one segment of B streams with their current M, then take one update step on each M.

    inputs, targets: (B, n) int64; mask: (B, n) bool, True on a prefix of each row; state: (B, ...);
    adapter.mats[site]: (B, k, k); ms_g[site]: (k, k) (see `adapter_ms_g`; None for the SGD rules).
    The returned log-probs come from the forward pass with the M given here, before any update.
    Non-finite guard, per row: a non-finite new state keeps the row's previous state and M; a non-finite
    new M alone keeps the previous M (the new state stands). Either way the row is flagged in `failed`;
    the other rows update normally. Pass a prebuilt `rule` (else one is built from `config` and `ms_g`).
    Only M takes gradients: with a frozen model (`LanguageModel.freeze`, as loaded for inference) autograd records
    nothing for the weights, and a model may run a cheaper backward (the mLSTM's, kernels.adapted_mlstm).
    """
    if rule is None and config is None:
        raise ValueError("sparse_step needs an update rule or the config to build one")
    # `row_lengths` (host integers, from a caller that built the mask from them) spares the mask check's and the
    # time cuts' reads back from the device
    with torch.inference_mode(False):  # a caller under inference mode still gets its gradient step
        return _sparse_step(model, _plain(inputs), _plain(targets), _plain(mask),
                            State({k: _plain(v) for k, v in state.tensors.items()}),
                            {n: _plain(m) for n, m in adapter.mats.items()}, ms_g, config, rule, row_lengths)


@torch.no_grad()
def score_step(model: LanguageModel, inputs: torch.Tensor, targets: torch.Tensor, mask: torch.Tensor,
               state: State, adapter: Adapter | None = None, *, keep_dist: bool = False,
               row_lengths: Sequence[int] | None = None) -> ScoreStep:
    """`sparse_step` without the update: score one segment of B right-padded streams, each with its own M
    (or none). Same layout as `sparse_step`; its log-probs equal sparse_step's for the same inputs.
    `keep_dist` also returns the log-distributions and hidden states (for the neural cache); `row_lengths`
    (the mask's row lengths as host integers) spares a read back from the device."""
    lengths = mask.long().sum(1)  # (B,)
    with eval_mode(model):
        logits, hidden, new_state = forward_rows(model, inputs, lengths, state, adapter, row_lengths)
        log_dist = model.log_probs(Output(logits=logits, state=new_state))  # (B, n, V)
        lp = log_dist.gather(-1, targets.unsqueeze(-1)).squeeze(-1)  # (B, n)
    return ScoreStep(logprobs=torch.where(mask, lp, 0.0), state=new_state,
                     log_dist=log_dist if keep_dist else None, hidden=hidden if keep_dist else None)


def _plain(t: torch.Tensor) -> torch.Tensor:
    """Tensors made under inference mode cannot enter autograd: copy them out."""
    return t.clone() if t.is_inference() else t


def _sparse_step(model: LanguageModel, inputs: torch.Tensor, targets: torch.Tensor, mask: torch.Tensor,
                 state_in: State, mats_in: dict[str, torch.Tensor], ms_g: Mapping[str, torch.Tensor] | None,
                 config: DynEvalConfig | None, rule: UpdateRule | None,
                 row_lengths: Sequence[int] | None) -> SparseStep:
    B, T = inputs.shape
    lengths = mask.long().sum(1)  # (B,)
    if row_lengths is None and not torch.equal(mask, torch.arange(T, device=mask.device).unsqueeze(0)
                                               < lengths.unsqueeze(1)):
        raise ValueError("mask must be True on a prefix of each row (right padding)")
    if rule is None:
        assert config is not None
        rule = UpdateRule(config, list(mats_in), ms_g)
    mats = {n: m.detach().requires_grad_(True) for n, m in mats_in.items()}
    # The update path runs in float32 whatever autocast the caller set (models/precision.py): a row's new M and
    # state must not depend on what else is in the batch. Under bf16 they would: a matmul's float32 accumulation
    # order depends on its row count (oneDNN and MKL pick kernels by shape), a last-bit difference flips the
    # rounding of a bf16 output now and then, and the adaptation carries each flip on, so replays of one session
    # in other batches drifted apart by up to half an adapter entry. In float32 the same differences stay at
    # float32's last bits (tests/models/test_batch_invariance.py).
    with torch.enable_grad(), eval_mode(model), torch.autocast(inputs.device.type, enabled=False):
        logits, hidden, new_state = forward_rows(model, inputs, lengths, state_in, Adapter(mats), row_lengths)
        log_dist = model.log_probs(Output(logits=logits, state=new_state))  # (B, n, V)
        lp = log_dist.gather(-1, targets.unsqueeze(-1)).squeeze(-1)  # (B, n)
        lp = torch.where(mask, lp, 0.0)
        # sum over rows of each row's mean: row b's gradient w.r.t. M_b is its own segment's
        loss = -(lp.sum(1) / lengths.clamp(min=1).to(lp.dtype)).sum()
        grads = torch.autograd.grad(loss, list(mats.values()))
    old = {n: m.detach() for n, m in mats.items()}
    new = rule.step(old, dict(zip(mats, grads, strict=True)))
    new_state = new_state.detach()
    # guard: a non-finite state (the forward blew up) rewinds the row; a non-finite M alone drops the update
    # but keeps the state, which the old M produced legitimately
    state_ok = finite_rows(list(new_state.tensors.values()), B)  # (B,)
    take_m = (lengths > 0) & state_ok & finite_rows(list(new.values()), B)  # (B,)
    # where() only when a row is refused: a (B, k, k) pass saved in the common case
    # On a CPU, where() only when a row is refused (a (B, k, k) pass saved in the common case); on a GPU always:
    # that costs less than the host synchronisation that asking would
    cpu = inputs.device.type == "cpu"
    out_mats = new if cpu and bool(take_m.all()) else {
        n: torch.where(row_mask(take_m, m), new[n], m) for n, m in old.items()}
    out_state = new_state if cpu and bool(state_ok.all()) else State(
        {k: torch.where(row_mask(state_ok, v), v, state_in.tensors[k].detach()) for k, v in new_state.tensors.items()})
    return SparseStep(logprobs=lp.detach(), state=out_state, adapter=Adapter(out_mats),
                      failed=(lengths > 0) & ~take_m,
                      log_dist=log_dist.detach(), hidden=hidden.detach() if hidden is not None else None)
