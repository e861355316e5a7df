"""The session record: one text stream adapted online (sparse dynamic evaluation, docs/algorithms.md §3).

A session holds the recurrent state after everything it has observed, the next input token, its adapter M
(zeros at the start), and a second, never-adapted state of the same text, so that the bits it would have cost
the static model can be counted in the same batched step. Records are immutable: the engine's worker builds a
new one and writes it back, so a reader always sees a consistent snapshot.
"""

from __future__ import annotations

import functools
import secrets
from dataclasses import dataclass, field

import torch

from models.base import Adapter, State
from models.copymodel import branch_view, frozen_stats, merge_state
from models.wordcache import WordCache

__all__ = ["PENDING_MAX_BYTES", "AdaptationConfig", "Session", "SessionStats", "new_session_id"]

# The most pending text a word session keeps (`Session.pending`: its last word, or run of spaces, and the gap before
# it). One that never ends (text without spaces: a blob, Chinese or Japanese) grew with every observe, and every
# suggestion read all of it (seconds on the engine's thread, a prefix of megabytes). No vocabulary holds a word or a
# run of spaces that long (<unk> whatever follows), so an observe scores it as it stands; what follows starts a new
# token (the one place where observing in pieces differs from observing at once).
PENDING_MAX_BYTES = 1024


def new_session_id() -> str:
    """192 random bits, URL-safe (32 characters), never starting with "-" (a command line would read such an id
    as an option: `adaptlm client session get -x...` would fail, and one random id in 64 starts so)."""
    while (session_id := secrets.token_urlsafe(24)).startswith("-"):
        pass
    return session_id


@dataclass(frozen=True)
class AdaptationConfig:
    """What a session may choose of sparse dynamic evaluation; the rule, eps and segment are the checkpoint's."""

    lr: float
    decay: float
    adapter_size: int  # k: M is (k, k) on the first k units of every adaptation site
    cache_weight: float = 0.0  # lam of the word cache in keyboard suggestions (models/wordcache.py); 0: off
    # the neural cache (docs/algorithms.md §4, models/adaptation/_cache.py) mixed into every prediction of the
    # session; it takes the copy model's place: a session remembers its own text by one of them
    neural_cache: bool = False
    # the per-session copy model (models/copymodel.py), where the checkpoint has one; off: the network alone (with lr
    # 0 and no caches, the unadapted model, e.g. the keyboard page's twin)
    copy_model: bool = True


@dataclass(frozen=True)
class SessionStats:
    bytes_observed: int = 0
    updates: int = 0  # adapter updates applied (one per segment)
    nonfinite_resets: int = 0  # updates dropped by the non-finite guard
    bits: float = 0.0  # of the observed text, each segment scored before the update it caused
    static_bits: float = 0.0  # of the same text under the unadapted model

    @property
    def bits_per_byte(self) -> float | None:
        return self.bits / self.bytes_observed if self.bytes_observed else None

    @property
    def static_bits_per_byte(self) -> float | None:
        return self.static_bits / self.bytes_observed if self.bytes_observed else None

    @property
    def gain_over_static(self) -> float | None:
        """1 - bits / static bits: the fraction of the static model's bits that adaptation saved so far."""
        return 1.0 - self.bits / self.static_bits if self.bytes_observed and self.static_bits > 0 else None


@dataclass(frozen=True)
class Session:
    id: str
    owner: str | None  # hash of the API key that created it; None when the server has no keys
    created: float  # unix time
    last_used: float  # unix time; the session expires ttl_s after it
    ttl_s: float
    config: AdaptationConfig
    state: State  # batch 1: the state after every observed byte but the last
    static_state: State  # the same, under the unadapted model
    last_token: int  # the next input token (a byte, or a word id): the last one scored, or the BOS at the start
    adapter: Adapter  # mats[site]: (1, k, k)
    stats: SessionStats = field(default_factory=SessionStats)
    words: WordCache = field(default_factory=WordCache)  # the observed words; replaced, never changed in place
    copy: State | None = None  # batch 1: the copy model of what it observed (models/copymodel.py); None: off
    # observed text not yet scored: the tail whose tokens may still change with what follows
    # (`WordTokenizer.split_stable`); always empty for a byte model, whose every byte is a token
    pending: bytes = b""
    # with `config.neural_cache`: the cache's memory of (hidden state, next token) pairs (`NeuralCache.to_state`;
    # None until the session has observed a token)
    cache: State | None = None
    # the store's bookkeeping, never exported: the token of the stored record this one was read from (or written as),
    # which `SessionStore.update` checks is still the stored one; None for a record no store has held
    revision: str | None = None

    def view_state(self) -> State:
        """The state that sampling and the keyboard search continue from: the network's, with the last bytes the
        copy model read (`models.copymodel.CopyMixed`)."""
        if self.copy is None:
            return self.state
        return merge_state(self.state, branch_view(self.copy))

    @functools.cached_property
    def _frozen_copy(self) -> State | None:
        # a Session is never changed in place (an observe makes a new one), so what it indexes cannot go stale
        return frozen_stats(self.copy) if self.copy is not None else None

    def adapter_with_copy(self) -> Adapter:
        """The adapter, carrying the copy model's statistics for `models.copymodel.CopyMixed` (sampling and the
        keyboard search read the session through it; their index is built once per Session object, so once per
        request, and shared by every round of its search), or the neural cache's memory for
        `models.adaptation.CacheMixed`."""
        if self._frozen_copy is None and self.cache is None:
            return self.adapter
        return Adapter(self.adapter.mats, copy=self._frozen_copy, cache=self.cache)

    @property
    def nbytes(self) -> int:
        """Bytes the session holds: its tensors, and an estimate for its word cache."""
        tensors: list[torch.Tensor] = [*self.state.tensors.values(), *self.static_state.tensors.values(),
                                       *self.adapter.mats.values()]
        if self.copy is not None:
            tensors += self.copy.tensors.values()
        if self.cache is not None:
            tensors += self.cache.tensors.values()
        return int(sum(t.numel() * t.element_size() for t in tensors)) + self.words.nbytes + len(self.pending)

    def expires_at(self) -> float:
        return self.last_used + self.ttl_s

    def expired(self, now: float) -> bool:
        return now >= self.expires_at()
