"""Persistent content-addressed tensor cache (`--cache DIR`).

Files are named by the SHA-256 of their contents and verified against it every
time they are loaded, so a corrupted or truncated file is never served.
"""
from __future__ import annotations

import hashlib
import os
import pathlib
import re

import structlog

log = structlog.get_logger("cache")
_HEX = re.compile(r"^[0-9a-f]{64}$")


def digest(data) -> str:
    return hashlib.sha256(data).hexdigest()


class TensorCache:
    def __init__(self, root: str | os.PathLike):
        self.root = pathlib.Path(root)
        self.root.mkdir(parents=True, exist_ok=True)

    def _path(self, hex_digest: str) -> pathlib.Path:
        if not _HEX.match(hex_digest):
            raise ValueError("hash must be 64 lowercase hex digits (sha256)")
        return self.root / hex_digest[:2] / hex_digest

    def store(self, data) -> str:
        hex_digest = digest(data)
        path = self._path(hex_digest)
        if not path.exists():
            path.parent.mkdir(exist_ok=True)
            tmp = path.with_suffix(f".tmp{os.getpid()}")
            with open(tmp, "wb") as f:
                f.write(data)
            os.replace(tmp, path)
        return hex_digest

    def load_into(self, hex_digest: str, dest: memoryview) -> bool:
        """Fill `dest` with the cached content; False if absent, the wrong size or corrupt."""
        path = self._path(hex_digest)
        try:
            if path.stat().st_size != len(dest):
                return False
            with open(path, "rb") as f:
                if f.readinto(dest) != len(dest):
                    return False
        except FileNotFoundError:
            return False
        if digest(dest) != hex_digest:
            log.warning("corrupt cache entry removed", hash=hex_digest)
            path.unlink(missing_ok=True)
            return False
        return True
