"""The dataset card (README.md) a published store carries: Hub metadata, provenance, statistics, usage.

The YAML header is what the Hub indexes and what `datasets.load_dataset(REPO_ID)` reads: its
``configs:`` point at the catalog's Parquet export, so the Hub's viewer and `load_dataset` show the
catalog (one row per sample) instead of trying to read the Zarr metadata files as data. The body
records how the hidden states were captured (model, revision, layer ids and what each id means,
dtype, codec) and how to stream them back.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import yaml

from hiddenstates.errors import ConfigError
from hiddenstates.units import human_bytes

__all__ = [
    "CATALOG_CONFIGS",
    "CATALOG_DIR",
    "DEFAULT_TAGS",
    "HUB_LICENSES",
    "SIZE_CATEGORIES",
    "TASK_CATEGORIES",
    "CardInputs",
    "card_metadata",
    "check_card_metadata",
    "render_card",
    "size_category",
]

CATALOG_DIR = "catalog"
# (config name, default?) -> catalog/<name>.parquet. `samples` is the default config, so
# load_dataset(REPO_ID) returns one row per sample.
CATALOG_CONFIGS: tuple[tuple[str, bool], ...] = (
    ("samples", True), ("shards", False), ("runs", False), ("token_counts", False), ("rejects", False),
)

# The Hub's size categories (also shipped by `datasets` as utils/resources/size_categories.json),
# as (exclusive upper bound on the number of rows, label).
SIZE_CATEGORIES: tuple[tuple[float, str], ...] = (
    (1e3, "n<1K"), (1e4, "1K<n<10K"), (1e5, "10K<n<100K"), (1e6, "100K<n<1M"), (1e7, "1M<n<10M"),
    (1e8, "10M<n<100M"), (1e9, "100M<n<1B"), (1e10, "1B<n<10B"), (1e11, "10B<n<100B"), (1e12, "100B<n<1T"),
    (float("inf"), "n>1T"),
)

# License identifiers the Hub accepts in card metadata (huggingface.co/docs/hub/repositories-licenses).
HUB_LICENSES = frozenset({
    "apache-2.0", "mit", "openrail", "afl-3.0", "artistic-2.0", "bsl-1.0", "bsd", "bsd-2-clause", "bsd-3-clause",
    "bsd-3-clause-clear", "cc", "cc0-1.0", "cc-by-2.0", "cc-by-2.5", "cc-by-3.0", "cc-by-4.0", "cc-by-sa-3.0",
    "cc-by-sa-4.0", "cc-by-nc-2.0", "cc-by-nc-3.0", "cc-by-nc-4.0", "cc-by-nd-4.0", "cc-by-nc-nd-3.0",
    "cc-by-nc-nd-4.0", "cc-by-nc-sa-2.0", "cc-by-nc-sa-3.0", "cc-by-nc-sa-4.0", "cdla-sharing-1.0",
    "cdla-permissive-1.0", "cdla-permissive-2.0", "wtfpl", "ecl-2.0", "epl-1.0", "epl-2.0", "eupl-1.1", "eupl-1.2",
    "agpl-3.0", "gfdl", "gpl", "gpl-2.0", "gpl-3.0", "lgpl", "lgpl-2.1", "lgpl-3.0", "isc", "mpl-2.0", "odc-by",
    "odbl", "osl-3.0", "postgresql", "ofl-1.1", "ncsa", "unlicense", "zlib", "pddl", "llama2", "llama3", "llama3.1",
    "llama3.2", "llama3.3", "llama4", "gemma", "unknown", "other",
})

# Hidden states are features of a text-generation model, used to train a draft for text generation.
TASK_CATEGORIES = ("feature-extraction", "text-generation")
DEFAULT_TAGS = ("hiddenstates", "hidden-states", "speculative-decoding", "eagle3", "zarr")


def size_category(num_rows: int) -> str:
    if num_rows < 0:
        raise ConfigError(f"a row count cannot be negative ({num_rows})")
    for bound, label in SIZE_CATEGORIES:
        if num_rows < bound:
            return label
    return SIZE_CATEGORIES[-1][1]


@dataclass(frozen=True, kw_only=True)
class CardInputs:
    """Everything the card states, gathered from the store by `hiddenstates.hub.publish`."""

    repo_id: str
    summary: Mapping[str, Any]  # hiddenstates.h5store.summary.dataset_summary(...)
    length_quantiles: Mapping[str, float] = field(default_factory=dict)  # "p10" -> tokens
    sources: Sequence[tuple[str, int]] = ()  # (source, samples), largest first
    license: str = "unknown"
    pretty_name: str | None = None
    extra_tags: Sequence[str] = ()
    histogram: str | None = None  # repo-relative path of the length histogram image
    revision: str | None = None  # branch the card is published on (None: main)

    def __post_init__(self) -> None:
        if self.license not in HUB_LICENSES:
            raise ConfigError(
                f"license {self.license!r} is not a Hugging Face Hub license id; use one of e.g. apache-2.0, mit, "
                "cc-by-4.0, llama3.1, other (and state the terms in the card), or unknown"
            )
        if "/" not in self.repo_id:
            raise ConfigError(f"repo id {self.repo_id!r} must be ORG/NAME")


def card_metadata(inputs: CardInputs) -> dict[str, Any]:
    """The card's YAML header: Hub metadata plus the catalog configs."""
    s = inputs.summary
    tags = list(dict.fromkeys([*DEFAULT_TAGS, *inputs.extra_tags]))
    configs = [
        {"config_name": name, **({"default": True} if default else {}),
         "data_files": [{"split": "train", "path": f"{CATALOG_DIR}/{name}.parquet"}]}
        for name, default in CATALOG_CONFIGS
    ]
    return {
        "license": inputs.license,
        "pretty_name": inputs.pretty_name or inputs.repo_id.split("/", 1)[1],
        "task_categories": list(TASK_CATEGORIES),
        "tags": tags,
        "size_categories": [size_category(int(s.get("samples", 0)))],
        "configs": configs,
    }


