"""NT-ASGD (Merity et al. 2018, Algorithm 1) and variable-length BPTT (their sec. 4.1)."""

import random

import pytest
import torch
from torch import nn

from trainer.ntasgd import NTASGD, bptt_chunks, sample_seq_len, scaled_lr


def _model() -> nn.Linear:
    torch.manual_seed(0)
    return nn.Linear(3, 2).double()


def _sgd_step(nt: NTASGD, model: nn.Linear, seed: int, lr_scale: float = 1.0) -> None:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(4, 3, generator=g, dtype=torch.float64)
    nt.zero_grad()
    model(x).pow(2).sum().backward()
    nt.step(lr_scale)


def _first_switch(losses: list[float], n: int) -> int | None:
    """The rule written out: the first check t with t > n and v_t > min(v_0 .. v_{t-n-1})."""
    for t, v in enumerate(losses):
        if t > n and v > min(losses[: t - n]):
            return t
    return None


def _run_checks(losses: list[float], n: int) -> int | None:
    nt = NTASGD(_model(), lr=0.1, nonmono=n)
    for t, v in enumerate(losses):
        fired = nt.check(v)
        assert fired == nt.averaging == (nt.switched_at is not None)
        if fired:
            return t
    return None


def test_switches_exactly_at_the_first_violating_check() -> None:
    n = 2
    # t:       0    1    2    3    4    5
    losses = [5.0, 4.0, 3.0, 3.5, 3.2, 3.1, 9.0]
    # t=3: worse than the best (3.0) but that best is among the last n: no switch; nor at t=4 (min(5, 4) = 4)
    # t=5: min(v_0 .. v_2) = 3.0 < 3.1: switch
    nt = NTASGD(_model(), lr=0.1, nonmono=n)
    for t, v in enumerate(losses[:5]):
        assert not nt.check(v), t
        assert not nt.averaging
    assert nt.check(losses[5]) and nt.averaging and nt.switched_at == 0
    assert nt.logs == losses[:6]
    assert not nt.check(losses[6]) and nt.logs == losses[:6]  # once averaging, Algorithm 1 checks no more
    assert _first_switch(losses, n) == 5


def test_equal_is_not_worse_and_t_must_exceed_n() -> None:
    assert _run_checks([3.0, 4.0, 5.0, 3.0, 3.0], n=2) is None  # 3.0 > min(...) = 3.0 is false
    assert _run_checks([3.0, 4.0, 5.0, 3.0, 3.0, 3.0 + 1e-9], n=2) == 5
    # with n = 5 (the paper's), nothing fires before the sixth check however bad the loss
    assert _run_checks([1.0, 9.0, 9.0, 9.0, 9.0, 9.0, 9.0], n=5) == 6
    assert _run_checks([1.0, 9.0], n=0) == 1  # n = 0: any loss worse than the best so far


@pytest.mark.parametrize("seed", range(6))
def test_rule_matches_the_written_out_rule_on_random_sequences(seed: int) -> None:
    rng = random.Random(seed)
    losses = [10.0 / (1 + t) + rng.uniform(0, 1.5) for t in range(40)]
    for n in (1, 3, 5):
        assert _run_checks(losses, n) == _first_switch(losses, n)


def test_average_is_the_mean_of_the_iterates_since_the_switch() -> None:
    model = _model()
    nt = NTASGD(model, lr=0.05, nonmono=0, interval=3)
    for k in range(3):
        _sgd_step(nt, model, k)
    assert nt.check_due()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    assert {k: torch.equal(v, before[k]) for k, v in nt.averaged_state_dict().items()} == {"weight": True,
                                                                                          "bias": True}
    assert not nt.check(1.0) and not nt.averaging
    assert nt.check(2.0) and nt.switched_at == 3  # n = 0: worse than the best so far
    iterates = [{k: v.clone() for k, v in model.state_dict().items()}]  # w_T: the weights at the switch
    for k in range(3, 8):
        _sgd_step(nt, model, k)
        iterates.append({k: v.clone() for k, v in model.state_dict().items()})
    avg = nt.averaged_state_dict()
    for name in ("weight", "bias"):
        mean = torch.stack([w[name] for w in iterates]).mean(0)
        torch.testing.assert_close(avg[name], mean, rtol=0, atol=1e-14)
        assert not torch.allclose(mean, iterates[-1][name])  # the average is not the last iterate
    # the model still holds the last iterate
    assert torch.equal(model.weight, iterates[-1]["weight"])


