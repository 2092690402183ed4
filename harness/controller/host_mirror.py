"""What a cluster host's agent sends back of the files a run's ranks write (``host_agent``): the
growth of each file, as JSON-line ``file`` messages the controller writes at the same offsets."""

from __future__ import annotations

import base64
import hashlib
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

CHUNK = 1 << 20  # bytes of one file per message


def sha256_of(path: Path, size: int | None = None) -> str | None:
    """The file's SHA-256 (of its first ``size`` bytes, where given), or ``None`` if unreadable."""
    try:
        h = hashlib.sha256()
        left = size
        with open(path, "rb") as f:
            while left is None or left > 0:
                block = f.read(CHUNK if left is None else min(CHUNK, left))
                if not block:
                    break
                h.update(block)
                if left is not None:
                    left -= len(block)
        return h.hexdigest() if not left else None  # shorter than ``size``: not that prefix
    except OSError:
        return None


class Mirror:
    """Sends the growth of every file under the watched directories; a file replaced (a new
    inode, as atomic writes do) or shrunk is sent again whole."""

    def __init__(self, root: Path, dirs: list[str]):
        self.root, self.dirs = root, [Path(d) for d in dirs]
        self.sent: dict[Path, tuple[int, int]] = {}  # path -> (inode, bytes sent)

    def resume(self, known: dict[str, list[Any]]) -> int:
        """Take up where an earlier agent's mirror left off: ``known`` maps a path relative to the
        root to ``[size, sha256]`` of the controller's copy; a file here whose first ``size`` bytes
        have that digest is sent from there on, any other whole. Returns the files resumed."""
        resumed = 0
        for rel, (size, digest) in known.items():
            path = self.root / rel
            try:
                inode = path.stat().st_ino
            except OSError:
                continue
            if sha256_of(path, int(size)) == digest:
                self.sent[path] = (inode, int(size))
                resumed += 1
        return resumed

    def scan(self, send: Callable[[dict[str, Any]], None]) -> None:
        for d in self.dirs:
            if not d.is_dir():
                continue
            for dirpath, _, files in os.walk(d):
                for name in files:
                    if name.startswith("."):
                        continue  # a file being written under a temporary name
                    self._send_file(Path(dirpath) / name, send)

    def _send_file(self, path: Path, send: Callable[[dict[str, Any]], None]) -> None:
        try:
            st = path.stat()
        except OSError:
            return
        inode, done = self.sent.get(path, (None, 0))
        offset = done if inode == st.st_ino and st.st_size >= done else 0
        if inode == st.st_ino and offset == st.st_size:
            return
        try:
            with open(path, "rb") as f:
                f.seek(offset)
                while True:
                    data = f.read(CHUNK)
                    if not data and offset > 0:
                        break
                    send({"op": "file", "path": str(path.relative_to(self.root)), "offset": offset,
                          "data": base64.b64encode(data).decode()})
                    offset += len(data)
                    if not data or len(data) < CHUNK:
                        break
        except OSError:
            return
        self.sent[path] = (st.st_ino, offset)
