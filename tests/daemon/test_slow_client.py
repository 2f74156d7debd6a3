"""The slow-client floor (--min-rate, --min-rate-window; docs/security.md): an
authenticated client that sends a frame it has started slower than the floor
loses its connection and its --max-clients slot, with a log line saying why; an
honest client sending above the floor, however long its frame, does not.

* RateFloor (rpc_daemon/daemon/ratelimit.py) alone, on a given clock.
* A real daemon: a raw socket that trickles a frame after HELLO is closed within
  the window (and a second's check) and its slot is free again; one that sends a
  large SET_TENSOR at a few times the floor for several windows is answered.
"""
from __future__ import annotations

import time

import numpy as np
import pytest

from conftest import SLACK
from rpc_daemon.daemon.ratelimit import RateFloor
from rpc_daemon.wire import framing as F
from rpc_daemon.wire import protocol as P
from rpc_daemon.wire.protocol import Command, Status
from rpc_helpers import RawConn, raw_session

KiB = 1 << 10


# ---------------------------------------------------------------- RateFloor alone

def test_floor_trips_only_after_a_whole_window_below_the_rate():
    floor = RateFloor(rate=1000, window=10)
    total = 0
    for t in range(10):  # 100 bytes/s: below the floor, but not for a whole window yet
        assert floor.sample(float(t), total, True) is None
        total += 100
    assert floor.sample(10.0, total, True) == pytest.approx(100.0)


def test_floor_is_a_sliding_window_not_an_average_since_the_frame_began():
    """A frame that came fast and then stalls is caught one window after the stall,
    however much arrived before it."""
    floor = RateFloor(rate=1000, window=5)
    assert floor.sample(0.0, 0, True) is None
    assert floor.sample(1.0, 100 << 20, True) is None  # 100 MiB in the first second
    tripped = [t for t in range(2, 12) if floor.sample(float(t), 100 << 20, True) is not None]
    assert tripped and tripped[0] == 6  # one window after the last byte


def test_floor_resets_between_frames_and_can_be_off():
    floor = RateFloor(rate=1000, window=3)
    for t in range(20):  # every other sample without a frame in progress: never a whole window
        assert floor.sample(float(t), 0, t % 2 == 0) is None
    above = RateFloor(rate=1000, window=3)
    assert all(above.sample(float(t), 2000 * t, True) is None for t in range(20))
    off = RateFloor(rate=0, window=3)
    assert all(off.sample(float(t), 0, True) is None for t in range(20))


# ---------------------------------------------------------------- a real daemon

WINDOW = 2.0  # --min-rate-window of the test daemons: short, so the tests are
FLOOR = 16 * KiB  # the default --min-rate


@pytest.mark.system
def test_a_client_trickling_a_frame_after_hello_loses_its_connection_and_slot(start_daemon):
    d = start_daemon("-t", "1", "--max-clients", "2", "--min-rate", str(FLOOR), "--min-rate-window", str(WINDOW))
    trickler = raw_session(d)
    other = raw_session(d)  # the two slots are taken
    with RawConn(d.port) as third:
        refused = third.wait_closed(5.0)
        assert refused and refused[0]["status"] == Status.LIMIT_EXCEEDED, refused

    frame = F.encode_frame({"cmd": int(Command.PING), "id": 7, "pad": "x" * 200})
    start = len(d.log_lines)
    t0 = time.monotonic()
    trickler.sock.setblocking(False)
    sent, closed_at, got = 0, None, b""
    bound = (WINDOW + 2.0) * SLACK  # a whole window below the floor, plus the once-a-second check
    while time.monotonic() - t0 < bound + 2.0 and sent < len(frame) - 1:  # never completes the frame
        try:
            trickler.sock.send(frame[sent:sent + 1])  # 10 bytes/s
            sent += 1
            while True:
                data = trickler.sock.recv(4096)
                if not data:
                    raise EOFError
                got += data
        except BlockingIOError:
            pass
        except (EOFError, ConnectionResetError, BrokenPipeError):
            closed_at = time.monotonic()
            break
        time.sleep(0.1)
    assert closed_at is not None, f"a client trickling 10 bytes/s was not closed within {bound:.1f} s"
    assert closed_at - t0 >= WINDOW * 0.9, "closed before a whole window below the floor"
    if got:  # the daemon says why before it closes (unless the reset came first)
        header = F.decode_header(got[F.PREFIX.size:F.PREFIX.size + F.PREFIX.unpack(got[:F.PREFIX.size])[0]],
                                 P.Limits())
        assert header["status"] == Status.LIMIT_EXCEEDED and "--min-rate" in header["error"], header
    line = d.wait_log("closing slow client", start=start)
    assert "min_rate" in line
    trickler.close()

    # its slot is free: a new client is served; the other one never lost its connection
    with raw_session(d) as fresh:
        assert fresh.call(Command.PING)[0]["status"] == Status.SUCCESS
    assert other.call(Command.PING)[0]["status"] == Status.SUCCESS
    other.close()


@pytest.mark.system
def test_an_honest_slow_sender_above_the_floor_keeps_its_connection(start_daemon):
    """A 512 KiB SET_TENSOR sent at about 5 times the floor takes several windows and
    is answered; the connection stays usable."""
    d = start_daemon("-t", "1", "--min-rate", str(FLOOR), "--min-rate-window", str(WINDOW))
    with raw_session(d) as conn:
        size = 512 * KiB
        h, _ = conn.call(Command.ALLOC_BUFFER, {"size": size})
        assert h["status"] == Status.SUCCESS
        data = np.random.default_rng(3).integers(0, 255, size, dtype=np.uint8).tobytes()
        frame_head = F.encode_frame({"cmd": int(Command.SET_TENSOR), "id": 99, "buffer": h["buffer"],
                                     "offset": 0, "size": size}, size)
        conn.send_raw(frame_head)  # the prefix and header at once...
        t0 = time.monotonic()
        chunk = 8 * KiB  # ...then the blob, 8 KiB every 0.1 s: ~80 KiB/s
        for off in range(0, size, chunk):
            conn.send_raw(data[off:off + chunk])
            time.sleep(0.1)
        elapsed = time.monotonic() - t0
        assert elapsed > 2 * WINDOW  # the frame really was in progress for several windows
        conn.sock.settimeout(10.0 * SLACK)
        reply, _ = conn.recv_frame()
        assert reply["id"] == 99 and reply["status"] == Status.SUCCESS, reply
        _, got = conn.call(Command.GET_TENSOR, {"buffer": h["buffer"], "offset": 0, "size": size})
        assert got == data
    assert not any("closing slow client" in line for line in d.log_lines)
