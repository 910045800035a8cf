"""The training loop: speculators' EAGLE-3 model, loss and collate, fed by HiddenStatesDataset.

speculators' own Trainer needs an accelerator (`model.to(local_rank)`, accelerator syncs), so this
is a small loop of our own around speculators' pieces. It runs unchanged as one process or under
`torchrun` (DDP, or FSDP2 with --fsdp; NCCL on GPUs, gloo on CPU). Every rank takes the same
number of steps per epoch (the loader pads the tail, see order.py), so collectives never hang.
"""

from __future__ import annotations

import contextlib
import json
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import xxhash

from hiddenstates.errors import TrainingError
from hiddenstates.train.checkpoint import (
    CHECKPOINTS_DIR,
    Checkpointer,
    ResumePoint,
    full_model_state,
    save_speculators_model,
)
from hiddenstates.train.config import TrainConfig
from hiddenstates.train.dataset import HiddenStatesDataset, StreamOptions
from hiddenstates.train.distributed import (
    DistContext,
    setup_distributed,
    teardown_distributed,
    unwrap,
    wrap_model,
)
from hiddenstates.train.draft import DraftSpec, build_draft, resolve_attn, resolve_loss_impl
from hiddenstates.train.metrics import METRICS_FILE, PLOT_FILE, MetricsLog, StepReporter, plot_loss_curve
from hiddenstates.train.verifier import check_store_matches, load_verifier
from hiddenstates.train.vocab import load_vocab_mapping, save_vocab_mapping, vocab_mapping_from_store

__all__ = ["TrainResult", "train"]

VOCAB_DIR = "vocab"
FINAL_DIR = "final"
CONFIG_FILE = "train_config.json"
SUMMARY_FILE = "summary.json"
_HIDDEN_KEYS = ("hidden_states", "verifier_last_hidden_states")


@dataclass(frozen=True)
class TrainResult:
    out: Path
    final_dir: Path
    global_step: int
    completed: bool  # False when stopped early by --max-steps
    last_train_loss: float | None
    last_val_loss: float | None


def train(config: TrainConfig) -> TrainResult:
    """Train an EAGLE-3 draft on a store. Call it in every process (torchrun) or in one."""
    ctx = setup_distributed(config.device)
    try:
        return _Run(config, ctx).run()
    finally:
        teardown_distributed(ctx)


def batch_digest(batch: dict[str, torch.Tensor]) -> int:
    """63-bit hash of a packed row's tokens and document layout: identifies the data a step saw."""
    h = xxhash.xxh3_64()
    h.update(batch["input_ids"].cpu().numpy().tobytes())
    h.update(batch["document_ids"].cpu().numpy().tobytes())
    return h.intdigest() & 0x7FFFFFFFFFFFFFFF


