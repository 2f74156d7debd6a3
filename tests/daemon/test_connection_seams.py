"""Sans-I/O tests of what the daemon's connection delegates (docs/architecture.md,
"The daemon, module by module"): a connection's first bytes (wire/llamacpp.py
Opening), which queued requests run side by side (the command table's `beside`
column, daemon/handlers.py), and the limits the coordinator shares with the
workers (wire/graph_limits.py, service/memory.py). No sockets, no daemon."""
from __future__ import annotations

import struct

import pytest

from ggml_ffi import lib
from rpc_daemon.daemon import handlers as H
from rpc_daemon.service import memory
from rpc_daemon.validation import graph as G
from rpc_daemon.wire import graph_limits
from rpc_daemon.wire import llamacpp as L
from rpc_daemon.wire.framing import encode_frame
from rpc_daemon.wire.protocol import Command

# llama.cpp's HELLO as ggml-rpc.cpp sends it, written out here, not taken from the module under test
HELLO_NOW = bytes([14]) + struct.pack("<Q", 24) + bytes(24)
HELLO_OLD = bytes([14]) + struct.pack("<Q", 0)
REPLY_NOW = struct.pack("<Q", 28) + bytes(28)  # size, 0.0.0, pad, conn_caps
REPLY_OLD = struct.pack("<Q", 3) + bytes(3)


# ---------------------------------------------------------------- a connection's first bytes

def feed(opening: L.Opening, data: bytes, step: int) -> list:
    """The events of `data` received `step` bytes at a time, as a connection sees them: after Ours
    it stops asking (the rest goes to its frame reader)."""
    events = []
    for i in range(0, len(data), step):
        events += opening.received(data[i: i + step])
        if events and isinstance(events[-1], L.Ours):
            break
    return events


@pytest.mark.parametrize("step", [1, 2, 5, 9, 33, 100])
@pytest.mark.parametrize("hello, input_size, reply", [(HELLO_NOW, 24, REPLY_NOW), (HELLO_OLD, 0, REPLY_OLD)])
def test_a_llamacpp_hello_in_any_pieces_is_detected_once_then_answered(hello, input_size, reply, step):
    assert feed(L.Opening(), hello, step) == [L.Detected(input_size), L.Answer(reply)]


def test_detection_comes_before_the_hello_input_is_in():
    opening = L.Opening()
    assert opening.received(HELLO_NOW[:8]) == []  # 7 of 8 size bytes: could still be llama.cpp's
    assert opening.received(HELLO_NOW[8:20]) == [L.Detected(24)]
    assert opening.received(HELLO_NOW[20:32]) == []  # one byte of conn_caps short
    assert opening.received(HELLO_NOW[32:]) == [L.Answer(REPLY_NOW)]
    assert opening.received(b"more") == [L.Answer(REPLY_NOW)]  # bytes after it: the connection is closing


@pytest.mark.parametrize("step", [1, 3, 12, 64])
def test_our_frames_go_to_the_reader_whole_from_the_first_byte(step):
    hello = encode_frame({"cmd": int(Command.HELLO), "id": 0, "version": 2})
    assert hello[0] != 14
    assert feed(L.Opening(), hello, step) == [L.Ours(hello[:step])]  # decided on the first byte


@pytest.mark.parametrize("opening, decided_at", [
    (bytes([14]) + struct.pack("<Q", 25), 2),  # input_size 25: not llama.cpp's, told by its first byte
    (bytes([14]) + struct.pack("<Q", 24 + (1 << 8)), 3),  # 24 then a byte no size of llama.cpp's has
    (bytes([14, 0, 0, 0, 0, 0, 0, 0, 1]), 9),  # 0 up to the last size byte
])
def test_an_opening_like_a_llamacpp_hello_but_not_one_is_ours(opening, decided_at):
    assert feed(L.Opening(), opening, 1) == [L.Ours(opening[:decided_at])]


