"""Build the EAGLE-3 draft with speculators' own factories, from the verifier's config.

`create_transformer_layer_config` (speculators' draft-decoder factory) derives the draft layer's
config from the verifier; `Eagle3DraftModel.from_training_args` wraps it in a typed
`Eagle3SpeculatorConfig` (never a raw dict), loads the vocabulary mapping and the verifier's
embeddings, final norm and LM head. The EAGLE-3 flags follow speculators' defaults for eagle3
(norm before residual, norm before fc, norm output), so a checkpoint matches what its own trainer
would produce and vLLM serves it the same way.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from hiddenstates.errors import TrainingError

if TYPE_CHECKING:
    import torch

__all__ = ["DraftSpec", "build_draft", "resolve_attn", "resolve_loss_impl"]


@dataclass(frozen=True, kw_only=True)
class DraftSpec:
    verifier: str
    aux_layer_ids: list[int]
    draft_vocab_size: int
    ttt_steps: int
    draft_layers: int = 1
    sliding_window: int = 2048
    attn: str = "sdpa"
    skip_verifier_norm: bool = False


def resolve_attn(attn: str, device_type: str) -> str:
    """flex attention needs a GPU (it has no CPU backward); sdpa elsewhere."""
    if attn != "auto":
        if attn == "simple_flex_attention" and device_type != "cuda":
            raise TrainingError("--attn simple_flex_attention needs a CUDA device; use sdpa or eager on CPU")
        return attn
    return "simple_flex_attention" if device_type == "cuda" else "sdpa"


def resolve_loss_impl(impl: str) -> str:
    # The fused Triton loss crashed under torch.compile (REFERENCE.md) and needs a GPU; eager costs ~2%.
    return "eager" if impl == "auto" else impl


def build_draft(spec: DraftSpec, *, t2d: torch.Tensor | None, d2t: torch.Tensor | None) -> Any:
    """An Eagle3DraftModel (fp32, on CPU) ready to move to a device and wrap."""
    import torch
    from speculators.models.eagle3 import Eagle3DraftModel, Eagle3SpeculatorConfig
    from speculators.train.cli import create_transformer_layer_config

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # speculators warns about defaults we set explicitly
        layer_config = create_transformer_layer_config(
            verifier_name_or_path=spec.verifier, num_layers=spec.draft_layers, draft_arch="llama", hidden_act="silu",
            sliding_window=spec.sliding_window, full_attention_indices=[],
        )
        model = Eagle3DraftModel.from_training_args(
            layer_config, t2d=t2d, d2t=d2t, verifier_name_or_path=spec.verifier,
            draft_vocab_size=spec.draft_vocab_size, norm_before_residual=True, norm_before_fc=True, norm_output=True,
            ttt_steps=spec.ttt_steps, target_layer_ids=list(spec.aux_layer_ids), draft_attn_impl=spec.attn,
        )
    if not isinstance(model.config, Eagle3SpeculatorConfig):  # the factory's contract; guard against drift
        raise TrainingError(f"speculators built a {type(model.config).__name__}, expected Eagle3SpeculatorConfig")
    if spec.skip_verifier_norm:
        # The stored last layer is already normalized: targets = lm_head(state). The norm's weights are
        # never saved (speculators ignores them on save), so the checkpoint is unaffected.
        model.verifier_norm = torch.nn.Identity()
    return model
