"""Mutations of a session export (a safetensors blob with the session's JSON metadata), shared by the property test
of imports (tests/server/_import_fuzz.py, hypothesis draws them) and the hostile catalogue (bench/hostile.py,
drawn at random): change one tensor's shape, dtype or values, one metadata field, or add a tensor."""

from __future__ import annotations

import json
import math
import random
from typing import Any

import torch
from safetensors.torch import load as load_tensors
from safetensors.torch import save as save_tensors

__all__ = ["DTYPES", "EXTRAS", "HOWS", "JSON_VALUES", "VALUES", "apply", "draw", "fields", "finite_numbers", "header"]

VALUES = [math.nan, math.inf, -math.inf, 3e38, -1e9, 1e6 + 1, -1e6, 1e6, 0.0, 1.0, -1.0, 2.0**31, -(2.0**31), 255.0]
JSON_VALUES = [10**400, -1, 2**53, 2**53 + 1, 1.5, 1e300, -1e300, "x", None, True, [], {}, 0, 1, 65535, 10**6]
DTYPES = [torch.float64, torch.float32, torch.float16, torch.int64, torch.int32, torch.uint8, torch.bool]
HOWS = ["empty", "twice", "unsqueeze", "dtype", "one", "fill", "drop"]
EXTRAS = ["state.x", "copy.y", "adapter.z", "nothing"]


def header(blob: bytes) -> dict[str, Any]:
    """The safetensors header of `blob`: its tensors' dtypes, shapes and offsets, and `__metadata__`."""
    return json.loads(blob[8 : 8 + int.from_bytes(blob[:8], "little")])  # type: ignore[no-any-return]


def _tensor_change(t: torch.Tensor, how: str, value: float, dim: int, dtype: torch.dtype, index: int) -> torch.Tensor:
    if how == "empty" and t.dim():
        return t.narrow(dim % t.dim(), 0, 0)
    if how == "twice" and t.dim():
        return torch.cat([t, t], dim % t.dim())
    if how == "unsqueeze":
        return t.unsqueeze(0)
    if how == "dtype":
        return t.to(dtype)
    out = t.clone()
    flat = out.view(-1) if out.numel() else out
    if how == "one" and out.numel():
        flat[index % out.numel()] = torch.tensor(value).to(out.dtype) if out.is_floating_point() \
            else _integer(value, out.dtype, 0)
        return out
    if out.is_floating_point():
        return out.fill_(value)
    return out.fill_(_integer(value, out.dtype, -1))


def _integer(value: float, dtype: torch.dtype, nonfinite: int) -> int:
    """`value` as an integer that `dtype` holds (clamped to its range); `nonfinite` (clamped too) for NaN and inf."""
    if dtype == torch.bool:
        return int(bool(value)) if math.isfinite(value) else 1
    info = torch.iinfo(dtype)
    return int(max(min(value if math.isfinite(value) else nonfinite, info.max), info.min))


def apply(blob: bytes, change: tuple[Any, ...]) -> bytes:
    """`blob` with one change: ("tensor", key, how, value, dim, dtype, index), ("field", path, value) or
    ("extra", key)."""
    tensors = load_tensors(blob)
    meta = dict(header(blob)["__metadata__"])
    session = json.loads(meta["session"])
    if change[0] == "tensor":
        _, key, how, value, dim, dtype, index = change
        if how == "drop":
            del tensors[key]
        else:
            tensors[key] = _tensor_change(tensors[key], how, value, dim, dtype, index).contiguous()
    elif change[0] == "field":
        _, path, value = change
        node = session
        for part in path[:-1]:
            node = node.setdefault(part, {}) if isinstance(node, dict) else node
        if isinstance(node, dict):
            node[path[-1]] = value
    else:
        tensors[change[1]] = torch.zeros(1)
    meta["session"] = json.dumps(session)
    return save_tensors(tensors, metadata=meta)


def fields(session: dict[str, Any], prefix: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    """Every leaf path of the export's session metadata, and a new key in each object."""
    out = [(*prefix, "new")]
    for k, v in session.items():
        if isinstance(v, dict) and v:
            out += fields(v, (*prefix, k))
        else:
            out.append((*prefix, k))
    return out


def draw(rng: random.Random, keys: list[str], paths: list[tuple[str, ...]]) -> tuple[Any, ...]:
    """One change at random, from the same space as the property test's."""
    kind = rng.choice(["tensor", "tensor", "field", "extra"])
    if kind == "tensor":
        return ("tensor", rng.choice(keys), rng.choice(HOWS), rng.choice(VALUES), rng.randrange(4),
                rng.choice(DTYPES), rng.randrange(10**6))
    if kind == "field":
        return ("field", rng.choice(paths), rng.choice(JSON_VALUES))
    return ("extra", rng.choice(EXTRAS))


def finite_numbers(value: Any) -> bool:
    """Every float in a decoded JSON answer is finite."""
    if isinstance(value, float):
        return math.isfinite(value)
    if isinstance(value, dict):
        return all(finite_numbers(v) for v in value.values())
    if isinstance(value, list):
        return all(finite_numbers(v) for v in value)
    return True
