"""Where the model runs: `ADAPTLM_DEVICE` / `--device` (auto | cpu | cuda | cuda:N).

"auto" is CUDA when a device is present, else the CPU. Nothing here touches a GPU driver at import; CUDA is
queried only when a device is resolved.
"""

from __future__ import annotations

import re

import torch

__all__ = ["DEVICE_PATTERN", "SWITCHES", "resolve_device", "switched_on"]

DEVICE_PATTERN = r"^(auto|cpu|cuda(:\d+)?)$"
SWITCHES = ("auto", "on", "off")  # the values of a setting that turns a GPU path on (`switched_on`)


def switched_on(setting: str, device: torch.device, name: str) -> bool:
    """Is a path that pays on a GPU on, on `device`? `setting` (the setting `name`): on, off, or auto: on a CUDA
    device only."""
    if setting not in SWITCHES:
        raise ValueError(f"{name} must be one of {', '.join(SWITCHES)}, not {setting!r}")
    return setting == "on" or (setting == "auto" and device.type == "cuda")


def resolve_device(name: str = "auto") -> torch.device:
    """The torch device `name` means here; ValueError when it is malformed or not present."""
    name = name.strip().lower()
    if not re.match(DEVICE_PATTERN, name):
        raise ValueError(f"device must be auto, cpu, cuda or cuda:N, not {name!r}")
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device {name!r}: no CUDA device is available here")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise ValueError(f"device {name!r}: only {torch.cuda.device_count()} CUDA device(s) here")
    return device
