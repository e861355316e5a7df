"""Sampling: temperature, top-k and nucleus (top-p) sampling of bytes, decoded incrementally to text.

`Stepper` generates one sequence a token at a time: `prefill(prompt)` once, then `step()` per byte.
A step is two halves, `sample()` (no model call) and `feed(token)` (one model step), so that a server
can check for cancellation between tokens, interleave sequences, or run the model steps of many
sequences as one batched forward. `generate` is the plain loop over a `Stepper`.

A word model's generation (docs/architecture.md, "Word-level models"): the prompt's last tokens whose cut may move
with what follows are held back and continued as typed (token healing, `Stepper.prefill`), and the unknown word is
never sampled (masked before temperature, top-k and top-p; its log-probabilities stay in `Step.logits`). A byte
model's has neither: no byte is held, no token masked.
"""

from __future__ import annotations

import codecs
import math
from collections.abc import Generator, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Literal

import torch

from models.base import Adapter, LanguageModel, State
from models.tokenizer import ByteTokenizer, Tokenizer

__all__ = [
    "FinishReason", "SamplingParams", "Step", "Stepper", "TextDecoder", "TopLogprobs", "filter_logits",
    "generate", "sample_next", "top_logprobs",
]

FinishReason = Literal["length", "stop"]


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 200
    temperature: float = 1.0  # 0: greedy
    top_k: int = 0  # 0: off
    top_p: float = 1.0  # 1: off
    seed: int | None = None
    stop: tuple[str, ...] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError("max_tokens must be at least 1")
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise ValueError("temperature must be a finite number >= 0")
        if self.top_k < 0:
            raise ValueError("top_k must be >= 0")
        if not (0 < self.top_p <= 1):
            raise ValueError("top_p must be in (0, 1]")
        if any(not s for s in self.stop):
            raise ValueError("stop strings must not be empty")


def filter_logits(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """logits: (V,) -> log-weights (V,) float64 with filtered entries at -inf; temperature > 0. In float64 (the
    type of the parameters themselves) and shifted to a maximum of 0, every finite temperature divides without
    overflow or 0/0: 5e-324 leaves the most likely tokens at 0 and the rest at -inf (greedy, its limit), 1e308
    gives every allowed token 0 (uniform) and keeps the disallowed at -inf."""
    logits = logits.double()
    logits = (logits - logits.max()) / temperature
    if top_k and top_k < logits.numel():
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, -math.inf)
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        drop = probs.cumsum(-1) - probs >= top_p  # keep the smallest set reaching top_p
        drop[0] = False  # and always the most likely token (a top_p below the first's rounding error keeps it)
        logits = logits.masked_fill(torch.zeros_like(drop).scatter(0, order, drop), -math.inf)
    return logits


