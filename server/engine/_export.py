"""The session export format: a versioned, pickle-free blob (safetensors bytes of the state, shadow state and the
memories' tensors, with JSON metadata in the safetensors header), tagged with the checkpoint's weights hash.

Version 2 names every memory the server has: its settings, or null where the session has it off, and its own
metadata (a memory's tensors are named "<memory>.<tensor>"); a memory an export does not name (the exporting server
had none of it) is off in the imported session. Version 1 (the flat settings `lr`, `decay`,
`adapter_size`, `cache_weight`, `neural_cache`, `copy_model`, the word cache under "words", the next token under
`last_byte`) still imports. `pending` (base64) is a word session's observed text not yet scored
(`Session.pending`).
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import json
import math
from collections.abc import Mapping
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load as load_tensors
from safetensors.torch import save as save_tensors

from models.base import State
from models.memory import MEMORY_PREFIX_SEP, RESTORED_MAX_COUNT, MemorySettingsError, SessionConfig, check_restored
from models.session import SessionModel
from models.tokenizer import Tokenizer
from server.engine._errors import SessionImportError
from server.engine._session import PENDING_MAX_BYTES, Session, SessionStats

__all__ = ["EXPORT_FORMAT", "EXPORT_VERSION", "export_session", "import_session"]

EXPORT_FORMAT = "adaptlm-session"
EXPORT_VERSION = 2
_MAX_HEADER = 1 << 20  # a session's safetensors header is a few kilobytes


def _plain(t: torch.Tensor) -> torch.Tensor:
    return t.detach().to("cpu").contiguous().clone()


def export_session(session: Session, model_hash: str, sessions: SessionModel) -> bytes:
    """A versioned, pickle-free blob: safetensors bytes of the tensors, with JSON metadata in its header,
    tagged with the checkpoint's weights hash. Owner and id are not part of it: the importer chooses both."""
    tensors = {f"state.{k}": _plain(v) for k, v in session.state.persistent().tensors.items()}
    tensors |= {f"static.{k}": _plain(v) for k, v in session.static_state.persistent().tensors.items()}
    settings: dict[str, Any] = {name: None for name in sessions.memories}
    memories: dict[str, Any] = {}
    for name, value in session.config.memories.items():
        settings[name] = value.model_dump()
        mine, meta = sessions.memories[name].export(session.memories.get(name))
        tensors |= {f"{name}{MEMORY_PREFIX_SEP}{k}": _plain(v) for k, v in mine.items()}
        if meta is not None:
            memories[name] = meta
    info = {"ttl_s": session.ttl_s, "created": session.created, "last_token": session.last_token,
            "config": {"memories": settings}, "stats": dataclasses.asdict(session.stats), "memories": memories}
    if session.pending:
        info["pending"] = base64.b64encode(session.pending).decode("ascii")
    return save_tensors(tensors, metadata={"format": EXPORT_FORMAT, "version": str(EXPORT_VERSION),
                                           "model_hash": model_hash,
                                           "session": json.dumps(info, ensure_ascii=False)})


def safetensors_header(blob: bytes) -> tuple[int, Any]:
    """A safetensors blob's header: an 8-byte little-endian length, then JSON -> (the length, the parsed JSON)."""
    if len(blob) < 8:
        raise SessionImportError("not a session export (too short)")
    n = int.from_bytes(blob[:8], "little")
    if n > min(_MAX_HEADER, len(blob) - 8):
        raise SessionImportError("not a session export (bad header)")
    try:
        return n, json.loads(blob[8 : 8 + n])
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError):  # RecursionError: nesting 1e5 deep
        raise SessionImportError("not a session export (bad header)") from None


def _header_metadata(blob: bytes) -> dict[str, str]:
    """The `__metadata__` of a session export's safetensors header."""
    _, header = safetensors_header(blob)
    meta = header.get("__metadata__") if isinstance(header, dict) else None
    if not isinstance(meta, dict) or meta.get("format") != EXPORT_FORMAT:
        raise SessionImportError("not a session export (no adaptlm-session metadata)")
    return {str(k): str(v) for k, v in meta.items()}


