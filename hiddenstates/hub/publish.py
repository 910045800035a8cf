"""Publish a local store to the Hugging Face Hub as a dataset repo: `publish(root, "ORG/NAME")`.

What goes up: the committed shards (Zarr), their manifests, dataset.json and the run records, plus
what publishing generates: the catalog exported to Parquet under ``catalog/``, a dataset card
(README.md) whose ``configs:`` point at ``catalog/samples.parquet``, and a length histogram. They
are staged in a folder of symlinks (the store is never copied or modified) and sent with
huggingface_hub's ``upload_folder``, which commits in batches and, when re-run, skips files the
Hub already has: an interrupted publish resumes, and a publish with nothing new makes no commit.

Upload order keeps a half-finished repo readable: first the shard data, dataset.json and run
records, then the manifests (which commit shards), the catalog and the card. Remote files under the
store's folders that the local store no longer has (e.g. shards dropped by `repair`) are deleted in
that second step.

The token comes from the usual places (``HF_TOKEN``, then ``hf auth login``'s cache) or the
`token=` argument; it is only ever handed to huggingface_hub, never printed, logged or written,
and staged text files are checked not to contain it.
"""

from __future__ import annotations

import glob as _glob
import logging
import math
import os
import re
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hiddenstates.errors import ConfigError, HubError, HubLimitsError
from hiddenstates.h5store.format import (
    DATASET_JSON,
    MANIFESTS_DIR,
    RUNS_DIR,
    SHARDS_DIR,
    manifest_path,
    shard_path,
)
from hiddenstates.h5store.root import Root, open_root
from hiddenstates.hub.card import CATALOG_CONFIGS, CATALOG_DIR, CardInputs, render_card
from hiddenstates.hub.limits import HubLimits, LimitViolation, check_layout
from hiddenstates.units import human_bytes

__all__ = ["PublishConfig", "PublishPlan", "PublishResult", "plan_publish", "publish", "resolve_token"]

log = logging.getLogger(__name__)

ASSETS_DIR = "assets"
HISTOGRAM = f"{ASSETS_DIR}/length_histogram.png"
_MARKER = ".hiddenstates-publish"  # marks a staging folder we may clear and refill
# Folders (and files) of a repo that publish manages: remote files there that the store no longer
# has are deleted. Anything else a user added to the repo is left alone.
_MANAGED_PREFIXES = (f"{SHARDS_DIR}/", f"{MANIFESTS_DIR}/", f"{RUNS_DIR}/", f"{CATALOG_DIR}/", f"{ASSETS_DIR}/")
_MANAGED_FILES = (DATASET_JSON, "README.md")
# Step 1 sends the data, step 2 what makes it visible (manifests commit shards; catalog and card describe them).
_DATA_PATTERNS = [DATASET_JSON, f"{RUNS_DIR}/*", f"{SHARDS_DIR}/*"]
_COMMIT_PATTERNS = [f"{MANIFESTS_DIR}/*", f"{CATALOG_DIR}/*", f"{ASSETS_DIR}/*", "README.md"]
# huggingface_hub's upload pipeline starts at ~250 files per commit and adapts; good enough for a plan.
_FILES_PER_COMMIT = 250
_REPO_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*$")
_REF = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_./-]*$")


@dataclass(frozen=True, kw_only=True)
class PublishConfig:
    """Where and how to publish. `token=None` takes the usual one (HF_TOKEN or `hf auth login`)."""

    repo_id: str
    private: bool = False
    revision: str | None = None  # branch to commit to; created from main when missing. None: main
    tag: str | None = None  # tag the published commit
    license: str = "unknown"
    pretty_name: str | None = None
    tags: tuple[str, ...] = ()
    endpoint: str | None = None  # Hub URL; None: HF_ENDPOINT or https://huggingface.co
    dry_run: bool = False
    workdir: str | None = None  # staging folder; None: a temp dir (dry run: ./hiddenstates-publish-<NAME>)
    commit_message: str | None = None
    limits: HubLimits = field(default_factory=HubLimits)
    token: str | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if not _REPO_ID.fullmatch(self.repo_id) or "--" in self.repo_id or ".." in self.repo_id:
            raise ConfigError(f"repo id {self.repo_id!r} must be ORG/NAME (letters, digits, '-', '_', '.')")
        for name in ("revision", "tag"):
            v = getattr(self, name)
            if v is not None and (not _REF.fullmatch(v) or ".." in v or v.endswith("/") or v.startswith("refs/")):
                raise ConfigError(f"{name} {v!r} is not a valid branch/tag name (letters, digits, '-', '_', '.', '/')")
        if self.endpoint is not None and not re.match(r"^https?://", self.endpoint):
            raise ConfigError(f"endpoint {self.endpoint!r} must be an http(s) URL, e.g. https://huggingface.co")

    @property
    def branch(self) -> str:
        return self.revision or "main"


