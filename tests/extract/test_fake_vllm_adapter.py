"""The vllm backend's adapter logic with a FAKE engine: no vLLM code runs here (every name says so).

These run in the main suite (no vLLM installed). What vLLM itself does is tested against the real
engine in test_vllm_engine.py (`make test-vllm`). The fake engine mimics the hidden-states
connector's contract: one safetensors file per request (`hidden_states [T, K, H]`, `token_ids [T]`)
in the shared folder, with a companion `.lock` file the writer holds while writing.
"""

from __future__ import annotations

import fcntl
import os
from collections.abc import Callable, Sequence
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from hiddenstates.errors import BackendError, ConfigError
from hiddenstates.extract import vllm_backend as vb
from hiddenstates.extract.backend import HiddenStateBackend
from hiddenstates.extract.vllm_backend import EngineResult, VLLMBackend, VLLMBackendConfig

L, H = 8, 16


def reference_states(seq: Sequence[int], layer_ids: Sequence[int]) -> torch.Tensor:
    """Deterministic per-token states that depend on the token and the layer id."""
    t = torch.tensor(list(seq), dtype=torch.float32)
    cols = [
        t[:, None] * 0.01 + lid + torch.arange(H, dtype=torch.float32)[None, :] * 1e-3 for lid in layer_ids
    ]
    return torch.stack(cols, dim=1)


class FakeEngine:
    """Writes files the way vLLM's connector does; `tamper(i, files)` corrupts request i's output."""

    def __init__(
        self,
        storage: Path,
        layer_ids: Sequence[int],
        *,
        max_model_len: int = 64,
        tamper: Callable[[int, dict[str, torch.Tensor]], None] | None = None,
        echo: Callable[[int, list[int]], list[int] | None] | None = None,
        path_for: Callable[[int, str], str] | None = None,
    ) -> None:
        self.storage, self.layer_ids = storage, list(layer_ids)
        self.num_layers, self.hidden_size, self.max_model_len = L, H, max_model_len
        self.tamper, self.echo, self.path_for = tamper, echo, path_for
        self.loaded: list[str] = []
        self.cleaned: list[str] = []
        self.shut = False
        self.calls = 0

    def version(self) -> str:
        return "vllm 0.32.0 (fake)"

    def generate(self, batch: Sequence[Sequence[int]]) -> list[EngineResult]:
        out = []
        for i, seq in enumerate(batch):
            rid = f"{self.calls}-{i}-req"
            path = self.path_for(i, rid) if self.path_for else str(self.storage / f"{rid}.safetensors")
            files = {
                "hidden_states": reference_states(seq, self.layer_ids),
                "token_ids": torch.tensor(list(seq)),
            }
            if self.tamper:
                self.tamper(i, files)
            Path(path + ".lock").touch()
            save_file({k: v.contiguous() for k, v in files.items()}, path)
            echoed = self.echo(i, list(seq)) if self.echo else list(seq)
            out.append(EngineResult(request_id=rid, prompt_token_ids=echoed, hidden_states_path=path))
        self.calls += 1
        return out

    def load(self, path: str) -> dict[str, torch.Tensor]:
        self.loaded.append(path)
        return load_file(path)

    def cleanup(self, path: str) -> None:
        self.cleaned.append(path)
        for p in (path, path + ".lock"):
            if os.path.exists(p):
                os.remove(p)

    def shutdown(self) -> None:
        self.shut = True


def make_backend(
    tmp_path: Path,
    layer_ids: Sequence[int] | str = (2, 4, 5, 8),
    dtype: str = "float32",
    load_timeout_s: float = 5.0,
    **engine_kw: object,
) -> tuple[VLLMBackend, FakeEngine]:
    storage = tmp_path / "shm-fake"
    storage.mkdir()
    cfg = VLLMBackendConfig(
        model="fake-model",
        layer_ids=layer_ids if isinstance(layer_ids, str) else tuple(layer_ids),
        dtype=dtype,
        load_timeout_s=load_timeout_s,
    )
    ids = [2, 4, 5, 8] if isinstance(layer_ids, str) else sorted(layer_ids)
    engine = FakeEngine(storage, ids, **engine_kw)  # type: ignore[arg-type]
    return VLLMBackend._from_engine(cfg, engine, storage), engine


