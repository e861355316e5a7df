import pytest
import torch
from torch import nn

from models.adaptive import AdaptiveInput, AdaptiveSoftmax

V, D, CUTOFFS = 50, 32, [10, 25]  # bands of 10, 15 and 25 words; dims 32, 8, 2


def _reference_pair(head_bias: bool) -> tuple[AdaptiveSoftmax, nn.AdaptiveLogSoftmaxWithLoss]:
    torch.manual_seed(0)
    ref = nn.AdaptiveLogSoftmaxWithLoss(D, V, CUTOFFS, div_value=4.0, head_bias=head_bias)
    with torch.no_grad():  # random bias: torch initialises it to zeros
        if head_bias:
            ref.head.bias.normal_()
    ours = AdaptiveSoftmax(V, D, CUTOFFS, div_value=4.0, head_bias=head_bias)
    with torch.no_grad():
        ours.head_weight.copy_(ref.head.weight[:10])
        ours.cluster_weight.copy_(ref.head.weight[10:])
        if head_bias:
            assert ours.head_bias is not None
            ours.head_bias.copy_(ref.head.bias)
        for i, tail in enumerate(ref.tail):
            ours.tail_projections[i].copy_(tail[0].weight.T)
            ours.tail_weights[i].copy_(tail[1].weight)
    return ours, ref


@pytest.mark.parametrize("head_bias", [False, True])
def test_matches_torch_adaptive_log_softmax(head_bias: bool) -> None:
    ours, ref = _reference_pair(head_bias)
    torch.manual_seed(1)
    hidden = torch.randn(V + 10, D)
    targets = torch.cat([torch.arange(V), torch.randint(0, V, (10,))])[torch.randperm(V + 10)]  # every word
    torch.testing.assert_close(ours.log_prob(hidden), ref.log_prob(hidden), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ours.target_log_prob(hidden, targets), ref(hidden, targets).output,
                               atol=1e-5, rtol=1e-5)
    assert [p.shape[1] for p in ours.tail_projections] == [8, 2]


def test_distribution_sums_to_one_and_target_matches_gather() -> None:
    torch.manual_seed(2)
    sm = AdaptiveSoftmax(V, D, CUTOFFS, head_bias=True)
    hidden = torch.randn(3, 7, D)  # leading dims kept
    lp = sm.log_prob(hidden)
    assert lp.shape == (3, 7, V)
    torch.testing.assert_close(lp.exp().sum(-1), torch.ones(3, 7), atol=1e-5, rtol=0)
    targets = torch.randint(0, V, (3, 7))
    got = sm.target_log_prob(hidden, targets)
    assert got.shape == (3, 7)
    torch.testing.assert_close(got, lp.gather(-1, targets.unsqueeze(-1)).squeeze(-1), atol=1e-5, rtol=1e-5)
    # only head targets: no tail band is computed, the result is still right
    head_only = targets % 10
    torch.testing.assert_close(sm.target_log_prob(hidden, head_only),
                               lp.gather(-1, head_only.unsqueeze(-1)).squeeze(-1), atol=1e-5, rtol=1e-5)


def test_tail_dropout_only_in_training() -> None:
    torch.manual_seed(3)
    sm = AdaptiveSoftmax(V, D, CUTOFFS, dropout=0.5)
    hidden, targets = torch.randn(16, D), torch.full((16,), 30)  # a tail word
    sm.eval()
    a, b = sm.target_log_prob(hidden, targets), sm.target_log_prob(hidden, targets)
    torch.testing.assert_close(a, b)
    sm.train()
    assert not torch.allclose(sm.target_log_prob(hidden, targets), a)
    head = torch.zeros(16, dtype=torch.long)  # head words never see the dropout
    torch.testing.assert_close(sm.target_log_prob(hidden, head), sm.eval().target_log_prob(hidden, head))


def test_adaptive_input_bands_and_shape() -> None:
    torch.manual_seed(4)
    inp = AdaptiveInput(V, D, CUTOFFS, div_value=4.0)
    assert [tuple(e.shape) for e in inp.embeddings] == [(10, 32), (15, 8), (25, 2)]  # band i: d / 4**i
    assert [tuple(p.shape) for p in inp.projections] == [(32, 32), (32, 8), (32, 2)]
    ids = torch.tensor([[0, 9, 10, 24], [25, 49, 3, 30]])
    out = inp(ids)
    assert out.shape == (2, 4, D)
    # each position is its band's embedding projected to D
    want = inp.embeddings[2][49 - 25] @ inp.projections[2].T
    torch.testing.assert_close(out[1, 1], want)
    torch.testing.assert_close(out[0, 2], inp.embeddings[1][0] @ inp.projections[1].T)
    assert inp(torch.zeros(0, dtype=torch.long)).shape == (0, D)


