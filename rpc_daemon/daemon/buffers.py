"""Client buffers: anonymous shared memory owned by the daemon process.

Each client has ONE arena: a sparse file of shared memory (a memfd, or a file on
a tmpfs given huge pages: service/shared_memory.py) mapped once (`arena_bytes` of address
space, default up to 1 TiB; only touched pages cost memory). Its buffers are
page-aligned ranges of it, first fit from a free list that coalesces
neighbours. So a client costs a constant number of descriptors (the memfd and
the mmap's duplicate of it) however many buffers it holds, and its compute
process maps its arena, and nobody else's, once.

* ALLOC returns zeroed memory: the file is grown over a range past its end
  (fresh pages), or the range was released with MADV_REMOVE when it was freed.
* FREE releases the pages: MADV_REMOVE, or ftruncate when the range is the top
  of the arena. The file never extends past the highest live buffer, so a
  compute that strays past it faults (SIGBUS) instead of taking memory.

The registry enforces the daemon-wide byte cap (`--mem`) on sizes rounded up to
whole pages, as allocated. The cap covers the compute processes' intermediates
too (`compute_bytes`, as they last reported them): a buffer is refused if it
would not fit beside them.
"""
from __future__ import annotations

import bisect
import itertools
import mmap
import os
from dataclasses import dataclass, field
from typing import Callable

from rpc_daemon.service.memory import HUGE_PAGE
from rpc_daemon.service.shared_memory import SharedMemory

ALIGNMENT = 64  # every buffer base is page aligned; tensors inside should be 64-byte aligned
PAGE = mmap.PAGESIZE
MAX_ARENA = 1 << 40
MIN_ARENA = 1 << 30


