import math

import pytest
import torch

from models.mlstm import MLSTM, MLSTMConfig
from models.sampling import SamplingParams, filter_logits, generate
from models.scoring import BOS, score_bytes


@pytest.fixture(scope="module")
def model() -> MLSTM:
    torch.manual_seed(0)
    return MLSTM(MLSTMConfig(hidden=16, embed_dim=8)).eval()


def test_score_matches_manual_log_softmax(model: MLSTM) -> None:
    data = "Hello, wörld".encode()
    res = score_bytes(model, data, logprobs=True)
    inputs = torch.tensor([[BOS, *data[:-1]]])
    logp = torch.log_softmax(model(inputs, model.init_state(1)).logits[0].detach().double(), -1)
    manual = -sum(float(logp[t, b]) for t, b in enumerate(data)) / math.log(2)
    assert res.bytes == len(data)
    assert res.bits == pytest.approx(manual, rel=1e-5)
    assert res.bits_per_byte == pytest.approx(res.bits / res.bytes)
    assert res.logprobs is not None and len(res.logprobs) == len(data)
    assert -sum(res.logprobs) / math.log(2) == pytest.approx(res.bits, rel=1e-5)


def test_chunking_does_not_change_scores(model: MLSTM) -> None:
    data = bytes(range(200))
    assert score_bytes(model, data, chunk=7).bits == pytest.approx(score_bytes(model, data, chunk=1024).bits, rel=1e-6)


def test_continuation_from_state_equals_whole(model: MLSTM) -> None:
    a, b = b"first part, ", b"second part"
    first = score_bytes(model, a)
    second = score_bytes(model, b, state=first.state, last_byte=a[-1])
    assert first.bits + second.bits == pytest.approx(score_bytes(model, a + b).bits, rel=1e-6)


def test_empty_text_is_an_error(model: MLSTM) -> None:
    with pytest.raises(ValueError, match="empty"):
        score_bytes(model, b"")


def test_seeded_generation_is_reproducible_and_bounded(model: MLSTM) -> None:
    p = SamplingParams(max_tokens=40, temperature=1.0, seed=7)
    a = "".join(generate(model, b"The ", p))
    b = "".join(generate(model, b"The ", p))
    assert a == b
    assert len(a.encode("utf-8", errors="surrogatepass")) <= 40 * 3  # U+FFFD may stand for one byte


def test_greedy_is_argmax(model: MLSTM) -> None:
    text = "".join(generate(model, b"ab", SamplingParams(max_tokens=1, temperature=0)))
    logits = model(torch.tensor([[BOS, ord("a"), ord("b")]]), model.init_state(1)).logits[0, -1]
    assert text == bytes([int(logits.argmax())]).decode("utf-8", errors="replace")


def test_stop_string_cuts_output(model: MLSTM) -> None:
    full = "".join(generate(model, b"x", SamplingParams(max_tokens=60, temperature=0)))
    if len(full) < 10:
        pytest.skip("greedy output too short to place a stop string")
    stop = full[5:8]
    cut = "".join(generate(model, b"x", SamplingParams(max_tokens=60, temperature=0, stop=(stop,))))
    assert cut == full[: full.find(stop)]


def test_filters() -> None:
    logits = torch.tensor([3.0, 2.0, 1.0, 0.0])
    k2 = filter_logits(logits, 1.0, 2, 1.0)
    assert torch.isinf(k2[2:]).all() and torch.isfinite(k2[:2]).all()
    p = torch.softmax(logits, -1)  # [0.644, 0.237, 0.087, 0.032]
    top = filter_logits(logits, 1.0, 0, 0.7)  # 0.644 < 0.7, so the first two are kept
    assert torch.isfinite(top[:2]).all() and torch.isinf(top[2:]).all()
    assert float(p[0]) < 0.7
    only = filter_logits(logits, 1.0, 0, 0.5)
    assert torch.isfinite(only[0]) and torch.isinf(only[1:]).all()


@pytest.mark.parametrize("kw", [{"max_tokens": 0}, {"temperature": -1.0}, {"temperature": float("nan")},
                                {"top_p": 0.0}, {"top_p": 1.5}, {"top_k": -1}])
def test_bad_sampling_params(kw: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        SamplingParams(**kw)  # type: ignore[arg-type]
