"""A word model's keyboard suggestions for a session (`word_suggestions`): a word is one token, so one model step
gives the next word's distribution, and the ranking is exact (no search). The engine answers a word model's
keystrokes with it, and the in-process keyboard simulator (models/keysim.py) runs it too.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Protocol

import torch

from models.base import Adapter, LanguageModel, State
from models.session import Session, SessionModel
from models.suggest import SUGGEST_MIN_PROB, Completion, NextChar, Suggestions, takes_space
from models.word_tokenizer import WordTokenizer
from models.wordcache import WordCache, WordsMemory, WordsSettings

__all__ = ["WordStates", "word_suggestions"]

_CACHE_CANDIDATES = 64  # a word model's completions mixed with the session's word cache (the rest count 0)


class WordStates(Protocol):
    """What a session's earlier keystrokes computed (server/engine/_suggest.py `WordStateCache`): the model after a
    session record's view state and token ids, so that a letter typed within a word runs no model step and a space
    feeds only the words it settled."""

    def longest(self, session: Session, ids: Sequence[int]) -> tuple[int, State | None, torch.Tensor | None]:
        """-> (n, the state after ids[:n], the next token's log-probs (V,) there) for the longest ids[:n] kept for
        this record of the session; (0, None, None) if none."""

    def put(self, session: Session, ids: Sequence[int], state: State, logprobs: torch.Tensor) -> None:
        """Keep the state after `ids` and the next token's log-probs (V,) there."""


@torch.no_grad()
def word_suggestions(model: LanguageModel, tokenizer: WordTokenizer, session: Session, context: str, *, k: int,
                     n_chars: int, max_chars: int, sessions: SessionModel,
                     states: WordStates | None = None) -> Suggestions:
    """A word model's keyboard suggestions: one model step from the session (its text, then its pending text and
    the stable part of `context`: `WordTokenizer.split_stable`, and a punctuation mark or a gap before the word being
    typed: `split_typed`) gives the next word's distribution; the completions are the k most probable vocabulary
    entries that a keyboard may offer (`WordTokenizer.offered`: words, no whitespace or punctuation, that add
    1..max_chars characters) that start with the typed part (the word being typed with the single space before it,
    as the tokenizer writes a word after a space), each with its probability given the typed part (at least
    SUGGEST_MIN_PROB, as the byte search's): divided by the mass of the entries (but the specials: end of line,
    <unk>) that start with it, as a byte model's completions are conditioned on the context that holds it. `prefix`
    and each completion's `text` are the word without that space. `next_chars`: the characters that would follow
    the typed part, each with the summed probability (given the typed part, likewise) of the entries that continue
    with it, plus, when the typed part is itself an entry, its probability times that of each first character of
    the token after it (a second model step: " " for a next word, "," ...); with nothing typed, the first characters
    of the next token. No search: a word is one token, so the model's ranking is exact (`exact` is always true). The
    session's word cache (`cache_weight` > 0) is mixed in as for a byte model (models/wordcache.py), reading the
    pending text and the context; it also offers the words the session typed that the vocabulary lacks (a name,
    an address), which the model alone can only predict as <unk>; `next_chars` go on with them (`_cached_chars`).

    After a mark (`models.suggest.takes_space`: nothing typed, `context` ending in punctuation or a symbol, "Hi,")
    the next word may come directly ("(the": the unspaced entries, and the spaced words as <unk>) or after a space
    that the keyboard inserts: the spaced entries (" there", the tokenizer's token after "Hi,") are offered too, with
    their own probability given the same typed part (nothing), marked `space_before`, as the byte search offers
    them; the word cache's words split between the two kinds by the model's odds of a spaced word (`space_share`:
    the spaced words' and " <unk>"'s mass against the unspaced words' and "<unk>"'s)."""
    typing = session.pending + context.encode("utf-8")
    stable, tail = tokenizer.split_stable(typing)
    settled, typed = tokenizer.split_typed(tail)  # "  wo": "  " is settled before " wo"; "(": all of it
    stable += settled
    ids = [session.last_token, *tokenizer.encode(stable)]
    adapter = sessions.adapter(session)
    fed, last, calls = _after(model, session, ids, adapter, states, sessions)  # the state after ids
    logprobs = last.double().cpu()  # (V,)
    # the words (no end of line, no <unk>) that continue the typed part, in byte order: after a space, nearly the
    # whole vocabulary, so tensor work only (no Python pass over them)
    matching = tokenizer.ids_with_prefix(typed)
    probs = logprobs[matching].exp()  # (n,)
    # a word typed without the space before it (at a line's start, after "("): most words have only a spaced entry,
    # which the tokenizer writes there as <unk>, and they share its probability (`WordTokenizer.unspaced`)
    unspaced, shares = tokenizer.unspaced(typed) if not typed.startswith(b" ") else (matching[:0], probs[:0])
    unspaced_probs = math.exp(float(logprobs[tokenizer.unk])) * shares  # (m,)
    # P(word | text, the word starts so): the words that start so share the mass; the word cache's p_cache, mixed
    # with these, is conditioned so too
    typed_mass = float(probs.sum()) + float(unspaced_probs.sum())
    whole = tokenizer.token_id(typed) if typed else None  # the typed part as a token of its own, if it is one
    if whole is not None and tokenizer.is_special(whole):  # typed out (" <unk>"): not among the words
        typed_mass += math.exp(float(logprobs[whole]))
    norm = 1.0 / typed_mass if typed_mass > 0 else 0.0
    space = typed.startswith(b" ")
    prefix = (typed[1:] if space else typed).decode("utf-8", errors="ignore")
    # after a mark, the entries of the words after a space too (matching holds them: nothing is typed), marked
    spaced_words = torch.zeros_like(matching, dtype=torch.bool)  # (n,)
    space_share = 0.0
    if not typed and takes_space(context):
        spaced_words = tokenizer.offered(matching, b" ", max_chars)
        unk, spaced_unk = tokenizer.unknown  # "<unk>", " <unk>": an unknown word, directly or after a space
        spaced_mass = float(probs[tokenizer.words_of(matching, spaced=True)].sum()) \
            + math.exp(float(logprobs[spaced_unk]))
        direct_mass = float(probs[tokenizer.words_of(matching, spaced=False)].sum()) + math.exp(float(logprobs[unk]))
        space_share = spaced_mass / (spaced_mass + direct_mass) if spaced_mass > 0 else 0.0

    state = session.memories.get(WordsMemory.name)
    words = state if isinstance(state, WordCache) else None
    settings = session.config.get(WordsMemory.name)
    weight = settings.weight if isinstance(settings, WordsSettings) and words is not None else 0.0
    candidates, candidate_probs = torch.cat([matching, unspaced]), torch.cat([probs, unspaced_probs])  # (n + m,)
    spaced_kind = torch.cat([spaced_words, torch.zeros_like(unspaced, dtype=torch.bool)])  # (n + m,)

    def word(j: int, token: int, spaced: bool) -> str:  # candidate j's word: without the space it has where the
        data = tokenizer.token_bytes(token)  # typed part has it, or unspaced
        return (data[1:] if space or j >= len(matching) or spaced else data).decode("utf-8", errors="ignore")

    offered = torch.cat([tokenizer.offered(matching, typed, max_chars) | spaced_words,
                         tokenizer.offered(unspaced, b" " + typed, max_chars) & (shares > 0)])
    offered &= candidate_probs * norm >= SUGGEST_MIN_PROB
    # with the cache, more of the model's candidates: a cached word's own probability under the model counts
    top = _best(torch.where(offered, candidate_probs, -1.0), k if weight <= 0 else max(k, _CACHE_CANDIDATES))
    top = top[offered[top]]  # (c,) ties in byte order
    completions = [Completion(word(j, token, spaced), norm * p, spaced) for j, token, p, spaced in zip(
        top.tolist(), candidates[top].tolist(), candidate_probs[top].tolist(), spaced_kind[top].tolist(), strict=True)]
    if weight > 0 and words is not None:
        mixed = words.mix(completions, typing.decode("utf-8", errors="replace"), weight, k, max_chars,
                          space=space_share)
        completions = [c for c in mixed if c.text.startswith(prefix) and len(c.text) > len(prefix)]
    chars: dict[str, float] = {}
    typed_text = typed.decode("utf-8", errors="strict") if _whole_utf8(typed) else None
    if not typed and n_chars > 0:  # nothing typed: the next token's first character, whatever it is
        chars = tokenizer.first_char_probs(logprobs.exp())  # <unk>'s first letter unknown: its unspaced words'
        _add_next_chars(chars, tokenizer, b" ", unspaced_probs, 1.0)
    elif typed_text is not None and n_chars > 0:
        _add_next_chars(chars, tokenizer, typed, probs, norm)  # the words going on with each character
        _add_next_chars(chars, tokenizer, b" " + typed, unspaced_probs, norm)
        # the typed part may end here (an entry, or an unspaced word: <unk>): the next token's first character follows
        ended, end = 0.0, whole
        if whole is not None:
            ended = norm * math.exp(float(logprobs[whole]))
        elif unspaced.numel() and tokenizer.token_bytes(int(unspaced[0])) == b" " + typed and shares[0] > 0:
            ended, end = norm * float(unspaced_probs[0]), tokenizer.unk
        if end is not None:  # kept too: after a space, the next keystroke continues from it
            _, following, run = _after(model, session, [*ids, end], adapter, states, sessions, fed, len(ids))
            for char, p in tokenizer.first_char_probs(following.double().exp()).items():
                chars[char] = chars.get(char, 0.0) + ended * p
            calls += run
    if weight > 0 and n_chars > 0 and words is not None:  # the word cache's words go on too, as mixed in above
        chars = _cached_chars(chars, words, typing.decode("utf-8", errors="replace"), prefix, weight,
                              max_chars, space_share)
    next_ = [NextChar(c, p) for c, p in sorted(chars.items(), key=lambda cp: -cp[1])[:n_chars]]
    return Suggestions(prefix, completions, next_, expansions=0, model_calls=sum(calls), exact=True,
                       space_share=space_share, reused=len(calls) - sum(calls))


def _best(values: torch.Tensor, n: int) -> torch.Tensor:
    """The indices of the n largest of `values` (c,) that are at least 0 (the offered candidates' probabilities;
    the others are -1), largest first, ties in index order: a stable descending argsort's first n of them, without
    sorting the whole vocabulary (the candidates tying with the n-th are all kept, then sorted stably)."""
    n = min(n, values.numel())
    if n == 0:
        return values.new_zeros(0, dtype=torch.long)
    kth = torch.topk(values, n).values[-1].clamp(min=0.0)
    near = (values >= kth).nonzero()[:, 0]  # (m,) in index order: every one of the n best, and their ties
    return near[torch.argsort(values[near], descending=True, stable=True)[:n]]


def _after(model: LanguageModel, session: Session, ids: list[int], adapter: Adapter, states: WordStates | None,
           sessions: SessionModel, state: State | None = None, fed: int = 0) -> tuple[State, torch.Tensor, list[int]]:
    """The model after the session's view state and `ids` (`state` after the first `fed` of them, if given): its
    state and the next token's log-probs (V,), from `states` if they hold them (or a start of them: the rest is
    fed) -> (state, log-probs, [1] if a model step ran, else [0])."""
    if states is not None:
        n, kept, logprobs = states.longest(session, ids)
        if n == len(ids) and kept is not None and logprobs is not None:
            return kept, logprobs, [0]
        if n > fed and kept is not None:
            state, fed = kept, n
    if state is None:
        state, fed = sessions.view_state(session), 0
    device = next(model.parameters()).device
    out = model(torch.tensor([ids[fed:]], dtype=torch.long, device=device), state, adapter)
    # a copy: a view would keep the whole (1, T, V) distribution of a long feed alive in the cache
    logprobs = model.log_probs(out)[0, -1].clone()
    if states is not None:
        states.put(session, ids, out.state, logprobs)
    return out.state, logprobs, [1]


def _add_next_chars(chars: dict[str, float], tokenizer: WordTokenizer, typed: bytes, probs: torch.Tensor,
                    scale: float) -> None:
    """Add to `chars` the probabilities `probs` (n,) of the entries that start with `typed` (`ids_with_prefix`'s, in
    its order), times `scale`, summed by the character that follows `typed` in each."""
    if not probs.numel():
        return
    mass = torch.cat([probs.new_zeros(1), probs.cumsum(0)])  # mass[j]: the first j entries' probability
    runs = tokenizer.by_next_char(typed)
    if not runs:
        return
    starts, ends = torch.tensor([r[1] for r in runs]), torch.tensor([r[2] for r in runs])
    for (char, _, _), p in zip(runs, (mass[ends] - mass[starts]).tolist(), strict=True):  # one gather, not one a char
        chars[char] = chars.get(char, 0.0) + scale * p


def _cached_chars(chars: dict[str, float], words: WordCache, context: str, prefix: str, weight: float,
                  max_chars: int, space: float = 0.0) -> dict[str, float]:
    """The next characters `chars` (the model's, given the typed `prefix`) with the session's word cache mixed in as
    `WordCache.mix` mixes it into the completions (lam = weight conf): (1 - lam) p_model(c) + lam p_cache(the cached
    words that go on with c). A completion's next character is then at least as likely as the completion, a word the
    vocabulary lacks included: its letters come from the cache alone (the model has only <unk> for it). After a
    mark, the share `space` of each cached word goes on with the space before it."""
    cached, conf = words.estimate_at(context, max_chars)
    lam = weight * conf
    if not cached or lam <= 0:
        return chars
    mixed = {c: (1 - lam) * p for c, p in chars.items()}
    for word, p in cached.items():
        if word.startswith(prefix) and len(word) > len(prefix):  # the words the completions may hold
            for char, share in (word[len(prefix)], 1.0 - space), (" ", space):
                if share > 0:
                    mixed[char] = mixed.get(char, 0.0) + lam * p * share
    return mixed


def _whole_utf8(data: bytes) -> bool:
    try:
        data.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True