BATCH = [[0, 11, 12, 13], [0, 5], list(range(3, 40))]


# --- version check -----------------------------------------------------------------------------------


def test_parse_version_forms_fake_vllm() -> None:
    assert vb.parse_version("0.32.0") == (0, 32, 0)
    assert vb.parse_version("0.33.1+cu129") == (0, 33, 1)
    assert vb.parse_version("0.34.0rc1.dev5+g1234") == (0, 34, 0)
    assert vb.parse_version("1.0") == (1, 0, 0)
    with pytest.raises(BackendError, match="cannot read the vLLM version"):
        vb.parse_version("nightly")


def test_version_check_missing_vllm_names_install_commands_fake_vllm() -> None:
    with pytest.raises(
        BackendError, match=r"not installed.*pip install 'vllm>=0\.32,<0\.34'.*make setup-vllm"
    ):
        vb.check_vllm_version(None)


@pytest.mark.parametrize("version", ["0.31.2", "0.34.0", "0.18.0", "1.0.0"])
def test_version_check_out_of_range_names_install_command_fake_vllm(version: str) -> None:
    with pytest.raises(BackendError, match=rf"vllm {version} is installed.*>=0\.32,<0\.34.*pip install"):
        vb.check_vllm_version(version)


@pytest.mark.parametrize("version", ["0.32.0", "0.32.5", "0.33.0+cu129"])
def test_version_check_accepts_supported_fake_vllm(version: str) -> None:
    assert vb.check_vllm_version(version)[:2] in ((0, 32), (0, 33))


def test_constructor_without_vllm_fails_clearly_and_leaves_no_folder_fake_vllm(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(vb, "installed_vllm_version", lambda: None)
    with pytest.raises(BackendError, match="make setup-vllm"):
        VLLMBackend("some/model", layer_ids=[1, 2], storage_dir=tmp_path)
    assert list(tmp_path.iterdir()) == []


def test_constructor_with_unsupported_vllm_fails_before_importing_it_fake_vllm(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(vb, "installed_vllm_version", lambda: ("vllm", "0.20.1"))
    with pytest.raises(BackendError, match=r"vllm 0\.20\.1 is installed"):
        VLLMBackend("some/model", layer_ids=[1, 2], storage_dir=tmp_path)
    assert list(tmp_path.iterdir()) == []


# --- configuration -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "key", ["enable_prefix_caching", "tensor_parallel_size", "speculative_config", "kv_transfer_config"]
)
def test_config_refuses_engine_kwargs_the_backend_owns_fake_vllm(key: str) -> None:
    with pytest.raises(ConfigError, match="set by the vllm backend itself"):
        VLLMBackendConfig(model="m", layer_ids=(1,), engine_kwargs={key: True})


@pytest.mark.parametrize(
    ("kw", "msg"),
    [
        ({"dtype": "int8"}, "dtype 'int8'"),
        ({"tp": 0}, "tp"),
        ({"max_model_len": 1}, "max_model_len"),
        ({"layer_ids": (2, 2)}, "more than once"),
        ({"layer_ids": "first"}, "'auto'"),
        ({"model": ""}, "needs a model"),
        ({"load_timeout_s": 0}, "load_timeout_s"),
    ],
)
def test_config_validates_itself_fake_vllm(kw: dict, msg: str) -> None:
    args = {"model": "m", "layer_ids": (1,), **kw}
    with pytest.raises(ConfigError, match=msg):
        VLLMBackendConfig(**args)


def test_config_sorts_layer_ids_fake_vllm() -> None:
    assert VLLMBackendConfig(model="m", layer_ids=(8, 2, 5)).layer_ids == (2, 5, 8)


def test_engine_arguments_gpu_uses_stock_connector_prefix_caching_off_fake_vllm(tmp_path: Path) -> None:
    cfg = VLLMBackendConfig(
        model="m", layer_ids=(2, 8), tp=4, max_model_len=4096, engine_kwargs={"gpu_memory_utilization": 0.8}
    )
    args = vb.engine_arguments(cfg, [2, 8], tmp_path, on_cpu=False)
    assert args["enable_prefix_caching"] is False
    assert args["tensor_parallel_size"] == 4 and args["max_model_len"] == 4096 and args["dtype"] == "bfloat16"
    assert args["gpu_memory_utilization"] == 0.8
    assert args["speculative_config"] == {
        "method": "extract_hidden_states",
        "num_speculative_tokens": 1,
        "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": [2, 8]}},
    }
    kv = args["kv_transfer_config"]
    assert kv["kv_connector"] == "ExampleHiddenStatesConnector" and kv["kv_role"] == "kv_producer"
    assert kv["kv_connector_extra_config"] == {"shared_storage_path": str(tmp_path)}
    assert "kv_connector_module_path" not in kv


