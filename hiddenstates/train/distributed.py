"""Process-group setup and model wrapping: the same code runs as one process or under torchrun.

NCCL on GPUs, gloo on CPU (so the tests run two CPU processes); DDP by default, FSDP2
(`fully_shard`, through speculators' own `apply_fully_sharded`) on request.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from hiddenstates.errors import TrainingError

__all__ = ["DistContext", "setup_distributed", "teardown_distributed", "unwrap", "wrap_model"]


@dataclass(frozen=True)
class DistContext:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    backend: str | None  # None: a single process without a process group

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.backend is not None

    def barrier(self) -> None:
        if self.distributed:
            dist.barrier()

    def all_reduce_sum(self, t: torch.Tensor) -> torch.Tensor:
        if self.distributed:
            dist.all_reduce(t, op=dist.ReduceOp.SUM)
        return t

    def all_gather_int(self, value: int) -> list[int]:
        if not self.distributed:
            return [int(value)]
        local = torch.tensor([int(value)], dtype=torch.int64, device=self.device)
        out = [torch.zeros_like(local) for _ in range(self.world_size)]
        dist.all_gather(out, local)
        return [int(x.item()) for x in out]

    def any_true(self, flag: bool) -> bool:
        t = torch.tensor([1 if flag else 0], dtype=torch.int64, device=self.device)
        return bool(self.all_reduce_sum(t).item() > 0)


def _pick_device(pref: str, local_rank: int) -> torch.device:
    if pref == "cuda" or (pref == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            raise TrainingError("--device cuda was requested but no CUDA device is visible")
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def setup_distributed(device: str = "auto") -> DistContext:
    """Join torchrun's process group when launched by it (WORLD_SIZE > 1); else run as one process."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    dev = _pick_device(device, local_rank)
    if world <= 1:
        return DistContext(rank=0, world_size=1, local_rank=local_rank, device=dev, backend=None)
    backend = "nccl" if dev.type == "cuda" else "gloo"
    if not dist.is_initialized():
        kwargs: dict[str, Any] = {"backend": backend}
        if dev.type == "cuda":
            kwargs["device_id"] = dev
        dist.init_process_group(**kwargs)
    return DistContext(rank=dist.get_rank(), world_size=dist.get_world_size(), local_rank=local_rank, device=dev,
                       backend=backend)


def teardown_distributed(ctx: DistContext) -> None:
    if ctx.distributed and dist.is_initialized():
        dist.destroy_process_group()


def wrap_model(model: torch.nn.Module, ctx: DistContext, *, fsdp: bool) -> torch.nn.Module:
    """Move to the device and wrap for data parallelism (DDP, or FSDP2 when `fsdp`)."""
    if fsdp:
        if not ctx.distributed:
            raise TrainingError("--fsdp shards the model over processes: launch with torchrun --nproc_per_node N (N >= 2)")
        from speculators.train.distributed import apply_fully_sharded

        model.to(ctx.device)
        # bf16 compute with fp32 gradient reduction on GPUs (speculators' policy); fp32 on CPU.
        apply_fully_sharded(model, param_dtype=torch.bfloat16 if ctx.device.type == "cuda" else torch.float32)
        return model
    model.to(ctx.device)
    if not ctx.distributed:
        return model
    from torch.nn.parallel import DistributedDataParallel

    return DistributedDataParallel(model, device_ids=[ctx.device.index] if ctx.device.type == "cuda" else None)


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The Eagle3DraftModel inside a DDP wrapper (FSDP2 modifies the model in place)."""
    from torch.nn.parallel import DistributedDataParallel

    return model.module if isinstance(model, DistributedDataParallel) else model
