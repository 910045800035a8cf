"""A static HTTP file server with single-range Range support, on 127.0.0.1, that logs every request.

Python's http.server ignores Range (it always sends the whole file); this subclass honours
``bytes=a-b``, ``bytes=a-`` and ``bytes=-n`` with 206 + Content-Range, and keeps the directory
listings (fsspec's HTTP filesystem lists folders by parsing them). ``RangeServer(..., ranges=False)``
is the plain stdlib server, for the test that a store refuses a server without Range support.
"""

from __future__ import annotations

import os
import re
import threading
from dataclasses import dataclass
from functools import partial
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

__all__ = ["Hit", "RangeServer"]


@dataclass(frozen=True)
class Hit:
    method: str
    path: str
    range: str | None
    status: int
    nbytes: int  # body bytes sent


class _Handler(SimpleHTTPRequestHandler):
    def __init__(self, *args: Any, server_obj: RangeServer, **kwargs: Any) -> None:
        self._owner = server_obj
        super().__init__(*args, **kwargs)

    def log_message(self, format: str, *args: Any) -> None:
        return

    def _hit(self, status: int, nbytes: int) -> None:
        with self._owner.lock:
            self._owner.hits.append(Hit(self.command, self.path, self.headers.get("Range"), status, nbytes))

    def do_HEAD(self) -> None:
        super().do_HEAD()
        self._hit(200, 0)

    def do_GET(self) -> None:
        path = self.translate_path(self.path)
        rng = self.headers.get("Range")
        if not self._owner.ranges or rng is None or os.path.isdir(path) or not os.path.isfile(path):
            f = self.send_head()
            n = 0
            if f is not None:
                try:
                    data = f.read()
                    self.wfile.write(data)
                    n = len(data)
                finally:
                    f.close()
            self._hit(200 if f is not None else 404, n)
            return
        size = os.path.getsize(path)
        m = re.fullmatch(r"bytes=(\d*)-(\d*)", rng.strip())
        if m is None or m.group(1) == m.group(2) == "":
            self.send_error(416)
            self._hit(416, 0)
            return
        if m.group(1) == "":
            start, end = max(0, size - int(m.group(2))), size - 1
        else:
            start, end = int(m.group(1)), min(int(m.group(2)) if m.group(2) else size - 1, size - 1)
        if start >= size or start > end:
            self.send_response(416)
            self.send_header("Content-Range", f"bytes */{size}")
            self.send_header("Content-Length", "0")
            self.end_headers()
            self._hit(416, 0)
            return
        with open(path, "rb") as f:
            f.seek(start)
            body = f.read(end - start + 1)
        self.send_response(206)
        self.send_header("Content-Type", "application/octet-stream")
        self.send_header("Content-Range", f"bytes {start}-{end}/{size}")
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Accept-Ranges", "bytes")
        self.end_headers()
        self.wfile.write(body)
        self._hit(206, len(body))


class RangeServer:
    """Serve `directory` on http://127.0.0.1:<free port>; `hits` lists what was asked for."""

    def __init__(self, directory: str | os.PathLike[str], *, ranges: bool = True) -> None:
        self.ranges = ranges
        self.hits: list[Hit] = []
        self.lock = threading.Lock()
        handler = partial(_Handler, directory=os.fspath(directory), server_obj=self)
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)

    @property
    def url(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

    def __enter__(self) -> RangeServer:
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)
