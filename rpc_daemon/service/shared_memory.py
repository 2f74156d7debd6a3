"""Where the daemon's shared memory comes from: the files behind the client arenas
(daemon/buffers.py), which hold the weights and KV cache its compute processes read.

Token generation reads every weight once a token, so how the weights are mapped
shows in tokens/s: a 1B model's token ran 4 % faster on a worker alone with its
arena on 2 MiB pages than on 4 KiB ones, 8 % in one process (docs/operations.md,
"Huge pages"). An arena is shared memory
(shmem), and most kernels give shmem no transparent huge pages
(/sys/kernel/mm/transparent_hugepage/shmem_enabled: never), whatever they do for
anonymous memory. A tmpfs mounted with huge=within_size gets them all the same.
So, `SharedMemory.open`:

* `directory` (--shm-dir): arenas are files in it, unlinked at once; it must be a
  tmpfs without a size limit (shm_dir_problem; the systemd unit mounts one with
  huge=within_size, deploy/);
* auto (the default): memfds where the kernel already gives shmem huge pages,
  else a private tmpfs of this process's own, mounted with huge=within_size by
  a short-lived child in namespaces of its own (private_tmpfs.py): nobody else
  can see or reach it, and it goes with the daemon;
* else, or off (--no-huge-pages): memfds, on whatever pages the kernel gives.

Nothing changes for the arenas' users: a file of either kind is grown with
ftruncate, mapped shared, its pages given back with MADV_REMOVE, its descriptor
passed to the compute process.
"""
from __future__ import annotations

import os
import re
import secrets
import socket
import subprocess
import sys
import tempfile
from dataclasses import dataclass

THP = "/sys/kernel/mm/transparent_hugepage"
TMPFS_OPTIONS = "huge=within_size,size=0,nr_inodes=0,mode=0700"  # size=0: no limit but the daemon's --mem
HELPER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "private_tmpfs.py")
HELPER_TIMEOUT = 10.0  # seconds the mount helper may take (it takes ~20 ms)


def shmem_thp() -> str:
    """The kernel's transparent huge page policy for shmem (memfds): never, always, within_size,
    advise, deny or force; 'unsupported' without THP."""
    try:
        with open(f"{THP}/shmem_enabled") as f:
            words = f.read().split()
    except OSError:
        return "unsupported"
    return next((w.strip("[]") for w in words if w.startswith("[")), "unsupported")


def memfd_gets_huge_pages(policy: str) -> bool:
    # advise: the arenas are madvised (MADV_HUGEPAGE) by their mappers
    return policy in ("always", "within_size", "advise", "force")


_OCTAL = re.compile(rb"\\([0-7]{3})")


def mount_of(path: str) -> tuple[str, str, str] | None:
    """(mount point, file system type, super options) of the mount holding `path` (which must
    exist), from /proc/self/mountinfo: the deepest mount point above it on its device (the
    last listed of those stacked on one point); None if unreadable."""
    try:
        path = os.path.realpath(path)
        dev = os.stat(path).st_dev
        with open("/proc/self/mountinfo", "rb") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    best = None
    for line in lines:
        head, sep, tail = line.partition(b" - ")
        fields, rest = head.split(), tail.split()
        if not sep or len(fields) < 5 or len(rest) < 3:
            continue
        # the kernel escapes space, tab, newline and backslash as \NNN; the rest is the path's bytes
        point = os.fsdecode(_OCTAL.sub(lambda m: bytes([int(m.group(1), 8)]), fields[4]))
        major, _, minor = fields[2].partition(b":")
        inside = path == point or path.startswith(point.rstrip("/") + "/")
        if inside and os.makedev(int(major), int(minor)) == dev and (best is None or len(point) >= len(best[0])):
            best = (point, os.fsdecode(rest[0]), os.fsdecode(rest[2]))
    return best


def shm_dir_problem(directory: str, huge_pages: bool = True) -> str | None:
    """Why `directory` cannot hold the clients' memory (--shm-dir), or None. It must be a
    writable directory on a tmpfs without a size limit: a full tmpfs answers the daemon's
    next write into a buffer with SIGBUS, which would end the daemon (its --mem cap bounds
    what it puts there)."""
    if not huge_pages:
        return "--no-huge-pages keeps the clients' memory in memfds: give it or --shm-dir, not both"
    if not os.path.isdir(directory):
        return f"--shm-dir {directory} is not a directory"
    mount = mount_of(directory)
    if mount is None or mount[1] != "tmpfs":
        where = mount[1] if mount else "an unknown file system"
        return (f"--shm-dir {directory} must be on a tmpfs (it is on {where}): its files hold the clients' "
                f"memory, which must not be written back to a disk")
    if os.statvfs(directory).f_blocks:
        return (f"--shm-dir {directory} is a tmpfs with a size limit ({mount[2]}): mount it with size=0 (the "
                f"daemon's --mem caps what it holds there), since a full tmpfs would end the daemon (SIGBUS)")
    try:
        probe = SharedMemory(directory, False, "", os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC))
    except OSError as exc:
        return f"--shm-dir {directory} cannot be opened: {exc}"
    try:
        os.close(probe.new_file("ggml-rpc-probe"))
    except OSError as exc:
        return f"--shm-dir {directory}: cannot make a file there: {exc}"
    finally:
        probe.close()
    return None


