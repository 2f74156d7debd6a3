"""Client buffers: anonymous shared memory owned by the daemon process.

The compute process maps the same memory, so its death loses no data. The
registry enforces the daemon-wide byte cap (`--mem`) and per-client ownership.
The cap covers the compute process's intermediates too (`compute_bytes`, as
it last reported them): a buffer is refused if it would not fit beside them.
"""
from __future__ import annotations

import itertools
import mmap
import os
from dataclasses import dataclass, field
from typing import Callable

ALIGNMENT = 64  # every buffer base is page aligned; tensors inside should be 64-byte aligned


@dataclass(eq=False)
class SharedBuffer:
    key: int
    size: int
    fd: int
    mm: mmap.mmap
    owner: int
    view: memoryview = field(init=False)

    def __post_init__(self):
        self.view = memoryview(self.mm)

    def close(self) -> None:
        self.view.release()
        os.close(self.fd)
        try:
            self.mm.close()
        except BufferError:
            pass  # a slice of the view is still alive somewhere: the mapping goes with it


class BufferRegistry:
    def __init__(self, max_bytes: int):
        self.max_bytes = max_bytes
        self.allocated = 0
        self.compute_bytes: Callable[[], int] = lambda: 0  # set by the daemon: its compute process's share
        self._buffers: dict[int, SharedBuffer] = {}
        self._keys = itertools.count(1)

    def alloc(self, owner: int, size: int) -> SharedBuffer | None:
        """A zero-filled buffer, or None if the cap or the system refuses."""
        if size <= 0 or self.allocated + self.compute_bytes() + size > self.max_bytes:
            return None
        key = next(self._keys)
        try:
            fd = os.memfd_create(f"ggml-rpc-{key}", os.MFD_CLOEXEC)
            try:
                os.ftruncate(fd, size)
                mm = mmap.mmap(fd, size)
            except BaseException:
                os.close(fd)
                raise
        except OSError:
            return None
        buf = SharedBuffer(key, size, fd, mm, owner)
        self._buffers[key] = buf
        self.allocated += size
        return buf

    def get(self, owner: int, key: int) -> SharedBuffer | None:
        buf = self._buffers.get(key)
        return buf if buf is not None and buf.owner == owner else None

    def free(self, buf: SharedBuffer) -> None:
        if self._buffers.pop(buf.key, None) is buf:
            self.allocated -= buf.size
            buf.close()

    def owned_by(self, owner: int) -> list[SharedBuffer]:
        return [b for b in self._buffers.values() if b.owner == owner]

    def __len__(self) -> int:
        return len(self._buffers)
