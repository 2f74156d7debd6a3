"""Where a daemon's client arenas live (rpc_daemon/service/shared_memory.py): on a private tmpfs
with 2 MiB pages by default, in memfds with --no-huge-pages, in files on a given tmpfs with
--shm-dir; and the memory behaves the same on each (zeroed when given, readable back, freed)."""
from __future__ import annotations

import mmap
import os
import subprocess
import sys

import numpy as np
import pytest

from rpc_daemon.service.shared_memory import SharedMemory, mount_of, private_tmpfs, shmem_thp, tmpfs_gets_huge_pages
from rpc_daemon.wire.protocol import Command, Status
from rpc_helpers import raw_session

MiB = 1 << 20
THP = os.path.exists("/sys/kernel/mm/transparent_hugepage/shmem_enabled")


def pmd_mapped_kib(pid: int | str = "self") -> int:
    """Shared memory process `pid` maps with 2 MiB page table entries, in KiB."""
    with open(f"/proc/{pid}/smaps_rollup") as f:
        return sum(int(line.split()[1]) for line in f if line.startswith("ShmemPmdMapped:"))


def arena_links(pid: int) -> list[str]:
    links = []
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            link = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if "ggml-rpc-client-" in link:
            links.append(link)
    return links


def test_the_mount_table_is_read_for_the_mount_holding_a_path():
    assert mount_of("/proc/self/status")[:2] == ("/proc", "proc")
    assert mount_of("/")[0] == "/"


@pytest.mark.parametrize("options, policy, huge", [
    ("rw,size=100k,huge=within_size", "never", True), ("rw,huge=always", "never", True),
    ("rw,huge=advise", "never", True), ("rw,huge=never", "never", False), ("rw,size=24683784k", "never", False),
    ("rw,huge=always", "deny", False), ("rw,size=1k", "force", True)])
def test_which_tmpfs_gives_huge_pages(options, policy, huge):
    assert tmpfs_gets_huge_pages(options, policy) is huge


@pytest.mark.skipif(not THP, reason="this kernel has no transparent huge pages")
def test_a_private_tmpfs_gives_its_files_huge_pages_and_is_mounted_nowhere_else():
    before = open("/proc/self/mountinfo").read()
    fd, why = private_tmpfs()
    if fd is None:
        pytest.skip(f"no private tmpfs on this machine: {why}")
    try:
        assert open("/proc/self/mountinfo").read() == before, "the tmpfs shows in this process's mounts"
        shm = SharedMemory("private tmpfs", True, "", fd)
        f = shm.new_file("ggml-rpc-client-test")
        os.ftruncate(f, 8 * MiB)
        m = mmap.mmap(f, 8 * MiB)
        pmd_before = pmd_mapped_kib()
        m[:] = b"\x5a" * (8 * MiB)
        assert pmd_mapped_kib() - pmd_before >= 4096, "no 2 MiB pages for a file of the private tmpfs"
        assert os.readlink(f"/proc/self/fd/{f}").endswith("(deleted)"), "the file is still linked"
        m.madvise(mmap.MADV_REMOVE, 3 * MiB, MiB)  # a hole in the middle of a huge page reads zero
        assert m[3 * MiB: 4 * MiB] == bytes(MiB) and m[4 * MiB] == 0x5a and m[3 * MiB - 1] == 0x5a
        m.close()
        os.close(f)
    finally:
        os.close(fd)


def test_a_mount_the_kernel_refuses_is_a_reason_not_an_exception():
    fd, why = private_tmpfs("huge=bogus")
    assert fd is None and ("huge=bogus" in why or "unshare" in why), why