def tmpfs_gets_huge_pages(options: str, policy: str) -> bool:
    if policy == "deny":
        return False
    if policy == "force":
        return True
    huge = next((o.split("=", 1)[1] for o in options.split(",") if o.startswith("huge=")), "never")
    return huge in ("always", "within_size", "advise")


@dataclass
class SharedMemory:
    """Makes the arenas' files. `source`: memfd, private tmpfs or the directory's path;
    `huge_pages`: whether their pages can be 2 MiB ones; `why`: how that was decided."""
    source: str = "memfd"
    huge_pages: bool = False
    why: str = ""
    dir_fd: int | None = None

    @classmethod
    def open(cls, directory: str | None = None, huge_pages: bool = True) -> SharedMemory:
        """The daemon's source of shared memory (raises ValueError for a `directory` that
        shm_dir_problem refuses: the command line checks it first)."""
        policy = shmem_thp()
        if directory is not None:
            problem = shm_dir_problem(directory, huge_pages)
            if problem:
                raise ValueError(problem)
            mount = mount_of(directory)
            fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
            huge = tmpfs_gets_huge_pages(mount[2], policy)
            return cls(directory, huge, f"tmpfs at {mount[0]} ({mount[2]}); shmem_enabled {policy}", fd)
        if not huge_pages:
            return cls("memfd", memfd_gets_huge_pages(policy), f"--no-huge-pages; shmem_enabled {policy}")
        if memfd_gets_huge_pages(policy):
            return cls("memfd", True, f"shmem_enabled {policy}")
        if policy in ("deny", "unsupported"):
            return cls("memfd", False, f"shmem_enabled {policy}")
        fd, failure = private_tmpfs()
        if fd is None:
            return cls("memfd", False, f"shmem_enabled {policy}; no private tmpfs: {failure}")
        return cls("private tmpfs", True, f"shmem_enabled {policy}; a private tmpfs mounted {TMPFS_OPTIONS}", fd)

    def new_file(self, name: str) -> int:
        """A new empty file of shared memory, named `name` where /proc/PID/fd shows it, linked nowhere."""
        if self.dir_fd is None:
            return os.memfd_create(name, os.MFD_CLOEXEC)
        # named, then unlinked at once: /proc/PID/fd says whose it is, as a memfd's name does. The
        # suffix is random: others who can write the directory cannot take the names in advance
        for attempt in range(8):
            unique = f"{name}-{os.getpid()}-{secrets.token_hex(6)}"
            try:
                fd = os.open(unique, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600, dir_fd=self.dir_fd)
                break
            except FileExistsError:
                if attempt == 7:
                    raise
        try:
            os.unlink(unique, dir_fd=self.dir_fd)
        except OSError:
            os.close(fd)
            raise
        return fd

    def describe(self) -> dict:
        return {"source": self.source, "huge_pages": self.huge_pages, "why": self.why}

    def close(self) -> None:
        if self.dir_fd is not None:
            os.close(self.dir_fd)
            self.dir_fd = None


def private_tmpfs(options: str = TMPFS_OPTIONS, timeout: float = HELPER_TIMEOUT) -> tuple[int | None, str]:
    """(descriptor of the root of a tmpfs mounted with `options` where only its holder can reach
    it, "") or (None, why not). The mount is made by a child process in namespaces of its own
    (private_tmpfs.py): this process stays in the system's, whatever threads it runs."""
    try:
        mountpoint = tempfile.mkdtemp(prefix="ggml-rpc-shm-")  # a mount point in the child's namespace only
    except OSError as exc:
        return None, f"no directory to mount on: {exc}"
    try:
        ours, theirs = socket.socketpair()
    except OSError as exc:
        os.rmdir(mountpoint)
        return None, f"no socket pair for the mount helper: {exc}"
    try:
        try:
            child = subprocess.Popen([sys.executable, "-I", "-S", HELPER, str(theirs.fileno()), mountpoint,
                                      options], pass_fds=[theirs.fileno()], stdin=subprocess.DEVNULL,
                                     stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        except OSError as exc:
            return None, f"cannot start the mount helper: {exc}"
        theirs.close()
        try:
            ours.settimeout(timeout)
            msg, fds, _, _ = socket.recv_fds(ours, 512, 1)
        except OSError as exc:  # a timeout too
            msg, fds = f"no answer from the mount helper: {exc}".encode(), []
        finally:
            try:
                _, err = child.communicate(timeout=timeout)
            except subprocess.TimeoutExpired:
                child.kill()
                _, err = child.communicate()
        if fds and msg == b"ok":
            os.set_inheritable(fds[0], False)  # recvmsg gives it without close-on-exec
            return fds[0], ""
        for fd in fds:
            os.close(fd)
        text = msg.decode(errors="replace")
        if text.startswith("error: "):
            return None, text[len("error: "):]
        lines = (err or b"").decode(errors="replace").strip().splitlines()
        return None, lines[-1] if lines else f"the mount helper exited with status {child.returncode}"
    finally:
        ours.close()
        theirs.close()
        try:
            os.rmdir(mountpoint)
        except OSError:
            pass