class _Run:
    def __init__(self, config: TrainConfig, ctx: DistContext) -> None:
        self.c = config
        self.ctx = ctx
        self.out = Path(config.out).expanduser().resolve()
        self.reporter = StepReporter(total=1, start=0, enabled=False, progress=False, log_every=1)
        if ctx.is_main:
            self.out.mkdir(parents=True, exist_ok=True)
        ctx.barrier()
        self.checkpointer = Checkpointer(self.out, ctx, keep=config.keep_checkpoints)
        self.resume_point = self._resume_point()
        self._open_data()
        self._check_verifier()
        self._build_model()
        self._build_optimizer()
        if self.resume_point is not None:
            self._restore(self.resume_point)
        else:
            self.global_step = 0

    # -- setup -----------------------------------------------------------------------------
    def _resume_point(self) -> ResumePoint | None:
        has_run = (self.out / CHECKPOINTS_DIR).exists() or (self.out / METRICS_FILE).exists()
        if not self.c.resume:
            if has_run:
                raise TrainingError(f"{self.out} already holds a training run; pass --resume to continue it, "
                                    "or choose another --out")
            return None
        point = self.checkpointer.latest()
        if point is None:
            return None  # --resume on a fresh output folder starts a new run (job scripts can always pass it)
        saved = json.loads((self.out / CONFIG_FILE).read_text()) if (self.out / CONFIG_FILE).exists() else {}
        saved_id = saved.get("identity", {})
        now = self.c.data_identity()
        diffs = sorted(k for k in set(saved_id) | set(now) if saved_id.get(k) != now.get(k))
        if diffs:
            detail = "; ".join(f"{k}: {saved_id.get(k)!r} -> {now.get(k)!r}" for k in diffs)
            raise TrainingError(f"--resume with different settings than the run in {self.out} ({detail}); "
                                "resume with the same settings (only performance flags may change)")
        return point

    def _open_data(self) -> None:
        c = self.c
        common: dict[str, Any] = {"where": c.where, "params": list(c.params) or None, "layers": c.layers,
                                  "rank": self.ctx.rank, "world_size": self.ctx.world_size}
        self.train_ds = HiddenStatesDataset(c.root, options=StreamOptions(
            split="train" if c.val_fraction > 0 else "all", val_fraction=c.val_fraction, shuffle=True, seed=c.seed,
            total_seq_len=c.total_seq_len, prefetch_bytes=c.prefetch_mb << 20, threads=c.decode_threads), **common)
        if self.train_ds.num_samples == 0:
            raise TrainingError(f"no training samples in {c.root} (where={c.where!r}, val_fraction={c.val_fraction}); "
                                "loosen --where or add data")
        self.val_ds: HiddenStatesDataset | None = None
        if c.val_fraction > 0:
            self.val_ds = HiddenStatesDataset(self.train_ds.store, options=StreamOptions(
                split="val", val_fraction=c.val_fraction, shuffle=False, seed=c.seed, total_seq_len=c.total_seq_len,
                prefetch_bytes=c.prefetch_mb << 20, threads=c.decode_threads), **common)
            if self.val_ds.num_samples == 0:
                self.val_ds = None
        self.steps_per_epoch = [self.train_ds.steps_in_epoch(e) for e in range(c.epochs)]
        self.total_steps = sum(self.steps_per_epoch)

    def _check_verifier(self) -> None:
        self.verifier = load_verifier(self.c.verifier)
        self.notes = check_store_matches(self.train_ds.store, self.verifier, aux_layer_ids=self.train_ds.aux_layer_ids,
                                         last_layer_id=self.train_ds.last_layer_id, postnorm=self.c.postnorm,
                                         check_tokenizer=self.c.check_tokenizer)

    def _vocab(self) -> tuple[torch.Tensor | None, torch.Tensor | None, int]:
        target = self.verifier.vocab_size
        draft = min(self.c.draft_vocab_size, target)
        if draft == target:
            return None, None, draft  # the full vocabulary: speculators needs no mapping
        vdir = self.out / VOCAB_DIR
        if self.ctx.is_main and load_vocab_mapping(vdir) is None:
            mapping = vocab_mapping_from_store(self.train_ds.store, draft_vocab_size=draft, target_vocab_size=target)
            save_vocab_mapping(mapping, vdir, meta={"source": "catalog token_counts (loss-masked)",
                                                    "dataset_fingerprint": self.train_ds.store.fingerprint})
        self.ctx.barrier()
        loaded = load_vocab_mapping(vdir)
        if loaded is None:
            raise TrainingError(f"the vocabulary mapping was not found in {vdir} after rank 0 wrote it; is --out on a "
                                "filesystem every rank sees?")
        mapping, _ = loaded
        if mapping.draft_vocab_size != draft or mapping.t2d.shape[0] != target:
            raise TrainingError(f"the saved vocabulary mapping in {vdir} is for draft/target sizes "
                                f"{mapping.draft_vocab_size}/{mapping.t2d.shape[0]}, this run needs {draft}/{target}; "
                                f"delete {vdir} or use another --out")
        self.vocab_coverage = mapping.covered_fraction
        t2d, d2t = mapping.tensors()
        return t2d, d2t, draft

    def _build_model(self) -> None:
        from loguru import logger as loguru_logger
        from speculators.losses import resolve_loss_config

        loguru_logger.disable("speculators")  # its per-file INFO lines drown the progress output
        t2d, d2t, draft_vocab = self._vocab()
        self.attn = resolve_attn(self.c.attn, self.ctx.device.type)
        spec = DraftSpec(verifier=self.c.verifier, aux_layer_ids=self.train_ds.aux_layer_ids,
                         draft_vocab_size=draft_vocab, ttt_steps=self.c.ttt_steps, draft_layers=self.c.draft_layers,
                         sliding_window=self.c.sliding_window, attn=self.attn,
                         skip_verifier_norm=self.c.postnorm == "skip-verifier-norm"
                         and self.train_ds.store.info.last_layer == "postnorm")
        # The same seed on every rank: identical initial weights even before DDP/FSDP synchronize them.
        torch.manual_seed(self.c.seed)
        raw = build_draft(spec, t2d=t2d, d2t=d2t)
        if self.resume_point is not None:
            Checkpointer.load_trainable(raw, self.resume_point)
        self.model = wrap_model(raw, self.ctx, fsdp=self.c.fsdp)
        self.loss_config = resolve_loss_config(self.c.loss, resolve_loss_impl(self.c.loss_impl))
        self.autocast = (torch.autocast("cuda", dtype=torch.bfloat16) if self.ctx.device.type == "cuda"
                         else contextlib.nullcontext())

    def _build_optimizer(self) -> None:
        from transformers import (
            get_constant_schedule_with_warmup,
            get_cosine_schedule_with_warmup,
            get_linear_schedule_with_warmup,
        )

        params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(params, lr=self.c.lr, weight_decay=self.c.weight_decay)
        warmup = int(self.total_steps * self.c.warmup_ratio)
        if self.c.scheduler == "linear":
            self.scheduler = get_linear_schedule_with_warmup(self.optimizer, warmup, self.total_steps)
        elif self.c.scheduler == "cosine":
            self.scheduler = get_cosine_schedule_with_warmup(self.optimizer, warmup, self.total_steps)
        else:
            self.scheduler = get_constant_schedule_with_warmup(self.optimizer, warmup)

    def _restore(self, point: ResumePoint) -> None:
        Checkpointer.load_optimizer(self.model, self.optimizer, self.scheduler, point)
        self.train_ds.load_state_dict(point.state["loader"])
        self.global_step = int(point.state["global_step"])

    # -- steps -----------------------------------------------------------------------------
    def _to_device(self, batch: dict[str, Any]) -> dict[str, torch.Tensor]:
        dev = self.ctx.device
        out = {}
        for k, v in batch.items():
            v = v.to(dev, non_blocking=True)
            if k in _HIDDEN_KEYS and dev.type != "cuda":
                v = v.float()  # no autocast on CPU: the fp32 model wants fp32 inputs
            out[k] = v
        return out

    def _forward(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        with self.autocast:
            _, loss, metrics = self.model(**batch, ttt_steps=self.c.ttt_steps,
                                          ttt_step_loss_decay=self.c.ttt_step_loss_decay, loss_config=self.loss_config)
        return loss, metrics

    def _metric_vector(self, loss: torch.Tensor, metrics: dict[str, torch.Tensor], batch: dict[str, torch.Tensor],
                       ) -> torch.Tensor:
        # Sums that add up across ranks: losses weighted by loss tokens (a padding row weighs nothing).
        n_loss = batch["loss_mask"].sum().float()
        n_tok = (batch["document_ids"] >= 0).sum().float()
        vals = [loss.detach().float() * n_loss, n_loss, n_tok]
        for i in range(self.c.ttt_steps):
            vals += [metrics[f"loss_{i}_sum"].detach().float() * n_loss]
            for kind in ("full_acc", "cond_acc"):
                vals += [metrics[f"{kind}_{i}_sum"].detach().float(), metrics[f"{kind}_{i}_total"].detach().float()]
        return torch.stack([v.reshape(()) for v in vals]).to(self.ctx.device)

    def _metric_row(self, v: torch.Tensor) -> dict[str, Any]:
        x = v.cpu().tolist()
        n_loss = max(x[1], 1.0)
        row: dict[str, Any] = {"loss": x[0] / n_loss, "loss_tokens": x[1], "tokens": x[2]}
        p = 3
        for i in range(self.c.ttt_steps):
            row[f"loss_{i}"] = x[p] / n_loss
            row[f"full_acc_{i}"] = x[p + 1] / max(x[p + 2], 1.0)
            row[f"cond_acc_{i}"] = x[p + 3] / max(x[p + 4], 1.0)
            p += 5
        return row

    def _train_step(self, batch: dict[str, Any]) -> tuple[torch.Tensor, int, float]:
        """One optimizer step. Returns (metric sums, batch digest, the learning rate this step used)."""
        digest = batch_digest(batch)
        lr = float(self.scheduler.get_last_lr()[0])
        b = self._to_device(batch)
        loss, metrics = self._forward(b)
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_([p for p in self.model.parameters() if p.requires_grad], self.c.grad_clip)
        self.optimizer.step()
        self.scheduler.step()
        return self._metric_vector(loss, metrics, b), digest, lr

    @torch.no_grad()
    def _validate(self) -> dict[str, Any] | None:
        if self.val_ds is None:
            return None
        self.model.eval()
        self.val_ds.set_epoch(0)  # the same batches every time: validation is unshuffled, epoch 0 is its order
        total: torch.Tensor | None = None
        for batch in self.val_ds:
            b = self._to_device(batch)
            loss, metrics = self._forward(b)
            v = self._metric_vector(loss, metrics, b)
            total = v if total is None else total + v
        self.model.train()
        if total is None:
            return None
        return self._metric_row(self.ctx.all_reduce_sum(total))

    def _checkpoint(self, epoch_done: bool) -> None:
        name = f"step-{self.global_step:08d}"
        self.checkpointer.save(name=name, model=self.model, optimizer=self.optimizer, scheduler=self.scheduler, state={
            "global_step": self.global_step, "loader": self.train_ds.state_dict(), "epoch_done": epoch_done,
            "world_size": self.ctx.world_size, "time": time.time(),
        })
        self.reporter.message(f"checkpoint {self.out / CHECKPOINTS_DIR / name}")

    # -- the loop --------------------------------------------------------------------------
    def run(self) -> TrainResult:
        c, ctx = self.c, self.ctx
        if ctx.is_main:
            (self.out / CONFIG_FILE).write_text(json.dumps({
                "config": json.loads(c.to_json()), "identity": c.data_identity(), "world_size": ctx.world_size,
                "attn": self.attn, "steps_per_epoch": self.steps_per_epoch,
                "dataset_fingerprint": self.train_ds.store.fingerprint,
            }, indent=2, sort_keys=True, default=str) + "\n")
        log = MetricsLog(self.out, c.ttt_steps,
                         resume_step=self.global_step if self.resume_point is not None else None) if ctx.is_main else None
        self.reporter = StepReporter(total=self.total_steps, start=self.global_step, enabled=ctx.is_main,
                                     progress=c.progress, log_every=c.log_every)
        for note in self.notes:
            self.reporter.message(f"note: {note}")
        self.reporter.message(
            f"training on {self.train_ds.num_samples} samples ({self.total_steps} steps over {c.epochs} epochs, "
            f"{ctx.world_size} process(es) on {ctx.device.type}, {'FSDP2' if c.fsdp else 'DDP' if ctx.distributed else 'single'}"
            f"); validation: {self.val_ds.num_samples if self.val_ds else 0} samples; from step {self.global_step}")
        t0 = time.time()
        last_train: float | None = None
        last_val: float | None = None
        stopped = False
        self.model.train()
        try:
            while self.train_ds.epoch < c.epochs and not stopped:
                epoch = self.train_ds.epoch
                for batch in self.train_ds.loader(num_workers=c.num_workers, pin_memory=ctx.device.type == "cuda"):
                    vec, digest, lr = self._train_step(batch)
                    self.global_step += 1
                    if self.global_step % c.log_every == 0 or self.global_step == self.total_steps:
                        row = self._metric_row(ctx.all_reduce_sum(vec))
                        digests = ctx.all_gather_int(digest)
                        row.update(split="train", step=self.global_step, epoch=epoch, lr=lr,
                                   batch_digest=xxhash.xxh3_64_hexdigest(repr(digests).encode()),
                                   elapsed_s=time.time() - t0)
                        if not math.isfinite(row["loss"]):  # the reduced value: every rank stops together
                            raise TrainingError(f"the loss became {row['loss']} at step {self.global_step}; lower "
                                                "--lr, or check the store with `hiddenstates verify --deep`")
                        last_train = row["loss"]
                        if log is not None:
                            log.write(row)
                        self.reporter.step(self.global_step, row)
                    if c.val_every and self.global_step % c.val_every == 0:
                        last_val = self._log_val(log, epoch, t0, last_val)
                    if c.checkpoint_every and self.global_step % c.checkpoint_every == 0:
                        self._checkpoint(epoch_done=False)
                    if c.max_steps is not None and self.global_step >= c.max_steps:
                        stopped = True
                        break
                if stopped:
                    break
                if not c.val_every:
                    last_val = self._log_val(log, epoch, t0, last_val)
                if not c.checkpoint_every or self.global_step % c.checkpoint_every:
                    self._checkpoint(epoch_done=True)
            if stopped and (not c.checkpoint_every or self.global_step % c.checkpoint_every):
                self._checkpoint(epoch_done=False)
            final = self._save_final()
        finally:
            self.reporter.close()
            if log is not None:
                log.close()
        completed = not stopped
        if ctx.is_main:
            if c.plot:
                plot_loss_curve(self.out / METRICS_FILE, self.out / PLOT_FILE)
            (self.out / SUMMARY_FILE).write_text(json.dumps({
                "completed": completed, "global_step": self.global_step, "last_train_loss": last_train,
                "last_val_loss": last_val, "final": str(final), "seconds": time.time() - t0,
                "vocab_coverage": getattr(self, "vocab_coverage", 1.0),
            }, indent=2) + "\n")
        ctx.barrier()
        return TrainResult(out=self.out, final_dir=final, global_step=self.global_step, completed=completed,
                           last_train_loss=last_train, last_val_loss=last_val)

    def _log_val(self, log: MetricsLog | None, epoch: int, t0: float, previous: float | None) -> float | None:
        """Validate, log the row; returns the validation loss (or `previous` when there is no validation split)."""
        row = self._validate()
        if row is None:
            return previous
        row.update(split="val", step=self.global_step, epoch=epoch, lr=self.scheduler.get_last_lr()[0],
                   batch_digest="", elapsed_s=time.time() - t0)
        if log is not None:
            log.write(row)
        self.reporter.message(f"validation at step {self.global_step}: loss {row['loss']:.4f} acc "
                              + " ".join(f"{row[f'full_acc_{i}']:.3f}" for i in range(self.c.ttt_steps)))
        return row["loss"]

    def _save_final(self) -> Path:
        full = full_model_state(self.model)
        final = self.out / FINAL_DIR
        if self.ctx.is_main:
            import shutil

            tmp = self.out / f".{FINAL_DIR}.tmp"
            if tmp.exists():
                shutil.rmtree(tmp)
            tmp.mkdir()
            save_speculators_model(unwrap(self.model), full, tmp)
            if final.exists():
                shutil.rmtree(final)
            tmp.rename(final)
        self.ctx.barrier()
        return final
