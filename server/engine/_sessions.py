"""Sessions: the per-session adaptation record, the store interface, the in-process store, the export format.

A session is one text stream adapted online (sparse dynamic evaluation, ALGORITHMS.md §3): the recurrent
state after everything it has observed, the next input byte, its adapter M (zeros at the start), and a
second, never-adapted state of the same text, so that the bits it would have cost the static model can be
counted in the same batched step. Records are immutable: the engine's worker builds a new one and writes
it back, so a reader always sees a consistent snapshot.

Only the engine's worker thread writes sessions (create, adapt, reset, import); HTTP handlers read them
(stats, export) and delete them. `SessionStore` is the interface the engine needs; `MemorySessionStore`
keeps them in this process (LRU order, TTL, a memory budget, a count limit): they are lost when the process
ends. `RedisSessionStore` (`_redis.py`) implements the same methods over `export_session` blobs in Redis.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import threading
import time
import zipfile
from abc import ABC, abstractmethod
from collections import Counter, OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load as load_tensors
from safetensors.torch import save as save_tensors

from models.base import Adapter, State
from models.wordcache import WordCache
from server.engine._errors import SessionImportError, SessionStoreFull

__all__ = [
    "EXPORT_FORMAT", "EXPORT_VERSION", "AdaptationConfig", "MemorySessionStore", "Session", "SessionStats",
    "SessionStore", "StoreStats", "export_session", "import_session",
]

EXPORT_FORMAT = "adaptlm-session"
EXPORT_VERSION = 1
SNAPSHOT_FORMAT = "adaptlm-session-snapshot-1"  # MemorySessionStore's file

log = logging.getLogger(__name__)
_MAX_HEADER = 1 << 20  # a session's safetensors header is a few hundred bytes


@dataclass(frozen=True)
class AdaptationConfig:
    """What a session may choose of sparse dynamic evaluation; the rule, eps and segment are the checkpoint's."""

    lr: float
    decay: float
    adapter_size: int  # k: M is (k, k) on the first k units of every adaptation site
    cache_weight: float = 0.0  # lam of the word cache in keyboard suggestions (models/wordcache.py); 0: off


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
    last_byte: int  # the next input byte: the last observed byte, or scoring.BOS at the start
    adapter: Adapter  # mats[site]: (1, k, k)
    stats: SessionStats = field(default_factory=SessionStats)
    words: WordCache = field(default_factory=WordCache)  # the observed words; replaced, never changed in place

    @property
    def nbytes(self) -> int:
        """Bytes the session holds: its tensors, and an estimate for its word cache."""
        tensors = [*self.state.tensors.values(), *self.static_state.tensors.values(), *self.adapter.mats.values()]
        return sum(t.numel() * t.element_size() for t in tensors) + self.words.nbytes

    def expires_at(self) -> float:
        return self.last_used + self.ttl_s

    def expired(self, now: float) -> bool:
        return now >= self.expires_at()


@dataclass(frozen=True)
class StoreStats:
    sessions: int
    bytes: int
    evictions: Mapping[str, int]  # by reason: "ttl" (expired), "lru" (made room for another session)


class SessionStore(ABC):
    """Where sessions live. Thread-safe. `owner` is checked on reads and deletes: a session of another owner
    is reported as absent. Sessions that the engine has work for are pinned and never evicted."""

    @abstractmethod
    def get(self, session_id: str, owner: str | None, *, touch: bool = True) -> Session | None:
        """The session, or None if there is none (expired, evicted, deleted, never created, another owner's).
        `touch` marks it used (extends its TTL, makes it most recently used)."""

    @abstractmethod
    def contains(self, session_id: str) -> bool:
        """Whether a session of that id exists, whoever owns it (expired ones included until swept)."""

    @abstractmethod
    def insert(self, session: Session) -> None:
        """Create or replace `session`; evicts expired, then least recently used unpinned sessions to stay in
        the limits; raises SessionStoreFull (evicting and storing nothing) if that cannot make room."""

    @abstractmethod
    def update(self, session: Session) -> bool:
        """Replace the stored session of the same id; False (storing nothing) if it is gone (deleted)."""

    @abstractmethod
    def delete(self, session_id: str, owner: str | None) -> bool:
        """Remove the session; False if there was none for `owner`."""

    @abstractmethod
    def pin(self, session_id: str) -> None:
        """Protect the session from eviction until as many `unpin` calls (work for it is in flight)."""

    @abstractmethod
    def unpin(self, session_id: str) -> None: ...

    @abstractmethod
    def sweep(self) -> int:
        """Remove expired unpinned sessions now; -> how many."""

    @abstractmethod
    def stats(self) -> StoreStats: ...

    @abstractmethod
    def bind(self, model_hash: str, template: Session) -> None:
        """Called by the engine once its checkpoint is loaded, before any other call: the weights' hash and a
        fresh session of the model (its tensor layouts, dtype and device). A store that serialises sessions
        needs both to read them back; it may also check here that it is reachable (SessionStoreUnavailable)."""

    @abstractmethod
    def close(self) -> None:
        """Release connections; called once the engine has stopped (its last writes are done)."""