@dataclass(frozen=True)
class PublishPlan:
    """What a publish sends: the staged folder, its files (repo path -> bytes) and the commits it takes."""

    repo_id: str
    branch: str
    stage_dir: str
    files: dict[str, int]
    generated: list[str]  # repo paths created by publish (catalog, card, histogram)
    shards: list[str]
    samples: int
    violations: list[LimitViolation]

    @property
    def total_bytes(self) -> int:
        return sum(self.files.values())

    @property
    def data_files(self) -> list[str]:
        return [p for p in self.files if _matches(p, _DATA_PATTERNS)]

    @property
    def commit_files(self) -> list[str]:
        return [p for p in self.files if _matches(p, _COMMIT_PATTERNS)]

    @property
    def estimated_commits(self) -> int:
        """Commits a first publish makes (re-runs make fewer: files already on the Hub are skipped)."""
        return sum(math.ceil(len(x) / _FILES_PER_COMMIT) for x in (self.data_files, self.commit_files))

    @property
    def card_path(self) -> str:
        return os.path.join(self.stage_dir, "README.md")

    def describe(self) -> list[str]:
        largest = max(self.files.values(), default=0)
        lines = [
            f"repo: datasets/{self.repo_id} (branch {self.branch})",
            f"store: {self.samples:,} samples in {len(self.shards):,} shards",
            f"files: {len(self.files):,} ({human_bytes(self.total_bytes)}; largest file {human_bytes(largest)}), "
            f"of which generated: {', '.join(self.generated)}",
            f"upload: step 1 data {len(self.data_files):,} files, step 2 manifests/catalog/card "
            f"{len(self.commit_files):,} files; about {self.estimated_commits} commit(s) on a first publish, "
            "none for files already on the Hub",
            f"card: {self.card_path}",
        ]
        if self.violations:
            lines.append("Hub limits: BROKEN")
            lines += [f"  - {v}" for v in self.violations]
        else:
            lines.append("Hub limits: ok (files per folder and per repo, file sizes)")
        return lines


@dataclass(frozen=True)
class PublishResult:
    plan: PublishPlan
    dry_run: bool
    url: str | None = None
    commit: str | None = None  # the branch head after publishing
    new_commits: int = 0  # commits this publish made (0: the Hub already had everything)
    deleted: list[str] = field(default_factory=list)
    tag: str | None = None
    notes: list[str] = field(default_factory=list)




def _matches(path: str, patterns: list[str]) -> bool:
    import fnmatch

    return any(fnmatch.fnmatch(path, p) for p in patterns)


def resolve_token(explicit: str | None = None) -> str | None:
    """The token to publish with: `explicit`, else HF_TOKEN, else the `hf auth login` cache. Never logged."""
    if explicit:
        return explicit
    from huggingface_hub import get_token

    return get_token()


def _redact(text: str, token: str | None) -> str:
    return text.replace(token, "hf_***") if token else text


# -- staging ----------------------------------------------------------------------------------

def _prepare_stage(config: PublishConfig) -> tuple[str, bool]:
    """(staging folder, whether to delete it afterwards)."""
    if config.workdir is None and not config.dry_run:
        return tempfile.mkdtemp(prefix="hiddenstates-publish-"), True
    stage = config.workdir or os.path.join(os.getcwd(), f"hiddenstates-publish-{config.repo_id.split('/', 1)[1]}")
    stage = os.path.abspath(stage)
    if os.path.exists(stage):
        entries = os.listdir(stage)
        if entries and _MARKER not in entries:
            raise ConfigError(
                f"staging folder {stage} exists and holds other files; pass an empty or new folder as --workdir"
            )
        shutil.rmtree(stage)
    os.makedirs(stage)
    Path(stage, _MARKER).write_text("staging folder of `hiddenstates publish`; safe to delete\n")
    return stage, False


def _link(src: str, dst: str) -> None:
    os.makedirs(os.path.dirname(dst), exist_ok=True)
    os.symlink(src, dst)


