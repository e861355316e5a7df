"""The session export format: a versioned, pickle-free blob (safetensors bytes of the state, shadow state and
adapter, with JSON metadata in the safetensors header), tagged with the checkpoint's weights hash.

The metadata keeps the key `last_byte` for the session's next input token (`Session.last_token`: a byte, or a word
model's token id): exports written before the record's rename, and by servers that have not been updated, read the
same. `pending` (base64) is a word session's observed text not yet scored (`Session.pending`); an export without it
(a byte session's, or an older one) has none.
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

from models.base import Adapter, State
from models.copymodel import CopyConfig, CopyModel
from models.tokenizer import ByteTokenizer, Tokenizer
from models.wordcache import WordCache
from server.engine._errors import SessionImportError
from server.engine._session import PENDING_MAX_BYTES, AdaptationConfig, Session, SessionStats

__all__ = ["EXPORT_FORMAT", "EXPORT_VERSION", "export_session", "import_session"]

EXPORT_FORMAT = "adaptlm-session"
EXPORT_VERSION = 1
_MAX_HEADER = 1 << 20  # a session's safetensors header is a few hundred bytes


def _plain(t: torch.Tensor) -> torch.Tensor:
    return t.detach().to("cpu").contiguous().clone()


def export_session(session: Session, model_hash: str) -> bytes:
    """A versioned, pickle-free blob: safetensors bytes of the tensors, with JSON metadata in its header,
    tagged with the checkpoint's weights hash. Owner and id are not part of it: the importer chooses both."""
    tensors = {f"state.{k}": _plain(v) for k, v in session.state.persistent().tensors.items()}
    tensors |= {f"static.{k}": _plain(v) for k, v in session.static_state.persistent().tensors.items()}
    tensors |= {f"adapter.{k}": _plain(v) for k, v in session.adapter.mats.items()}
    if session.copy is not None:
        tensors |= {f"copy.{k}": _plain(v) for k, v in session.copy.tensors.items()}
    if session.cache is not None:
        tensors |= {f"cache.{k}": _plain(v) for k, v in session.cache.tensors.items()}
    meta = {
        "ttl_s": session.ttl_s, "created": session.created, "last_byte": session.last_token,
        "config": dataclasses.asdict(session.config), "stats": dataclasses.asdict(session.stats),
        "words": session.words.to_dict(),
    }
    if session.pending:
        meta["pending"] = base64.b64encode(session.pending).decode("ascii")
    return save_tensors(tensors, metadata={"format": EXPORT_FORMAT, "version": str(EXPORT_VERSION),
                                           "model_hash": model_hash,
                                           "session": json.dumps(meta, ensure_ascii=False)})


def _header_metadata(blob: bytes) -> dict[str, str]:
    """The `__metadata__` of a safetensors blob: an 8-byte little-endian header length, then a JSON header."""
    if len(blob) < 8:
        raise SessionImportError("not a session export (too short)")
    n = int.from_bytes(blob[:8], "little")
    if n > min(_MAX_HEADER, len(blob) - 8):
        raise SessionImportError("not a session export (bad header)")
    try:
        header = json.loads(blob[8 : 8 + n])
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError):  # RecursionError: nesting 1e5 deep
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