class MemorySessionStore(SessionStore):
    """In-process store: an LRU map with per-session TTL, a byte budget and a count limit.

    With a `snapshot` path, the sessions outlive the process: `close` (at shutdown, once the engine has finished
    its work) writes them all to that file, and `bind` (at start-up) reads back those of the same weights that
    have not expired. The file is a zip (stored, not compressed) of `export_session` blobs, one per session,
    and an `index.json` with each one's id, owner (the API key's hash), times and TTL: no pickle. It is
    written to a temporary file and renamed, so a crash mid-write leaves the previous snapshot whole.
    """

    def __init__(self, *, max_sessions: int, max_bytes: int, clock: Callable[[], float] = time.time,
                 snapshot: str | Path | None = None) -> None:
        if max_sessions < 1 or max_bytes < 1:
            raise ValueError("max_sessions and max_bytes must be >= 1")
        self.max_sessions = max_sessions
        self.max_bytes = max_bytes
        self.snapshot = Path(snapshot) if snapshot is not None else None
        self._model_hash: str | None = None
        self._clock = clock
        self._lock = threading.Lock()
        self._sessions: OrderedDict[str, Session] = OrderedDict()  # least recently used first
        self._bytes = 0
        self._pins: Counter[str] = Counter()
        self._evictions: Counter[str] = Counter({"ttl": 0, "lru": 0})

    def get(self, session_id: str, owner: str | None, *, touch: bool = True) -> Session | None:
        with self._lock:
            session = self._sessions.get(session_id)
            if session is None or session.owner != owner:
                return None
            now = self._clock()
            if session.expired(now) and not self._pins[session_id]:
                self._remove(session_id, "ttl")
                return None
            if touch:
                session = dataclasses.replace(session, last_used=now)
                self._sessions[session_id] = session
                self._sessions.move_to_end(session_id)
            return session

    def contains(self, session_id: str) -> bool:
        with self._lock:
            return session_id in self._sessions

    def insert(self, session: Session) -> None:
        with self._lock:
            if not self._fits(session, []):
                self._sweep_locked()
            victims: list[str] = []
            for key in self._sessions:  # least recently used first
                if self._fits(session, victims):
                    break
                if key != session.id and not self._pins[key]:
                    victims.append(key)
            if not self._fits(session, victims):  # refuse before evicting anything
                raise SessionStoreFull(f"the session store is full ({len(self._sessions)} sessions, {self._bytes} "
                                       f"of {self.max_bytes} bytes) and no session can be evicted now")
            for key in victims:
                self._remove(key, "lru")
            self._put(session)

    def update(self, session: Session) -> bool:
        with self._lock:
            if session.id not in self._sessions:
                return False
            self._put(session)
            return True

    def delete(self, session_id: str, owner: str | None) -> bool:
        with self._lock:
            session = self._sessions.get(session_id)
            if session is None or session.owner != owner:
                return False
            self._remove(session_id, None)
            return True

    def pin(self, session_id: str) -> None:
        with self._lock:
            self._pins[session_id] += 1

    def unpin(self, session_id: str) -> None:
        with self._lock:
            self._pins[session_id] -= 1
            if self._pins[session_id] <= 0:
                del self._pins[session_id]

    def sweep(self) -> int:
        with self._lock:
            return self._sweep_locked()

    def stats(self) -> StoreStats:
        with self._lock:
            return StoreStats(sessions=len(self._sessions), bytes=self._bytes, evictions=dict(self._evictions))

    def bind(self, model_hash: str, template: Session) -> None:
        self._model_hash = model_hash
        if self.snapshot is not None and self.snapshot.exists():
            self._restore(self.snapshot, model_hash, template)

    def close(self) -> None:
        """Write the snapshot, if there is one to write (without a path the sessions end with the process)."""
        if self.snapshot is not None and self._model_hash is not None:
            self._save(self.snapshot, self._model_hash)

    def _save(self, path: Path, model_hash: str) -> None:
        with self._lock:
            self._sweep_locked()
            sessions = list(self._sessions.values())  # least recently used first
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        index = []
        with zipfile.ZipFile(tmp, "w", compression=zipfile.ZIP_STORED) as z:
            for i, session in enumerate(sessions):
                member = f"{i}.safetensors"
                z.writestr(member, export_session(session, model_hash))
                index.append({"member": member, "id": session.id, "owner": session.owner,
                              "created": session.created, "last_used": session.last_used, "ttl_s": session.ttl_s})
            z.writestr("index.json", json.dumps({"format": SNAPSHOT_FORMAT, "model_hash": model_hash,
                                                 "sessions": index}))
        os.replace(tmp, path)
        log.info("wrote %d sessions to %s", len(sessions), path)

    def _restore(self, path: Path, model_hash: str, template: Session) -> None:
        """Read a snapshot back; a snapshot of other weights, or one that cannot be read, is left alone (and
        said so in the log): the server starts without those sessions rather than not at all."""
        now, kept, skipped = self._clock(), 0, 0
        try:
            with zipfile.ZipFile(path) as z:
                index = json.loads(z.read("index.json"))
                if index.get("format") != SNAPSHOT_FORMAT:
                    raise ValueError(f"not a session snapshot (format {index.get('format')!r})")
                if index.get("model_hash") != model_hash:
                    log.warning("the session snapshot %s is of other weights (sha256 %s…): not restored", path,
                                str(index.get("model_hash"))[:12])
                    return
                for entry in index["sessions"]:  # least recently used first, so the LRU order comes back
                    try:
                        session, _ = import_session(z.read(entry["member"]), model_hash=model_hash,
                                                    template=template)
                        owner = entry["owner"]
                        if owner is not None and not isinstance(owner, str):
                            raise TypeError("an owner is a string or null")
                        session = dataclasses.replace(
                            session, id=str(entry["id"]), owner=owner, created=float(entry["created"]),
                            last_used=float(entry["last_used"]), ttl_s=float(entry["ttl_s"]))
                    except (KeyError, TypeError, ValueError, SessionImportError) as e:
                        skipped += 1
                        log.warning("a session of the snapshot cannot be read (%s): skipped", e)
                        continue
                    if session.expired(now):
                        continue
                    try:
                        self.insert(session)
                    except SessionStoreFull:
                        skipped += 1
                        continue
                    kept += 1
        except (OSError, KeyError, ValueError, zipfile.BadZipFile) as e:
            log.error("the session snapshot %s cannot be read (%s): starting without it", path, e)
            return
        log.info("restored %d sessions from %s (%d skipped)", kept, path, skipped)

    def _fits(self, session: Session, without: list[str]) -> bool:
        """Would `session` fit within the limits once the sessions `without` are gone?"""
        old = self._sessions.get(session.id)
        gone = [self._sessions[k] for k in without] + ([old] if old is not None else [])
        count = len(self._sessions) - len(gone) + 1
        size = self._bytes - sum(s.nbytes for s in gone) + session.nbytes
        return count <= self.max_sessions and size <= self.max_bytes

    def _put(self, session: Session) -> None:
        old = self._sessions.pop(session.id, None)
        if old is not None:
            self._bytes -= old.nbytes
        self._sessions[session.id] = session  # most recently used
        self._bytes += session.nbytes

    def _remove(self, session_id: str, reason: str | None) -> None:
        session = self._sessions.pop(session_id)
        self._bytes -= session.nbytes
        if reason is not None:
            self._evictions[reason] += 1

    def _sweep_locked(self) -> int:
        now = self._clock()
        expired = [k for k, s in self._sessions.items() if s.expired(now) and not self._pins[k]]
        for k in expired:
            self._remove(k, "ttl")
        return len(expired)