def _finite_number(data: Mapping[str, Any], key: str) -> float:
    value = data.get(key)
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise SessionImportError(f"the export's {key!r} is not a finite number")
    return float(value)


def import_session(blob: bytes, *, model_hash: str, template: Session, sessions: SessionModel,
                   ) -> tuple[Session, SessionConfig]:
    """Read an `export_session` blob (version 1 or 2) into a session of `sessions`' model, with the id, owner and
    clock times of `template`; its settings are checked against what this checkpoint serves (`SessionConfig
    .resolve`), its next token and pending text against the model's tokenizer. -> the session and its settings.
    Raises SessionImportError: `conflict` when the blob comes from other weights, otherwise because it is not a valid
    export or its settings are refused here."""
    meta = _header_metadata(blob)
    version = meta.get("version")
    if version not in ("1", str(EXPORT_VERSION)):
        raise SessionImportError(f"unsupported session export version {version!r} "
                                 f"(this server reads versions 1 to {EXPORT_VERSION})")
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
    if version == "1":
        asked, metas, token_key = _v1_settings(info, sessions), {"words": info.get("words") or {}}, "last_byte"
    else:
        asked, metas, token_key = _v2_settings(info), info.get("memories") or {}, "last_token"
    if not isinstance(metas, dict):
        raise SessionImportError("the export's 'memories' is not an object")
    # a memory the export does not name is one the exporting server did not have (version 2 names all of its own):
    # the session goes on without it, as it would have there, rather than with this checkpoint's default of it
    asked = {**dict.fromkeys(sessions.memories), **asked}
    try:
        config = SessionConfig.resolve(sessions.memories, asked)
    except MemorySettingsError as e:
        param = f"{e.memory}.{e.param}" if e.param else e.memory
        raise SessionImportError(f"the export's adaptation settings are refused here: {param}: {e}") from None
    tokenizer = sessions.tokenizer
    last_token = info.get(token_key)
    if isinstance(last_token, bool) or not isinstance(last_token, int) \
            or not 0 <= last_token < tokenizer.vocab_size:
        raise SessionImportError(f"the export's {token_key!r} is not a token id of this model (0 to "
                                 f"{tokenizer.vocab_size - 1})")
    pending = _pending(info.get("pending", ""), tokenizer)
    st = info["stats"]
    counts = {}
    for key in ("bytes_observed", "updates", "nonfinite_resets"):
        value = st.get(key)
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= RESTORED_MAX_COUNT:
            raise SessionImportError(f"the export's {key!r} is not a count (0 to 2**53)")
        counts[key] = value
    bits, static_bits = _finite_number(st, "bits"), _finite_number(st, "static_bits")
    if not (0 <= bits <= RESTORED_MAX_COUNT and 0 <= static_bits <= RESTORED_MAX_COUNT):
        raise SessionImportError("the export's 'bits' and 'static_bits' are not numbers of bits (0 to 2**53)")
    stats = SessionStats(**counts, bits=bits, static_bits=static_bits)

    def take(prefix: str, like: Mapping[str, torch.Tensor]) -> dict[str, Any]:
        mine = {k: tensors.pop(f"{prefix}.{k}") for k in like if f"{prefix}.{k}" in tensors}
        try:
            check_restored(prefix, mine, like)
        except ValueError as e:
            raise SessionImportError(f"the export's {e}") from None
        return {k: t.to(like[k].device) for k, t in mine.items()}

    # derived tensors (caches, `State.persistent`) are not exported: the template's fresh ones, rebuilt on use
    fresh = sessions.fresh(config)
    state = {**fresh.state.tensors, **take("state", fresh.state.persistent().tensors)}
    static = {**fresh.static_state.tensors, **take("static", fresh.static_state.persistent().tensors)}
    memories: dict[str, Any] = {}
    for name, memory in sessions.memories.items():
        prefix = f"{name}{MEMORY_PREFIX_SEP}"
        if name not in config:
            continue  # off in this session: any tensors of it are unexpected
        mine = {k[len(prefix):]: tensors.pop(k) for k in [k for k in tensors if k.startswith(prefix)]}
        try:
            memories[name] = memory.restore(config.memories[name], mine, metas.get(name), sessions.device)
        except ValueError as e:
            raise SessionImportError(f"the export's {name} memory is not valid: {e}") from None
    if version == "1" and "copy" not in sessions.memories:  # a copy model this server has not: dropped, as before
        tensors = {k: v for k, v in tensors.items() if not k.startswith(f"copy{MEMORY_PREFIX_SEP}")}
    if tensors:
        raise SessionImportError(f"the export holds unexpected tensors: {', '.join(sorted(tensors)[:5])}")
    ttl = _finite_number(info, "ttl_s")
    session = dataclasses.replace(template, ttl_s=ttl if ttl > 0 else template.ttl_s, config=config,
                                  state=State(state), static_state=State(static),
                                  last_token=last_token, memories=memories, stats=stats, pending=pending,
                                  revision=None, _views={})  # not the template's: one per imported record
    return session, config