def test_engine_arguments_cpu_uses_cpu_connector_by_module_path_fake_vllm(tmp_path: Path) -> None:
    cfg = VLLMBackendConfig(model="m", layer_ids=(2, 8))
    kv = vb.engine_arguments(cfg, [2, 8], tmp_path, on_cpu=True)["kv_transfer_config"]
    assert kv["kv_connector"] == vb.CPU_CONNECTOR_NAME == "HiddenStatesCPUConnector"
    assert (
        kv["kv_connector_module_path"] == vb.CPU_CONNECTOR_MODULE == "hiddenstates.extract.vllm_cpu_connector"
    )
    assert "max_model_len" not in vb.engine_arguments(cfg, [2, 8], tmp_path, on_cpu=True)


def test_storage_prefers_shm_and_falls_back_to_tempdir_fake_vllm(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(vb.tempfile, "gettempdir", lambda: str(tmp_path / "tmp"))
    shm = tmp_path / "shm"
    shm.mkdir()
    assert vb.choose_storage_base(str(shm), min_free=1) == shm
    assert vb.choose_storage_base(str(tmp_path / "absent"), min_free=1) == tmp_path / "tmp"
    assert (
        vb.choose_storage_base(str(shm), min_free=1 << 62) == tmp_path / "tmp"
    )  # too small (a 64 MiB docker shm)


# --- capture and validation ----------------------------------------------------------------------------


def test_fake_engine_backend_satisfies_protocol_fake_vllm(tmp_path: Path) -> None:
    b, _ = make_backend(tmp_path)
    assert isinstance(b, HiddenStateBackend)
    assert (b.name, b.num_layers, b.hidden_size, b.layer_ids) == ("vllm", L, H, [2, 4, 5, 8])
    assert b.version() == "vllm 0.32.0 (fake)"


def test_auto_layer_ids_resolve_against_the_model_fake_vllm(tmp_path: Path) -> None:
    b, _ = make_backend(tmp_path, layer_ids="auto")
    assert b.layer_ids == [2, 4, 5, 8]


def test_capture_returns_states_and_deletes_every_file_fake_vllm(tmp_path: Path) -> None:
    b, eng = make_backend(tmp_path)
    outs = b.capture(BATCH, [8, 2, 5, 4])  # any order of the same ids: output stays ascending
    for seq, out in zip(BATCH, outs, strict=True):
        assert torch.equal(out, reference_states(seq, [2, 4, 5, 8]))
    assert len(eng.loaded) == 3 and os.listdir(b.storage_dir) == []


def test_capture_with_other_layer_ids_is_refused_fake_vllm(tmp_path: Path) -> None:
    b, eng = make_backend(tmp_path)
    with pytest.raises(
        BackendError, match=r"asked for layers \[2, 4, 8\].*built for \[2, 4, 5, 8\].*layer_ids="
    ):
        b.capture(BATCH, [2, 4, 8])
    assert eng.calls == 0


def test_capture_rejects_duplicate_layer_ids_fake_vllm(tmp_path: Path) -> None:
    b, _ = make_backend(tmp_path)
    with pytest.raises(ConfigError, match="more than once"):
        b.capture(BATCH, [2, 4, 5, 8, 8])


def test_empty_and_overlong_prompts_name_the_request_fake_vllm(tmp_path: Path) -> None:
    b, eng = make_backend(tmp_path, max_model_len=10)
    with pytest.raises(BackendError, match="request 1 of the batch is empty"):
        b.capture([[1], []], [2, 4, 5, 8])
    with pytest.raises(BackendError, match=r"request 2 of the batch has 10 tokens.*max_model_len is 10"):
        b.capture([[1], [1] * 9, [1] * 10], [2, 4, 5, 8])
    assert eng.calls == 0
    assert b.capture([], [2, 4, 5, 8]) == []
    assert b.max_prompt_len == 9 and len(b.capture([[1] * 9], [2, 4, 5, 8])[0]) == 9


def _tamper_at(
    index: int, fn: Callable[[dict[str, torch.Tensor]], None]
) -> Callable[[int, dict[str, torch.Tensor]], None]:
    def tamper(i: int, files: dict[str, torch.Tensor]) -> None:
        if i == index:
            fn(files)

    return tamper


def _set(
    key: str, value: Callable[[torch.Tensor], torch.Tensor]
) -> Callable[[dict[str, torch.Tensor]], None]:
    def fn(files: dict[str, torch.Tensor]) -> None:
        files[key] = value(files[key])

    return fn


def _nan(x: torch.Tensor) -> torch.Tensor:
    x = x.clone()
    x[1, 0, 3] = float("nan")
    return x


def _inf(x: torch.Tensor) -> torch.Tensor:
    x = x.clone()
    x[0, -1, 0] = float("inf")
    return x


@pytest.mark.parametrize(
    ("fn", "msg"),
    [
        (_set("token_ids", lambda t: t.flip(0)), "file's token_ids .* do not echo the prompt"),
        (_set("token_ids", lambda t: t[:-1]), "file's token_ids .* do not echo the prompt"),
        (
            _set("hidden_states", lambda x: x[:, :3]),
            r"shape \[37, 3, 16\], expected \[T, K, H\] = \[37, 4, 16\]",
        ),
        (_set("hidden_states", lambda x: x[:-1]), r"shape \[36, 4, 16\]"),
        (
            _set("hidden_states", lambda x: x.to(torch.bfloat16)),
            "dtype torch.bfloat16, expected torch.float32",
        ),
        (_set("hidden_states", _nan), "1 NaN/Inf values"),
        (_set("hidden_states", _inf), "1 NaN/Inf values"),
        (lambda files: files.pop("token_ids"), r"lacks \['token_ids'\]"),
    ],
)
def test_validation_rejects_bad_output_and_names_request_fake_vllm(
    tmp_path: Path, fn: Callable, msg: str
) -> None:
    b, _ = make_backend(tmp_path, tamper=_tamper_at(2, fn))
    with pytest.raises(
        BackendError, match=r"vLLM request 2 of the batch \(request id 0-2-req, 37 prompt tokens\): .*" + msg
    ):
        b.capture(BATCH, [2, 4, 5, 8])
    assert os.listdir(b.storage_dir) == [], "files of a failed batch must be deleted too"


def test_validation_rejects_bad_echo_fake_vllm(tmp_path: Path) -> None:
    b, _ = make_backend(tmp_path, echo=lambda i, seq: seq[::-1] if i == 1 else seq)
    with pytest.raises(
        BackendError, match=r"request 1 of the batch \(request id 0-1-req.*prompt_token_ids do not echo"
    ):
        b.capture(BATCH, [2, 4, 5, 8])
    assert os.listdir(b.storage_dir) == []


def test_validation_rejects_misordered_outputs_fake_vllm(tmp_path: Path) -> None:
    """Outputs for the right prompts in the wrong order (the failure mode of older pipelines)."""
    b, eng = make_backend(tmp_path)
    real_generate = eng.generate
    eng.generate = lambda batch: real_generate(batch)[::-1]  # type: ignore[method-assign]
    with pytest.raises(BackendError, match=r"request 0 of the batch .* do not echo"):
        b.capture(BATCH, [2, 4, 5, 8])


def test_path_outside_the_backend_folder_is_refused_fake_vllm(tmp_path: Path) -> None:
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    b, eng = make_backend(tmp_path, path_for=lambda i, rid: str(elsewhere / f"{rid}.safetensors"))
    with pytest.raises(BackendError, match="outside this backend's folder"):
        b.capture(BATCH[:1], [2, 4, 5, 8])
    assert eng.loaded == [] and eng.cleaned == [] and len(list(elsewhere.iterdir())) == 2


def test_missing_path_means_connector_inactive_fake_vllm(tmp_path: Path) -> None:
    b, eng = make_backend(tmp_path)
    eng.generate = lambda batch: [EngineResult("r0", list(batch[0]), None)]  # type: ignore[method-assign]
    with pytest.raises(BackendError, match="without a hidden_states_path"):
        b.capture(BATCH[:1], [2, 4, 5, 8])


def test_output_count_mismatch_is_an_error_fake_vllm(tmp_path: Path) -> None:
    b, eng = make_backend(tmp_path)
    real_generate = eng.generate
    eng.generate = lambda batch: real_generate(batch)[:-1]  # type: ignore[method-assign]
    with pytest.raises(BackendError, match="2 outputs for a batch of 3"):
        b.capture(BATCH, [2, 4, 5, 8])
    assert os.listdir(b.storage_dir) == []


def test_waits_for_the_writer_lock_then_times_out_naming_request_fake_vllm(tmp_path: Path) -> None:
    """A writer that never releases its lock (a dead engine) must not hang extraction forever."""
    b, eng = make_backend(tmp_path, load_timeout_s=0.3)
    held: list[int] = []

    def hold_lock(i: int, rid: str) -> str:
        path = str(b.storage_dir / f"{rid}.safetensors")
        fd = os.open(path + ".lock", os.O_CREAT | os.O_WRONLY, 0o644)
        fcntl.flock(fd, fcntl.LOCK_EX)
        held.append(fd)
        return path

    eng.path_for = hold_lock
    try:
        with pytest.raises(
            BackendError, match=r"request 0 of the batch \(request id 0-0-req\).*not written within 0.3 s"
        ):
            b.capture(BATCH[:1], [2, 4, 5, 8])
    finally:
        for fd in held:
            os.close(fd)
    assert eng.loaded == []


def test_wait_returns_once_the_lock_is_released_fake_vllm(tmp_path: Path) -> None:
    import threading

    path = str(tmp_path / "r.safetensors")
    fd = os.open(path + ".lock", os.O_CREAT | os.O_WRONLY, 0o644)
    fcntl.flock(fd, fcntl.LOCK_EX)
    timer = threading.Timer(0.2, os.close, args=(fd,))
    timer.start()
    try:
        vb._wait_for_write(path, 5.0, 0, "r")  # returns only after the timer released the lock
    finally:
        timer.join()
    with pytest.raises(OSError):
        os.fstat(fd)  # closed by the timer, i.e. the wait did see the release


def test_close_shuts_engine_and_removes_folder_fake_vllm(tmp_path: Path) -> None:
    b, eng = make_backend(tmp_path)
    b.capture(BATCH[:1], [2, 4, 5, 8])
    with b:
        pass
    assert eng.shut and not b.storage_dir.exists()
    with pytest.raises(BackendError, match="closed"):
        b.capture(BATCH[:1], [2, 4, 5, 8])
    b.close()  # idempotent