# -- export and import -----------------------------------------------------------------------------------


def _plain(t: torch.Tensor) -> torch.Tensor:
    return t.detach().to("cpu").contiguous().clone()


def export_session(session: Session, model_hash: str) -> bytes:
    """A versioned, pickle-free blob: safetensors bytes of the tensors, with JSON metadata in its header,
    tagged with the checkpoint's weights hash. Owner and id are not part of it: the importer chooses both."""
    tensors = {f"state.{k}": _plain(v) for k, v in session.state.tensors.items()}
    tensors |= {f"static.{k}": _plain(v) for k, v in session.static_state.tensors.items()}
    tensors |= {f"adapter.{k}": _plain(v) for k, v in session.adapter.mats.items()}
    meta = {
        "ttl_s": session.ttl_s, "created": session.created, "last_byte": session.last_byte,
        "config": dataclasses.asdict(session.config), "stats": dataclasses.asdict(session.stats),
        "words": session.words.to_dict(),
    }
    return save_tensors(tensors, metadata={"format": EXPORT_FORMAT, "version": str(EXPORT_VERSION),
                                           "model_hash": model_hash, "session": json.dumps(meta)})


def _header_metadata(blob: bytes) -> dict[str, str]:
    """The `__metadata__` of a safetensors blob: an 8-byte little-endian header length, then a JSON header."""
    if len(blob) < 8:
        raise SessionImportError("not a session export (too short)")
    n = int.from_bytes(blob[:8], "little")
    if n > min(_MAX_HEADER, len(blob) - 8):
        raise SessionImportError("not a session export (bad header)")
    try:
        header = json.loads(blob[8 : 8 + n])
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise SessionImportError("not a session export (bad header)") from None
    meta = header.get("__metadata__") if isinstance(header, dict) else None
    if not isinstance(meta, dict) or meta.get("format") != EXPORT_FORMAT:
        raise SessionImportError("not a session export (no adaptlm-session metadata)")
    return {str(k): str(v) for k, v in meta.items()}


