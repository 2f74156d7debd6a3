"""Where the daemon's shared memory comes from: the files behind the client arenas
(daemon/buffers.py), which hold the weights and KV cache its compute processes read.

Token generation reads every weight once a token, so how the weights are mapped
shows in tokens/s: ggml's matmuls over a 1B model's weights ran 8 % faster in
one process on 2 MiB pages than on 4 KiB ones, and a tensor-parallel member's
token 3-6 % faster (docs/operations.md, "Huge pages"). An arena is shared memory
(shmem), and most kernels give shmem no transparent huge pages
(/sys/kernel/mm/transparent_hugepage/shmem_enabled: never), whatever they do for
anonymous memory. A tmpfs mounted with huge=within_size gets them all the same.
So, `SharedMemory.open`:

* `directory` (--shm-dir): arenas are files in it, unlinked at once; it must be a
  tmpfs (the systemd unit mounts one with huge=within_size, deploy/);
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


def mount_of(path: str) -> tuple[str, str, str] | None:
    """(mount point, file system type, super options) of the mount holding `path`, from
    /proc/self/mountinfo; None if unreadable."""
    path = os.path.realpath(path)
    best = None
    try:
        with open("/proc/self/mountinfo") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    for line in lines:
        head, sep, tail = line.partition(" - ")
        fields, rest = head.split(), tail.split()
        if not sep or len(fields) < 5 or len(rest) < 3:
            continue
        point = fields[4].encode().decode("unicode_escape")  # \040 and the like
        inside = path == point or path.startswith(point.rstrip("/") + "/")
        if inside and (best is None or len(point) >= len(best[0])):  # the last of stacked mounts wins
            best = (point, rest[0], rest[2])
    return best


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
        """The daemon's source of shared memory (raises ValueError for a `directory` that is no tmpfs)."""
        policy = shmem_thp()
        if directory is not None:
            mount = mount_of(directory)
            if mount is None or mount[1] != "tmpfs":
                raise ValueError(f"--shm-dir {directory} is not on a tmpfs (it is on "
                                 f"{mount[1] if mount else 'an unknown file system'}): its files are the clients' "
                                 f"memory, which must not be written back to a disk")
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
        # named, then unlinked at once: /proc/PID/fd says whose it is, as a memfd's name does
        unique = f"{name}-{os.getpid()}"  # another daemon may share the directory
        fd = os.open(unique, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600, dir_fd=self.dir_fd)
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
    ours, theirs = socket.socketpair()
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
