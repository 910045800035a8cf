"""A small in-process fake of the Hugging Face Hub's HTTP API, for offline tests.

It implements the endpoints that the real ``huggingface_hub`` client (HfApi, HfFileSystem,
hf_hub_download) and ``datasets.load_dataset`` call for public and private dataset repos:

    POST /api/repos/create                               create_repo (409 when it exists)
    POST /api/validate-yaml                              README.md metadata check (400 + errors)
    GET  /api/whoami-v2                                  token check
    GET  /api/{type}s/{ns}/{name}[/revision/{rev}]       repo_info / dataset_info
    POST /api/{type}s/{ns}/{name}/preupload/{rev}        upload mode + remote oid per file
    POST /api/{type}s/{ns}/{name}/commit/{rev}           ndjson commit (files inlined as base64)
    GET  /api/{type}s/{ns}/{name}/tree/{rev}[/{path}]    listing, recursive, cursor pagination (Link)
    POST /api/{type}s/{ns}/{name}/paths-info/{rev}       info for given paths
    GET  /api/{type}s/{ns}/{name}/refs | commits/{rev}   branches/tags, history
    POST /api/{type}s/{ns}/{name}/branch/{b} | tag/{rev} create branch / tag
    HEAD|GET /{datasets/}{ns}/{name}/resolve/{rev}/{path} file bytes, single Range, ETag, X-Repo-Commit

What it does NOT do, on purpose: it always answers ``uploadMode: "regular"`` in preupload, so the
client inlines every file in the commit payload and never talks to LFS or the Xet storage
service (which the real Hub uses for binary and large files). Commits are kept whole in memory.
Every request is recorded in ``FakeHub.log`` (bodies included) so tests can check what the
client sent; requests to endpoints it does not implement are answered 404 and listed in
``FakeHub.unhandled``, so a test can prove the fake covered everything the client asked for.

Binds 127.0.0.1 only, on a free port; stops when closed (a context manager).
"""

from __future__ import annotations

import base64
import hashlib
import itertools
import json
import re
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, quote, unquote, urlsplit

import yaml

__all__ = ["FakeHub", "RequestRecord", "validate_card_metadata"]

# The Hub's dataset metadata vocabularies this fake checks (from the Hub documentation; the
# size categories also ship with `datasets` in datasets/utils/resources/size_categories.json).
_SIZE_CATEGORIES = {
    "unknown", "n<1K", "1K<n<10K", "10K<n<100K", "100K<n<1M", "1M<n<10M", "10M<n<100M",
    "100M<n<1B", "1B<n<10B", "10B<n<100B", "100B<n<1T", "n>1T", "other",
}
_LICENSES = {
    "apache-2.0", "mit", "openrail", "afl-3.0", "artistic-2.0", "bsl-1.0", "bsd", "bsd-2-clause",
    "bsd-3-clause", "bsd-3-clause-clear", "cc", "cc0-1.0", "cc-by-2.0", "cc-by-2.5", "cc-by-3.0",
    "cc-by-4.0", "cc-by-sa-3.0", "cc-by-sa-4.0", "cc-by-nc-2.0", "cc-by-nc-3.0", "cc-by-nc-4.0",
    "cc-by-nd-4.0", "cc-by-nc-nd-3.0", "cc-by-nc-nd-4.0", "cc-by-nc-sa-2.0", "cc-by-nc-sa-3.0",
    "cc-by-nc-sa-4.0", "cdla-sharing-1.0", "cdla-permissive-1.0", "cdla-permissive-2.0", "wtfpl",
    "ecl-2.0", "epl-1.0", "epl-2.0", "eupl-1.1", "eupl-1.2", "agpl-3.0", "gfdl", "gpl", "gpl-2.0",
    "gpl-3.0", "lgpl", "lgpl-2.1", "lgpl-3.0", "isc", "mpl-2.0", "odc-by", "odbl", "osl-3.0",
    "postgresql", "ofl-1.1", "ncsa", "unlicense", "zlib", "pddl", "llama2", "llama3", "llama3.1",
    "llama3.2", "llama3.3", "llama4", "gemma", "unknown", "other",
}
_TASK_CATEGORIES = {
    "text-classification", "token-classification", "table-question-answering", "question-answering",
    "zero-shot-classification", "translation", "summarization", "feature-extraction",
    "text-generation", "fill-mask", "sentence-similarity", "text-ranking", "other",
}
_FRONT_MATTER = re.compile(r"\A---\s*\n(.*?)\n---\s*(\n|\Z)", re.DOTALL)
_REPO_TYPES = {"datasets": "dataset", "models": "model"}
_HEX40 = re.compile(r"^[0-9a-f]{40}$")