def arena_round_trip(d) -> None:
    """Two buffers of 3 MiB on a daemon: written and read back whole, and after the first is freed
    and taken again, it reads zero (the pages were given back) while the second keeps its bytes."""
    rng = np.random.default_rng(3)
    data = [rng.integers(0, 256, 3 * MiB, dtype=np.uint8).tobytes() for _ in range(2)]
    with raw_session(d) as conn:
        bufs = []
        for blob in data:
            h, _ = conn.call(Command.ALLOC_BUFFER, {"size": len(blob)})
            assert h["status"] == Status.SUCCESS, h
            bufs.append(h["buffer"])
            h, _ = conn.call(Command.SET_TENSOR, {"buffer": h["buffer"], "offset": 0, "size": len(blob)}, blob)
            assert h["status"] == Status.SUCCESS, h
        for buf, blob in zip(bufs, data):
            h, out = conn.call(Command.GET_TENSOR, {"buffer": buf, "offset": 0, "size": len(blob)})
            assert h["status"] == Status.SUCCESS and bytes(out) == blob
        pmd = pmd_mapped_kib(d.proc.pid)
        conn.call(Command.FREE_BUFFER, {"buffer": bufs[0]})
        h, _ = conn.call(Command.ALLOC_BUFFER, {"size": 3 * MiB})
        _, out = conn.call(Command.GET_TENSOR, {"buffer": h["buffer"], "offset": 0, "size": 3 * MiB})
        assert bytes(out) == bytes(3 * MiB), "a buffer given again is not zeroed"
        _, out = conn.call(Command.GET_TENSOR, {"buffer": bufs[1], "offset": 0, "size": 3 * MiB})
        assert bytes(out) == data[1]
        h, _ = conn.call(Command.DEVICE_INFO)
        return h["shared_memory"], pmd


@pytest.mark.skipif(not THP, reason="this kernel has no transparent huge pages")
def test_a_daemon_keeps_client_memory_on_huge_pages_by_default(start_daemon):
    d = start_daemon("-t", "1")
    shm, pmd = arena_round_trip(d)
    if not shm["huge_pages"]:
        pytest.skip(f"no huge pages for shared memory on this machine: {shm['why']}")
    assert shm["source"] in ("private tmpfs", "memfd"), shm
    assert pmd >= 2048, f"the daemon maps no 2 MiB pages of its arena: {shm}"
    assert "shared memory" in d.wait_log("shared memory") and "huge_pages=True" in d.wait_log("shared memory")


def test_no_huge_pages_keeps_client_memory_in_memfds(start_daemon):
    d = start_daemon("-t", "1", "--no-huge-pages")
    shm, pmd = arena_round_trip(d)
    assert shm["source"] == "memfd", shm
    with raw_session(d) as conn:
        conn.call(Command.ALLOC_BUFFER, {"size": 4096})
        links = arena_links(d.proc.pid)
        assert links and all(link.startswith("/memfd:ggml-rpc-client-") for link in links), links
    if shmem_thp() == "never":
        assert pmd == 0 and shm["huge_pages"] is False, shm


def test_shm_dir_keeps_client_memory_in_unlinked_files_there(start_daemon, tmp_path):
    if mount_of("/dev/shm") is None or mount_of("/dev/shm")[1] != "tmpfs":
        pytest.skip("no tmpfs at /dev/shm")
    before = set(os.listdir("/dev/shm"))
    d = start_daemon("-t", "1", "--shm-dir", "/dev/shm")
    shm, _ = arena_round_trip(d)
    assert shm["source"] == "/dev/shm", shm
    with raw_session(d) as conn:
        conn.call(Command.ALLOC_BUFFER, {"size": 4096})
        links = arena_links(d.proc.pid)
        assert links and all(link.startswith("/dev/shm/ggml-rpc-client-") and link.endswith("(deleted)")
                             for link in links), links
        assert set(os.listdir("/dev/shm")) == before, "arena files left linked in --shm-dir"


@pytest.mark.parametrize("where", ["disk", "missing"])
def test_shm_dir_that_is_no_tmpfs_is_refused_at_the_command_line(tmp_path, where):
    path = tmp_path if where == "disk" else tmp_path / "nowhere"
    if where == "disk" and mount_of(str(tmp_path))[1] == "tmpfs":
        pytest.skip("the test's temporary directory is on a tmpfs")
    r = subprocess.run([sys.executable, "-m", "rpc_daemon", "-p", "0", "--shm-dir", str(path)],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "--shm-dir" in r.stderr and "must be a directory on a tmpfs" in r.stderr, r.stderr

