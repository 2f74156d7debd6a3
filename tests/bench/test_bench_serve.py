"""bench/bench_serve.py's pure parts: its options, and the llama-server command
line of its reference row (no process is started)."""
from __future__ import annotations

import pathlib
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # plain `pytest` does not put the repo root on sys.path
    sys.path.insert(0, str(ROOT))

from bench.bench_serve import IN_PROCESS, OURS, THEIRS, gap_lines, llama_server_command, parse_args  # noqa: E402

HELP = "-np, --parallel N\n-kvu, --kv-unified, -no-kvu, --no-kv-unified\n--repack, -nr, --no-repack\n" \
       "--ui, --webui, --no-ui, --no-webui\n"


def test_defaults_keep_the_existing_rows():
    args = parse_args([])
    assert (args.clients, args.parallel, args.ctx_per_slot, args.tokens, args.rounds, args.reference) == \
           ((1, 4, 8), 8, 1024, 32, 2, True)
    assert args.in_process and not parse_args(["--no-in-process"]).in_process


def test_gap_lines_split_the_ratio_into_its_two_factors():
    """ours / llama-server = (in process / llama-server) x (workers / in process), each the median
    of the rounds' own ratios; a factor whose rows are missing is left out."""
    def rounds(*tps):
        return [(t, [0.1], [64]) for t in tps]
    rows = {OURS: {4: rounds(40, 45, 30)}, IN_PROCESS: {4: rounds(50, 50, 40)}, THEIRS: {4: rounds(55, 60, 50)}}
    serving, spread = gap_lines(rows, 4)
    assert "ours in process / llama-server (4 clients): 0.83" in serving  # 50/55, 50/60, 40/50: median 0.83
    assert "ours over 2 workers / ours in process (4 clients): 0.80" in spread  # 0.8, 0.9, 0.75: median 0.8
    assert gap_lines({OURS: rows[OURS], THEIRS: rows[THEIRS]}, 4) == []
    assert gap_lines(rows, 8) == []


def test_issue_row_options():
    args = parse_args(["--clients", "4", "--tokens", "64", "--parallel", "2", "--no-reference"])
    assert (args.clients, args.tokens, args.parallel, args.reference) == ((4,), 64, 2, False)


@pytest.mark.parametrize("bad", ["", "0", "1,x", "4,-1"])
def test_clients_refused(bad, capsys):
    with pytest.raises(SystemExit):
        parse_args(["--clients", bad])
    assert "client counts" in capsys.readouterr().err


def test_llama_server_command_matches_our_serve():
    cmd = llama_server_command("/b/llama-server", "/m.gguf", 5555, 2, 2, 1024, HELP)
    opt = {a: b for a, b in zip(cmd, cmd[1:])}
    assert cmd[0] == "/b/llama-server"
    assert (opt["-m"], opt["--host"], opt["--port"], opt["-t"], opt["-np"]) == \
           ("/m.gguf", "127.0.0.1", "5555", "2", "2")
    assert opt["-c"] == "2048"  # -c is the total: ctx_per_slot x slots, as our --parallel x --ctx-per-slot
    assert (opt["-fa"], opt["-ctk"], opt["-ctv"]) == ("on", "f16", "f16")
    assert {"--no-kv-unified", "--no-repack", "--no-webui"} <= set(cmd)
    assert "--cache-reuse" not in cmd  # its default


def test_llama_server_command_leaves_out_flags_its_help_lacks():
    cmd = llama_server_command("llama-server", "m.gguf", 1, 2, 8, 512,
                               "-np, --parallel N\n--ui-mcp-proxy, --no-webui-mcp-proxy\n")
    assert not {"--no-kv-unified", "--no-repack", "--no-webui"} & set(cmd)
    assert cmd[cmd.index("-c") + 1] == "4096"
