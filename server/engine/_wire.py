"""What the engine's process and its HTTP workers send each other: MessagePack, each of our records (a score, a
suggestion, an event, the model's info...) an extension value that names its type from a fixed list and carries its
fields. Nothing on the wire names code to run (no pickle): a client's text is a string or bytes in it, and a dict a
client sent stays a dict, whatever its keys."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import msgpack
import numpy as np

from models.adaptation import CacheConfig
from models.memory import SessionConfig
from models.sampling import SamplingParams
from models.suggest import Completion, NextChar, Suggestions
from models.tokenizer import ByteTokenizer, tokenizer_from_dict
from models.word_tokenizer import WordTokenizer
from server.engine._engine import EngineConfig, ModelInfo, SessionLimits
from server.engine._generation import Finished, PromptScored, Token, TokenLogprob
from server.engine._session import SessionStats, SettingsView
from server.engine._stats import EngineStats
from server.engine._text import TextScore

__all__ = ["SettingsView", "pack", "record", "unpack"]

_RECORD, _SETTINGS, _TOKENIZER = 1, 2, 3  # extension codes
_RECORDS: dict[str, type[Any]] = {}


_TUPLES: dict[str, tuple[str, ...]] = {}  # a record's fields declared as tuples


def record(cls: type[Any]) -> type[Any]:
    """Let `cls`, a dataclass, cross the wire (by its fields' values; each itself one that can)."""
    assert dataclasses.is_dataclass(cls) and cls.__name__ not in _RECORDS
    _RECORDS[cls.__name__] = cls
    _TUPLES[cls.__name__] = tuple(f.name for f in dataclasses.fields(cls) if str(f.type).startswith("tuple"))
    return cls


def _tupled(value: Any) -> Any:
    return tuple(_tupled(v) for v in value) if isinstance(value, list) else value


for _cls in (CacheConfig, Completion, EngineConfig, EngineStats, Finished, ModelInfo, NextChar, PromptScored,
             SamplingParams, SessionLimits, SessionStats, Suggestions, TextScore, Token, TokenLogprob):
    record(_cls)


def _default(obj: Any) -> Any:
    if type(obj).__name__ in _RECORDS and _RECORDS[type(obj).__name__] is type(obj):
        fields = {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj) if f.init}
        return msgpack.ExtType(_RECORD, pack([type(obj).__name__, fields]))
    if isinstance(obj, SessionConfig | SettingsView):
        return msgpack.ExtType(_SETTINGS, pack(obj.to_dict()))
    if isinstance(obj, ByteTokenizer | WordTokenizer):
        return msgpack.ExtType(_TOKENIZER, pack(obj.to_dict()))
    if isinstance(obj, Path):
        return str(obj)
    if isinstance(obj, np.ndarray | np.generic):
        return obj.tolist()
    if isinstance(obj, frozenset | set):
        return sorted(obj)
    raise TypeError(f"{type(obj).__name__} does not cross to the engine's process")


def _ext(code: int, data: bytes) -> Any:
    value = unpack(data)
    if code == _RECORD:
        name, fields = value
        cls = _RECORDS.get(name)
        if cls is None:
            raise ValueError(f"no record {name!r} crosses the wire")
        if cls is ModelInfo:
            fields["path"] = Path(fields["path"])
        for field in _TUPLES.get(name, ()):  # MessagePack has one array type: a tuple field reads back a list
            fields[field] = _tupled(fields[field])
        return cls(**fields)
    if code == _SETTINGS:
        return SettingsView(value)
    if code == _TOKENIZER:
        return tokenizer_from_dict(value)
    raise ValueError(f"unknown extension {code}")


def pack(obj: Any) -> bytes:
    data: bytes = msgpack.packb(obj, default=_default, use_bin_type=True)
    return data


def unpack(data: bytes) -> Any:
    return msgpack.unpackb(data, raw=False, strict_map_key=False, ext_hook=_ext)