def test_tying_shares_storage_but_not_the_head_projection() -> None:
    torch.manual_seed(5)
    inp = AdaptiveInput(V, D, CUTOFFS)
    sm = AdaptiveSoftmax(V, D, CUTOFFS).tie(inp)
    assert sm.head_weight is inp.embeddings[0]
    for i in range(2):
        assert sm.tail_weights[i] is inp.embeddings[i + 1]
        assert sm.tail_projections[i] is inp.projections[i + 1]
        assert sm.tail_weights[i].data_ptr() == inp.embeddings[i + 1].data_ptr()
    softmax_params = {id(p) for p in sm.parameters()}
    assert id(inp.projections[0]) not in softmax_params  # the head projection is never tied
    assert id(sm.cluster_weight) not in {id(p) for p in inp.parameters()}
    # a model holding both counts the shared tensors once
    both = nn.ModuleDict({"inp": inp, "sm": sm})
    n_inp = sum(p.numel() for p in inp.parameters())
    assert sum(p.numel() for p in both.parameters()) == n_inp + sm.cluster_weight.numel()
    # embeddings only (the paper's billion word setting)
    emb_only = AdaptiveSoftmax(V, D, CUTOFFS).tie(inp, projections=False)
    assert emb_only.tail_weights[0] is inp.embeddings[1]
    assert emb_only.tail_projections[0] is not inp.projections[1]
    with pytest.raises(ValueError, match="cannot tie"):
        AdaptiveSoftmax(V, D, [10, 20]).tie(inp)


def test_gradients_reach_every_band_embedding_through_a_tied_model() -> None:
    torch.manual_seed(6)
    inp = AdaptiveInput(V, D, CUTOFFS)
    sm = AdaptiveSoftmax(V, D, CUTOFFS).tie(inp)
    ids = torch.tensor([[1, 12, 40, 5, 30]])  # one id per band at least, inputs and targets
    loss = -sm.target_log_prob(inp(ids[:, :-1]), ids[:, 1:]).mean()
    loss.backward()
    for e in inp.embeddings:
        assert e.grad is not None and e.grad.abs().sum() > 0
    for p in [*inp.projections, sm.cluster_weight]:
        assert p.grad is not None and p.grad.abs().sum() > 0


def test_tied_gradient_is_the_sum_of_both_uses() -> None:
    torch.manual_seed(7)
    inp = AdaptiveInput(V, D, CUTOFFS)
    tied = AdaptiveSoftmax(V, D, CUTOFFS).tie(inp)
    ids, targets = torch.tensor([3, 14, 44]), torch.tensor([44, 3, 14])
    (-tied.target_log_prob(inp(ids), targets).sum()).backward()
    grad_tied = inp.embeddings[1].grad.clone()
    # the same computation with the input's weights copied into an untied softmax
    inp.zero_grad()
    untied = AdaptiveSoftmax(V, D, CUTOFFS)
    untied.load_state_dict(tied.state_dict())
    (-untied.target_log_prob(inp(ids), targets).sum()).backward()
    torch.testing.assert_close(grad_tied, inp.embeddings[1].grad + untied.tail_weights[0].grad, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize(("cutoffs", "message"), [
    ([25, 10], "strictly increasing"),
    ([10, 10], "strictly increasing"),
    ([0, 10], "positive"),
    ([10, 50], "beyond the vocabulary"),
    ([10, 60], "beyond the vocabulary"),
    ([10.0, 20], "integers"),
])
def test_bad_cutoffs_raise(cutoffs: list[int], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        AdaptiveInput(V, D, cutoffs)
    with pytest.raises(ValueError, match=message):
        AdaptiveSoftmax(V, D, cutoffs)


def test_bad_dims_and_ids_raise() -> None:
    with pytest.raises(ValueError, match="dimension"):
        AdaptiveInput(V, 8, [5, 10, 20])  # 8 // 4**2 = 0
    inp, sm = AdaptiveInput(V, D, CUTOFFS), AdaptiveSoftmax(V, D, CUTOFFS)
    with pytest.raises(ValueError, match=r"\[0, 50\)"):
        inp(torch.tensor([50]))
    with pytest.raises(ValueError, match=r"\[0, 50\)"):
        sm.target_log_prob(torch.zeros(1, D), torch.tensor([-1]))
    with pytest.raises(ValueError, match="do not match"):
        sm.target_log_prob(torch.zeros(2, D), torch.tensor([1]))