def test_evaluation_with_averaged_weights_swaps_back() -> None:
    model = _model()
    nt = NTASGD(model, lr=0.05, nonmono=0)
    nt.check(1.0)
    _sgd_step(nt, model, 0)
    assert nt.check(2.0)
    for k in range(1, 4):
        _sgd_step(nt, model, k)
    avg = nt.averaged_state_dict()
    last = {k: v.clone() for k, v in model.state_dict().items()}
    weight = model.weight
    x = torch.randn(5, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(9))
    with nt.averaged():
        assert torch.equal(model.weight, avg["weight"]) and torch.equal(model.bias, avg["bias"])
        torch.testing.assert_close(model(x), x @ avg["weight"].t() + avg["bias"], rtol=0, atol=1e-14)
    assert model.weight is weight and torch.equal(model.weight, last["weight"]) and torch.equal(model.bias,
                                                                                                last["bias"])
    with pytest.raises(RuntimeError), nt.averaged():
        raise RuntimeError("evaluation failed")
    assert torch.equal(model.weight, last["weight"])  # swapped back on an exception too
    # before any switch the context changes nothing
    fresh = NTASGD(model, lr=0.05)
    with fresh.averaged():
        assert torch.equal(model.weight, last["weight"])


def test_finetuning_restarts_from_the_average_and_stops_by_the_same_rule() -> None:
    model = _model()
    nt = NTASGD(model, lr=0.05, nonmono=1)
    for v in (3.0, 2.0, 3.5):  # the third is worse than min(v_0) = 3.0: switch
        _sgd_step(nt, model, int(v * 10))
        nt.check(v)
    assert nt.averaging
    for k in range(3):
        _sgd_step(nt, model, 100 + k)
    avg = nt.averaged_state_dict()
    nt.restart()
    assert nt.finetuning and nt.logs == [] and not nt.finished
    assert torch.equal(model.weight, avg["weight"]) and torch.equal(model.bias, avg["bias"])  # hot start: w_0
    iterates = [avg]
    for k in range(4):
        _sgd_step(nt, model, 200 + k)
        iterates.append({k: v.clone() for k, v in model.state_dict().items()})
    torch.testing.assert_close(nt.averaged_state_dict()["weight"],
                               torch.stack([w["weight"] for w in iterates]).mean(0), rtol=0, atol=1e-14)
    assert not nt.check(1.0) and not nt.check(1.5) and not nt.finished  # t = 1 is not > n = 1
    assert nt.check(1.2) and nt.finished  # 1.2 > min(v_0) = 1.0


def test_state_dict_round_trip_resumes_the_same_average() -> None:
    model = _model()
    nt = NTASGD(model, lr=0.05, nonmono=0)
    nt.check(1.0)
    _sgd_step(nt, model, 0)
    nt.check(2.0)
    _sgd_step(nt, model, 1)
    saved, weights = nt.state_dict(), {k: v.clone() for k, v in model.state_dict().items()}
    _sgd_step(nt, model, 2)
    expect = nt.averaged_state_dict()
    other = _model()
    other.load_state_dict(weights)
    resumed = NTASGD(other, lr=1.0)
    resumed.load_state_dict(saved)
    _sgd_step(resumed, other, 2)
    assert resumed.steps == 3 and resumed.switched_at == 1 and resumed.logs == [1.0, 2.0]
    for k, v in resumed.averaged_state_dict().items():
        torch.testing.assert_close(v, expect[k], rtol=0, atol=0)


def test_step_learning_rate_is_rescaled() -> None:
    model = _model()
    nt = NTASGD(model, lr=0.5)
    w0 = model.weight.detach().clone()
    _sgd_step(nt, model, 0, lr_scale=0.3)
    assert model.weight.grad is not None
    torch.testing.assert_close(model.weight.detach(), w0 - 0.5 * 0.3 * model.weight.grad, rtol=0, atol=1e-15)
    assert nt.lr == 0.5 and nt.optimizer.param_groups[0]["lr"] == pytest.approx(0.15)
    assert scaled_lr(30.0, 35, 70) == 15.0 and scaled_lr(30.0, 77, 70) == pytest.approx(33.0)


