"""Persistent content-addressed tensor cache (`--cache DIR`, bounded by `--cache-max`).

Files are named by the SHA-256 of their contents and verified against it every
time they are loaded, so a corrupted or truncated file is never served. The
cache holds at most `max_bytes`: room for a new entry is made first by deleting
the least recently used ones (a load or a store is a use; the order survives a
restart as the files' mtimes). An entry being read or written is never deleted.

Store and load run on executor threads, for any number of connections at once:
the index (sizes, use order, entries in use) is guarded by one lock; reads and
writes happen outside it, deletions under it (so that a store of the same
content cannot land between the index and the disk). The directory is meant for one daemon (the systemd unit
gives each port its own).
"""
from __future__ import annotations

import collections
import hashlib
import os
import pathlib
import re
import tempfile
import threading

import structlog

log = structlog.get_logger("cache")
_HEX = re.compile(r"^[0-9a-f]{64}$")
_OLD_TMP = re.compile(r"^[0-9a-f]{64}\.tmp\d+$")
COPY_PIECE = 256 << 10  # a load's piece: read, hashed and written while it stays in the CPU's cache
_TMP_PREFIX = ".tmp-"  # .tmp-<pid>-...: a store in progress; one of a dead process was cut short


def digest(data) -> str:
    return hashlib.sha256(data).hexdigest()


