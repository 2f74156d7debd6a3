"""The machine's memory, as both sides read it: the daemon for its default
--mem and the free memory DEVICE_INFO reports, the coordinator for what it may
hold itself (the output head's rows it computes). Here, not in daemon/, because
the coordinator needs it without the daemon's modules."""
from __future__ import annotations

import ctypes
import mmap
import os


def physical_memory() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def available_memory() -> int:
    """MemAvailable of /proc/meminfo; the physical memory where there is none."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return physical_memory()


_trim = None  # glibc's malloc_trim, once looked up; False where there is none (musl, macOS)


def give_back_free_heap() -> bool:
    """Return the C heap's free pages to the system (glibc's malloc_trim(0)):
    what a client's requests made the heap grow to (frames, graphs, replies)
    stays mapped after they are freed, the main heap's middle and the
    threads' arenas alike, unless trimmed. A few hundred microseconds on a
    daemon's heap. False where the C library has no malloc_trim."""
    global _trim
    if _trim is None:
        try:
            _trim = ctypes.CDLL(None).malloc_trim  # the C library this process runs on
            _trim.argtypes, _trim.restype = [ctypes.c_size_t], ctypes.c_int
        except (OSError, AttributeError):
            _trim = False
    if _trim is False:
        return False
    _trim(0)
    return True


HUGE_PAGE = 2 << 20
MADV_HUGEPAGE = 14
# the C library's memory calls, typed once for every user in the process (the compute process's
# shared mappings too)
libc = ctypes.CDLL(None, use_errno=True)
libc.mmap.restype, libc.mmap.argtypes = ctypes.c_void_p, [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int,
                                                          ctypes.c_int, ctypes.c_int, ctypes.c_long]
libc.munmap.restype, libc.munmap.argtypes = ctypes.c_int, [ctypes.c_void_p, ctypes.c_size_t]
libc.madvise.restype, libc.madvise.argtypes = ctypes.c_int, [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
libc.mincore.restype, libc.mincore.argtypes = ctypes.c_int, [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
_MAP_FAILED = ctypes.c_void_p(-1).value


def map_pages(size: int, flags: int, fd: int = -1) -> int:
    """Address of a read-write mapping of `size` bytes (`flags`: mmap's MAP_*); OSError if refused.
    Python's mmap would not do for a file: it will not map past the file's end."""
    addr = libc.mmap(None, size, mmap.PROT_READ | mmap.PROT_WRITE, flags, fd, 0)
    if addr in (None, _MAP_FAILED):
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))
    return addr


def map_anonymous(size: int) -> int:
    """Address of `size` bytes of fresh zeroed private memory (munmap_anonymous frees it), asked to
    be on huge pages. Fresh: memory malloc hands out may have been touched before, on 4 KiB
    pages, which asking afterwards does not change (glibc serves up to 32 MiB from its heap)."""
    try:
        addr = map_pages(max(1, size), mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    except OSError as exc:
        raise MemoryError(f"cannot map {size} bytes: {exc.strerror}") from None
    advise_huge_pages(addr, size)
    return addr


def munmap_anonymous(addr: int, size: int) -> None:
    libc.munmap(addr, max(1, size))


def advise_huge_pages(addr: int, size: int) -> bool:
    """Ask for transparent huge pages over the whole 2 MiB pages of [addr, addr+size) (MADV_HUGEPAGE),
    before it is first touched: where THP is "madvise" (Ubuntu's default, and most VMs'), ggml's
    reads of weights on 4 KiB pages run measurably slower (docs/operations.md, "Huge pages"). Best
    effort: False where refused or unsupported, and the memory is as usable either way."""
    start, end = -(-addr // HUGE_PAGE) * HUGE_PAGE, (addr + size) // HUGE_PAGE * HUGE_PAGE
    return end > start and libc.madvise(start, end - start, MADV_HUGEPAGE) == 0