def _stage_store(root: Root, stage: str, shards: list[str]) -> None:
    """Symlink the store's published files into the staging folder (no copies)."""
    _link(root.full(DATASET_JSON), os.path.join(stage, DATASET_JSON))
    for name in root.listdir(RUNS_DIR):
        if name.endswith(".json") and not name.startswith("."):
            _link(root.full(f"{RUNS_DIR}/{name}"), os.path.join(stage, RUNS_DIR, name))
    for shard in shards:
        rel = manifest_path(shard)
        if not root.exists(rel):
            raise HubError(f"shard {shard} is in the catalog but its manifest {rel} is gone; run `hiddenstates catalog "
                           "refresh` and publish again")
        _link(root.full(rel), os.path.join(stage, rel))
        top = root.full(shard_path(shard))
        for dirpath, dirnames, names in os.walk(top):
            dirnames[:] = [d for d in dirnames if not d.startswith(".")]
            for n in names:
                if n.startswith("."):
                    continue  # temp files of an interrupted write are not data
                src = os.path.join(dirpath, n)
                _link(src, os.path.join(stage, shard_path(shard), os.path.relpath(src, top)))


def _staged_files(stage: str) -> dict[str, int]:
    out = {}
    for dirpath, _, names in os.walk(stage):
        for n in names:
            full = os.path.join(dirpath, n)
            rel = os.path.relpath(full, stage).replace(os.sep, "/")
            if rel == _MARKER:
                continue
            out[rel] = os.path.getsize(full)  # follows the symlink
    return dict(sorted(out.items()))


def _check_no_token(stage: str, files: dict[str, int], token: str | None) -> None:
    """Refuse to upload a text file that contains the token (e.g. a run record that saved CLI arguments)."""
    if not token:
        return
    needle = token.encode()
    for rel in files:
        if rel.startswith(f"{SHARDS_DIR}/") and not rel.endswith(".json"):
            continue  # compressed array data
        with open(os.path.join(stage, rel), "rb") as f:
            if needle in f.read():
                raise HubError(f"{rel} contains your Hugging Face token; remove it from the store before publishing")


def _card_inputs(root: Root, stage: str, config: PublishConfig) -> tuple[CardInputs, list[str], int]:
    """Statistics for the card from the exported catalog (so card and Parquet always agree)."""
    import duckdb

    from hiddenstates.h5store.format import read_dataset_info
    from hiddenstates.h5store.plots import length_histogram

    cat = os.path.join(stage, CATALOG_DIR)
    con = duckdb.connect(":memory:")
    try:
        for name, _ in CATALOG_CONFIGS:
            # Views cannot take bound parameters; the path is ours (stage dir), quoted as a SQL literal.
            path = os.path.join(cat, f"{name}.parquet").replace("'", "''")
            con.execute(f"CREATE VIEW {name} AS SELECT * FROM read_parquet('{path}')")
        s = con.execute(
            "SELECT count(*), coalesce(sum(num_tokens), 0), coalesce(sum(num_loss_tokens), 0), "
            "coalesce(sum(truncated::INT), 0) FROM samples").fetchone()
        assert s is not None
        sh = con.execute(
            "SELECT list(name ORDER BY name), coalesce(sum(raw_bytes), 0), coalesce(sum(stored_bytes), 0), "
            "coalesce(sum(files), 0), coalesce(sum(num_rejects), 0), list(DISTINCT codec), max(max_rel_err), "
            "min(min_cos) FROM shards").fetchone()
        assert sh is not None
        q = con.execute("SELECT quantile_cont(num_tokens, [0.0, 0.1, 0.5, 0.9, 0.99, 1.0]) FROM samples").fetchone()
        sources = con.execute(
            "SELECT coalesce(source, '(none)'), count(*) AS n FROM samples GROUP BY 1 ORDER BY n DESC, 1 LIMIT 20"
        ).fetchall()
        runs = con.execute("SELECT run_id FROM runs ORDER BY created_at, run_id").fetchall()
        lengths = con.execute("SELECT num_tokens FROM samples").fetchnumpy()["num_tokens"]
    finally:
        con.close()
    info = read_dataset_info(root)
    shards = [x for x in (sh[0] or []) if x is not None]
    summary = {
        "samples": int(s[0]), "tokens": int(s[1]), "loss_tokens": int(s[2]), "truncated_samples": int(s[3]),
        "shards": len(shards), "raw_bytes": int(sh[1]), "stored_bytes": int(sh[2]), "files": int(sh[3]),
        "rejects": int(sh[4]), "codecs": sorted(c for c in (sh[5] or []) if c),
        "lossy_error": {"max_rel_err": sh[6], "min_cos": sh[7]} if sh[6] is not None else None,
        "layer_ids": info.layer_ids, "layer_meaning": info.layer_meaning, "num_layers": info.num_layers,
        "last_layer": info.last_layer, "hidden_size": info.hidden_size, "dtype": info.dtype,
        "capture": info.capture, "runs": [{"run_id": r[0]} for r in runs],
    }
    quantiles = {}
    if s[0] and q and q[0]:
        quantiles = dict(zip(("min", "p10", "median", "p90", "p99", "max"), (float(v) for v in q[0]), strict=True))
    histogram = None
    if s[0]:
        os.makedirs(os.path.join(stage, ASSETS_DIR), exist_ok=True)
        length_histogram(lengths, os.path.join(stage, HISTOGRAM), title=f"sample lengths ({int(s[0]):,} samples)")
        histogram = HISTOGRAM
    inputs = CardInputs(
        repo_id=config.repo_id, summary=summary, length_quantiles=quantiles,
        sources=[(str(a), int(b)) for a, b in sources], license=config.license, pretty_name=config.pretty_name,
        extra_tags=config.tags, histogram=histogram, revision=config.revision,
    )
    return inputs, shards, int(s[0])