def default_max_bytes(root: str | os.PathLike, mem_bytes: int) -> int:
    """Twice the memory a worker hands out (its current weights and one other
    model's), at most half of the cache's file system."""
    root = pathlib.Path(root)
    root.mkdir(parents=True, exist_ok=True)
    st = os.statvfs(root)
    return min(2 * mem_bytes, st.f_blocks * st.f_frsize // 2)


class TensorCache:
    def __init__(self, root: str | os.PathLike, max_bytes: int):
        if max_bytes < 1:
            raise ValueError("the tensor cache needs a size limit of at least one byte")
        self.root = pathlib.Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.max_bytes = max_bytes
        self._lock = threading.Lock()
        self._sizes: collections.OrderedDict[str, int] = collections.OrderedDict()  # least recently used first
        self._in_use: collections.Counter[str] = collections.Counter()  # entries being read
        self._writing: set[str] = set()  # entries being written (not yet in _sizes)
        self.bytes = 0  # the entries' sizes, and the room reserved for those being written
        self.evictions = 0  # entries deleted to make room
        self._scan()
        with self._lock:
            victims = self._make_room(0)  # a smaller --cache-max than the last run's
        self._log_evicted(victims, reason="over --cache-max at start")
        log.info("tensor cache", dir=str(self.root), entries=len(self._sizes), bytes=self.bytes,
                 max_bytes=self.max_bytes)

    def _path(self, hex_digest: str) -> pathlib.Path:
        if not _HEX.match(hex_digest):
            raise ValueError("hash must be 64 lowercase hex digits (sha256)")
        return self.root / hex_digest[:2] / hex_digest

    def _scan(self) -> None:
        """Index the entries on disk, oldest use first; delete partial writes left by a dead process."""
        found = []
        for sub in self.root.iterdir():
            if not sub.is_dir() or len(sub.name) != 2:
                continue
            for entry in os.scandir(sub):
                if entry.name.startswith(_TMP_PREFIX):
                    if not _writer_alive(entry.name):
                        pathlib.Path(entry.path).unlink(missing_ok=True)
                        log.warning("partial cache entry removed", file=entry.path)
                elif _OLD_TMP.match(entry.name):  # a write of a daemon before --cache-max, cut short
                    pathlib.Path(entry.path).unlink(missing_ok=True)
                elif _HEX.match(entry.name) and entry.name[:2] == sub.name and entry.is_file():
                    st = entry.stat()
                    found.append((st.st_mtime_ns, entry.name, st.st_size))
        for _, name, size in sorted(found):
            self._sizes[name] = size
            self.bytes += size

    @property
    def entries(self) -> int:
        return len(self._sizes)

    def _make_room(self, size: int) -> list[tuple[str, int]] | None:
        """Under the lock: delete least recently used entries not in use until
        `size` more bytes fit; the entries deleted, or None (and nothing deleted)
        when even that would not make room."""
        if self.bytes + size > self.max_bytes:
            evictable = sum(s for name, s in self._sizes.items() if not self._in_use[name])
            if self.bytes - evictable + size > self.max_bytes:
                return None
        victims = []
        for name in list(self._sizes):
            if self.bytes + size <= self.max_bytes:
                break
            if not self._in_use[name]:
                victims.append((name, self._sizes.pop(name)))
                self.bytes -= victims[-1][1]
                # under the lock, so a store of the same content cannot land between index and disk
                self._path(name).unlink(missing_ok=True)
        self.evictions += len(victims)
        return victims

    def _log_evicted(self, victims: list[tuple[str, int]], reason: str) -> None:
        if victims:
            log.info("tensor cache evicted", reason=reason, entries=len(victims),
                     bytes=sum(s for _, s in victims), cache_bytes=self.bytes, max_bytes=self.max_bytes,
                     oldest=victims[0][0])

    def _forget(self, name: str, delete: bool = False) -> None:
        with self._lock:
            if delete:
                self._path(name).unlink(missing_ok=True)
            self.bytes -= self._sizes.pop(name, 0)

    def store(self, data) -> str | None:
        """Keep `data` under its SHA-256 (the digest); None when it was not kept
        (larger than the whole cache, no room beside entries in use, a write error)."""
        hex_digest = digest(data)
        path, size = self._path(hex_digest), len(data)
        with self._lock:
            if hex_digest in self._writing:
                return hex_digest  # another connection is writing the same content right now
            if self._sizes.get(hex_digest) == size:
                self._sizes.move_to_end(hex_digest)
                victims = None
            elif self._in_use[hex_digest]:
                return None  # a load is reading the (truncated) entry; the next store rewrites it
            else:
                self.bytes -= self._sizes.pop(hex_digest, 0)  # a truncated entry: rewritten below
                victims = self._make_room(size) if size <= self.max_bytes else None
                if victims is None:
                    log.warning("tensor not cached: no room beside the entries in use" if size <= self.max_bytes
                                else "tensor not cached: larger than the whole cache (--cache-max)",
                                bytes=size, cache_bytes=self.bytes, max_bytes=self.max_bytes)
                    return None
                self.bytes += size  # reserved now, so that concurrent stores cannot overfill the cache
                self._writing.add(hex_digest)
        if victims is None:
            _touch(path)
            return hex_digest
        self._log_evicted(victims, reason="room for a new entry")
        try:
            written = self._write(path, data)
        finally:
            with self._lock:
                self._writing.discard(hex_digest)
                if written:
                    self._sizes[hex_digest] = size  # only now can it be loaded, or evicted
                else:
                    self.bytes -= size
        return hex_digest if written else None

    def _write(self, path: pathlib.Path, data) -> bool:
        try:
            path.parent.mkdir(exist_ok=True)
            fd, tmp = tempfile.mkstemp(prefix=f"{_TMP_PREFIX}{os.getpid()}-", dir=path.parent)
            try:
                with open(fd, "wb") as f:
                    f.write(data)
                os.replace(tmp, path)
            except BaseException:
                pathlib.Path(tmp).unlink(missing_ok=True)
                raise
        except OSError as exc:  # disk full, read-only: the SET_TENSOR itself succeeded; only caching failed
            log.warning("tensor not cached: cannot write the cache", error=str(exc), dir=str(self.root))
            return False
        return True

    def load_into(self, hex_digest: str, fd: int, offset: int, size: int) -> bool:
        """Write the cached content to file `fd` (a client's shared memory) at
        `offset`; False if absent, not `size` bytes or corrupt (what was
        written of it stays there)."""
        path = self._path(hex_digest)
        with self._lock:
            if self._sizes.get(hex_digest) != size:
                return False
            self._sizes.move_to_end(hex_digest)
            self._in_use[hex_digest] += 1  # not evicted while it is read
        try:
            try:
                copied = _copy_hashing(path, fd, offset, size)
            except FileNotFoundError:  # deleted behind the daemon's back
                self._forget(hex_digest)
                return False
            if copied != hex_digest:  # short, or not the content its name says
                log.warning("corrupt cache entry removed", hash=hex_digest)
                self._forget(hex_digest, delete=True)
                return False
            _touch(path)
            return True
        finally:
            with self._lock:
                self._in_use[hex_digest] -= 1
                if not self._in_use[hex_digest]:
                    del self._in_use[hex_digest]


def _copy_hashing(path: pathlib.Path, fd: int, offset: int, size: int) -> str | None:
    """Copy the first `size` bytes of file `path` to file `fd` at `offset`, a
    piece at a time, hashing each piece as it passes (while it is in the CPU's
    cache: a quarter less CPU than reading it all into place, page faults
    included, and hashing it there); their SHA-256, or None if the file is
    shorter. What is hashed is what is written."""
    h = hashlib.sha256()
    piece = memoryview(bytearray(min(size, COPY_PIECE)))
    done = 0
    with open(path, "rb", buffering=0) as f:
        while done < size:
            n = f.readinto(piece[:min(COPY_PIECE, size - done)])
            if not n:
                return None
            h.update(piece[:n])
            written = 0
            while written < n:
                written += os.pwrite(fd, piece[written:n], offset + done + written)
            done += n
    return h.hexdigest()


def _writer_alive(tmp_name: str) -> bool:
    """Whether the process that names a temp file (.tmp-<pid>-...) still runs: its
    write may be in progress (a test rig's daemons may share a directory)."""
    try:
        pid = int(tmp_name[len(_TMP_PREFIX):].split("-", 1)[0])
        os.kill(pid, 0)
    except (ValueError, ProcessLookupError):
        return False
    except PermissionError:
        return True
    return pid != os.getpid()


def _touch(path: pathlib.Path) -> None:
    """Record a use in the file's mtime: the use order a restarted daemon reads back."""
    try:
        os.utime(path)
    except OSError:
        pass