def _v1_settings(info: dict[str, Any], sessions: SessionModel) -> dict[str, dict[str, Any] | None]:
    """A version-1 export's flat settings as the memories' (only of memories this server has: a copy model the
    exporting server had and this one has not is dropped, as before)."""
    cfg = info["config"]
    size = cfg.get("adapter_size")
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise SessionImportError("the export's 'adapter_size' is not a positive integer")
    neural = cfg.get("neural_cache", False)  # exports older than the session's neural cache have none
    if not isinstance(neural, bool):
        raise SessionImportError("the export's 'neural_cache' is not true or false")
    copy_model = cfg.get("copy_model", True)  # exports older than the setting had the copy model on
    if not isinstance(copy_model, bool):
        raise SessionImportError("the export's 'copy_model' is not true or false")
    asked: dict[str, dict[str, Any] | None] = {
        "adapter": {"lr": _finite_number(cfg, "lr"), "decay": _finite_number(cfg, "decay"), "size": size},
        "words": {"weight": _finite_number(cfg, "cache_weight") if "cache_weight" in cfg else 0.0},
        "cache": {} if neural else None, "copy": {} if copy_model and not neural else None}
    if "copy" not in sessions.memories:
        del asked["copy"]
    return {name: value for name, value in asked.items() if name in sessions.memories or value is not None}


def _v2_settings(info: dict[str, Any]) -> dict[str, dict[str, Any] | None]:
    settings = info["config"].get("memories")
    if not isinstance(settings, dict) or not all(v is None or isinstance(v, dict) for v in settings.values()):
        raise SessionImportError("the export's 'config.memories' is not an object of settings")
    return settings


def _pending(value: Any, tokenizer: Tokenizer) -> bytes:
    """The export's pending text: base64 of what the tokenizer leaves pending (nothing is stable in it)."""
    if not isinstance(value, str):
        raise SessionImportError("the export's 'pending' is not a string")
    try:
        pending = base64.b64decode(value, validate=True)
    except (binascii.Error, ValueError):
        raise SessionImportError("the export's 'pending' is not base64") from None
    if pending and tokenizer.split_stable(pending)[0]:
        raise SessionImportError("the export's 'pending' holds text that a session would have scored (a byte "
                                 "model's session has none; a word model's, at most the last word and the gap "
                                 "before it)")
    # An export of a version before the bound can hold more (a word that never ended, kept whole): its start is kept,
    # a word of that length being <unk> whatever follows (the same tokens), so that such a session still imports
    return pending[:PENDING_MAX_BYTES]
