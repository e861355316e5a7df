"""A model's skeleton: its modules and parameter shapes on the meta device, without initial values.

A load (models/checkpoint.py) and `LanguageModel.trainable_copy` build the model only to assign it tensors they
already have. On the meta device an initialiser computes nothing, yet `normal_` on a meta tensor runs torch's Python
reference implementation, whose first call imports torch._dynamo: 1.3-2.3 s of CPU in every process that loads a
checkpoint. `skeleton()` skips the initialisers on meta tensors instead, as torch's own `nn.init.orthogonal_` does.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

__all__ = ["skeleton"]

# the in-place random fills a module's initialiser calls directly (nn.init's functions are matched by module)
_TENSOR_FILLS = frozenset({torch.Tensor.normal_, torch.Tensor.uniform_, torch.Tensor.bernoulli_,
                           torch.Tensor.exponential_, torch.Tensor.geometric_, torch.Tensor.cauchy_,
                           torch.Tensor.log_normal_, torch.Tensor.random_})


class _NoInitOnMeta(TorchFunctionMode):
    """Returns a meta tensor as it is from `torch.nn.init.*` and the in-place random fills; anything else runs."""

    def __torch_function__(self, func: Callable[..., Any], types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        if func in _TENSOR_FILLS or getattr(func, "__module__", None) == "torch.nn.init":
            # nn.init's functions dispatch with the tensor as keyword `tensor`; Tensor methods get it as `self`
            target = args[0] if args else kwargs.get("tensor")
            if isinstance(target, torch.Tensor) and target.is_meta:
                return target
        return func(*args, **kwargs)


@contextmanager
def skeleton() -> Iterator[None]:
    """Modules built inside have their parameters and buffers on the meta device, uninitialised (module docstring):
    load them with `load_state_dict(..., assign=True)`."""
    with torch.device("meta"), _NoInitOnMeta():
        yield
