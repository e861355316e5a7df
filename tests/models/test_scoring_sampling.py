import itertools
import math

import pytest
import torch

from models.awd_lstm import AWDLSTM, AWDLSTMConfig
from models.base import Output
from models.mlstm import MLSTM, MLSTMConfig
from models.sampling import SamplingParams, Step, Stepper, TextDecoder, filter_logits, generate, sample_next
from models.scoring import BOS, score_bytes
from models.tokenizer import ByteTokenizer, WordTokenizer
from tests._families import assert_batched_steppers_equal_each_alone, assert_states_close


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
    second = score_bytes(model, b, state=first.state, last_token=a[-1])
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


def decode_all(decoder: TextDecoder, data: bytes) -> list[str]:
    return [decoder.push(bytes([b]), final=i == len(data) - 1) for i, b in enumerate(data)]


def test_decoder_never_splits_a_character() -> None:
    data = "a✓🙂b".encode()
    pieces = decode_all(TextDecoder(), data)
    assert "".join(pieces) == "a✓🙂b"
    assert pieces == ["a", "", "", "✓", "", "", "", "🙂", "b"]


def test_decoder_replaces_invalid_bytes() -> None:
    assert "".join(decode_all(TextDecoder(), b"a\xff\xe2\x28b\xe2\x9c")) == "a\ufffd\ufffd(b\ufffd"


def test_decoder_holds_text_that_may_start_a_stop_string() -> None:
    decoder = TextDecoder(["xyz", "é!"])  # holds back len("xyz") - 1 = 2 characters
    assert decoder.push(b"ab") == ""
    assert decoder.push(b"x") == "a"
    assert decoder.push(b"y") == "b"
    assert decoder.push(b"q") == "x"  # "xyq": not "xyz" after all
    assert decoder.push("é".encode()[:1]) == ""  # half a character
    assert decoder.push("é".encode()[1:]) == "y"
    assert decoder.push(b"!tail") == "q"  # "é!" completed: the text before it, then nothing more
    assert decoder.stopped and decoder.push(b"more", final=True) == ""


def test_decoder_offsets_point_at_characters() -> None:
    decoder = TextDecoder()
    offsets = []
    for b in "aé✓b".encode():
        offsets.append(decoder.chars)
        decoder.push(bytes([b]))
    assert offsets == [0, 1, 1, 2, 2, 2, 3]


def test_stepper_prefill_logprobs_equal_scoring(model: MLSTM) -> None:
    data = "Hello, wörld".encode()
    stepper = Stepper(model, SamplingParams(max_tokens=3))
    scored = stepper.prefill(data, logprobs=3, chunk=5)
    assert scored is not None
    # float32 in chunks of 5 against one pass: a few ulps apart, depending on the CPU's kernels
    assert scored.logprobs == pytest.approx(score_bytes(model, data, logprobs=True).logprobs, abs=1e-5)
    for lp, top in zip(scored.logprobs, scored.top, strict=True):
        assert len(top) == 3 and top[0][1] >= top[1][1] >= top[2][1] and lp <= top[0][1]


def test_stepper_steps_and_finishes(model: MLSTM) -> None:
    params = SamplingParams(max_tokens=10, seed=3)
    stepper = Stepper(model, params)
    stepper.prefill(b"ab")
    steps = []
    while stepper.finish_reason is None:
        steps.append(stepper.step())
    assert len(steps) == stepper.tokens == 10 and stepper.finish_reason == "length"
    assert "".join(s.text for s in steps) == "".join(generate(model, b"ab", params))
    assert bytes(s.token for s in steps).decode("utf-8", errors="replace") == "".join(s.text for s in steps)


def test_a_fork_is_a_fresh_sequence_from_the_same_prompt(model: MLSTM) -> None:
    first = Stepper(model, SamplingParams(max_tokens=15, seed=1))
    first.prefill(b"The ")
    forked = first.fork(SamplingParams(max_tokens=15, seed=2))
    text = "".join(first.step().text for _ in range(15))
    assert text == "".join(generate(model, b"The ", SamplingParams(max_tokens=15, seed=1)))
    other = "".join(forked.step().text for _ in range(15))
    assert other == "".join(generate(model, b"The ", SamplingParams(max_tokens=15, seed=2)))