def test_the_log_line_and_hint_are_what_operators_and_tests_look_for():
    assert L.LOG_LINE == "a llama.cpp RPC client connected; this worker speaks the ggml-distributed protocol"
    assert "rpc-server" in L.HINT and "ggml-coordinator" in L.HINT
    assert L.CLOSE_REASON == "llama.cpp RPC client (another protocol): answered its HELLO with version 0.0.0"


# ---------------------------------------------------------------- requests side by side

def hash_request(cmd=int(Command.SET_TENSOR_HASH), **fields) -> dict:
    return dict({"cmd": cmd, "id": 1, "buffer": 3, "offset": 100, "size": 50, "hash": "ab" * 32}, **fields)


def test_set_tensor_hash_runs_beside_others_with_its_range():
    row, rng = H.runs_beside(hash_request())
    assert row is H.COMMANDS[Command.SET_TENSOR_HASH] and row.at_once == H.LOOKUPS_AT_ONCE == 3
    assert rng == (3, 100, 150)


@pytest.mark.parametrize("header", [
    hash_request(cmd=8.0), hash_request(cmd=True), hash_request(cmd=None), hash_request(cmd=int(Command.SET_TENSOR)),
    hash_request(cmd=int(Command.GET_TENSOR)), hash_request(cmd=999),
    hash_request(offset=100.0), hash_request(size=True), hash_request(buffer="3"), hash_request(size=None),
    {"buffer": 3, "offset": 0, "size": 1}, None, [8, 3, 0, 1],
])
def test_anything_else_runs_alone_in_its_turn(header):
    assert H.runs_beside(header) is None


def test_only_set_tensor_hash_runs_beside_others():
    assert [cmd for cmd, row in H.COMMANDS.items() if row.beside is not None] == [Command.SET_TENSOR_HASH]
    assert all(row.at_once == 1 for cmd, row in H.COMMANDS.items() if cmd != Command.SET_TENSOR_HASH)


@pytest.mark.parametrize("a, b, overlapping", [
    ((3, 0, 10), (3, 9, 20), True), ((3, 0, 10), (3, 10, 20), False), ((3, 10, 20), (3, 0, 10), False),
    ((3, 0, 10), (4, 0, 10), False), ((3, 0, 100), (3, 40, 50), True), ((3, 5, 5), (3, 0, 10), True),
    ((3, 10, 10), (3, 0, 10), False),
])
def test_overlap(a, b, overlapping):
    assert H.overlap(a, b) is overlapping and H.overlap(b, a) is overlapping


# ---------------------------------------------------------------- shared with the coordinator

def test_the_validation_enforces_the_shared_limits():
    assert G.WEIGHT_TYPES is graph_limits.WEIGHT_TYPES and G.FLOAT_TYPES is graph_limits.FLOAT_TYPES
    assert G.MAX_EXPERTS is graph_limits.MAX_EXPERTS == 1024
    names = [lib.ggml_type_name(t) for t in graph_limits.WEIGHT_TYPES]
    from ggml_ffi import ffi
    assert [ffi.string(n).decode() for n in names] == ["f32", "f16", "bf16", "q4_0", "q4_1", "q5_0", "q5_1",
                                                       "q8_0", "q2_K", "q3_K", "q4_K", "q5_K", "q6_K"]


def test_available_memory_reads_meminfo_and_falls_back_to_physical(monkeypatch, tmp_path):
    physical = memory.physical_memory()
    assert 0 < memory.available_memory() <= physical
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       16000000 kB\nMemAvailable:    1234 kB\n")
    real_open = open
    monkeypatch.setattr("builtins.open", lambda path, *a, **k: real_open(meminfo if path == "/proc/meminfo" else path,
                                                                          *a, **k))
    assert memory.available_memory() == 1234 * 1024
    meminfo.write_text("MemTotal:       16000000 kB\n")  # an old kernel without MemAvailable
    assert memory.available_memory() == physical
    meminfo.unlink()
    assert memory.available_memory() == physical