def _finite_number(data: Mapping[str, Any], key: str) -> float:
    value = data.get(key)
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise SessionImportError(f"the export's {key!r} is not a finite number")
    return float(value)


def import_session(blob: bytes, *, model_hash: str, template: Session) -> tuple[Session, AdaptationConfig]:
    """Read an `export_session` blob into a session shaped like `template` (a fresh session of this model:
    its id, owner, clock times and tensor layouts are kept). -> the session and the config the blob asks for,
    which the caller must check against its limits before storing. Raises SessionImportError: `conflict`
    when the blob comes from other weights, otherwise because it is not a valid export."""
    meta = _header_metadata(blob)
    if meta.get("version") != str(EXPORT_VERSION):
        raise SessionImportError(f"unsupported session export version {meta.get('version')!r} "
                                 f"(this server reads version {EXPORT_VERSION})")
    if meta.get("model_hash") != model_hash:
        raise SessionImportError(f"the session was exported from other weights (sha256 "
                                 f"{meta.get('model_hash', '?')[:12]}…); this server's checkpoint is "
                                 f"{model_hash[:12]}…", conflict=True)
    try:
        info = json.loads(meta["session"])
        tensors = load_tensors(blob)
    except (KeyError, json.JSONDecodeError, SafetensorError, ValueError, RuntimeError):
        raise SessionImportError("the session export is corrupt") from None
    if not isinstance(info, dict) or not isinstance(info.get("config"), dict) or not isinstance(info.get("stats"),
                                                                                                  dict):
        raise SessionImportError("the session export's metadata is incomplete")
    cfg, st = info["config"], info["stats"]
    size = cfg.get("adapter_size")
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise SessionImportError("the export's 'adapter_size' is not a positive integer")
    config = AdaptationConfig(lr=_finite_number(cfg, "lr"), decay=_finite_number(cfg, "decay"), adapter_size=size,
                              cache_weight=_finite_number(cfg, "cache_weight") if "cache_weight" in cfg else 0.0)
    try:  # exports older than the word cache have none
        words = WordCache.from_dict(info.get("words") or {})
    except ValueError:
        raise SessionImportError("the export's word cache is not valid") from None
    last_byte = info.get("last_byte")
    if isinstance(last_byte, bool) or not isinstance(last_byte, int) or not 0 <= last_byte < 256:
        raise SessionImportError("the export's 'last_byte' is not a byte")
    counts = {}
    for key in ("bytes_observed", "updates", "nonfinite_resets"):
        value = st.get(key)
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise SessionImportError(f"the export's {key!r} is not a count")
        counts[key] = value
    stats = SessionStats(**counts, bits=_finite_number(st, "bits"), static_bits=_finite_number(st, "static_bits"))

    def take(prefix: str, like: Mapping[str, torch.Tensor], shapes: Mapping[str, tuple[int, ...]]) -> dict[str, Any]:
        out = {}
        for k, ref in like.items():
            t = tensors.pop(f"{prefix}.{k}", None)
            if t is None or tuple(t.shape) != shapes[k] or t.dtype != ref.dtype:
                raise SessionImportError(f"the export's {prefix}.{k} is missing or not of shape {shapes[k]} "
                                         f"and dtype {ref.dtype} (another model?)")
            if not bool(torch.isfinite(t).all()):
                raise SessionImportError(f"the export's {prefix}.{k} holds non-finite values")
            out[k] = t.to(ref.device)
        return out

    state_shapes = {k: tuple(v.shape) for k, v in template.state.tensors.items()}
    state = take("state", template.state.tensors, state_shapes)
    static = take("static", template.static_state.tensors, state_shapes)
    mats = take("adapter", template.adapter.mats, {k: (1, size, size) for k in template.adapter.mats})
    if tensors:
        raise SessionImportError(f"the export holds unexpected tensors: {', '.join(sorted(tensors)[:5])}")
    ttl = _finite_number(info, "ttl_s")
    session = dataclasses.replace(template, ttl_s=ttl if ttl > 0 else template.ttl_s, config=config,
                                  state=State(state), static_state=State(static), last_byte=last_byte,
                                  adapter=Adapter(mats), stats=stats, words=words)
    return session, config
