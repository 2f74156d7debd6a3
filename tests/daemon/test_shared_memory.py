"""Where a daemon's client arenas live (rpc_daemon/service/shared_memory.py): on a private tmpfs
with 2 MiB pages by default, in memfds with --no-huge-pages, in files on a given tmpfs with
--shm-dir; and the memory behaves the same on each (zeroed when given, readable back, freed)."""
from __future__ import annotations

import contextlib
import mmap
import os
import subprocess
import sys

import numpy as np
import pytest

from rpc_daemon.service.shared_memory import (SharedMemory, mount_of, private_tmpfs, shm_dir_problem, shmem_thp,
                                              tmpfs_gets_huge_pages)
from rpc_daemon.wire.protocol import Command, Status
from conftest import SLACK
from rpc_helpers import raw_session

MiB = 1 << 20
THP = os.path.exists("/sys/kernel/mm/transparent_hugepage/shmem_enabled")


def pmd_mapped_kib(pid: int | str = "self") -> int:
    """Shared memory process `pid` maps with 2 MiB page table entries, in KiB."""
    with open(f"/proc/{pid}/smaps_rollup") as f:
        return sum(int(line.split()[1]) for line in f if line.startswith("ShmemPmdMapped:"))


def thp_fallbacks() -> int:
    """Times the kernel wanted a huge page for file or shared memory and fell back to small ones
    (memory too fragmented): a test that saw one cannot tell whether huge pages were asked for."""
    with open("/proc/vmstat") as f:
        return sum(int(line.split()[1]) for line in f if line.startswith(("thp_file_fallback ", "thp_fault_fallback ")))


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
    assert mount_of("/no/such/path") is None


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
        m.madvise(mmap.MADV_HUGEPAGE)
        pmd_before, fallbacks = pmd_mapped_kib(), thp_fallbacks()
        m[:] = b"\x5a" * (8 * MiB)
        if thp_fallbacks() != fallbacks:
            pytest.skip("the kernel fell back to small pages (fragmented memory)")
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
    assert fd is None and why, why


def arena_round_trip(d) -> tuple[dict, int]:
    """Two buffers of 3 MiB on a daemon: written and read back whole, and after the first is freed
    and taken again, it reads zero (the pages were given back) while the second keeps its bytes."""
    rng = np.random.default_rng(3)
    data = [rng.integers(0, 256, 3 * MiB, dtype=np.uint8).tobytes() for _ in range(2)]
    fallbacks = thp_fallbacks()
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
        if thp_fallbacks() != fallbacks:
            pytest.skip("the kernel fell back to small pages (fragmented memory)")
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
    assert shm["source"] in ("private tmpfs", "memfd") and shm["page"] == 2 * MiB, shm
    assert pmd >= 2048, f"the daemon maps no 2 MiB pages of its arena: {shm}"
    assert "shared memory" in d.wait_log("shared memory") and "huge_pages=True" in d.wait_log("shared memory")


def test_no_huge_pages_keeps_client_memory_in_memfds(start_daemon):
    d = start_daemon("-t", "1", "--no-huge-pages")
    shm, pmd = arena_round_trip(d)
    assert shm["source"] == "memfd" and shm["page"] == (2 * MiB if shm["huge_pages"] else mmap.PAGESIZE), shm
    with raw_session(d) as conn:
        conn.call(Command.ALLOC_BUFFER, {"size": 4096})
        links = arena_links(d.proc.pid)
        assert links and all(link.startswith("/memfd:ggml-rpc-client-") for link in links), links
    if shmem_thp() == "never":
        assert pmd == 0 and shm["huge_pages"] is False, shm


@contextlib.contextmanager
def unlimited_tmpfs(path, options: str = "huge=within_size,size=0,mode=0700"):
    """A tmpfs mounted on `path` for the test (root only), unmounted after (lazily: a daemon may
    still hold its files)."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    path.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", options, "ggml-test-shm", str(path)], check=True,
                   timeout=30 * SLACK)
    try:
        yield str(path)
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False, timeout=30 * SLACK)


def test_shm_dir_keeps_client_memory_in_unlinked_files_there(start_daemon, tmp_path):
    with unlimited_tmpfs(tmp_path / "shm") as where:
        d = start_daemon("-t", "1", "--shm-dir", where)
        shm, pmd = arena_round_trip(d)
        assert shm["source"] == where, shm
        with raw_session(d) as conn:
            conn.call(Command.ALLOC_BUFFER, {"size": 4096})
            links = arena_links(d.proc.pid)
            assert links and all(link.startswith(f"{where}/ggml-rpc-client-") and link.endswith("(deleted)")
                                 for link in links), links
            assert os.listdir(where) == [], "arena files left linked in --shm-dir"
        if THP and shmem_thp() != "deny":
            assert shm["huge_pages"] and shm["page"] == 2 * MiB and pmd >= 2048, (shm, pmd)


def test_a_client_cannot_hold_more_than_its_cap_in_small_buffers_on_huge_pages(start_daemon):
    """On 2 MiB pages a buffer counts as whole 2 MiB pages: the first touch of a 2 MiB range
    takes all of it, whatever the buffers beside it."""
    d = start_daemon("-t", "1", "--max-client-mem", "8")
    with raw_session(d) as conn:
        page = conn.call(Command.DEVICE_INFO)[0]["shared_memory"]["page"]
        statuses = [conn.call(Command.ALLOC_BUFFER, {"size": 1})[0]["status"] for _ in range(8 * MiB // page + 1)]
    assert statuses[:-1] == [Status.SUCCESS] * (8 * MiB // page) and statuses[-1] == Status.LIMIT_EXCEEDED, statuses


@pytest.mark.parametrize("case", ["disk", "missing", "size limit", "with --no-huge-pages"])
def test_shm_dir_that_cannot_hold_client_memory_is_refused_at_the_command_line(tmp_path, case):
    args = {"disk": [str(tmp_path)], "missing": [str(tmp_path / "nowhere")], "size limit": ["/dev/shm"],
            "with --no-huge-pages": ["/dev/shm", "--no-huge-pages"]}[case]
    if case == "disk" and mount_of(str(tmp_path))[1] == "tmpfs":
        pytest.skip("the test's temporary directory is on a tmpfs")
    shm_mount = mount_of("/dev/shm") or ("", "")
    if case == "size limit" and (shm_mount[1] != "tmpfs" or not os.statvfs("/dev/shm").f_blocks):
        pytest.skip("no size-limited tmpfs at /dev/shm")
    expected = shm_dir_problem(args[0], "--no-huge-pages" not in args)
    assert expected, case
    r = subprocess.run([sys.executable, "-m", "rpc_daemon", "-p", "0", "--shm-dir", *args],
                       capture_output=True, text=True, timeout=60 * SLACK)
    assert r.returncode == 2 and expected in r.stderr, r.stderr