def check_card_metadata(meta: Mapping[str, Any]) -> list[str]:
    """Problems the Hub's metadata validator would reject, found before anything is sent."""
    problems = []
    for lic in meta["license"] if isinstance(meta.get("license"), list) else [meta.get("license")]:
        if lic not in HUB_LICENSES:
            problems.append(f"license {lic!r} is not a Hub license id")
    labels = {label for _, label in SIZE_CATEGORIES}
    for sc in meta.get("size_categories", []):
        if sc not in labels:
            problems.append(f"size category {sc!r} is not one of the Hub's")
    names = [c.get("config_name") for c in meta.get("configs", [])]
    if len(set(names)) != len(names):
        problems.append("configs repeat a config_name")
    if sum(bool(c.get("default")) for c in meta.get("configs", [])) > 1:
        problems.append("more than one default config")
    return problems




def _md_escape(text: Any) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def render_card(inputs: CardInputs) -> str:
    """README.md text: YAML header, then provenance, statistics, layout and usage."""
    meta = card_metadata(inputs)
    problems = check_card_metadata(meta)
    if problems:
        raise ConfigError("the dataset card metadata is invalid: " + "; ".join(problems))
    s = inputs.summary
    capture = dict(s.get("capture") or {})
    model = capture.get("model") or "unknown model"
    url = f"hf://datasets/{inputs.repo_id}" + (f"@{inputs.revision}" if inputs.revision else "")
    lines: list[str] = ["---", yaml.safe_dump(meta, sort_keys=False, allow_unicode=True).rstrip(), "---", ""]
    lines += [
        f"# {meta['pretty_name']}",
        "",
        f"Hidden states of **{_md_escape(model)}** captured for training speculative-decoding draft models "
        "(EAGLE-3), stored with [hiddenstates](https://pypi.org/project/hiddenstates/) as sharded, compressed "
        "Zarr v3 arrays with a SQL catalog. The Parquet files under `catalog/` describe every sample; the hidden "
        "states themselves live in `shards/` and are streamed on demand (see *Usage*).",
        "",
        "## Capture",
        "",
        "| | |",
        "|---|---|",
        f"| model | `{_md_escape(model)}` |",
        f"| model revision | `{_md_escape(capture.get('revision') or 'unrecorded')}` |",
    ]
    for key in sorted(k for k in capture if k not in ("model", "revision")):
        value = capture[key]
        text = json.dumps(value, sort_keys=True) if isinstance(value, dict | list) else value
        lines.append(f"| {_md_escape(key)} | `{_md_escape(text)}` |")
    lines += [
        f"| decoder layers | {s.get('num_layers') if s.get('num_layers') is not None else 'unrecorded'} |",
        f"| hidden size | {s.get('hidden_size')} |",
        f"| dtype | {s.get('dtype')} |",
        f"| codec | {', '.join(s.get('codecs') or []) or 'unknown'} |",
        f"| last layer | {s.get('last_layer')} (the final norm is {'not ' if s.get('last_layer') == 'prenorm' else ''}applied) |",
        "",
        "Layer ids use vLLM's numbering: id *k* below the number of decoder layers *L* is the input of decoder "
        "layer *k* (transformers' `hidden_states[k]`, 0 = embeddings); id *L* is the output of the last decoder "
        "layer before the final norm.",
        "",
        "| layer id | meaning |",
        "|---:|---|",
    ]
    meaning = s.get("layer_meaning") or {}
    for lid in s.get("layer_ids") or []:
        lines.append(f"| {lid} | {_md_escape(meaning.get(str(lid), ''))} |")
    lossy = s.get("lossy_error")
    if lossy:
        lines += ["", f"**Lossy codec.** Measured error: max relative L2 error {lossy.get('max_rel_err'):.4g}, "
                      f"min cosine similarity {lossy.get('min_cos'):.6f}."]
    raw, stored = int(s.get("raw_bytes", 0)), int(s.get("stored_bytes", 0))
    lines += [
        "",
        "## Statistics",
        "",
        "| | |",
        "|---|---|",
        f"| samples | {int(s.get('samples', 0)):,} |",
        f"| tokens | {int(s.get('tokens', 0)):,} |",
        f"| loss-masked tokens | {int(s.get('loss_tokens', 0)):,} |",
        f"| truncated samples | {int(s.get('truncated_samples', 0)):,} |",
        f"| rejected input rows | {int(s.get('rejects', 0)):,} |",
        f"| shards | {int(s.get('shards', 0)):,} ({int(s.get('files', 0)):,} files) |",
        f"| size | {human_bytes(stored)} stored, {human_bytes(raw)} raw"
        + (f" ({raw / stored:.2f}x)" if stored else "") + " |",
    ]
    q = inputs.length_quantiles
    if q:
        lines.append("| sample length | " + ", ".join(f"{k} {v:,.0f}" for k, v in q.items()) + " tokens |")
    if inputs.histogram:
        lines += ["", f"![Sample length histogram]({inputs.histogram})"]
    if inputs.sources:
        lines += ["", "| source | samples |", "|---|---:|"]
        lines += [f"| {_md_escape(src)} | {n:,} |" for src, n in inputs.sources]
    runs = s.get("runs") or []
    if runs:
        lines += ["", "Extraction runs: " + ", ".join(f"`{_md_escape(r.get('run_id'))}`" for r in runs)
                  + " (full records in the `runs` config)."]
    lines += [
        "",
        "## Usage",
        "",
        "Stream samples with hiddenstates (`pip install hiddenstates`); a read fetches the shard index and the "
        "chunks it needs, never whole shards:",
        "",
        "```python",
        "import hiddenstates",
        "",
        f'ds = hiddenstates.open_dataset("{url}")',
        "sample = ds[0]  # input_ids [T], loss_mask [T], hidden_states [T, K, H]",
        'long = ds.catalog.select_indices("num_tokens >= ?", [1024])',
        "```",
        "",
        "Train an EAGLE-3 draft from it with speculators:",
        "",
        "```python",
        "from hiddenstates.train.dataset import HiddenStatesDataset",
        "",
        f'train = HiddenStatesDataset("{url}", where="num_tokens <= ?", params=[4096], total_seq_len=8192)',
        "```",
        "",
        f"or from the command line: `hiddenstates info {url}`, `hiddenstates query {url} \"SELECT ...\"`. Set "
        "`HIDDENSTATES_CACHE_DIR` to keep fetched chunks on local disk between runs.",
        "",
        "The catalog alone loads with `datasets`:",
        "",
        "```python",
        "from datasets import load_dataset",
        "",
        f'samples = load_dataset("{inputs.repo_id}", split="train")            # one row per sample',
        f'counts = load_dataset("{inputs.repo_id}", "token_counts", split="train")  # loss-masked token counts',
        "```",
        "",
        "## Layout",
        "",
        "- `dataset.json`: format version and capture provenance.",
        "- `shards/<shard>.zarr/`: Zarr v3 groups with `hidden_states [tokens, layers, hidden]` (bf16 stored as "
        "uint16 bits, logical dtype in the array attributes), `input_ids`, `loss_mask`, `token_counts`; readable "
        "by any Zarr v3 reader.",
        "- `manifests/<shard>.parquet`: one row per sample of a shard; a shard without a manifest is not part of "
        "the dataset.",
        "- `catalog/*.parquet`: the catalog tables (`samples`, `shards`, `runs`, `token_counts`, `rejects`).",
        "- `runs/*.json`: one record per extraction run (model, backend, versions, arguments).",
        "",
        "## License",
        "",
        f"Published under `{inputs.license}`. Hidden states are derived from the model and the source "
        "conversations: their licenses and terms of use apply too.",
        "",
    ]
    return "\n".join(lines)
