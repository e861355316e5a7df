"""One adapted text stream: the session that the server's engine serves and the in-process keyboard simulator runs.

A `Session` record holds the network's state after everything it observed, a second, never-adapted state of the same
text (so that the bits the static model would have cost are counted in the same batched step), the next input token,
the text not yet scored (a word model's last word, which may go on), its statistics, and its memories' states by name
(models/memory.py). Records are immutable: observing makes a new one, so a reader always sees a consistent snapshot.

`SessionModel` is what a checkpoint's sessions share: the network, the memories it can serve, and the search model
that mixes the memories in. It makes fresh records, turns a record into the rows of a batched step
(`models.adaptation.batch_step`) and the step's rows back into the next record, and gives the views a search or a
generation reads (`view_state`, `adapter`) and the ranking of word suggestions (`rank`).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from models.adaptation import STATIC_SEGMENT, Row, TextJob, batch_step
from models.adaptation._adapter_memory import AdapterMemory, AdapterSettings
from models.adaptation._step import RuleCache
from models.base import Adapter, LanguageModel, State
from models.memory import (
    RESTORED_MAX_COUNT,
    Memory,
    MemoryMixed,
    SessionConfig,
    build_memories,
    merge_branches,
    state_nbytes,
)
from models.scoring import LN2
from models.tokenizer import Tokenizer

__all__ = ["PENDING_MAX_BYTES", "Observed", "Session", "SessionModel", "SessionStats"]

Mode = Literal["static", "peek", "observe"]

# The most pending text a word session keeps (`Session.pending`: its last word, or run of spaces, and the gap before
# it). Text without spaces (a blob, Chinese or Japanese) would otherwise grow it without end, and every suggestion
# reads all of it. No vocabulary holds a word or a run of spaces that long (<unk> whatever follows), so an observe
# scores it as it stands and what follows starts a new token.
PENDING_MAX_BYTES = 1024


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
    config: SessionConfig
    state: State  # batch 1: the state after every observed token but the last
    static_state: State  # the same, under the unadapted model
    last_token: int  # the next input token (a byte, or a word id): the last one scored, or the BOS at the start
    memories: Mapping[str, Any] = field(default_factory=dict)  # name -> state, for each memory in `config`
    stats: SessionStats = field(default_factory=SessionStats)
    # observed text not yet scored: the tail whose tokens may still change with what follows
    # (`Tokenizer.split_stable`); always empty for a byte model, whose every byte is a token
    pending: bytes = b""
    # the store's bookkeeping, never exported: the token of the stored record this one was read from (or written as),
    # which `SessionStore.update` checks is still the stored one; None for a record no store has held
    revision: str | None = None
    # the memories' views a search reads, built on first use: name -> (the memory state it was built from, view).
    # `dataclasses.replace` hands the dict on to the new record (a touch keeps the views), so a view is used only
    # while it was built from the record's own memory state (an import replaces one template for every record)
    _views: dict[str, tuple[Any, Any]] = field(default_factory=dict, repr=False, compare=False)

    @property
    def adapter(self) -> Adapter:
        """The adapter matrices, mats[site] (1, k, k) (none if the session has no adapter memory)."""
        mats = self.memories.get(AdapterMemory.name)
        return Adapter(dict(mats.tensors) if mats is not None else {})

    @property
    def nbytes(self) -> int:
        """Bytes the session holds: its states' tensors, its memories' and its pending text."""
        return (state_nbytes(self.state) + state_nbytes(self.static_state)
                + sum(state_nbytes(s) for s in self.memories.values()) + len(self.pending))

    def expires_at(self) -> float:
        return self.last_used + self.ttl_s

    def expired(self, now: float) -> bool:
        return now >= self.expires_at()


@dataclass
class Observed:
    """What one text did to a session: its rows in the batched step and what it leaves pending."""

    job: TextJob
    scored: bytes  # the text whose tokens it scores (a word session's: with the pending text, stable part)
    pending: bytes = b""  # an observe: the session's pending text after it


class SessionModel:
    """What a checkpoint's sessions share (module docstring)."""

    def __init__(self, model: LanguageModel, tokenizer: Tokenizer, memories: Mapping[str, Memory],
                 segment: int = STATIC_SEGMENT) -> None:
        self.model, self.tokenizer, self.memories, self.segment = model, tokenizer, dict(memories), segment
        self.search_model: LanguageModel = MemoryMixed(model, list(self.memories.values())) \
            if any(m.kind == "distribution" for m in self.memories.values()) else model
        self._rules = RuleCache()

    @classmethod
    def of(cls, ckpt: Any, memories: Mapping[str, Memory] | None = None) -> SessionModel:
        """For a loaded checkpoint (models.checkpoint.Checkpoint): every memory it can serve, its sessions' segment."""
        memories = build_memories(ckpt) if memories is None else memories
        adapter = memories.get(AdapterMemory.name)
        segment = adapter.base.segment if isinstance(adapter, AdapterMemory) else STATIC_SEGMENT
        return cls(ckpt.model, ckpt.tokenizer, memories, segment)

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def config(self, asked: Mapping[str, Mapping[str, Any] | None] | None = None) -> SessionConfig:
        """A session's settings: the checkpoint's defaults with `asked` applied (`SessionConfig.resolve`)."""
        return SessionConfig.resolve(self.memories, asked)

    def fresh(self, config: SessionConfig, *, id: str = "", owner: str | None = None, ttl_s: float = 0.0,
              now: float | None = None) -> Session:
        """A session at the start: the initial state before the BOS token, every memory of `config` new."""
        now = time.time() if now is None else now
        device = self.device
        return Session(id=id, owner=owner, created=now, last_used=now, ttl_s=ttl_s, config=config,
                       state=self.model.init_state(1), static_state=self.model.init_state(1),
                       last_token=self.tokenizer.bos,
                       memories={name: self.memories[name].init(settings, device)
                                 for name, settings in config.memories.items()})

    # -- text through the batched step --------------------------------------------------------------------------

    def start(self, session: Session | None, data: bytes, mode: Mode, *, shadow: bool = True,
              resident: bool = False) -> Observed:
        """The rows of a text read as `mode` (of `session`, or of the static model from the start when None); an
        observe also scores the text under the unadapted model unless `shadow` is False. `resident`: the session's
        tensors are its own storage, which the steps write in place (`Row.resident`: the server's session slots)."""
        if session is None:
            rows = [Row(self.model.init_state(1))]
            scored, pending, last = data, b"", None
        else:
            adapter = session.memories.get(AdapterMemory.name)
            mats = {k: m[0] for k, m in adapter.tensors.items()} if adapter is not None else None  # (k, k)
            rule = None
            if mode == "observe" and adapter is not None:
                settings = session.config.get(AdapterMemory.name)
                memory = self.memories[AdapterMemory.name]
                assert isinstance(memory, AdapterMemory) and isinstance(settings, AdapterSettings)
                rule = memory.rule(settings)
            mixed = {name: session.memories.get(name) for name, m in self.memories.items()
                     if m.kind == "distribution" and name in session.config}
            rows = [Row(session.state, mats, rule, memories=mixed, resident=resident)]
            if mode == "observe" and shadow:
                rows.append(Row(session.static_state, resident=resident))
            last = session.last_token
            scored, pending = session.pending + data, b""
            if mode == "observe":
                scored, pending = self.tokenizer.split_stable(scored)
                if len(pending) > PENDING_MAX_BYTES:  # <unk> whatever follows: scored as it stands
                    scored, pending = scored + pending, b""
        inputs, targets = self.tokenizer.stream(scored, last, self.device)
        return Observed(TextJob(inputs[: targets.numel()], targets, rows), scored, pending)

    def step(self, jobs: list[TextJob], rules: RuleCache | None = None) -> int:
        """One segment of every job in one batched call (`batch_step`); -> rows in the batch."""
        return batch_step(self.model, jobs, self.segment, rules or self._rules, self.memories)

    def observed(self, old: Session, text: Observed, bits: float, static_bits: float, now: float | None = None,
                 ) -> Session:
        """The record after an observe's rows are done."""
        main, shadow = text.job.rows[0], text.job.rows[-1] if len(text.job.rows) > 1 else None
        # the counts saturate where a restore stops accepting them (an import may start them there): a session
        # stored after this observe is always read back
        stats = SessionStats(bytes_observed=min(old.stats.bytes_observed + len(text.scored), RESTORED_MAX_COUNT),
                             updates=min(old.stats.updates + main.updates, RESTORED_MAX_COUNT),
                             nonfinite_resets=min(old.stats.nonfinite_resets + main.dropped + main.resets,
                                                  RESTORED_MAX_COUNT),
                             bits=min(old.stats.bits + bits, RESTORED_MAX_COUNT),
                             static_bits=min(old.stats.static_bits + static_bits, RESTORED_MAX_COUNT))
        memories = dict(old.memories)
        if main.mats is not None:
            memories[AdapterMemory.name] = State({k: m.unsqueeze(0).clone() for k, m in main.mats.items()})
        for name, state in main.memories.items():
            memories[name] = _owned(state) if isinstance(state, State) else state
        words = text.scored.decode("utf-8", errors="ignore")
        for name, memory in self.memories.items():
            if memory.kind == "words" and name in old.config:
                memories[name] = memory.observe_text(old.memories[name], words)
        return dataclasses.replace(
            old, last_used=time.time() if now is None else now, state=_owned(main.state),
            static_state=_owned(shadow.state) if shadow is not None else old.static_state,
            last_token=self.tokenizer.last_token(text.scored) if text.scored else old.last_token,
            pending=text.pending, memories=memories, stats=stats, revision=old.revision, _views={})

    def observe(self, session: Session, data: bytes, *, shadow: bool = True) -> Session:
        """`session` after observing `data` (all its segments, here and now)."""
        text = self.start(session, data, "observe", shadow=shadow)
        while not text.job.done:
            self.step([text.job])
        rows = text.job.rows
        return self.observed(session, text, -rows[0].total_logprob() / LN2,
                             -rows[1].total_logprob() / LN2 if shadow else 0.0)

    # -- what a search or a generation reads -------------------------------------------------------------------

    def view_state(self, session: Session) -> State:
        """The state that sampling and the keyboard search continue `session` from: the network's, with each
        distribution memory's branch state (an empty one where the session has none, so that its rows stack
        with other sessions')."""
        device = self.device
        return merge_branches(session.state, {
            name: m.branch_state(session.memories.get(name) if name in session.config else None, 1, device)
            for name, m in self.memories.items() if m.kind == "distribution"})

    def adapter(self, session: Session) -> Adapter:
        """The adapter with the session's distribution memories' views (`Adapter.memories`), built once per
        memory state and shared by every round of a search (and by the records made from this one that keep it)."""
        views = {}
        for name, m in self.memories.items():
            if m.kind == "distribution" and name in session.config:
                state = session.memories.get(name)
                built = session._views.get(name)
                if built is None or built[0] is not state:
                    built = session._views[name] = (state, m.view(state))
                views[name] = built[1]
        return Adapter(session.adapter.mats, {name: ([view], None) for name, view in views.items()})

    def search_width(self, session: Session, k: int) -> int:
        """Words the search finds for the session's word memories to rank k of them."""
        return max([k, *(m.search_width(session.config.memories[n], k) for n, m in self._words(session))])

    def rank(self, session: Session, completions: list[Any], context: str, k: int, max_chars: int,
             lexicon: Any = None, space: float = 0.0) -> list[Any]:
        """The k best completions, with the session's word memories mixed in (none: the first k, or the lexicon's
        ranking)."""
        words = self._words(session)
        if not words:
            return lexicon.rank(completions, k, None) if lexicon is not None else completions[:k]
        for name, m in words:
            completions = m.rank(session.memories[name], session.config.memories[name], completions, context, k,
                                 max_chars, lexicon, space)
        return completions

    def _words(self, session: Session) -> list[tuple[str, Memory]]:
        return [(n, m) for n, m in self.memories.items() if m.kind == "words" and n in session.config]


def _owned(state: State) -> State:
    """A state that owns its memory (not a view into a batch), fit to be stored."""
    return State({k: v.clone() for k, v in state.tensors.items()})
