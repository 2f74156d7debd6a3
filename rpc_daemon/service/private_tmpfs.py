"""Run as a child process (python -I -S private_tmpfs.py SOCKET_FD MOUNTPOINT OPTIONS), never imported:
mount a tmpfs with OPTIONS on MOUNTPOINT inside a mount namespace of its own (and a user namespace
of its own when it is not root), send a descriptor of the tmpfs's root over the Unix socket
SOCKET_FD, and exit. Its namespaces end with it; the descriptor keeps the (now detached) tmpfs
alive for whoever holds it, and nobody else can see or reach it. On failure it sends b"error: why".

Standard library only (it runs without site-packages). See shared_memory.py for why.
"""
import ctypes
import os
import socket
import sys

CLONE_NEWNS, CLONE_NEWUSER = 0x00020000, 0x10000000
MS_REC, MS_PRIVATE = 0x4000, 0x40000


def main() -> int:
    sock = socket.socket(fileno=int(sys.argv[1]))
    mountpoint, options = sys.argv[2], sys.argv[3]
    libc = ctypes.CDLL(None, use_errno=True)

    def failed(step: str) -> int:
        sock.send(f"error: {step}: {os.strerror(ctypes.get_errno())}".encode())
        return 1

    uid, gid = os.getuid(), os.getgid()
    if libc.unshare(CLONE_NEWNS) != 0:  # not root: a user namespace of its own makes it root there
        if libc.unshare(CLONE_NEWUSER | CLONE_NEWNS) != 0:
            return failed("unshare(user, mount namespaces)")
        try:
            for name, text in (("setgroups", "deny"), ("uid_map", f"{uid} {uid} 1"), ("gid_map", f"{gid} {gid} 1")):
                with open(f"/proc/self/{name}", "w") as f:
                    f.write(text)
        except OSError as exc:
            sock.send(f"error: user namespace id maps: {exc}".encode())
            return 1
    # private first: a mount in a namespace copied from one with shared mounts would propagate back
    if libc.mount(b"none", b"/", None, MS_REC | MS_PRIVATE, None) != 0:
        return failed("making the mounts private")
    if libc.mount(b"ggml-rpc-shm", mountpoint.encode(), b"tmpfs", 0, options.encode()) != 0:
        return failed(f"mount -t tmpfs -o {options}")
    root = os.open(mountpoint, os.O_RDONLY | os.O_DIRECTORY)
    socket.send_fds(sock, [b"ok"], [root])
    return 0


if __name__ == "__main__":
    sys.exit(main())
