"""The embedded default model: a valid HF folder, deterministic, rebuilt from shipped files."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from hiddenstates.extract import default as default_pkg
from hiddenstates.extract.default import build


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_default_model_dir_is_a_loadable_llama_folder(default_model: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        assert (default_model / name).is_file()
    model, info = AutoModelForCausalLM.from_pretrained(default_model, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    cfg = model.config
    assert cfg.num_hidden_layers == 8 and cfg.hidden_size == 128 and cfg.model_type == "llama"
    tok = AutoTokenizer.from_pretrained(default_model)
    assert len(tok) <= cfg.vocab_size
    text = tok.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    assert text == (
        "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nhi<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n"
    )


def test_materialization_is_deterministic_and_cached(tmp_path: Path, default_model: Path) -> None:
    again = default_pkg.materialize_default_model(tmp_path / "copy")
    assert _sha(again / "model.safetensors") == _sha(default_model / "model.safetensors")
    assert default_pkg.default_model_dir() == default_model  # cached: same folder, not rebuilt
    other = default_pkg.default_model_dir(tmp_path / "cache2")
    assert other.parent == tmp_path / "cache2" and _sha(other / "model.safetensors") == _sha(
        again / "model.safetensors"
    )


def test_weights_follow_the_recipe() -> None:
    w = default_pkg.default_weights()
    assert w["model.norm.weight"].min() == 1.0 == w["model.norm.weight"].max()
    q = w["model.layers.0.self_attn.q_proj.weight"]
    assert q.dtype.name == "float32" and abs(float(q.std()) - 0.02) < 0.002
    # per-tensor seeds: two tensors of one shape differ
    assert not (w["model.layers.0.mlp.up_proj.weight"] == w["model.layers.0.mlp.gate_proj.weight"]).all()


def test_shipped_files_are_what_build_py_generates(tmp_path: Path) -> None:
    rows = build.generate_conversations()
    shipped = [json.loads(line) for line in default_pkg.default_data_path().read_text().splitlines()]
    assert shipped == rows
    tok = build.build_tokenizer(rows)
    tok.save(str(tmp_path / "tokenizer.json"))
    assert json.loads((tmp_path / "tokenizer.json").read_text()) == json.loads(
        (default_pkg.HERE / "tokenizer.json").read_text()
    )


def test_package_data_is_small() -> None:
    total = sum(p.stat().st_size for p in default_pkg.HERE.iterdir() if p.is_file())
    assert total < 2 * 1024 * 1024