class _ScriptedRng(random.Random):
    def __init__(self, uniform: float, normal_offset: float) -> None:
        super().__init__(0)
        self.u, self.offset = uniform, normal_offset

    def random(self) -> float:
        return self.u

    def gauss(self, mu: float = 0.0, sigma: float = 1.0) -> float:
        assert sigma == 5.0
        return mu + self.offset


def test_sequence_length_rule() -> None:
    assert sample_seq_len(70, _ScriptedRng(0.5, 2.7)) == 72  # p = 0.95: base 70, then N(70, 5), truncated
    assert sample_seq_len(70, _ScriptedRng(0.96, 0.0)) == 35  # else base 35
    assert sample_seq_len(70, _ScriptedRng(0.96, -40.0)) == 5  # at least 5
    assert sample_seq_len(70, _ScriptedRng(0.5, 30.0), max_len=80) == 80
    rng = random.Random(0)
    draws = [sample_seq_len(70, rng) for _ in range(4000)]
    half = sum(d < 52 for d in draws) / len(draws)  # the bptt/2 branch: 35 +- 5 never reaches 52, 70 +- 5 rarely
    assert 0.035 < half < 0.065
    assert min(draws) >= 5 and 68 < sum(d for d in draws if d >= 52) / sum(d >= 52 for d in draws) < 70


def test_bptt_chunks_tile_the_stream_with_rescaled_lr() -> None:
    chunks = list(bptt_chunks(1000, 70, random.Random(1)))
    starts = [s for s, _, _ in chunks]
    assert starts[0] == 0 and all(s + n == nxt for (s, n, _), nxt in zip(chunks, starts[1:], strict=False))
    assert chunks[-1][0] + chunks[-1][1] == 999  # the last input predicts the last token
    assert all(scale == n / 70 for _, n, scale in chunks)
    assert all(n >= 5 for _, n, _ in chunks[:-1])
    assert chunks == list(bptt_chunks(1000, 70, random.Random(1)))  # seeded: reproducible


def test_awd_lstm_learns_under_ntasgd_with_variable_bptt() -> None:
    """The pieces together, as train.py will wire them: variable-length chunks, AR/TAR through `loss`, clipping,
    SGD at lr * seq_len / bptt, the trigger on the validation loss, evaluation with the average, fine-tuning."""
    from models.awd_lstm import AWDLSTM, AWDLSTMConfig

    torch.manual_seed(0)
    model = AWDLSTM(AWDLSTMConfig(vocab_size=7, emb_size=8, hidden_size=16, layers=2, dropout=0.1, dropouth=0.1,
                                  dropouti=0.1, dropoute=0.0, wdrop=0.2, alpha=0.1, beta=0.1)).train()
    stream = torch.arange(400).remainder(7).view(1, -1)  # (1, N) 0 1 2 ... 6 0 1 ...: each token predicts the next
    valid = stream[:, :50]
    nt = NTASGD(model, lr=20.0, nonmono=3, interval=20)

    def valid_loss() -> float:
        model.eval()
        with torch.no_grad():
            out = model(valid[:, :-1], model.init_state(1))
            loss = float(model.loss(out, valid[:, 1:]))
        model.train()
        return loss

    def epoch(rng: random.Random) -> None:
        state = model.init_state(1)
        for start, n, scale in bptt_chunks(stream.shape[1], 20, rng, std=2.0, min_len=3):
            out = model(stream[:, start:start + n], state)
            state = out.state.detach()
            nt.zero_grad()
            model.loss(out, stream[:, start + 1:start + 1 + n]).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.25)
            nt.step(scale)
            if nt.check_due():
                with nt.averaged():
                    nt.check(valid_loss())

    # one thread: with a model this small several threads contend and the test takes 10x longer (tests/_training.py)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        first = valid_loss()  # ~ ln 7
        rng = random.Random(0)
        for _ in range(6):
            epoch(rng)
        assert len(nt.logs) >= 5
        with nt.averaged():
            trained = valid_loss()
        assert trained < 0.5 * first, (first, trained)
        nt.restart()  # fine-tuning: averaging from here on
        epoch(rng)
        tuned = nt.averaged_state_dict()
        with nt.averaged():
            assert all(torch.equal(p, tuned[k]) for k, p in model.named_parameters())
            assert valid_loss() < 0.5 * first
    finally:
        torch.set_num_threads(threads)
