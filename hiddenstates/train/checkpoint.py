"""Checkpoints in speculators' format, plus what an exact resume needs.

    OUT/checkpoints/step-00000120/
        config.json  model.safetensors  (config.py)   speculators' format: bf16 weights incl. d2t/t2d;
                                                       SpeculatorModel.from_pretrained and vLLM load it
        trainer/trainable_fp32.safetensors             the trained weights at full precision
        trainer/optimizer.pt  trainer/scheduler.pt     (torch.save of tensors and numbers: weights_only loads)
        trainer/state.json                             step, epoch, loader position, run identity
    OUT/checkpoints/latest                             name of the newest complete checkpoint

A checkpoint is written into `<name>.tmp` and renamed into place, and `latest` is updated last, so
a crash mid-save leaves the previous checkpoint as the one to resume from.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from hiddenstates.errors import TrainingError
from hiddenstates.train.distributed import DistContext, unwrap

__all__ = ["CHECKPOINTS_DIR", "Checkpointer", "ResumePoint", "full_model_state", "save_speculators_model"]

CHECKPOINTS_DIR = "checkpoints"
LATEST = "latest"
STATE_VERSION = 1


@dataclass(frozen=True)
class ResumePoint:
    path: Path
    state: dict[str, Any]


def full_model_state(model: torch.nn.Module) -> dict[str, Any]:
    """Every weight, unsharded, on the CPU, under the unwrapped model's names.

    A collective under FSDP (gathers the shards): every rank must call it. Local under DDP.
    """
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return dict(get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True)))


def save_speculators_model(raw_model: Any, full_state: dict[str, Any], path: Path) -> None:
    """config.json + model.safetensors in bf16, as speculators' own checkpointer writes them."""
    from speculators.train.checkpointer import convert_float_dtype, patch_config_dtype
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    state = convert_float_dtype(full_state, torch.bfloat16)
    raw_model.save_pretrained(str(path), state_dict=state)
    patch_config_dtype(path / "config.json", torch.bfloat16)


class Checkpointer:
    def __init__(self, out: Path, ctx: DistContext, *, keep: int) -> None:
        self.dir = out / CHECKPOINTS_DIR
        self.ctx = ctx
        self.keep = keep

    def latest(self) -> ResumePoint | None:
        pointer = self.dir / LATEST
        if not pointer.exists():
            return None
        name = pointer.read_text().strip()
        path = self.dir / name
        state_file = path / "trainer" / "state.json"
        if not name or not state_file.exists():
            raise TrainingError(f"{pointer} names checkpoint {name!r}, which is missing or incomplete; "
                                "point it at a complete checkpoint folder or remove it to start over")
        state = json.loads(state_file.read_text())
        if state.get("version") != STATE_VERSION:
            raise TrainingError(f"{state_file} has version {state.get('version')}, this hiddenstates reads {STATE_VERSION}")
        return ResumePoint(path=path, state=state)

    def save(self, *, name: str, model: torch.nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any,
             state: dict[str, Any]) -> Path:
        """Collective: every rank calls it; rank 0 writes."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

        full = full_model_state(model)
        optim = get_optimizer_state_dict(model, optimizer,
                                         options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        final = self.dir / name
        if self.ctx.is_main:
            from safetensors.torch import save_file

            raw = unwrap(model)
            trainable = {n for n, p in raw.named_parameters() if p.requires_grad}
            tmp = self.dir / f"{name}.tmp"
            if tmp.exists():
                shutil.rmtree(tmp)
            tmp.mkdir(parents=True)
            save_speculators_model(raw, full, tmp)
            (tmp / "trainer").mkdir()
            save_file({k: v.detach().to(torch.float32).contiguous() for k, v in full.items() if k in trainable},
                      str(tmp / "trainer" / "trainable_fp32.safetensors"))
            torch.save(optim, tmp / "trainer" / "optimizer.pt")
            torch.save(scheduler.state_dict(), tmp / "trainer" / "scheduler.pt")
            (tmp / "trainer" / "state.json").write_text(
                json.dumps({"version": STATE_VERSION, **state}, indent=2, sort_keys=True, default=str) + "\n")
            if final.exists():
                shutil.rmtree(final)
            os.replace(tmp, final)
            pointer_tmp = self.dir / f".{LATEST}.tmp"
            pointer_tmp.write_text(name + "\n")
            os.replace(pointer_tmp, self.dir / LATEST)
            self._prune(keep_name=name)
        self.ctx.barrier()
        return final

    def _prune(self, *, keep_name: str) -> None:
        names = sorted(p.name for p in self.dir.iterdir() if p.is_dir() and p.name.startswith("step-")
                       and not p.name.endswith(".tmp"))
        for old in names[: max(0, len(names) - self.keep)]:
            if old != keep_name:
                shutil.rmtree(self.dir / old)

    @staticmethod
    def load_trainable(raw_model: torch.nn.Module, point: ResumePoint) -> None:
        from safetensors.torch import load_file

        weights = load_file(str(point.path / "trainer" / "trainable_fp32.safetensors"))
        trainable = {n for n, p in raw_model.named_parameters() if p.requires_grad}
        if set(weights) != trainable:
            raise TrainingError(
                f"checkpoint {point.path} holds trainable weights {sorted(set(weights) ^ trainable)[:5]} that do not "
                "match this draft's; resume with the same draft settings"
            )
        raw_model.load_state_dict(weights, strict=False)

    @staticmethod
    def load_optimizer(model: torch.nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any,
                       point: ResumePoint) -> None:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

        optim = torch.load(point.path / "trainer" / "optimizer.pt", weights_only=True, map_location="cpu")
        set_optimizer_state_dict(model, optimizer, optim, options=StateDictOptions(full_state_dict=True))
        scheduler.load_state_dict(torch.load(point.path / "trainer" / "scheduler.pt", weights_only=True))