def _git_blob_oid(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def _as_list(v: Any) -> list[Any]:
    return v if isinstance(v, list) else [v]


def validate_card_metadata(content: str) -> tuple[list[str], list[str]]:
    """(errors, warnings) for a README.md, the way the Hub's validator judges dataset cards."""
    m = _FRONT_MATTER.match(content)
    if m is None:
        return [], ["empty or missing yaml metadata in repo card"]
    try:
        meta = yaml.safe_load(m.group(1))
    except yaml.YAMLError as e:
        return [f"YAML metadata cannot be parsed: {e}"], []
    if meta is None:
        return [], ["empty or missing yaml metadata in repo card"]
    if not isinstance(meta, dict):
        return ["YAML metadata must be a mapping"], []
    errors: list[str] = []
    for lic in _as_list(meta.get("license", [])):
        if lic not in _LICENSES:
            errors.append(f'"license" must be one of the Hub\'s license identifiers, got {lic!r}')
    for sc in _as_list(meta.get("size_categories", [])):
        if sc not in _SIZE_CATEGORIES:
            errors.append(f'"size_categories" has an unknown value {sc!r}')
    for tc in _as_list(meta.get("task_categories", [])):
        if tc not in _TASK_CATEGORIES:
            errors.append(f'"task_categories" has an unknown value {tc!r}')
    tags = meta.get("tags", [])
    if not isinstance(tags, list) or not all(isinstance(t, str) for t in tags):
        errors.append('"tags" must be a list of strings')
    configs = meta.get("configs")
    if configs is not None:
        if not isinstance(configs, list):
            errors.append('"configs" must be a list')
        else:
            names: set[str] = set()
            defaults = 0
            for c in configs:
                if not isinstance(c, dict) or not isinstance(c.get("config_name"), str):
                    errors.append('"configs" entries need a string "config_name"')
                    continue
                if c["config_name"] in names:
                    errors.append(f'"configs" names {c["config_name"]!r} twice')
                names.add(c["config_name"])
                defaults += bool(c.get("default"))
                df = c.get("data_files")
                ok = isinstance(df, str) or (
                    isinstance(df, list)
                    and all(isinstance(x, str) or (isinstance(x, dict) and isinstance(x.get("split"), str)
                                                   and isinstance(x.get("path"), (str, list))) for x in df)
                )
                if not ok:
                    errors.append(f'"configs" entry {c["config_name"]!r} has malformed "data_files"')
            if defaults > 1:
                errors.append('"configs": at most one config may be the default')
    return errors, []


@dataclass(frozen=True)
class RequestRecord:
    method: str
    path: str  # raw path with query string, as sent
    headers: dict[str, str]  # lower-case names
    body: bytes
    status: int


@dataclass
class _Commit:
    oid: str
    parent: str | None
    files: dict[str, str]  # path -> blob oid
    title: str
    message: str
    author: str
    date: str


@dataclass
class _Repo:
    repo_type: str
    repo_id: str
    owner: str
    private: bool
    created_at: str
    branches: dict[str, str] = field(default_factory=dict)
    tags: dict[str, str] = field(default_factory=dict)
    commits: dict[str, _Commit] = field(default_factory=dict)


class _HubError(Exception):
    def __init__(self, status: int, message: str, code: str | None = None, extra: dict[str, Any] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.extra = extra or {}


class FakeHub:
    """A running fake Hub. ``url`` is its endpoint; ``tokens`` maps token -> user name."""

    def __init__(self, *, tokens: dict[str, str] | None = None, page_size: int = 1000, expand_page_size: int = 50) -> None:
        self.tokens = dict(tokens or {})
        self.page_size = page_size
        self.expand_page_size = expand_page_size
        self.log: list[RequestRecord] = []
        self.unhandled: list[str] = []
        self._repos: dict[tuple[str, str], _Repo] = {}
        self._blobs: dict[str, bytes] = {}
        self._sha256: dict[str, str] = {}  # sha256 -> blob oid (for lfsFile operations)
        self._lock = threading.RLock()
        self._counter = itertools.count()
        self._fail_commits_after: int | None = None
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), _make_handler(self))
        self._server.daemon_threads = True
        self._thread: threading.Thread | None = None

    # -- lifecycle ------------------------------------------------------------------------
    @property
    def url(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

    def start(self) -> FakeHub:
        self._thread = threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.05},
                                        name="fakehub", daemon=True)
        self._thread.start()
        return self

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def __enter__(self) -> FakeHub:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # -- test helpers ---------------------------------------------------------------------
    def fail_commits_after(self, n: int | None) -> None:
        """Refuse every commit after the next `n` successful ones (HTTP 422, which the client does
        not retry), as if the upload died part-way. None turns it off."""
        with self._lock:
            self._fail_commits_after = n

    def history(self, repo_id: str, revision: str = "main", repo_type: str = "dataset") -> list[str]:
        """Commit titles, newest first."""
        with self._lock:
            repo = self._repos[(repo_type, repo_id)]
            oid: str | None = self._resolve_rev(repo, revision)
            out = []
            while oid is not None:
                c = repo.commits[oid]
                out.append(c.title)
                oid = c.parent
            return out

    def read(self, repo_id: str, path: str, revision: str = "main", repo_type: str = "dataset") -> bytes:
        with self._lock:
            repo = self._repos[(repo_type, repo_id)]
            return self._blobs[repo.commits[self._resolve_rev(repo, revision)].files[path]]

    def paths(self, repo_id: str, revision: str = "main", repo_type: str = "dataset") -> list[str]:
        with self._lock:
            repo = self._repos[(repo_type, repo_id)]
            return sorted(repo.commits[self._resolve_rev(repo, revision)].files)

    def requests(self, method: str | None = None, contains: str = "") -> list[RequestRecord]:
        return [r for r in list(self.log) if (method is None or r.method == method) and contains in r.path]

    # -- state helpers --------------------------------------------------------------------
    def _now(self) -> str:
        return time.strftime("%Y-%m-%dT%H:%M:%S.000Z", time.gmtime())

    def _new_commit(self, repo: _Repo, parent: str | None, files: dict[str, str], title: str, message: str,
                    author: str) -> _Commit:
        seed = f"{repo.repo_id}|{parent}|{title}|{next(self._counter)}|{sorted(files.items())}"
        c = _Commit(oid=hashlib.sha1(seed.encode()).hexdigest(), parent=parent, files=files, title=title,
                    message=message, author=author, date=self._now())
        repo.commits[c.oid] = c
        return c

    def _put_blob(self, data: bytes) -> str:
        oid = _git_blob_oid(data)
        self._blobs[oid] = data
        self._sha256[hashlib.sha256(data).hexdigest()] = oid
        return oid

    def _user(self, headers: dict[str, str]) -> str | None:
        auth = headers.get("authorization")
        if not auth:
            return None
        token = auth.split(" ", 1)[1] if auth.lower().startswith("bearer ") else auth
        user = self.tokens.get(token)
        if user is None:
            raise _HubError(401, "Invalid credentials in Authorization header")
        return user

    def _repo(self, repo_type: str, repo_id: str, user: str | None, *, write: bool = False) -> _Repo:
        repo = self._repos.get((repo_type, repo_id))
        if repo is None or (repo.private and user != repo.owner):
            raise _HubError(404 if user else 401, "Repository not found", "RepoNotFound")
        if write and user != repo.owner:
            raise _HubError(403, f"You don't have the rights to write to {repo_id}")
        return repo

    def _resolve_rev(self, repo: _Repo, rev: str) -> str:
        if rev in repo.branches:
            return repo.branches[rev]
        if rev in repo.tags:
            return repo.tags[rev]
        if rev.startswith("refs/heads/") and rev[11:] in repo.branches:
            return repo.branches[rev[11:]]
        if _HEX40.match(rev) and rev in repo.commits:
            return rev
        raise _HubError(404, f"Invalid rev id: {rev}", "RevisionNotFound")

    @staticmethod
    def _dirs(files: dict[str, str]) -> set[str]:
        out = set()
        for p in files:
            parts = p.split("/")[:-1]
            for i in range(1, len(parts) + 1):
                out.add("/".join(parts[:i]))
        return out

    def _tree_oid(self, files: dict[str, str], d: str) -> str:
        prefix = d + "/"
        h = hashlib.sha1()
        for p in sorted(files):
            if p.startswith(prefix):
                h.update(f"{p}\0{files[p]}\n".encode())
        return h.hexdigest()

    def _last_commit(self, repo: _Repo, head: str, path: str) -> dict[str, str]:
        """The newest commit that changed `path` (a file or folder), as the tree API's lastCommit."""
        c = repo.commits[head]
        def sig(commit: _Commit) -> Any:
            if path in commit.files:
                return commit.files[path]
            return tuple(sorted((p, o) for p, o in commit.files.items() if p.startswith(path + "/")))
        while c.parent is not None and sig(repo.commits[c.parent]) == sig(c):
            c = repo.commits[c.parent]
        return {"id": c.oid, "title": c.title, "date": c.date}

    def _entry(self, repo: _Repo, commit: _Commit, path: str, expand: bool) -> dict[str, Any]:
        if path in commit.files:
            oid = commit.files[path]
            e: dict[str, Any] = {"type": "file", "oid": oid, "size": len(self._blobs[oid]), "path": path}
        else:
            e = {"type": "directory", "oid": self._tree_oid(commit.files, path), "size": 0, "path": path}
        if expand:
            e["lastCommit"] = self._last_commit(repo, commit.oid, path)
            if e["type"] == "file":
                e["securityFileStatus"] = {"status": "safe"}
        return e

    # -- endpoint implementations ---------------------------------------------------------
    def create_repo(self, user: str | None, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        if user is None:
            raise _HubError(401, "You must be authenticated to create a repo")
        name, org = body.get("name"), body.get("organization") or user
        repo_type = body.get("type") or "model"
        if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]*", name):
            raise _HubError(400, f"invalid repo name {name!r}")
        if org != user:
            raise _HubError(403, f"You don't have the rights to create a repo under {org}")
        repo_id = f"{org}/{name}"
        prefix = "" if repo_type == "model" else f"{repo_type}s/"
        url = f"{self.url}/{prefix}{repo_id}"
        if (repo_type, repo_id) in self._repos:
            # Like the Hub, the conflict answer still names the repo's URL (create_repo(exist_ok=True) reads it).
            raise _HubError(409, f"You already created this {repo_type} repo", extra={"url": url})
        repo = _Repo(repo_type=repo_type, repo_id=repo_id, owner=user, private=body.get("visibility") == "private",
                     created_at=self._now())
        # Like the Hub: a new repo has one commit holding a default .gitattributes.
        ga = self._put_blob(b"*.parquet filter=lfs diff=lfs merge=lfs -text\n")
        c = self._new_commit(repo, None, {".gitattributes": ga}, "initial commit", "", user)
        repo.branches["main"] = c.oid
        self._repos[(repo_type, repo_id)] = repo
        return 200, {"url": url, "name": repo_id, "id": hashlib.sha1(repo_id.encode()).hexdigest()[:24]}

    def repo_info(self, repo: _Repo, rev: str) -> dict[str, Any]:
        oid = self._resolve_rev(repo, rev)
        commit = repo.commits[oid]
        card: dict[str, Any] | None = None
        if "README.md" in commit.files:
            m = _FRONT_MATTER.match(self._blobs[commit.files["README.md"]].decode("utf-8", "replace"))
            if m:
                loaded = yaml.safe_load(m.group(1))
                card = loaded if isinstance(loaded, dict) else None
        return {
            "_id": hashlib.sha1(repo.repo_id.encode()).hexdigest()[:24],
            "id": repo.repo_id, "author": repo.repo_id.split("/")[0], "sha": oid, "private": repo.private,
            "gated": False, "disabled": False, "downloads": 0, "likes": 0, "tags": [],
            "createdAt": repo.created_at, "lastModified": commit.date, "cardData": card,
            "siblings": [{"rfilename": p} for p in sorted(commit.files)],
            "usedStorage": sum(len(self._blobs[o]) for o in set(commit.files.values())),
        }

    def preupload(self, repo: _Repo, rev: str, body: dict[str, Any]) -> dict[str, Any]:
        commit = repo.commits[self._resolve_rev(repo, rev)]
        files = []
        for f in body.get("files", []):
            path = f["path"]
            files.append({"path": path, "uploadMode": "regular", "shouldIgnore": False,
                          "oid": commit.files.get(path)})
        return {"files": files, "commitOid": commit.oid}

    def commit(self, repo: _Repo, rev: str, user: str, raw: bytes, query: dict[str, list[str]]) -> dict[str, Any]:
        if query.get("create_pr"):
            raise _HubError(400, "this fake Hub does not open pull requests")
        if rev not in repo.branches:
            raise _HubError(404, f"branch {rev!r} does not exist; create it first", "RevisionNotFound")
        lines = [json.loads(x) for x in raw.splitlines() if x.strip()]
        if not lines or lines[0].get("key") != "header":
            raise _HubError(400, "commit payload must start with a header line")
        header = lines[0]["value"]
        head = repo.branches[rev]
        parent = header.get("parentCommit")
        if parent and not head.startswith(parent):
            raise _HubError(412, "A commit has happened since. Please refresh and try again.")
        files = dict(repo.commits[head].files)
        for item in lines[1:]:
            key, v = item.get("key"), item.get("value", {})
            path = v.get("path", "")
            if not path or path.startswith("/") or ".." in path.split("/"):
                raise _HubError(400, f"invalid path {path!r}")
            if key == "file":
                if v.get("encoding") != "base64":
                    raise _HubError(400, "file content must be base64")
                data = base64.b64decode(v["content"])
                if path == "README.md":
                    errors, _ = validate_card_metadata(data.decode("utf-8", "replace"))
                    if errors:
                        raise _HubError(400, "Invalid metadata in README.md: " + "; ".join(errors))
                files[path] = self._put_blob(data)
            elif key == "lfsFile":
                oid = self._sha256.get(v.get("oid", ""))
                if oid is None:
                    raise _HubError(400, f"LFS object {v.get('oid')} for {path} was never uploaded")
                files[path] = oid
            elif key == "deletedFile":
                files.pop(path, None)
            elif key == "deletedFolder":
                prefix = path.rstrip("/") + "/"
                for p in [p for p in files if p.startswith(prefix)]:
                    del files[p]
            else:
                raise _HubError(400, f"unknown commit operation {key!r}")
        if self._fail_commits_after is not None:
            if self._fail_commits_after <= 0:
                raise _HubError(422, "commit refused by the test (simulated interruption)")
            self._fail_commits_after -= 1
        c = self._new_commit(repo, head, files, header.get("summary", ""), header.get("description", ""), user)
        repo.branches[rev] = c.oid
        prefix = "" if repo.repo_type == "model" else f"{repo.repo_type}s/"
        return {"success": True, "commitOid": c.oid, "commitUrl": f"{self.url}/{prefix}{repo.repo_id}/commit/{c.oid}",
                "hookOutput": "", "pullRequestUrl": None}

    def tree(self, repo: _Repo, rev: str, path: str, query: dict[str, list[str]]) -> tuple[list[dict[str, Any]], bool]:
        commit = repo.commits[self._resolve_rev(repo, rev)]
        recursive = query.get("recursive", ["false"])[0].lower() in ("true", "1")
        expand = query.get("expand", ["false"])[0].lower() in ("true", "1")
        path = path.strip("/")
        dirs = self._dirs(commit.files)
        if path and path not in dirs:
            raise _HubError(404, f"{path} does not exist on {rev} or is not a folder", "EntryNotFound")
        prefix = path + "/" if path else ""
        names = [p for p in sorted(dirs | set(commit.files)) if p.startswith(prefix)]
        if not recursive:
            names = [p for p in names if "/" not in p[len(prefix):]]
        # The Hub lists folders before files at each level ("tree first").
        names.sort(key=lambda p: (p.count("/"), p not in dirs, p))
        cursor = int(base64.urlsafe_b64decode(query["cursor"][0]).decode()) if "cursor" in query else 0
        size = self.expand_page_size if expand else self.page_size
        page = names[cursor: cursor + size]
        more = cursor + size < len(names)
        entries = [self._entry(repo, commit, p, expand) for p in page]
        return entries, more

    def paths_info(self, repo: _Repo, rev: str, form: dict[str, list[str]]) -> list[dict[str, Any]]:
        commit = repo.commits[self._resolve_rev(repo, rev)]
        expand = form.get("expand", ["false"])[0].lower() in ("true", "1")
        dirs = self._dirs(commit.files)
        out = []
        for p in form.get("paths", []):
            p = p.strip("/")
            if p in commit.files or p in dirs:
                out.append(self._entry(repo, commit, p, expand))
        return out

    def refs(self, repo: _Repo) -> dict[str, Any]:
        return {
            "branches": [{"name": n, "ref": f"refs/heads/{n}", "targetCommit": o} for n, o in sorted(repo.branches.items())],
            "tags": [{"name": n, "ref": f"refs/tags/{n}", "targetCommit": o} for n, o in sorted(repo.tags.items())],
            "converts": [], "pullRequests": [],
        }

    def commits(self, repo: _Repo, rev: str) -> list[dict[str, Any]]:
        oid: str | None = self._resolve_rev(repo, rev)
        out = []
        while oid is not None:
            c = repo.commits[oid]
            out.append({"id": c.oid, "title": c.title, "message": c.message, "authors": [{"user": c.author}],
                        "date": c.date})
            oid = c.parent
        return out

    def create_branch(self, repo: _Repo, branch: str, body: dict[str, Any]) -> dict[str, Any]:
        if branch in repo.branches:
            raise _HubError(409, f"Reference refs/heads/{branch} already exists")
        if branch.startswith("refs/"):
            raise _HubError(400, f"invalid branch name {branch!r}")
        repo.branches[branch] = self._resolve_rev(repo, body.get("startingPoint") or "main")
        return {}

    def create_tag(self, repo: _Repo, rev: str, body: dict[str, Any]) -> dict[str, Any]:
        tag = body.get("tag")
        if not isinstance(tag, str) or not tag:
            raise _HubError(400, "missing tag name")
        if tag in repo.tags:
            raise _HubError(409, f"Tag {tag} already exists")
        repo.tags[tag] = self._resolve_rev(repo, rev)
        return {}