def sample_next(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
    """logits: (V,) -> one token id. ValueError where the logits hold no distribution (`draw_next`)."""
    return drawn_token(int(draw_next(logits, params, generator)))


def draw_next(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> torch.Tensor:
    """`sample_next`'s token as a 0-d tensor where the logits are: not read back yet (a GPU does not wait for it).
    -1 where the logits hold no distribution to draw from (a NaN, a +inf, no finite entry): `drawn_token` refuses it
    once read back, so the check costs no read of its own."""
    if params.temperature == 0:
        token = torch.argmax(logits)  # a NaN's index where there is one
        ok = torch.isfinite(logits.take(token))
    else:
        weights = torch.softmax(filter_logits(logits, params.temperature, params.top_k, params.top_p), dim=-1)
        # torch.multinomial's draw of one sample, argmax of p / q with q ~ Exp(1) from `generator` (the same token for
        # the same generator: tests/models/test_step_counts.py), without its check of p, which reads the check's
        # result back from the device. These weights are a softmax's: invalid only as NaNs (from a NaN or +inf logit,
        # or none finite), one of which is then the argmax, so the token's own weight tells
        q = torch.empty_like(weights).exponential_(1, generator=generator)
        token = torch.argmax(weights / q)
        ok = weights.take(token) > 0
    return torch.where(ok, token, -1)


def drawn_token(token: int) -> int:
    """A token `draw_next` drew, read back: ValueError for its -1, the logits' lack of any distribution."""
    if token < 0:
        raise ValueError("no token to sample: the model's next-token distribution is not finite (NaN or infinite "
                         "logits)")
    return token


@dataclass
class TopLogprobs:
    """Per token: its natural-log probability, and the k most likely tokens `(id, logprob)` at its position,
    most likely first."""

    logprobs: list[float] = field(default_factory=list)
    top: list[list[tuple[int, float]]] = field(default_factory=list)

    def extend(self, other: TopLogprobs) -> None:
        self.logprobs += other.logprobs
        self.top += other.top


def top_logprobs(logits: torch.Tensor, targets: torch.Tensor, k: int) -> TopLogprobs:
    """logits: (T, V), targets: (T,) -> each target's natural-log probability under the raw (unfiltered,
    temperature 1) distribution, and the k most likely tokens with theirs, most likely first (at most those whose
    logit is not -inf)."""
    logp = torch.log_softmax(logits.float(), dim=-1)  # (T, V), as scoring computes it
    chosen = logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)  # (T,)
    top = torch.topk(logp, min(k, logp.shape[-1]), dim=-1) if k else None  # (T, k)
    ids: list[list[int]] = top.indices.tolist() if top is not None else [[] for _ in range(targets.numel())]
    lps: list[list[float]] = top.values.tolist() if top is not None else [[] for _ in range(targets.numel())]
    # logits at -inf (the tokens a healed position does not allow) are no alternatives
    return TopLogprobs(chosen.tolist(), [[(t, lp) for t, lp in zip(i, v, strict=True) if lp != -math.inf]
                                         for i, v in zip(ids, lps, strict=True)])


class TextDecoder:
    """Bytes in, text out, for one generated sequence.

    UTF-8 is decoded incrementally: a multibyte character comes out whole once its last byte is in, and
    invalid bytes become U+FFFD. Text that may still begin a stop string is held back; once a stop string
    is complete, the text before it comes out and the decoder is `stopped` (the stop string never comes out).
    """

    def __init__(self, stop: Sequence[str] = ()) -> None:
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._stop = tuple(stop)
        # An occurrence completed by a new character starts at most len(stop) - 1 characters before it.
        self._hold = max((len(s) for s in self._stop), default=1) - 1
        self._pending = ""  # decoded, not yet given out
        self.chars = 0  # characters decoded so far, given out or pending
        self.stopped = False

    def push(self, data: bytes, *, final: bool = False) -> str:
        """Decode `data`; returns the text that is now safe to give out (often empty)."""
        if self.stopped:
            return ""
        new = self._decoder.decode(data, final)
        self.chars += len(new)
        self._pending += new
        hits = [i for s in self._stop if (i := self._pending.find(s)) >= 0]
        if hits:
            self.stopped = True
            out, self._pending = self._pending[: min(hits)], ""
            return out
        n = len(self._pending) - (0 if final else self._hold)
        if n <= 0:
            return ""
        out, self._pending = self._pending[:n], self._pending[n:]
        return out


@dataclass(frozen=True)
class Step:
    token: int
    text: str  # text that became safe to give out with this byte (may be empty)
    offset: int  # index in the generated text of the character this byte starts or continues
    # (V,) the raw log-probabilities the token was sampled from (before temperature, top-k, top-p and the unknown
    # word's mask); while the prompt's held-back text is continued, -inf outside the tokens allowed there
    logits: torch.Tensor
    data: bytes = b""  # the bytes the token adds to the generated text: its own, past `held`
    held: bytes = b""  # the prompt's held-back text still to generate when the token was sampled (token healing)


class Stepper:
    """Generates one sequence token by token: `prefill(prompt)` once, then `step()` until `finish_reason`.

    The model must be in eval mode. Nothing here touches the shared module's state; the recurrent state,
    the random generator and the decoder belong to this object.
    """

    def __init__(self, model: LanguageModel, params: SamplingParams, *, state: State | None = None,
                 last_token: int | None = None, adapter: Adapter | None = None,
                 tokenizer: Tokenizer | None = None) -> None:
        self.model = model
        # a byte model's tokens are bytes; a word model's are its vocabulary's words (their text is what decodes)
        self.tokenizer = tokenizer or ByteTokenizer()
        self.params = params
        self.adapter = adapter
        self.device = next(model.parameters()).device
        self._generator = torch.Generator(device=self.device)
        if params.seed is not None:
            self._generator.manual_seed(params.seed)
        else:
            self._generator.seed()
        # the model's branch form: a state continued a token at a time keeps what it had and adds the new tokens' part
        # (a transformer's memory is not shifted and copied at every token)
        self._own: State = model.branch(state if state is not None else model.init_state(1))
        # after `feed_many`: this sequence's state is row b of that step's batch (selected when needed; the next
        # `feed_many` of the same sequences in the same order steps the batch itself, not a stack of the rows)
        self._row: tuple[State, int] | None = None
        self._last_token = self.tokenizer.bos if last_token is None else last_token  # the token the prompt follows
        self._logits: torch.Tensor | None = None  # (V,) log-probs of the next byte, once prefilled (model.log_probs)
        self.decoder = TextDecoder(params.stop)
        self.tokens = 0  # bytes sampled so far
        self.finish_reason: FinishReason | None = None
        # the end of the prompt that token healing held back (`prefill`), less what sampled tokens have covered
        self._held = b""
        unknown = self.tokenizer.unknown  # never sampled
        self._unknown = _on(self.device, unknown) if unknown else None

    @property
    def _state(self) -> State:
        """This sequence's state: its row of the last `feed_many`'s batch, selected now if it was one."""
        if self._row is not None:
            batch, b = self._row
            self._own, self._row = batch.select(b), None
        return self._own

    @_state.setter
    def _state(self, state: State) -> None:
        self._own, self._row = state, None

    def prefill(self, prompt: bytes, *, logprobs: int | None = None, chunk: int = 1024) -> TopLogprobs | None:
        """Run the prompt (after the last token of the state); with `logprobs` = k, also return every prompt
        token's log-probability and the top k at its position (the first token's is conditioned on the BOS token).

        Token healing: the prompt's last tokens whose cut may move with what follows (`Tokenizer.heal`: a word
        model's trailing " ", a word cut short; never a byte) are held back. The model reads the prompt without them,
        and the first tokens sampled must continue them as typed (`Tokenizer.continuing`); the generated text is
        what they add past the held-back text, so the prompt plus it is the text generated. The held tokens are
        still scored as written."""
        chunks = self.prefill_chunks(prompt, logprobs=logprobs, chunk=chunk)
        while True:
            try:
                next(chunks)
            except StopIteration as end:
                scored: TopLogprobs | None = end.value
                return scored

    @torch.no_grad()
    def prefill_chunks(self, prompt: bytes, *, logprobs: int | None = None,
                       chunk: int = 1024) -> Generator[None, None, TopLogprobs | None]:
        """`prefill`, one model call of at most `chunk` tokens at a time: it yields between two, so that its caller
        may do other work, or stop, there (a server reading a long prompt); it returns `prefill`'s answer."""
        if self._logits is not None:
            raise RuntimeError("prefill runs once")
        ids = self.tokenizer.encode_tensor(prompt, self.device)  # (T,) the prompt as written
        _, held = self.tokenizer.heal(prompt)
        n = ids.numel() - len(self.tokenizer.encode(held)) if held else ids.numel()  # the tokens read
        context = torch.cat([_on(self.device, [self._last_token]), ids[:n]])  # (n+1,) the token before, then those
        scored = TopLogprobs() if logprobs is not None else None
        state = self._state
        for start in range(0, context.numel(), chunk):
            if start:
                yield
            out = self.model(context[start : start + chunk].unsqueeze(0), state, self.adapter)  # logits (1, t, V)
            state = out.state
            # (t,): the tokens they predict, up to the first held one; (t-1,) in the last chunk unhealed
            targets = ids[start : min(start + chunk, n + 1)]
            if scored is not None and targets.numel():
                scored.extend(top_logprobs(self.model.log_probs(out)[0, : targets.numel()], targets, logprobs or 0))
        self._state, self._logits = state, self.model.log_probs(out)[0, -1]  # log-probs: the model's distribution
        if scored is not None and ids.numel() - n > 1:  # the held tokens after the first, read on a copy
            copy = State({k: v.clone() for k, v in state.tensors.items()}, state.roots)
            rest = self.model(ids[n:-1].unsqueeze(0), copy, self.adapter)  # logits (1, T-n-1, V)
            scored.extend(top_logprobs(self.model.log_probs(rest)[0], ids[n + 1 :], logprobs or 0))
        self._held = held
        return scored

    def fork(self, params: SamplingParams) -> Stepper:
        """A second sequence from the same prefilled prompt, with its own parameters (seed, stops)."""
        if self._logits is None or self.tokens:
            raise RuntimeError("fork after prefill and before the first step")
        # the roots of a branch form are never changed in place: shared, not copied
        state = State({k: v.clone() for k, v in self._state.tensors.items()}, self._state.roots)
        other = Stepper(self.model, params, state=state, adapter=self.adapter, tokenizer=self.tokenizer)
        other._logits, other._held = self._logits, self._held
        return other

    @torch.no_grad()
    def sample(self) -> Step:
        """Sample the next byte from the held logits and decode it; no model call."""
        drawn = self.draw()
        return self.take(int(drawn[0]), drawn)

    @torch.no_grad()
    def draw(self) -> tuple[torch.Tensor, torch.Tensor]:
        """`sample`'s first half: the next token as a 0-d tensor where the logits are (not read back: a server reads
        the tokens of all its sequences together, one wait for the device, and hands each to `take`), and the logits
        it was drawn from. Each sequence draws from its own generator: the tokens do not depend on the grouping."""
        if self._logits is None:
            raise RuntimeError("prefill before sampling")
        if self.finish_reason is not None:
            raise RuntimeError("the sequence is finished")
        logits = held_logits = self._logits  # (V,)
        held = self._held
        if held:  # only the tokens that continue the held-back text as typed
            allowed = self.tokenizer.continuing(held).to(self.device, non_blocking=True)  # (n,)
            held_logits = torch.full_like(logits, -math.inf).index_copy_(0, allowed, logits[allowed])  # (V,)
        weights = held_logits
        if self._unknown is not None:  # never write the unknown word; renormalised by the sampling's softmax
            weights = weights.index_fill(0, self._unknown, -math.inf)  # (V,)
        return draw_next(weights, self.params, self._generator), held_logits

    def take(self, token: int, drawn: tuple[torch.Tensor, torch.Tensor]) -> Step:
        """`sample`'s second half: the token `draw` drew (read back: `token`) decoded; no model call. ValueError for a
    token drawn from no distribution (`draw_next`)."""
        token = drawn_token(token)
        held_logits = drawn[1]
        held = self._held
        data = self.tokenizer.token_bytes(token)
        self._held = held[len(data):]  # b"" once a token covers it (or was never held)
        data = data[len(held):]  # past the held text (b"" for a token that covers a start of it)
        offset = self.decoder.chars
        self.tokens += 1
        last = self.tokens == self.params.max_tokens
        text = self.decoder.push(data, final=last)
        if self.decoder.stopped:
            self.finish_reason = "stop"
        elif last:
            self.finish_reason = "length"
        return Step(token, text, offset, held_logits, data, held)

    @torch.no_grad()
    def feed(self, token: int) -> None:
        """One model step on `token`: the logits of the byte after it."""
        out = self.model(_on(self.device, [token]).unsqueeze(0), self._state, self.adapter)  # (1, 1, V)
        self._state, self._logits = out.state, self.model.log_probs(out)[0, -1]

    @staticmethod
    @torch.no_grad()
    def feed_many(steppers: Sequence[Stepper], tokens: Sequence[int]) -> None:
        """`feed` for several sequences of one model, in one batched forward: their states are stacked and their
        adapters zero-padded to the largest (`Adapter.stack_padded`); each gets its own state and logits back."""
        if len(steppers) != len(tokens):
            raise ValueError("one token per stepper")
        if len(steppers) == 1:
            steppers[0].feed(tokens[0])
            return
        if not steppers:
            return
        model = steppers[0].model
        if any(s.model is not model for s in steppers):
            raise ValueError("feed_many needs steppers of one model")
        last = steppers[0]._row[0] if steppers[0]._row is not None else None
        if last is not None and last.batch == len(steppers) and all(
                s._row is not None and s._row[0] is last and s._row[1] == b for b, s in enumerate(steppers)):
            state = last  # the same sequences as the last step's, in its order
        else:
            state = State.stack([s._state for s in steppers])
        adapter = Adapter.stack_padded([s.adapter for s in steppers])
        x = _on(steppers[0].device, tokens).unsqueeze(1)  # (B, 1)
        out = model(x, state, adapter)  # logits (B, 1, V)
        lps = model.log_probs(out)  # (B, 1, V)
        for b, s in enumerate(steppers):
            s._row, s._logits = (out.state, b), lps[b, -1]

    def step(self) -> Step:
        """Sample a byte and, unless the sequence is finished, feed it to the model."""
        step = self.sample()
        if self.finish_reason is None:
            self.feed(step.token)
        return step


def _on(device: torch.device, tokens: Sequence[int]) -> torch.Tensor:
    """Host token ids (B,) on `device` without waiting for its queue (a blocking copy to a GPU waits for it)."""
    return torch.tensor(list(tokens)).to(device, non_blocking=True)


def generate(model: LanguageModel, prompt: bytes, params: SamplingParams, *, state: State | None = None,
             last_token: int | None = None, adapter: Adapter | None = None,
             tokenizer: Tokenizer | None = None) -> Iterator[str]:
    """Yield decoded text pieces of the continuation of `prompt` (invalid UTF-8 becomes U+FFFD).

    Stops after max_tokens bytes or when a stop string appears (the stop string is not yielded).
    """
    was_training = model.training
    model.eval()
    try:
        stepper = Stepper(model, params, state=state, last_token=last_token, adapter=adapter, tokenizer=tokenizer)
        stepper.prefill(prompt)
        while stepper.finish_reason is None:
            if text := stepper.step().text:
                yield text
    finally:
        model.train(was_training)