def test_feed_many_equals_feeding_each(model: MLSTM) -> None:
    """Several sequences, with adapters of different sizes or none, in one batched step."""
    from models.base import Adapter

    g = torch.Generator().manual_seed(3)
    adapters = [None, Adapter({"h": 0.1 * torch.randn(1, 4, 4, generator=g)}),
                Adapter({"h": 0.1 * torch.randn(1, 16, 16, generator=g)})]
    prompts = [b"one", b"the second", b"3"]

    def steppers() -> list[Stepper]:
        out = []
        for prompt, adapter in zip(prompts, adapters, strict=True):
            s = Stepper(model, SamplingParams(max_tokens=50, seed=1), adapter=adapter)
            s.prefill(prompt)
            out.append(s)
        return out

    assert_batched_steppers_equal_each_alone(steppers, 6, rtol=1e-5, atol=1e-6)
    batched = steppers()
    with pytest.raises(ValueError, match="one token per stepper"):
        Stepper.feed_many(batched, [1])


def test_feed_many_steps_the_last_batch_when_the_sequences_come_again(model: MLSTM,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """The same sequences in the same order step the last step's batch state itself (no stack of their rows); in
    another order, fewer of them, or one of them fed alone in between, their rows are stacked again; each sequence's
    state is its row throughout."""
    from models.base import State

    def steppers() -> list[Stepper]:
        out = []
        for prompt in (b"one", b"the second", b"3"):
            s = Stepper(model, SamplingParams(max_tokens=50, seed=1))
            s.prefill(prompt)
            out.append(s)
        return out

    batched, single = steppers(), steppers()
    stacks = []
    stack = State.stack
    monkeypatch.setattr(State, "stack", staticmethod(lambda states: stacks.append(len(states)) or stack(states)))
    for order in ([0, 1, 2], [0, 1, 2], [0, 1, 2], [2, 0, 1], [2, 0, 1], [0, 1], "alone 1", [0, 1], [0, 1]):
        if order == "alone 1":
            batched[1].feed(7)
            single[1].feed(7)
            continue
        Stepper.feed_many([batched[i] for i in order], [5] * len(order))
        for i in order:
            single[i].feed(5)
        for a, b in zip(batched, single, strict=True):
            torch.testing.assert_close(a._logits, b._logits, rtol=1e-5, atol=1e-6)
    assert stacks == [3, 3, 2, 2]  # the first step, a new order, fewer sequences, one fed alone in between
    for a, b in zip(batched, single, strict=True):
        assert_states_close(a._state, b._state, rtol=1e-5, atol=1e-6)


def test_generating_through_the_served_wrappers_leaves_the_network_in_its_mode() -> None:
    """The server's wrapper (MemoryMixed, with a neural cache, a copy model or both) takes its network's mode when it
    is made: `generate` and `score_bytes` put the model they are given back in its mode, which for a wrapper made in
    training mode (a new module's) put a network in eval mode into training mode (dropout on, the transformers'
    branch form off)."""
    from models.adaptation import CacheConfig, CacheMemory
    from models.copymodel import CopyConfig, CopyMemory, CopyModel
    from models.memory import MemoryMixed

    net = MLSTM(MLSTMConfig(hidden=16, embed_dim=8)).eval()
    cache, copy = CacheMemory(CacheConfig()), CopyMemory(CopyModel(CopyConfig()))
    for wrapper in (MemoryMixed(net, [cache]), MemoryMixed(net, [copy]), MemoryMixed(net, [copy, cache])):
        assert not wrapper.training
        "".join(generate(wrapper, "ab", SamplingParams(max_tokens=3, temperature=0.0)))
        score_bytes(wrapper, b"abc")
        assert not net.training and not wrapper.training


# -- a word model: token healing and the unknown word ----------------------------------------------------------------

WORD_TEXT = ("there was a thing, this and that; I think things. I don't know. They don't, don't they?  Two spaces.\n"
             "   Indented. Then there the them then. A cat, a dog and a bird.\n")


@pytest.fixture(scope="module")
def words() -> tuple[AWDLSTM, WordTokenizer]:
    tok = WordTokenizer.build([WORD_TEXT])
    torch.manual_seed(0)
    model = AWDLSTM(AWDLSTMConfig(vocab_size=tok.vocab_size, emb_size=8, hidden_size=16, layers=2)).eval()
    return model, tok


def word_steps(model: AWDLSTM, tok: WordTokenizer, prompt: str, params: SamplingParams) -> list[Step]:
    stepper = Stepper(model, params, tokenizer=tok)
    stepper.prefill(prompt.encode())
    steps = []
    while stepper.finish_reason is None:
        steps.append(stepper.step())
    return steps


def after(model: AWDLSTM, tok: WordTokenizer, text: bytes) -> torch.Tensor:
    """(V,) log-probs of the next token after `text`, from the stream's start (a reference: one plain forward)."""
    inputs = torch.tensor([[tok.bos, *tok.encode(text)]])
    return torch.log_softmax(model(inputs, model.init_state(1)).logits[0, -1].float(), -1)


@pytest.mark.parametrize("prompt", ["there was a ", "there was a thi", "I don'", "a  ", "Two spaces.  T", "ther"])
def test_a_word_prompt_is_healed_and_continued_as_typed(words: tuple[AWDLSTM, WordTokenizer], prompt: str) -> None:
    """The prompt's held-back end is not read: the first token is the best one, after the rest of the prompt, of
    those that continue it as typed; the text generated is what the tokens add past it, so that the prompt plus
    the text is the rest of the prompt plus the tokens' text."""
    model, tok = words
    kept, held = tok.heal(prompt.encode())
    assert held
    steps = word_steps(model, tok, prompt, SamplingParams(max_tokens=6, temperature=0))
    allowed = tok.continuing(held)
    expected = allowed[after(model, tok, kept)[allowed].argmax()]
    assert steps[0].token == expected and steps[0].held == held
    assert bool(torch.isinf(steps[0].logits).sum() == tok.vocab_size - allowed.numel())  # logprobs among them
    ids = [s.token for s in steps]
    text = "".join(s.text for s in steps)
    assert prompt + text == (kept + tok.decode_bytes(ids)).decode()
    assert b"".join(s.data for s in steps) == text.encode()
    for seed in range(5):  # sampled: the same
        steps = word_steps(model, tok, prompt, SamplingParams(max_tokens=4, seed=seed))
        assert prompt + "".join(s.text for s in steps) == (kept + tok.decode_bytes([s.token for s in steps])).decode()


def test_a_prompt_that_needs_no_healing_is_read_whole(words: tuple[AWDLSTM, WordTokenizer]) -> None:
    model, tok = words
    for prompt in ("I think things.", "a zyzzy", "Then\n"):
        assert tok.heal(prompt.encode())[1] == b""
        [step] = word_steps(model, tok, prompt, SamplingParams(max_tokens=1, temperature=0))
        known = after(model, tok, prompt.encode())
        torch.testing.assert_close(step.logits, known, rtol=1e-5, atol=1e-5)
        known[list(tok.unknown)] = -math.inf
        assert step.token == int(known.argmax())
        assert step.held == b"" and step.data == tok.token_bytes(step.token)


def test_healed_prompt_logprobs_score_the_prompt_as_written(words: tuple[AWDLSTM, WordTokenizer]) -> None:
    model, tok = words
    for prompt, chunk in itertools.product(("I don'", "there was a thi", "a  ", "ther", "I said: I don'"), (2, 1024)):
        stepper = Stepper(model, SamplingParams(max_tokens=3), tokenizer=tok)
        scored = stepper.prefill(prompt.encode(), logprobs=2, chunk=chunk)
        assert scored is not None and len(scored.logprobs) == len(tok.encode(prompt))
        expected = score_bytes(model, prompt.encode(), logprobs=True, tokenizer=tok).logprobs
        assert scored.logprobs == pytest.approx(expected, abs=1e-5)
        # the held tokens are only scored: generation reads the prompt without them
        kept = tok.heal(prompt.encode())[0]
        torch.testing.assert_close(stepper._logits, after(model, tok, kept), rtol=1e-5, atol=1e-5)


def test_a_fork_continues_the_same_held_text(words: tuple[AWDLSTM, WordTokenizer]) -> None:
    model, tok = words
    first = Stepper(model, SamplingParams(max_tokens=4, seed=1), tokenizer=tok)
    first.prefill(b"there was a thi")
    forked = first.fork(SamplingParams(max_tokens=4, seed=2))
    other = [forked.step() for _ in range(4)]
    assert [s.token for s in other] == [s.token for s in word_steps(model, tok, "there was a thi",
                                                                    SamplingParams(max_tokens=4, seed=2))]
    assert other[0].held == b" thi"


def test_the_unknown_word_is_never_sampled_but_still_scored(words: tuple[AWDLSTM, WordTokenizer],
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """<unk> made the most likely token by far: greedy takes the best known token, sampling renormalises over the
    known ones; the step's log-probs (what logprobs report) keep the model's own, <unk> included."""
    model, tok = words
    plain = model.log_probs

    def unk_heavy(output: Output) -> torch.Tensor:
        boost = torch.zeros(tok.vocab_size)
        boost[list(tok.unknown)] = 20.0
        return torch.log_softmax(plain(output) + boost, dim=-1)

    monkeypatch.setattr(model, "log_probs", unk_heavy)
    for params in (SamplingParams(max_tokens=20, temperature=0), SamplingParams(max_tokens=20, seed=4),
                   SamplingParams(max_tokens=20, seed=5, top_k=3, top_p=0.5)):
        for prompt in ("I think things.", "there was a "):
            steps = word_steps(model, tok, prompt, params)
            assert not {s.token for s in steps} & set(tok.unknown)
            assert "<unk>" not in "".join(s.text for s in steps)
            unheld = [s for s in steps if not s.held]
            assert unheld and all(int(s.logits.argmax()) in tok.unknown for s in unheld)
            if params.temperature == 0:
                for s in unheld:
                    known = s.logits.clone()
                    known[list(tok.unknown)] = -math.inf
                    assert s.token == int(known.argmax())


def test_byte_generation_is_plain_sampling_of_the_raw_logits(model: MLSTM) -> None:
    """Bytes: nothing to heal, nothing masked: the steps are the model's raw logits through `sample_next` with the
    seeded generator, the text their bytes (a reference loop, not the Stepper)."""
    for prompt in (b"there was a ", b"there was a thi", b"caf\xc3", b" "):
        for params in (SamplingParams(max_tokens=12, temperature=0), SamplingParams(max_tokens=12, seed=3),
                       SamplingParams(max_tokens=12, seed=4, temperature=0.7, top_k=20, top_p=0.9)):
            assert ByteTokenizer().heal(prompt) == (prompt, b"")
            generator = torch.Generator().manual_seed(params.seed) if params.seed is not None else None
            state = model.init_state(1)
            out = model(torch.tensor([[BOS, *prompt]]), state)
            expected = []
            for _ in range(params.max_tokens):
                token = sample_next(model.log_probs(out)[0, -1], params, generator)
                expected.append(token)
                out = model(torch.tensor([[token]]), out.state)
            stepper = Stepper(model, params)
            stepper.prefill(prompt)
            got = [stepper.step() for _ in range(params.max_tokens)]
            assert [s.token for s in got] == expected
            assert b"".join(s.data for s in got) == bytes(expected) and all(s.held == b"" for s in got)