def _make_handler(hub: FakeHub) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, format: str, *args: Any) -> None:  # keep test output quiet
            return

        # -- plumbing ---------------------------------------------------------------------
        def _body(self) -> bytes:
            if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
                out = bytearray()
                while True:
                    size = int(self.rfile.readline().strip().split(b";")[0], 16)
                    if size == 0:
                        self.rfile.readline()
                        return bytes(out)
                    out += self.rfile.read(size)
                    self.rfile.readline()
            n = int(self.headers.get("Content-Length") or 0)
            return self.rfile.read(n) if n else b""

        def _send(self, status: int, payload: Any = None, *, headers: dict[str, str] | None = None,
                  raw: bytes | None = None, head: bool = False) -> None:
            data = raw if raw is not None else (b"" if payload is None else json.dumps(payload).encode())
            self.send_response(status)
            hdrs = {"Content-Type": "application/json" if raw is None else "application/octet-stream"}
            hdrs.update(headers or {})
            for k, v in hdrs.items():
                self.send_header(k, v)
            if "Content-Length" not in hdrs:
                self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            if not head and self.command != "HEAD":
                self.wfile.write(data)
            self._status = status

        def _handle(self) -> None:
            self._status = 0
            body = self._body() if self.command in ("POST", "PUT", "DELETE") else b""
            headers = {k.lower(): v for k, v in self.headers.items()}
            try:
                with hub._lock:
                    self._route(body, headers)
            except _HubError as e:
                extra = {"X-Error-Message": str(e)}
                if e.code:
                    extra["X-Error-Code"] = e.code
                self._send(e.status, {"error": str(e), "errors": [{"message": str(e)}], **e.extra}, headers=extra)
            finally:
                hub.log.append(RequestRecord(self.command, self.path, headers, body, self._status))

        do_GET = do_POST = do_HEAD = do_PUT = do_DELETE = _handle

        # -- routing ----------------------------------------------------------------------
        def _route(self, body: bytes, headers: dict[str, str]) -> None:
            url = urlsplit(self.path)
            query = parse_qs(url.query)
            seg = [unquote(s) for s in url.path.split("/")[1:]]
            user = hub._user(headers)
            m = self.command

            if seg == ["api", "repos", "create"] and m == "POST":
                status, out = hub.create_repo(user, json.loads(body or b"{}"))
                return self._send(status, out)
            if seg == ["api", "validate-yaml"] and m == "POST":
                errors, warnings = validate_card_metadata(json.loads(body).get("content", ""))
                out = {"errors": [{"message": e} for e in errors], "warnings": [{"message": w} for w in warnings]}
                return self._send(400 if errors else 200, out)
            if seg == ["api", "whoami-v2"] and m == "GET":
                if user is None:
                    raise _HubError(401, "Invalid credentials in Authorization header")
                return self._send(200, {"type": "user", "name": user, "orgs": [],
                                        "auth": {"type": "access_token", "accessToken": {"role": "write"}}})
            if len(seg) >= 4 and seg[0] == "api" and seg[1] in _REPO_TYPES:
                return self._api_repo(_REPO_TYPES[seg[1]], f"{seg[2]}/{seg[3]}", seg[4:], body, query, user)
            # /datasets/ns/name/resolve/rev/path  or  /ns/name/resolve/rev/path (models)
            if len(seg) >= 5 and seg[0] == "datasets" and seg[3] == "resolve":
                return self._resolve("dataset", f"{seg[1]}/{seg[2]}", seg[4], "/".join(seg[5:]), user, headers)
            if len(seg) >= 4 and seg[2] == "resolve":
                return self._resolve("model", f"{seg[0]}/{seg[1]}", seg[3], "/".join(seg[4:]), user, headers)
            hub.unhandled.append(f"{m} {self.path}")
            raise _HubError(404, f"the fake Hub does not implement {m} {url.path}")

        def _api_repo(self, repo_type: str, repo_id: str, rest: list[str], body: bytes,
                      query: dict[str, list[str]], user: str | None) -> None:
            m = self.command
            if not rest and m == "GET":
                return self._send(200, hub.repo_info(hub._repo(repo_type, repo_id, user), "main"))
            if len(rest) == 2 and rest[0] == "revision" and m == "GET":
                return self._send(200, hub.repo_info(hub._repo(repo_type, repo_id, user), rest[1]))
            if len(rest) == 2 and rest[0] == "preupload" and m == "POST":
                repo = hub._repo(repo_type, repo_id, user, write=True)
                return self._send(200, hub.preupload(repo, rest[1], json.loads(body)))
            if len(rest) == 2 and rest[0] == "commit" and m == "POST":
                repo = hub._repo(repo_type, repo_id, user, write=True)
                assert user is not None
                return self._send(200, hub.commit(repo, rest[1], user, body, query))
            if len(rest) >= 2 and rest[0] == "tree" and m == "GET":
                repo = hub._repo(repo_type, repo_id, user)
                entries, more = hub.tree(repo, rest[1], "/".join(rest[2:]), query)
                extra = {}
                if more:
                    cursor = int(base64.urlsafe_b64decode(query["cursor"][0]).decode()) if "cursor" in query else 0
                    step = hub.expand_page_size if "expand" in query and query["expand"][0].lower() in ("true", "1") \
                        else hub.page_size
                    q = {k: v[0] for k, v in query.items() if k != "cursor"}
                    q["cursor"] = base64.urlsafe_b64encode(str(cursor + step).encode()).decode()
                    qs = "&".join(f"{k}={quote(str(v), safe='')}" for k, v in q.items())
                    extra["Link"] = f'<{hub.url}{urlsplit(self.path).path}?{qs}>; rel="next"'
                return self._send(200, entries, headers=extra)
            if len(rest) == 2 and rest[0] == "paths-info" and m == "POST":
                repo = hub._repo(repo_type, repo_id, user)
                ctype = self.headers.get("Content-Type", "")
                form = ({k: [str(x) for x in _as_list(v)] for k, v in json.loads(body).items()}
                        if "json" in ctype else parse_qs(body.decode()))
                return self._send(200, hub.paths_info(repo, rest[1], form))
            if rest == ["refs"] and m == "GET":
                return self._send(200, hub.refs(hub._repo(repo_type, repo_id, user)))
            if len(rest) == 2 and rest[0] == "commits" and m == "GET":
                return self._send(200, hub.commits(hub._repo(repo_type, repo_id, user), rest[1]))
            if len(rest) == 2 and rest[0] == "branch" and m == "POST":
                repo = hub._repo(repo_type, repo_id, user, write=True)
                return self._send(200, hub.create_branch(repo, rest[1], json.loads(body or b"{}")))
            if len(rest) == 2 and rest[0] == "tag" and m == "POST":
                repo = hub._repo(repo_type, repo_id, user, write=True)
                return self._send(200, hub.create_tag(repo, rest[1], json.loads(body or b"{}")))
            hub.unhandled.append(f"{m} {self.path}")
            raise _HubError(404, f"the fake Hub does not implement {m} {self.path}")

        def _resolve(self, repo_type: str, repo_id: str, rev: str, path: str, user: str | None,
                     headers: dict[str, str]) -> None:
            if self.command not in ("GET", "HEAD"):
                raise _HubError(405, "resolve is read-only")
            repo = hub._repo(repo_type, repo_id, user)
            oid = hub._resolve_rev(repo, rev)
            commit = repo.commits[oid]
            if path not in commit.files:
                raise _HubError(404, f"Entry not found: {path}", "EntryNotFound")
            blob_oid = commit.files[path]
            data = hub._blobs[blob_oid]
            base = {"ETag": f'"{blob_oid}"', "X-Repo-Commit": oid, "Accept-Ranges": "bytes"}
            rng = headers.get("range")
            if rng is None or self.command == "HEAD":
                return self._send(200, raw=data, headers=base)
            m = re.fullmatch(r"bytes=(\d*)-(\d*)", rng.strip())
            n = len(data)
            if m is None or (m.group(1) == "" and m.group(2) == ""):
                raise _HubError(416, f"unsupported range {rng!r}")
            if m.group(1) == "":  # suffix range: the last N bytes
                start, end = max(0, n - int(m.group(2))), n - 1
            else:
                start = int(m.group(1))
                end = min(int(m.group(2)), n - 1) if m.group(2) else n - 1
            if start >= n or start > end:
                return self._send(416, raw=b"", headers={**base, "Content-Range": f"bytes */{n}"})
            return self._send(206, raw=data[start: end + 1],
                              headers={**base, "Content-Range": f"bytes {start}-{end}/{n}"})

    return Handler