def _export_catalog(root: Root, out_dir: str) -> None:
    """The catalog tables as Parquet: the catalog module's export (the same tables `Catalog` serves)."""
    from hiddenstates.catalog import export_parquet

    written = export_parquet(root, out_dir)
    missing = [name for name, _ in CATALOG_CONFIGS if name not in written]
    if missing:
        raise HubError(f"the catalog export lacks tables {missing}; upgrade hiddenstates")


def plan_publish(root: str | os.PathLike[str] | Root, config: PublishConfig, *,
                 token: str | None = None) -> PublishPlan:
    """Stage the upload (export catalog, render card, link files) and check the Hub's limits. Sends nothing."""
    root = open_root(root)
    if not root.is_local:
        raise ConfigError(f"publish reads a local store; {root.url} is remote. Download it first (or publish from "
                          "the machine that wrote it)")
    from hiddenstates.h5store.format import read_dataset_info

    read_dataset_info(root)  # a clear error when ROOT is not a dataset
    stage, _ = _prepare_stage(config)
    _export_catalog(root, os.path.join(stage, CATALOG_DIR))
    inputs, shards, samples = _card_inputs(root, stage, config)
    Path(stage, "README.md").write_text(render_card(inputs), encoding="utf-8")
    _stage_store(root, stage, shards)
    files = _staged_files(stage)
    _check_no_token(stage, files, token)
    generated = [p for p in files if p == "README.md" or p.startswith((f"{CATALOG_DIR}/", f"{ASSETS_DIR}/"))]
    return PublishPlan(repo_id=config.repo_id, branch=config.branch, stage_dir=stage, files=files,
                       generated=generated, shards=shards, samples=samples,
                       violations=check_layout(files, config.limits))


def _stale_remote_files(api: Any, config: PublishConfig, plan: PublishPlan) -> list[str]:
    remote = api.list_repo_files(config.repo_id, repo_type="dataset", revision=config.branch)
    return sorted(p for p in remote
                  if (p.startswith(_MANAGED_PREFIXES) or p in _MANAGED_FILES) and p not in plan.files)


def _head(api: Any, config: PublishConfig) -> str:
    return str(api.repo_info(config.repo_id, repo_type="dataset", revision=config.branch).sha)


