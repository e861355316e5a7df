"""The processes of a distributed training run (torch.distributed), or the one process of a plain run.

Launched by `torchrun --nproc_per_node N -m trainer ...` (trainer/__main__.py): torchrun sets RANK, WORLD_SIZE,
LOCAL_RANK and the rendezvous address; `init` joins the group, gloo on the CPU and NCCL on CUDA devices (one
device per process: cuda:LOCAL_RANK). Everything here is a no-op with one process, so the single-process trainer
runs exactly as it did before distributed training existed.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["Group", "current", "init", "launched", "shutdown"]


@dataclass(frozen=True)
class Group:
    rank: int = 0
    world: int = 1

    @property
    def main(self) -> bool:
        """Rank 0: the one process that validates, logs and writes files."""
        return self.rank == 0

    def share(self, batch: int, what: str = "batch_size") -> int:
        """This process's rows of a global batch of `batch` rows: batch / world (an error unless it divides)."""
        if batch % self.world:
            raise ValueError(f"{what} {batch} must be a multiple of the number of processes ({self.world})")
        return batch // self.world

    def barrier(self) -> None:
        if self.world > 1:
            dist.barrier()

    def mean_(self, tensors: list[torch.Tensor]) -> None:
        """Replace every tensor by its mean over the processes, in place (one all-reduce of a flat buffer)."""
        if self.world == 1 or not tensors:
            return
        flat = torch.cat([t.reshape(-1) for t in tensors])
        dist.all_reduce(flat)
        flat /= self.world
        offset = 0
        for t in tensors:
            t.copy_(flat[offset : offset + t.numel()].view_as(t))
            offset += t.numel()

    def mean(self, value: torch.Tensor) -> float:
        """The mean of a scalar over the processes."""
        t = value.detach().reshape(1).clone()
        self.mean_([t])
        return float(t)

    def any(self, flag: bool, device: torch.device | str = "cpu") -> bool:
        """True on every process when `flag` is true on one (the processes must agree where to stop)."""
        if self.world == 1:
            return flag
        t = torch.tensor([1.0 if flag else 0.0], device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return bool(t.item())

    def gather(self, obj: Any) -> list[Any]:
        """Every process's `obj` (picklable; tensors on the CPU), in rank order, on every process."""
        if self.world == 1:
            return [obj]
        out: list[Any] = [None] * self.world
        dist.all_gather_object(out, obj)
        return out

    def broadcast(self, obj: Any) -> Any:
        """Rank 0's `obj` on every process."""
        if self.world == 1:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]


def current() -> Group:
    """The group this process belongs to: the initialised torch.distributed group, else one process."""
    if dist.is_available() and dist.is_initialized():
        return Group(dist.get_rank(), dist.get_world_size())
    return Group()


def launched() -> bool:
    """Whether a launcher (torchrun) started this process as one of a group."""
    return "WORLD_SIZE" in os.environ and "RANK" in os.environ


def init(device: torch.device) -> torch.device:
    """Join the group torchrun set up; -> this process's device (cuda:LOCAL_RANK on CUDA). No-op unless launched."""
    if not launched() or dist.is_initialized():
        return device
    if device.type == "cuda":
        # one GPU per process; NCCL refuses two ranks on one device
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
    else:
        dist.init_process_group("gloo")
    return device


def shutdown(clean: bool = False) -> None:
    """Leave the group. `clean` (every process got here without an error): wait for the others first, so that no
    process tears its connections down while another still talks on them (gloo then aborts the survivor with
    "terminate called without an active exception", seen once in a resumed 2-process run)."""
    if dist.is_available() and dist.is_initialized():
        if clean:
            dist.barrier()
        dist.destroy_process_group()
