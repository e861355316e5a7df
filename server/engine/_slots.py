"""Session slots: the per-session tensors of observed sessions kept on the model's device between requests, in
tables of `capacity` rows, so that a batched step gathers its rows from them by index and, when an observe is done,
writes its results back into them in place (`models.adaptation.batch_step`, `Row.resident`), instead of stacking
every row's tensors, zero-padded, into a new batch.

A slot holds one session's network state and its static shadow's (a table per tensor: "state.h", "static.h", ...),
and its memories' tensors ("memory.adapter.h": M (k, k); "memory.head.delta": the output rows' delta), each a row of
its table. It is a cache of the session's stored record, never the truth: a slot is used for a record only while it
holds that record's revision (`Session.revision`, new at every write of any store: an observe, a reset, an import,
another replica's write through Redis), and the record written to the store after an observe is complete (the model
layer clones the slot's rows into it: `SessionModel.observed`), so that nothing acknowledged exists only here.

Life of a slot (the engine's worker thread only): an observe's start `acquire`s it (a hit: the slot holds the
record's revision; a miss: the least recently used slot no running work holds is filled from the record), which
claims it; the observe's last step writes into it; after the store accepted the new record, `commit` marks the slot as
holding the new revision; an observe that fails, is cancelled or whose write is refused `drop`s it (its rows are then
no record's). A session whose tensors do not fit the tables (another adapter size, a state that grows) or that finds
every slot claimed runs as it would without slots.
"""

from __future__ import annotations

import dataclasses
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from models.base import State
from models.session import Session

__all__ = ["SLOTS_CPU", "SLOTS_CUDA", "SessionSlots", "SlotStats", "session_slots"]

# Slots by default: on a GPU, a thousand typists' sessions and more (the default model's state and head delta are
# ~0.4 MB a session, its adapter M at k = 256 0.26 MB: 4,096 sessions take under 3 GB of an accelerator's memory).
SLOTS_CUDA = 4096
SLOTS_CPU = 0  # on a CPU, off: no gain measured there (docs/operations.md, ADAPTLM_SESSION_SLOTS)


def session_slots(setting: int | None, device: torch.device) -> SessionSlots | None:
    """The slots an engine on `device` keeps for `setting` (ADAPTLM_SESSION_SLOTS: a count, 0 off, None the
    device's default); None: off."""
    count = setting if setting is not None else SLOTS_CUDA if device.type == "cuda" else SLOTS_CPU
    return SessionSlots(count, device) if count > 0 else None


@dataclass(frozen=True)
class SlotStats:
    capacity: int
    used: int
    hits: int
    misses: int
    evictions: int
    declined: int  # observes that ran without a slot (none free, or tensors that do not fit)