def publish(root: str | os.PathLike[str] | Root, repo_id: str | None = None, *, config: PublishConfig | None = None,
            progress: Callable[[str], None] | None = None, **kwargs: Any) -> PublishResult:
    """Publish a local store to the Hub (or, with dry_run=True, only stage it and report the plan).

    >>> publish("store", "my-org/qwen3-8b-eagle3-hidden-states", license="apache-2.0", private=True)
    """
    if config is None:
        if repo_id is None:
            raise ConfigError("publish needs a repo id (ORG/NAME)")
        config = PublishConfig(repo_id=repo_id, **kwargs)
    elif repo_id is not None or kwargs:
        raise ConfigError("pass either config=PublishConfig(...) or repo_id and keyword options, not both")
    say = progress or log.info
    token = None if config.dry_run else resolve_token(config.token)
    if not config.dry_run and not token:
        raise HubError("no Hugging Face token found: set HF_TOKEN or run `hf auth login` (the token needs write access "
                       "to the repo's namespace)")
    say("staging: exporting the catalog, rendering the card, linking the store's files")
    plan = plan_publish(root, config, token=token)
    if plan.violations:
        raise HubLimitsError("the store breaks the Hub's limits, nothing was sent:\n" +
                             "\n".join(f"  - {v}" for v in plan.violations))
    if config.dry_run:
        return PublishResult(plan=plan, dry_run=True)
    try:
        return _upload(plan, config, token, say)
    except (HubError, ConfigError):
        raise
    except Exception as e:
        from huggingface_hub.errors import HfHubHTTPError

        if isinstance(e, HfHubHTTPError | ValueError | OSError):
            raise HubError(f"publishing to datasets/{config.repo_id} failed: {_redact(str(e), token)}. Re-run the same "
                           "command to resume: files already on the Hub are not sent again") from e
        raise
    finally:
        if config.workdir is None:  # a temp folder made for this upload
            shutil.rmtree(plan.stage_dir, ignore_errors=True)


def _upload(plan: PublishPlan, config: PublishConfig, token: str | None, say: Callable[[str], None]) -> PublishResult:
    from huggingface_hub import HfApi

    api = HfApi(endpoint=config.endpoint, token=token, library_name="hiddenstates")
    try:
        user = api.whoami().get("name", "?")
    except Exception as e:
        raise HubError(f"the Hub did not accept the token ({_redact(str(e).splitlines()[0], token)}); check HF_TOKEN or "
                       "run `hf auth login`") from e
    notes: list[str] = []
    url = api.create_repo(config.repo_id, repo_type="dataset", private=config.private, exist_ok=True)
    info = api.repo_info(config.repo_id, repo_type="dataset")
    if bool(info.private) != config.private:
        notes.append(f"the repo already exists and is {'private' if info.private else 'public'}; --private does not "
                     "change an existing repo's visibility (change it in the repo settings)")
    if config.branch != "main":
        api.create_branch(config.repo_id, branch=config.branch, repo_type="dataset", exist_ok=True)
    before = _head(api, config)
    stale = _stale_remote_files(api, config, plan)
    say(f"uploading as {user} to {url} (branch {config.branch}): {len(plan.files):,} files, {human_bytes(plan.total_bytes)}")
    message = config.commit_message or f"Publish hiddenstates dataset ({plan.samples:,} samples, {len(plan.shards):,} shards)"

    def send(patterns: list[str], what: str, delete: list[str] | None = None) -> None:
        api.upload_folder(repo_id=config.repo_id, repo_type="dataset", folder_path=plan.stage_dir,
                          revision=config.branch, allow_patterns=patterns, ignore_patterns=[_MARKER],
                          delete_patterns=delete, commit_message=f"{message}: {what}")

    say("step 1/2: shard data, dataset.json, run records")
    send(_DATA_PATTERNS, "data")
    say("step 2/2: manifests, catalog, dataset card" + (f"; deleting {len(stale)} stale file(s)" if stale else ""))
    send(_COMMIT_PATTERNS, "manifests, catalog, card", [_glob.escape(p) for p in stale] or None)
    after = _head(api, config)
    new_commits = 0
    if after != before:
        history = api.list_repo_commits(config.repo_id, repo_type="dataset", revision=config.branch)
        ids = [c.commit_id for c in history]
        new_commits = ids.index(before) if before in ids else len(ids)
    tag = None
    if config.tag:
        refs = api.list_repo_refs(config.repo_id, repo_type="dataset")
        existing = {t.name: t.target_commit for t in refs.tags}
        if config.tag in existing and existing[config.tag] != after:
            raise HubError(f"tag {config.tag!r} already exists on datasets/{config.repo_id} at another commit "
                           f"({existing[config.tag][:10]}); choose a new tag")
        if config.tag not in existing:
            api.create_tag(config.repo_id, tag=config.tag, revision=after, repo_type="dataset",
                           tag_message=message)
        tag = config.tag
    return PublishResult(plan=plan, dry_run=False, url=str(url), commit=after, new_commits=new_commits,
                         deleted=stale, tag=tag, notes=notes)