def import_session(blob: bytes, *, model_hash: str, template: Session,
                   tokenizer: Tokenizer | None = None) -> tuple[Session, AdaptationConfig]:
    """Read an `export_session` blob into a session shaped like `template` (a fresh session of this model:
    its id, owner, clock times and tensor layouts are kept), its next token and pending text checked against the
    model's `tokenizer` (None: bytes). -> the session and the config the blob asks for,
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
    neural = cfg.get("neural_cache", False)  # exports older than the session's neural cache have none
    if not isinstance(neural, bool):
        raise SessionImportError("the export's 'neural_cache' is not true or false")
    copy_model = cfg.get("copy_model", True)  # exports older than the setting had the copy model on
    if not isinstance(copy_model, bool):
        raise SessionImportError("the export's 'copy_model' is not true or false")
    config = AdaptationConfig(lr=_finite_number(cfg, "lr"), decay=_finite_number(cfg, "decay"), adapter_size=size,
                              cache_weight=_finite_number(cfg, "cache_weight") if "cache_weight" in cfg else 0.0,
                              neural_cache=neural, copy_model=copy_model)
    try:  # exports older than the word cache have none
        words = WordCache.from_dict(info.get("words") or {})
    except ValueError:
        raise SessionImportError("the export's word cache is not valid") from None
    tokenizer = tokenizer or ByteTokenizer()
    last_token = info.get("last_byte")
    if isinstance(last_token, bool) or not isinstance(last_token, int) \
            or not 0 <= last_token < tokenizer.vocab_size:
        raise SessionImportError("the export's 'last_byte' is not a byte" if tokenizer.kind == "bytes" else
                                 f"the export's 'last_byte' is not a token id of this model (0 to "
                                 f"{tokenizer.vocab_size - 1})")
    pending = _pending(info.get("pending", ""), tokenizer)
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

    # derived tensors (caches, `State.persistent`) are not exported: the template's fresh ones, rebuilt on use
    kept = template.state.persistent().tensors
    state_shapes = {k: tuple(v.shape) for k, v in kept.items()}
    state = {**template.state.tensors, **take("state", kept, state_shapes)}
    static = {**template.static_state.tensors, **take("static", template.static_state.persistent().tensors,
                                                       state_shapes)}
    mats = take("adapter", template.adapter.mats, {k: (1, size, size) for k in template.adapter.mats})
    # an export without a copy model (older, or from a server without one) starts one afresh; a session with the
    # neural cache, or with its copy model turned off, has none
    copy = template.copy if not neural and copy_model else None
    given = {k[len("copy."):]: tensors.pop(k) for k in [k for k in tensors if k.startswith("copy.")]}
    if given and copy is not None and template.copy is not None:
        try:
            copy = State({k: v.to(template.copy.tensors[k].device) if k in template.copy.tensors else v
                          for k, v in given.items()})
            if copy.batch != 1:
                raise ValueError("a session's copy model has one row")
            _check_copy(copy, template.copy)
        except ValueError as e:
            raise SessionImportError(f"the export's copy model is not valid: {e}") from None
    cache = _cache(tensors, template.cache, tokenizer.vocab_size) if neural else None
    if tensors:
        raise SessionImportError(f"the export holds unexpected tensors: {', '.join(sorted(tensors)[:5])}")
    ttl = _finite_number(info, "ttl_s")
    session = dataclasses.replace(template, ttl_s=ttl if ttl > 0 else template.ttl_s, config=config,
                                  state=State(state), static_state=State(static), last_token=last_token,
                                  adapter=Adapter(mats), stats=stats, words=words, copy=copy, pending=pending,
                                  cache=cache)
    return session, config


def _cache(tensors: dict[str, torch.Tensor], template: State | None, vocab_size: int) -> State | None:
    """The export's neural-cache memory ("cache.keys" (1, L, H) float32, "cache.values" (1, L) int64 token ids,
    "cache.valid" (1, L) bool), popped from `tensors` and checked against the template's (its H); None if it has
    none (a session that had observed nothing)."""
    given = {k[len("cache."):]: tensors.pop(k) for k in [k for k in tensors if k.startswith("cache.")]}
    if not given:
        return None
    if template is None:
        raise SessionImportError("the export's neural cache cannot be read here (the model gives no hidden states)")
    keys, values, valid = given.get("keys"), given.get("values"), given.get("valid")
    if keys is None or values is None or valid is None or len(given) != 3:
        raise SessionImportError("the export's neural cache needs exactly cache.keys, cache.values and cache.valid")
    H = template.tensors["keys"].shape[2]
    L = keys.shape[1] if keys.dim() == 3 else -1
    if (keys.dtype != torch.float32 or keys.dim() != 3 or keys.shape[0] != 1 or keys.shape[2] != H
            or values.dtype != torch.int64 or tuple(values.shape) != (1, L)
            or valid.dtype != torch.bool or tuple(valid.shape) != (1, L)):
        raise SessionImportError(f"the export's neural cache is not of shapes (1, L, {H}) float32, (1, L) int64 and "
                                 "(1, L) bool (another model?)")
    if not bool(torch.isfinite(keys).all()):
        raise SessionImportError("the export's cache.keys holds non-finite values")
    if L and not (0 <= int(values.min()) and int(values.max()) < vocab_size):
        raise SessionImportError(f"the export's cache.values are not token ids of this model (0 to {vocab_size - 1})")
    device = template.tensors["keys"].device
    return State({"keys": keys.to(device), "values": values.to(device), "valid": valid.to(device)})


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


def _check_copy(copy: State, template: State) -> None:
    """ValueError unless `copy` has the template's layout and values a copy model could have made."""
    window = template.tensors["hist"].shape[1]
    orders = template.tensors["weights"].shape[2] - 3
    CopyModel(CopyConfig(window=window, orders=orders)).check_state(copy)