class SessionSlots:
    def __init__(self, capacity: int, device: torch.device) -> None:
        if capacity < 1:
            raise ValueError("session slots: capacity >= 1")
        self.capacity, self.device = capacity, device
        self._tables: dict[str, torch.Tensor] = {}  # name -> (capacity, *row shape), allocated on first use
        self._slots: OrderedDict[str, int] = OrderedDict()  # session id -> slot, least recently used first
        self._revision: dict[int, str] = {}  # slot -> the revision of the record it holds (absent: none)
        self._claimed: set[int] = set()  # slots of work in flight
        self._free = list(range(capacity - 1, -1, -1))
        self.hits = self.misses = self.evictions = self.declined = 0

    def stats(self) -> SlotStats:
        return SlotStats(self.capacity, len(self._slots), self.hits, self.misses, self.evictions, self.declined)

    def holds(self, session_id: str, revision: str | None) -> bool:
        """The session has a slot holding that revision of its record."""
        slot = self._slots.get(session_id)
        return slot is not None and revision is not None and self._revision.get(slot) == revision

    def acquire(self, session: Session) -> Session | None:
        """(At an observe's start.) `session` with its tensors replaced by views of its slot, claimed until `commit`
        or `drop`: the slot's own rows where it holds this revision, else rows filled from the record. None: no slot
        (every slot claimed, or tensors that do not fit the tables): the observe runs without one."""
        named = list(_tensors(session))
        if any(t.device != self.device or t.dim() == 0 or t.shape[0] != 1 for _, t in named) or any(
                (table := self._tables.get(name)) is not None
                and (table.shape[1:] != t.shape[1:] or table.dtype != t.dtype) for name, t in named):
            self.declined += 1
            return None
        slot = self._slots.get(session.id)
        if slot is not None and slot in self._claimed:  # (the scheduler runs one piece of a session's work at a time)
            self.declined += 1
            return None
        hit = slot is not None and session.revision is not None and self._revision.get(slot) == session.revision
        if slot is None:
            slot = self._take()
            if slot is None:
                self.declined += 1
                return None
            self._slots[session.id] = slot
        self._slots.move_to_end(session.id)
        self._claimed.add(slot)
        self._revision.pop(slot, None)  # written in place from now on: no record's until `commit`
        if hit:
            self.hits += 1
        else:
            self.misses += 1
            with torch.no_grad():
                for name, t in named:
                    self._table(name, t)[slot].copy_(t[0])
        return _viewed(session, lambda name: self._tables[name][slot : slot + 1])

    def commit(self, session_id: str, revision: str | None) -> None:
        """The store accepted the record the slot's rows hold, as `revision`: the slot serves that revision."""
        slot = self._slots.get(session_id)
        if slot is None:
            return
        self._claimed.discard(slot)
        if revision is None:
            self._release(session_id)
        else:
            self._revision[slot] = revision

    def drop(self, session_id: str) -> None:
        """The work on the session's slot ended without a committed record: the slot's rows are no record's."""
        if session_id in self._slots:
            self._release(session_id)

    def _release(self, session_id: str) -> None:
        slot = self._slots.pop(session_id)
        self._claimed.discard(slot)
        self._revision.pop(slot, None)
        self._free.append(slot)

    def _take(self) -> int | None:
        if self._free:
            return self._free.pop()
        for session_id, slot in self._slots.items():  # least recently used first
            if slot not in self._claimed:
                self._release(session_id)
                self.evictions += 1
                return self._free.pop()
        return None

    def _table(self, name: str, t: torch.Tensor) -> torch.Tensor:
        table = self._tables.get(name)
        if table is None:
            with torch.inference_mode(False):  # written in place from any mode, and read by autograd's steps
                table = self._tables[name] = torch.zeros(self.capacity, *t.shape[1:], dtype=t.dtype,
                                                         device=self.device)
        return table


def _tensors(session: Session) -> Iterator[tuple[str, torch.Tensor]]:
    """A record's tensors that live in slots, by table name: its states' and its memories' `State` tensors."""
    if session.state.roots or session.static_state.roots:
        yield "", torch.zeros(())  # a state in a branch form: no slot (`acquire` declines a 0-d tensor)
        return
    for key, t in session.state.tensors.items():
        yield f"state.{key}", t
    for key, t in session.static_state.tensors.items():
        yield f"static.{key}", t
    for name, state in session.memories.items():
        if isinstance(state, State):
            for key, t in state.tensors.items():
                yield f"memory.{name}.{key}", t


def _viewed(session: Session, row: Callable[[str], torch.Tensor]) -> Session:
    """`session` with each slotted tensor replaced by `row(table name)`, its slot's (1, ...) view."""

    def of(prefix: str, state: State) -> State:
        return State({k: row(f"{prefix}.{k}") for k in state.tensors})

    memories = {name: of(f"memory.{name}", s) if isinstance(s, State) else s for name, s in session.memories.items()}
    return dataclasses.replace(session, state=of("state", session.state),
                               static_state=of("static", session.static_state), memories=memories, _views={})
