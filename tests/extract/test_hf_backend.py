"""The hf backend's layer numbering (vLLM's) and batching, against transformers' own outputs."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from hiddenstates.errors import ConfigError
from hiddenstates.extract.backend import HiddenStateBackend
from hiddenstates.extract.hf_backend import HFBackend


@pytest.fixture(scope="module")
def fp32_backend(default_model: Path) -> HFBackend:
    return HFBackend(default_model, dtype="float32", device="cpu")


@pytest.fixture(scope="module")
def reference(default_model: Path) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(default_model, dtype=torch.float32).eval()


def test_backend_satisfies_the_protocol(fp32_backend: HFBackend) -> None:
    assert isinstance(fp32_backend, HiddenStateBackend)
    assert (fp32_backend.num_layers, fp32_backend.hidden_size) == (8, 128)
    assert fp32_backend.version().startswith("transformers ")


def test_layer_ids_follow_vllm_numbering(fp32_backend: HFBackend, reference: torch.nn.Module) -> None:
    L = fp32_backend.num_layers
    ids = list(range(L + 1))  # every id: embeddings, each layer's input, and L
    seq = torch.randint(0, 1800, (37,), generator=torch.Generator().manual_seed(0))
    got = fp32_backend.capture([seq.tolist()], ids)[0]
    assert got.shape == (37, L + 1, 128) and got.dtype == torch.float32

    prenorm: dict[str, torch.Tensor] = {}
    hook = reference.model.norm.register_forward_pre_hook(lambda _m, args: prenorm.__setitem__("x", args[0]))
    try:
        with torch.inference_mode():
            out = reference(seq[None], output_hidden_states=True)
    finally:
        hook.remove()
    hs = out.hidden_states
    for k in range(L):  # id k < L == transformers' hidden_states[k]
        torch.testing.assert_close(got[:, k], hs[k][0], rtol=0, atol=1e-5)
    # id L == the final norm's input (last layer's output before the norm), not hidden_states[L]
    torch.testing.assert_close(got[:, L], prenorm["x"][0], rtol=0, atol=1e-5)
    assert not torch.allclose(got[:, L], hs[L][0], atol=1e-3)


def test_padding_never_reaches_real_tokens(fp32_backend: HFBackend) -> None:
    g = torch.Generator().manual_seed(1)
    seqs = [torch.randint(0, 1800, (n,), generator=g).tolist() for n in (5, 41, 17)]
    ids = [2, 4, 5, 8]
    batched = fp32_backend.capture(seqs, ids)
    for seq, b in zip(seqs, batched, strict=True):
        alone = fp32_backend.capture([seq], ids)[0]
        assert b.shape == (len(seq), 4, 128)
        torch.testing.assert_close(b, alone, rtol=0, atol=2e-5)


def test_bf16_capture_dtype_and_subset(default_model: Path) -> None:
    be = HFBackend(default_model, dtype="bfloat16", device="cpu")
    out = be.capture([[1, 2, 3, 4]], [8, 2])
    assert out[0].dtype == torch.bfloat16 and out[0].shape == (4, 2, 128)
    with pytest.raises(ConfigError):
        be.capture([[1, 2]], [9])
    be.close()