def round_up(n: int, to: int = PAGE) -> int:
    return -(-n // to) * to


FILL_PIECE = 1 << 20


def fill_bytes(view: memoryview, value: int) -> None:
    """Set every byte of `view` to `value` (BUFFER_CLEAR): a memset a piece at a
    time, with no temporary of the buffer's size."""
    piece = bytes([value]) * min(len(view), FILL_PIECE)
    for off in range(0, len(view), FILL_PIECE):
        n = min(FILL_PIECE, len(view) - off)
        view[off: off + n] = piece[:n]


def arena_size_for(client_cap: int) -> int:
    """Address space of one client's arena: room for 4x its byte cap (first fit
    with coalescing never fragments that badly), a power of two in 1 GiB..1 TiB."""
    want = max(MIN_ARENA, 4 * client_cap)
    return min(MAX_ARENA, 1 << (want - 1).bit_length())


@dataclass(eq=False)
class SharedBuffer:
    key: int
    size: int  # as asked: the range clients may address
    offset: int  # in the owner's arena, page aligned
    alloc_size: int  # size rounded up to whole pages: what the caps count
    arena: "ClientArena"
    owner: int
    view: memoryview = field(init=False)

    def __post_init__(self):
        self.view = self.arena.view[self.offset: self.offset + self.size]

    @property
    def fd(self) -> int:
        return self.arena.fd

    def close(self) -> None:
        self.view.release()


class ClientArena:
    """One client's sparse shared memory and the page ranges of its buffers."""

    def __init__(self, owner: int, size: int, shm: SharedMemory):
        self.owner = owner
        self.size = size
        self.fd = shm.new_file(f"ggml-rpc-client-{owner}")
        try:
            os.ftruncate(self.fd, size)  # Python's mmap refuses to map past the end of the file...
            self.mm = mmap.mmap(self.fd, size)
            os.ftruncate(self.fd, 0)  # ...which then grows with the buffers
        except BaseException:
            os.close(self.fd)
            raise
        if shm.huge_pages and hasattr(mmap, "MADV_HUGEPAGE"):  # shmem_enabled "advise" asks for it
            try:
                self.mm.madvise(mmap.MADV_HUGEPAGE)
            except OSError:
                pass  # best effort: the memory is as usable on 4 KiB pages
        self.view = memoryview(self.mm)
        self.end = 0  # file size: one past the highest live buffer
        self._free_offs = [0]  # free ranges, sorted, never adjacent (coalesced)
        self._free_lens = [size]
        self.buffers: dict[int, SharedBuffer] = {}
        self.held = 0  # bytes of its buffers, page rounded

    def take(self, n: int) -> int | None:
        """Offset of `n` (page multiple) zeroed bytes, or None if no free range is that long."""
        for i, length in enumerate(self._free_lens):
            if length >= n:
                off = self._free_offs[i]
                if length == n:
                    del self._free_offs[i], self._free_lens[i]
                else:
                    self._free_offs[i] += n
                    self._free_lens[i] -= n
                if off + n > self.end:
                    os.ftruncate(self.fd, off + n)  # fresh pages past the old end read as zero
                    self.end = off + n
                return off
        return None

    def give_back(self, off: int, n: int) -> None:
        i = bisect.bisect_left(self._free_offs, off)
        if i < len(self._free_offs) and off + n == self._free_offs[i]:  # merge with the range above
            n += self._free_lens[i]
            del self._free_offs[i], self._free_lens[i]
        if i > 0 and self._free_offs[i - 1] + self._free_lens[i - 1] == off:  # and below
            i -= 1
            off = self._free_offs[i]
            n += self._free_lens[i]
            del self._free_offs[i], self._free_lens[i]
        self._free_offs.insert(i, off)
        self._free_lens.insert(i, n)
        if off + n == self.size:  # the top of the arena: shrink the file, which frees the pages
            if off < self.end:
                os.ftruncate(self.fd, off)
                self.end = off
        else:
            self.mm.madvise(mmap.MADV_REMOVE, off, n)  # pages freed; they read back as zero

    def close(self) -> None:
        self.view.release()
        os.close(self.fd)
        try:
            self.mm.close()
        except BufferError:
            pass  # a slice of the view is still alive somewhere: the mapping goes with it


class BufferRegistry:
    def __init__(self, max_bytes: int, arena_bytes: int | None = None, shm: SharedMemory | None = None):
        self.max_bytes = max_bytes
        self.arena_bytes = arena_bytes or arena_size_for(max_bytes)
        self.shm = shm or SharedMemory()  # default: memfds
        # the arena's page: buffers start on one and count as whole ones. On huge pages the first touch
        # of a 2 MiB range takes all of it, so a smaller unit would let a client hold up to 512x what the
        # caps count (4 KiB buffers between freed ranges)
        self.page = HUGE_PAGE if self.shm.huge_pages else PAGE
        self.allocated = 0  # page rounded, all clients
        self.compute_bytes: Callable[[], int] = lambda: 0  # set by the daemon: its compute processes' share
        self.arenas: dict[int, ClientArena] = {}
        self._count = 0
        self._keys = itertools.count(1)

    def arena(self, owner: int) -> ClientArena | None:
        return self.arenas.get(owner)

    def alloc(self, owner: int, size: int) -> SharedBuffer | None:
        """A zero-filled buffer, or None if the cap or the system refuses."""
        n = self.round_up(size)
        if size <= 0 or self.allocated + self.compute_bytes() + n > self.max_bytes:
            return None
        try:
            arena = self.arenas.get(owner)
            if arena is None:
                arena = self.arenas[owner] = ClientArena(owner, self.arena_bytes, self.shm)
            off = arena.take(n)
        except OSError:
            return None
        if off is None:
            return None
        key = next(self._keys)
        buf = SharedBuffer(key, size, off, n, arena, owner)
        arena.buffers[key] = buf
        arena.held += n
        self.allocated += n
        self._count += 1
        return buf

    def round_up(self, n: int) -> int:
        """`n` bytes as the caps count them: whole pages of the arena."""
        return round_up(n, self.page)

    def get(self, owner: int, key: int) -> SharedBuffer | None:
        arena = self.arenas.get(owner)
        return arena.buffers.get(key) if arena is not None else None

    def free(self, buf: SharedBuffer) -> None:
        arena = buf.arena
        if arena.buffers.pop(buf.key, None) is buf:
            buf.close()
            arena.held -= buf.alloc_size
            self.allocated -= buf.alloc_size
            self._count -= 1
            arena.give_back(buf.offset, buf.alloc_size)

    def release(self, owner: int) -> None:
        """Free all of a client's buffers and its arena (when it leaves)."""
        arena = self.arenas.pop(owner, None)
        if arena is None:
            return
        for buf in arena.buffers.values():
            buf.close()
            self.allocated -= buf.alloc_size
            self._count -= 1
        arena.buffers.clear()
        arena.close()

    def held_by(self, owner: int) -> tuple[int, int]:
        """(buffers, bytes page rounded) a client holds."""
        arena = self.arenas.get(owner)
        return (len(arena.buffers), arena.held) if arena is not None else (0, 0)

    def owned_by(self, owner: int) -> list[SharedBuffer]:
        arena = self.arenas.get(owner)
        return list(arena.buffers.values()) if arena is not None else []

    def __len__(self) -> int:
        return self._count
