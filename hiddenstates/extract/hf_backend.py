"""The transformers backend: forward hooks on the decoder layers, CPU or GPU, any dtype.

Layer id k < L is captured by a forward *pre*-hook on decoder layer k (its input hidden states,
equal to transformers' ``output_hidden_states[k]``); id L by a forward hook on the last decoder
layer (its output, before the final norm). The LM head never runs: the forward goes through the
decoder stack only.

A batch is right-padded and masked. Under a causal mask a real token attends only to earlier
real tokens, so padding never reaches the captured states of real tokens; the pad positions
are cut off before anything leaves the backend.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import torch

from hiddenstates.errors import BackendError, ConfigError

__all__ = ["HFBackend", "find_decoder_layers", "resolve_device"]

_TORCH_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def resolve_device(device: str, local_rank: int | None = None) -> torch.device:
    """'auto' -> cuda:LOCAL_RANK (or cuda:0) when CUDA is available, else cpu."""
    if device == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda", (local_rank or 0) % max(1, torch.cuda.device_count()))
        return torch.device("cpu")
    try:
        dev = torch.device(device)
    except RuntimeError as e:
        raise ConfigError(f"unknown device {device!r}: use auto, cpu, cuda or cuda:N") from e
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"--device {device} asked for CUDA, but torch sees no GPU; use --device cpu")
    return dev


def find_decoder_layers(model: torch.nn.Module, num_layers: int) -> torch.nn.ModuleList:
    """The ModuleList of decoder layers: the one with L entries, preferring the usual names."""
    candidates = [
        (name, mod)
        for name, mod in model.named_modules()
        if isinstance(mod, torch.nn.ModuleList) and len(mod) == num_layers
    ]
    if not candidates:
        raise BackendError(
            f"cannot find the {num_layers} decoder layers in {type(model).__name__}: no ModuleList of that length"
        )
    preferred = [c for c in candidates if c[0].split(".")[-1] in ("layers", "h", "blocks", "layer")]
    _name, mod = (preferred or candidates)[0]
    return mod  # type: ignore[return-value]


def _text_config(config: Any) -> Any:
    get = getattr(config, "get_text_config", None)
    return get() if callable(get) else config


class HFBackend:
    """HiddenStateBackend over a transformers causal LM."""

    name = "hf"

    def __init__(
        self,
        model_dir: str | os.PathLike[str],
        *,
        dtype: str = "bfloat16",
        device: str = "auto",
        local_rank: int | None = None,
        trust_remote_code: bool = False,
        revision: str | None = None,
        attn_implementation: str | None = "sdpa",
    ) -> None:
        import transformers
        from transformers import AutoConfig, AutoModelForCausalLM

        if dtype not in _TORCH_DTYPES:
            raise ConfigError(
                f"dtype {dtype!r} is not supported by the hf backend; use bfloat16, float16 or float32"
            )
        self.dtype = _TORCH_DTYPES[dtype]
        self.device = resolve_device(device, local_rank)
        self._transformers_version = transformers.__version__
        config = AutoConfig.from_pretrained(model_dir, trust_remote_code=trust_remote_code, revision=revision)
        text = _text_config(config)
        self.num_layers = int(text.num_hidden_layers)
        self.hidden_size = int(text.hidden_size)
        # The weight-loading bar is noise next to ours; the loading report's warnings still show.
        transformers.utils.logging.disable_progress_bar()
        try:
            kwargs: dict[str, Any] = {
                "dtype": self.dtype,
                "trust_remote_code": trust_remote_code,
                "revision": revision,
            }
            if attn_implementation:
                kwargs["attn_implementation"] = attn_implementation
            model = AutoModelForCausalLM.from_pretrained(model_dir, **kwargs)
        except (OSError, ValueError, KeyError) as e:
            raise BackendError(f"transformers cannot load the model at {model_dir}: {e}") from e
        finally:
            transformers.utils.logging.enable_progress_bar()
        model.eval().requires_grad_(False)
        model.to(self.device)  # type: ignore[arg-type]  # transformers' stub types .to() narrowly
        # The decoder stack alone: the LM head's logits are never needed.
        get_decoder = getattr(model, "get_decoder", None)
        decoder = get_decoder() if callable(get_decoder) else None
        self._model = model
        self._decoder = decoder if isinstance(decoder, torch.nn.Module) else model
        self._layers = find_decoder_layers(self._decoder, self.num_layers)

    def version(self) -> str:
        return f"transformers {self._transformers_version} (torch {torch.__version__}, {self.device}, {self.dtype})"

    def _hooks(self, layer_ids: Sequence[int], store: dict[int, torch.Tensor]) -> list[Any]:
        L = self.num_layers
        handles = []
        for i in layer_ids:
            if not 0 <= i <= L:
                raise ConfigError(f"layer id {i} is out of range 0..{L}")
            if i < L:

                def pre(_mod: Any, args: tuple[Any, ...], kwargs: dict[str, Any], i: int = i) -> None:
                    h = args[0] if args else kwargs["hidden_states"]
                    store[i] = h

                handles.append(self._layers[i].register_forward_pre_hook(pre, with_kwargs=True))
            else:

                def post(_mod: Any, _args: Any, out: Any, i: int = i) -> None:
                    store[i] = out[0] if isinstance(out, (tuple, list)) else out

                handles.append(self._layers[L - 1].register_forward_hook(post))
        return handles

    @torch.inference_mode()
    def capture(self, batch: Sequence[Sequence[int]], layer_ids: Sequence[int]) -> list[torch.Tensor]:
        if not batch:
            return []
        ids = sorted(int(i) for i in layer_ids)
        lengths = [len(s) for s in batch]
        if min(lengths) == 0:
            raise BackendError("cannot capture an empty sequence")
        T = max(lengths)
        input_ids = torch.zeros((len(batch), T), dtype=torch.long)
        for r, seq in enumerate(batch):
            input_ids[r, : len(seq)] = torch.as_tensor(list(seq), dtype=torch.long)
        kwargs: dict[str, Any] = {"use_cache": False}
        if min(lengths) != T:
            attn = torch.zeros((len(batch), T), dtype=torch.long)
            for r, n in enumerate(lengths):
                attn[r, :n] = 1
            kwargs["attention_mask"] = attn.to(self.device)
        store: dict[int, torch.Tensor] = {}
        handles = self._hooks(ids, store)
        try:
            self._decoder(input_ids=input_ids.to(self.device), **kwargs)
        finally:
            for h in handles:
                h.remove()
        missing = [i for i in ids if i not in store]
        if missing:
            raise BackendError(
                f"the forward pass never reached layer ids {missing}; the model's layer structure is unusual"
            )
        stacked = torch.stack([store[i] for i in ids], dim=2)  # [B, T, K, H]
        if stacked.shape[-1] != self.hidden_size or stacked.shape[:2] != (len(batch), T):
            raise BackendError(
                f"captured states have shape {tuple(stacked.shape)}, expected [{len(batch)}, {T}, K, {self.hidden_size}]"
            )
        stacked = stacked.to(self.dtype)
        if stacked.is_cuda:
            # Page-locked host memory copies at full PCIe speed; torch's host allocator caches these
            # blocks, so steady-state batches reuse them once the writer has released earlier ones.
            host = torch.empty(stacked.shape, dtype=stacked.dtype, pin_memory=True)
            host.copy_(stacked, non_blocking=True)
            torch.cuda.current_stream(stacked.device).synchronize()
            stacked = host
        else:
            stacked = stacked.cpu()
        return [stacked[r, :n].contiguous() for r, n in enumerate(lengths)]

    def close(self) -> None:
        self._model = None  # type: ignore[assignment]
        self._decoder = None  # type: ignore[assignment]
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
