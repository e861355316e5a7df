"""A session's stored form in Redis: its export (`export_session`, safetensors) in parts, so that a write sends only
the parts that changed since the revision it read.

An observe changes the adapter (every weight: the decay scales all of them), the states, the copy model's mixer and
history, the word cache and the counters; it leaves most of the copy model's history and match lengths as they were,
only slid along by the bytes observed. The parts, hash fields of the session's key (`<ns>:s:<id>`):

    hdr             the export's safetensors header (8-byte length, then JSON: the tensors' names, dtypes, shapes
                    and offsets, and the metadata: settings, counters, the word cache), written at every write
    lay             {"v": 1, "chunk": bytes a chunk, "roll": {tensor: r}}: how the tensors are cut
    c:<tensor>:<i>  chunk i of the tensor's bytes (`CHUNK` bytes each, the last shorter), of a byte window (a uint8
                    tensor of several chunks) rotated right by r bytes: a window that slid left by t bytes is
                    stored at r + t, so that its kept bytes stay where they were and only the slots of the new
                    bytes (and any other byte that changed) are written again

The stored bytes, their concatenation, are the export byte for byte (the record's size in the accounting is the
export's length, as before), so reading a record is `import_session` of the joined parts, with all its checks.
A record written before the parts has one field, `blob` (the export): it still reads, and its next write stores it
in parts.

Which parts changed is decided by digests (`Form.digests`: BLAKE2b of each stored field) of the revision the write
read; the write script writes only over that revision (compare-and-set), so the parts it does not send are those.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
from collections.abc import Mapping

from server.engine._errors import SessionImportError
from server.engine._export import safetensors_header

__all__ = ["CHUNK", "Form", "Stored", "join", "split"]

# Bytes a chunk (the adapter is 65 of them, a copy model's history 9): with its string's header (6 bytes) it fills one
# 4 KiB allocation of Redis's allocator (jemalloc); 4,096 would take 5 KiB, a session 17% more memory than its blob
CHUNK = 4090
_LAYOUT_VERSION = 1
_WINDOW_DTYPE = "U8"  # a byte window (the copy model's history and match lengths) is stored rotated


def _digest(value: bytes) -> bytes:
    return hashlib.blake2b(value, digest_size=16).digest()


@dataclasses.dataclass(frozen=True)
class Form:
    """A record's state as stored: its fields (name -> bytes), their digests, and the rotation of its windows."""

    fields: dict[bytes, bytes]
    rolls: dict[str, int]

    @functools.cached_property
    def digests(self) -> dict[bytes, bytes]:
        return {name: _digest(value) for name, value in self.fields.items()}


@dataclasses.dataclass(frozen=True)
class Stored:
    """What a server remembers of a record it read or wrote, to write the next revision as a change: the digests of
    its stored fields and its windows' rotations."""

    digests: dict[bytes, bytes]
    rolls: dict[str, int]

    @staticmethod
    def of(form: Form) -> Stored:
        return Stored(form.digests, dict(form.rolls))


def _tensors(blob: bytes) -> tuple[int, list[tuple[str, str, int, int]]]:
    """The header's length (with its 8-byte prefix) and the tensors: (name, dtype, start, end) in data order."""
    try:
        n, header = safetensors_header(blob)
        tensors = sorted((int(v["data_offsets"][0]), int(v["data_offsets"][1]), str(name), str(v["dtype"]))
                         for name, v in header.items() if name != "__metadata__")
    except (SessionImportError, AttributeError, KeyError, TypeError, ValueError, IndexError):
        raise SessionImportError("the stored session's header is corrupt") from None
    return 8 + n, [(name, dtype, start, end) for start, end, name, dtype in tensors]


def _roll(data: bytes, r: int) -> bytes:
    """data rotated right by r: byte j at (j + r) mod len."""
    r %= max(len(data), 1)
    return data[len(data) - r :] + data[: len(data) - r] if r else data


def _chunks(name: str, data: bytes) -> dict[bytes, bytes]:
    return {f"c:{name}:{i}".encode(): data[at : at + CHUNK] for i, at in enumerate(range(0, len(data), CHUNK))}


def split(blob: bytes, base: Stored | None = None, slid: int = 0) -> Form:
    """An export in parts. `base`: the record it changes (None: a whole write), whose windows, slid left by `slid`
    bytes (the bytes observed since), keep their bytes where they are stored if that rewrites fewer chunks."""
    start, tensors = _tensors(blob)
    fields: dict[bytes, bytes] = {b"hdr": blob[:start]}
    rolls: dict[str, int] = {}
    for name, dtype, begin, end in tensors:
        data = blob[start + begin : start + end]
        r = 0
        if base is not None and dtype == _WINDOW_DTYPE and len(data) >= 2 * CHUNK:
            was = base.rolls.get(name, 0)

            def changed(r: int, data: bytes = data, name: str = name) -> int:
                return sum(base.digests.get(k) != _digest(v) for k, v in _chunks(name, _roll(data, r)).items())

            candidates = {was % len(data), (was + slid) % len(data)}
            r = min(sorted(candidates), key=changed)
        if r:
            rolls[name] = r
        fields |= _chunks(name, _roll(data, r))
    fields[b"lay"] = json.dumps({"v": _LAYOUT_VERSION, "chunk": CHUNK, "roll": rolls}, sort_keys=True).encode()
    return Form(fields, rolls)


def join(fields: Mapping[bytes, bytes]) -> tuple[bytes, Form | None]:
    """The export that stored fields hold -> it, and its form (None: a record of one `blob` field, written before
    the parts). Raises SessionImportError if the parts are not a whole export."""
    if b"blob" in fields:
        return fields[b"blob"], None
    hdr, lay = fields.get(b"hdr"), fields.get(b"lay")
    if hdr is None or lay is None:
        raise SessionImportError("the stored session has no state")
    try:
        layout = json.loads(lay)
        chunk, rolls = int(layout["chunk"]), {str(k): int(v) for k, v in layout["roll"].items()}
        version = layout["v"]
    except (UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError, ValueError, AttributeError):
        raise SessionImportError("the stored session's layout is corrupt") from None
    if version != _LAYOUT_VERSION or chunk < 1:
        raise SessionImportError(f"the stored session's layout is of version {version!r} (this server reads "
                                 f"{_LAYOUT_VERSION})")
    _, tensors = _tensors(hdr)
    parts = [hdr]
    at = 0
    for name, _, begin, end in tensors:
        if begin != at:
            raise SessionImportError("the stored session's tensors are not contiguous")
        pieces = [fields.get(f"c:{name}:{i}".encode()) for i in range(-(-(end - begin) // chunk))]
        if any(p is None for p in pieces):
            raise SessionImportError(f"the stored session lacks a part of {name!r}")
        data = b"".join(p for p in pieces if p is not None)
        if len(data) != end - begin:
            raise SessionImportError(f"the stored session's {name!r} has {len(data)} bytes, not {end - begin}")
        parts.append(_roll(data, -rolls.get(name, 0)))
        at = end
    return b"".join(parts), Form(dict(fields), rolls)
