"""TrainConfig: every setting of a draft-training run, validated on construction.

The CLI (`hiddenstates train`) maps its flags one to one onto these fields; the Python API is
`hiddenstates.train.train(TrainConfig(...))`.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any

from hiddenstates.errors import ConfigError

__all__ = ["ATTN_IMPLS", "LOSS_IMPLS", "POSTNORM_MODES", "SCHEDULERS", "TrainConfig"]

ATTN_IMPLS = ("auto", "sdpa", "eager", "simple_flex_attention")
LOSS_IMPLS = ("auto", "eager", "fused")
SCHEDULERS = ("linear", "cosine", "constant")
# What to do when the store's last layer was captured after the final norm (DatasetInfo.last_layer):
# refuse, or feed it to the loss as is and bypass the draft's copy of the verifier norm (the
# targets are then exactly lm_head(stored state), which is what the verifier computes).
POSTNORM_MODES = ("refuse", "skip-verifier-norm")


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    """A training run. Paths are strings; `verifier` is a local folder or a Hub id."""

    root: str
    verifier: str
    out: str
    where: str | None = None
    params: tuple[Any, ...] = ()
    epochs: int = 1
    lr: float = 1e-4
    weight_decay: float = 0.01
    scheduler: str = "linear"
    warmup_ratio: float = 0.01
    grad_clip: float = 1.0
    total_seq_len: int = 8192
    ttt_steps: int = 3
    ttt_step_loss_decay: float = 1.0
    draft_vocab_size: int = 32000
    draft_layers: int = 1
    sliding_window: int = 2048
    layers: tuple[int, ...] | None = None  # auxiliary layer ids; default: all stored but the last
    val_fraction: float = 0.02
    val_every: int = 0  # steps between validations; 0: at the end of every epoch
    checkpoint_every: int = 0  # steps between checkpoints; 0: at the end of every epoch
    keep_checkpoints: int = 2
    max_steps: int | None = None  # stop after this many steps (the LR schedule still spans all epochs)
    seed: int = 0
    fsdp: bool = False
    resume: bool = False
    device: str = "auto"
    attn: str = "auto"
    loss: str = "kl_div"
    loss_impl: str = "auto"
    postnorm: str = "refuse"
    check_tokenizer: bool = True
    num_workers: int = 0
    prefetch_mb: int = 512
    decode_threads: int | None = None
    log_every: int = 1
    progress: bool = True
    plot: bool = True
    extra: dict[str, Any] = field(default_factory=dict)  # free-form notes recorded with the run

    def __post_init__(self) -> None:
        if not self.root or not self.verifier or not self.out:
            raise ConfigError("root, verifier and out are required")
        ints = {"epochs": 1, "total_seq_len": 2, "ttt_steps": 1, "draft_vocab_size": 1, "draft_layers": 1,
                "sliding_window": 1, "keep_checkpoints": 1, "prefetch_mb": 1, "log_every": 1}
        for name, low in ints.items():
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < low:
                raise ConfigError(f"--{name.replace('_', '-')} must be an integer >= {low}, got {v!r}")
        for name in ("val_every", "checkpoint_every", "num_workers", "seed"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 0:
                raise ConfigError(f"--{name.replace('_', '-')} must be an integer >= 0, got {v!r}")
        if self.max_steps is not None and self.max_steps < 1:
            raise ConfigError(f"--max-steps must be >= 1, got {self.max_steps}")
        if self.decode_threads is not None and self.decode_threads < 1:
            raise ConfigError(f"--decode-threads must be >= 1, got {self.decode_threads}")
        if not self.lr > 0:
            raise ConfigError(f"--lr must be positive, got {self.lr}")
        if self.weight_decay < 0 or self.grad_clip <= 0:
            raise ConfigError("--weight-decay must be >= 0 and --grad-clip > 0")
        if not 0.0 <= self.warmup_ratio <= 1.0:
            raise ConfigError(f"--warmup-ratio must be in [0, 1], got {self.warmup_ratio}")
        if not 0.0 <= self.val_fraction < 1.0:
            raise ConfigError(f"--val-fraction must be in [0, 1), got {self.val_fraction}")
        if self.ttt_step_loss_decay <= 0:
            raise ConfigError(f"--ttt-step-loss-decay must be positive, got {self.ttt_step_loss_decay}")
        choices = {"scheduler": SCHEDULERS, "attn": ATTN_IMPLS, "loss_impl": LOSS_IMPLS, "postnorm": POSTNORM_MODES}
        for name, allowed in choices.items():
            if getattr(self, name) not in allowed:
                raise ConfigError(f"--{name.replace('_', '-')} must be one of {', '.join(allowed)}, got {getattr(self, name)!r}")
        if self.device not in ("auto", "cpu", "cuda"):
            raise ConfigError(f"--device must be auto, cpu or cuda, got {self.device!r}")
        if self.layers is not None:
            object.__setattr__(self, "layers", tuple(int(i) for i in self.layers))
        object.__setattr__(self, "params", tuple(self.params))
        if self.params and not self.where:
            raise ConfigError("--param values were given without --where to bind them to")

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2, sort_keys=True, default=str)

    def data_identity(self) -> dict[str, Any]:
        """The settings a resumed run must share with the run it resumes (data and model shape)."""
        keys = ("root", "verifier", "where", "params", "epochs", "total_seq_len", "ttt_steps", "draft_vocab_size",
                "draft_layers", "layers", "val_fraction", "seed", "lr", "scheduler", "warmup_ratio", "weight_decay",
                "loss", "postnorm", "sliding_window", "ttt_step_loss_decay")
        d = asdict(self)
        return json.loads(json.dumps({k: d[k] for k in keys}, default=str))
