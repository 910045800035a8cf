"""ExtractConfig validates itself; the CLI has exactly one option per field."""

from __future__ import annotations

import dataclasses

import pytest

from hiddenstates.errors import ConfigError
from hiddenstates.extract.config import ExtractConfig
from hiddenstates.extract.pipeline import plan_batches


def test_defaults_and_dtype_spellings() -> None:
    c = ExtractConfig()
    assert (c.backend, c.layers, c.dtype, c.on_long) == ("hf", "auto", "bfloat16", "truncate")
    assert ExtractConfig(dtype="fp16").dtype == "float16"
    assert ExtractConfig(dtype="FP32").dtype == "float32"
    assert ExtractConfig(layers=[8, 2]).layers == (8, 2)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"backend": "tgi"}, "unknown backend"),
        ({"dtype": "int8"}, "unknown dtype"),
        ({"on_long": "drop"}, "on-long"),
        ({"batch_tokens": 0}, "--batch-tokens"),
        ({"max_len": 1}, "--max-len"),
        ({"num_shards": 2}, "together"),
        ({"num_shards": 2, "shard_index": 2}, "shard-index"),
        ({"tp": 2}, "--backend vllm"),
        ({"codec": "gzip"}, "codec"),
        ({"limit": -1}, "--limit"),
    ],
)
def test_invalid_settings_say_what_to_fix(kwargs: dict, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        ExtractConfig(**kwargs)


def test_cli_maps_one_to_one_onto_config() -> None:
    import typer

    from hiddenstates.cli import app

    extract = typer.main.get_command(app).commands["extract"]  # type: ignore[attr-defined]
    names = {p.name for p in extract.params}
    fields = {f.name for f in dataclasses.fields(ExtractConfig)}
    assert fields <= names
    assert names - fields == {"model", "data", "out", "json_summary"}


def test_plan_batches_respects_budget_and_covers_every_sample() -> None:
    import random

    rng = random.Random(0)
    lengths = [rng.randint(1, 300) for _ in range(500)]
    plan = plan_batches(lengths, 1024)
    assert sorted(i for b in plan for i in b) == list(range(500))
    for b in plan:
        longest = max(lengths[i] for i in b)
        assert len(b) * longest <= 1024 or len(b) == 1
        assert min(lengths[i] for i in b) >= (1 - 0.125) * longest  # bounded padding
    assert plan == plan_batches(list(lengths), 1024)  # pure
    assert plan_batches([5000, 10], 1024) == [[0], [1]]  # over-budget sample runs alone
