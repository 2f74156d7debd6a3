"""The flags a llama-server user types, parsed by ggml-coordinator's command
line without starting anything: each one is taken, or refused with exit 2 and
a message naming it; none is abbreviated or read as short flags run together."""
from __future__ import annotations

import pytest

from coordinator.serving.cli import parse_args

MODEL = ("-m", "/models/none.gguf")  # never read by parse_args


def parsed(*argv: str):
    return parse_args(["serve", *MODEL, *argv])


def refused(capsys, *argv: str, command: str = "serve") -> str:
    with pytest.raises(SystemExit) as info:
        parse_args([command, *MODEL, *argv])
    assert info.value.code == 2
    return capsys.readouterr().err


def test_defaults():
    a = parsed()
    assert (a.n_predict, a.slots, a.api_key, a.ssl_context, a.jinja, a.cache_type_k, a.cache_type_v) == (
        -1, True, None, None, False, "f16", "f16")


def test_the_commands_take_the_split_by_measurement_unless_told():
    """generate and serve default to --split-mode auto (tensor where the exchanges pay); the library
    keeps layer; -sm picks one."""
    from coordinator.config import CoordinatorConfig
    for command in (["serve"], ["generate", "-p", "hi"]):
        assert parse_args([*command, *MODEL]).split_mode == "auto"
        assert parse_args([*command, *MODEL, "-sm", "layer"]).split_mode == "layer"
    assert CoordinatorConfig.split_mode == "layer"


def test_the_commands_warm_up_unless_told():
    """generate and serve warm the workers up after loading (llama.cpp's tools do, unless --no-warmup);
    the library does not."""
    from coordinator.config import CoordinatorConfig
    for command in (["serve"], ["generate", "-p", "hi"]):
        assert parse_args([*command, *MODEL]).warmup is True
        assert parse_args([*command, *MODEL, "--no-warmup"]).warmup is False
    assert CoordinatorConfig.warmup is False


def test_n_predict():
    assert parsed("-n", "12").n_predict == 12
    assert parsed("--n-predict", "-1").n_predict == -1  # a negative number is a value, not a flag


def test_n_predict_zero_and_below_are_refused(capsys):
    assert "argument -n/--n-predict: must be -1 (no limit) or at least 1, not 0" in refused(capsys, "-n", "0")
    assert "argument -n/--n-predict: must be at least -1, not -2" in refused(capsys, "-n", "-2")
    assert parse_args(["generate", *MODEL, "-p", "x", "-n", "5"]).n_predict == 5  # generate's own -n, as before


def test_c_is_the_total_context_divided_over_the_slots_as_llama_server_sizes_them(capsys):
    """llama-server with -np: n_ctx / n_parallel a slot, padded up to a multiple of 256."""
    assert parsed().ctx_per_slot == 2048
    assert parsed("--ctx-per-slot", "500").ctx_per_slot == 500
    assert parsed("-c", "8192").ctx_per_slot == 2048  # 4 slots by default
    assert parsed("-c", "8192", "-np", "2").ctx_per_slot == 4096
    assert parsed("--ctx-size", "1001", "--parallel", "2").ctx_per_slot == 512  # 500, padded up
    assert parsed("-c", "20").ctx_per_slot == 256
    assert "-c/--ctx-size (the total, divided over the slots) and --ctx-per-slot both size a slot: give one" in \
        refused(capsys, "-c", "4096", "--ctx-per-slot", "1024")
    assert "argument -c/--ctx-size: 3 tokens over 4 slots leaves none a slot" in refused(capsys, "-c", "3")


def test_slots():
    assert parsed("--slots").slots is True
    assert parsed("--no-slots").slots is False


def test_api_keys_comma_separated_and_from_a_file(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("GGML_COORDINATOR_API_KEY", raising=False)
    keys = tmp_path / "keys"
    keys.write_text("# the team's keys\nkey-one\n\n  key-two  \n#key-old\n")
    assert parsed("--api-key-file", str(keys)).api_key == ["key-one", "key-two"]
    assert parsed("--api-key", "a,b", "--api-key-file", str(keys)).api_key == ["a", "b", "key-one", "key-two"]
    assert parsed("--api-key", "solo").api_key == ["solo"]
    empty = tmp_path / "empty"
    empty.write_text("# nothing\n\n")
    assert f"--api-key-file {empty} holds no key" in refused(capsys, "--api-key-file", str(empty))
    assert "cannot read --api-key-file /nonexistent/keys" in refused(capsys, "--api-key-file", "/nonexistent/keys")


def test_ssl_files(tmp_path, capsys):
    from tls_certs import make_tls_files
    tls = make_tls_files(tmp_path / "tls")
    a = parsed("--ssl-cert-file", tls.cert, "--ssl-key-file", tls.key)
    assert a.ssl_context is not None
    assert "--ssl-cert-file and --ssl-key-file go together: give both" in refused(capsys, "--ssl-cert-file", tls.cert)
    assert "--ssl-cert-file and --ssl-key-file go together" in refused(capsys, "--ssl-key-file", tls.key)
    err = refused(capsys, "--ssl-cert-file", tls.cert, "--ssl-key-file", tls.self_signed_key)  # not its key
    assert "cannot serve HTTPS with --ssl-cert-file" in err, err
    assert "cannot serve HTTPS" in refused(capsys, "--ssl-cert-file", "/nonexistent.pem", "--ssl-key-file", tls.key)


def test_jinja_is_taken():
    assert parsed("--jinja").jinja is True


def test_context_shift_flags():
    """llama-server's --context-shift / --no-context-shift: off by default, the last one given wins,
    and it reaches the server's options."""
    from coordinator.serving.lifecycle import server_options
    assert parsed().context_shift is False and server_options(parsed())["context_shift"] is False
    assert parsed("--context-shift").context_shift is True
    assert server_options(parsed("--context-shift"))["context_shift"] is True
    assert parsed("--no-context-shift").context_shift is False
    assert parsed("--context-shift", "--no-context-shift").context_shift is False
    assert parsed("--no-context-shift", "--context-shift").context_shift is True


def test_embeddings_and_pooling_flags():
    from coordinator.serving.lifecycle import server_options
    a = parsed()
    assert (a.embeddings, a.pooling) == (False, "mean") and server_options(a)["pooling"] is None
    for flag in ("--embeddings", "--embedding"):  # llama-server's spellings
        assert parsed(flag).embeddings is True and server_options(parsed(flag))["pooling"] == "mean"
    for pooling in ("mean", "last", "cls"):
        assert server_options(parsed("--embeddings", "--pooling", pooling))["pooling"] == pooling


@pytest.mark.parametrize("argv, message", [
    (("--no-jinja",), "--no-jinja: chat templates are always Jinja here"),
    (("--pooling", "none"), "argument --pooling: 'none' is not supported: /v1/embeddings returns one pooled"),
    (("--pooling", "rank"), "argument --pooling: 'rank' is not supported: there is no reranking endpoint"),
    (("--pooling", "max"), "argument --pooling: 'max' is not a pooling: choose mean, last or cls"),
    (("-ctk", "q5_0"), "argument -ctk/--cache-type-k: a KV cache of type 'q5_0' is not supported: choose f16, "
                       "q8_0, q4_0"),
    (("--cache-type-k", "iq4_nl"), "argument -ctk/--cache-type-k: a KV cache of type 'iq4_nl' is not supported"),
    (("-ctv", "bf16"), "argument -ctv/--cache-type-v: a KV cache of type 'bf16' is not supported"),
    (("-hf", "ggml-org/gemma-3-270m-GGUF"), "-hf: downloading a model is not supported: give its GGUF file with -m"),
    (("--hf-repo", "x/y"), "--hf-repo: downloading a model is not supported"),
    (("-xyz",), "unrecognized argument: -xyz (ggml-coordinator serve --help lists the flags)"),
    (("-npx", "3"), "unrecognized argument: -npx"),  # not -np x
    (("-cb",), "unrecognized argument: -cb"),  # llama-server's continuous batching: not -c b
    (("--ctx", "512"), "unrecognized arguments: --ctx 512"),  # no abbreviation of --ctx-per-slot
    (("--api", "k"), "unrecognized arguments: --api k"),  # nor of --api-key
    (("--par", "2"), "unrecognized arguments: --par 2"),  # nor of --parallel
])
def test_llama_server_flags_that_are_refused_say_so(capsys, argv, message):
    err = refused(capsys, *argv)
    assert message in err, err


def test_ctk_is_not_c_and_hf_is_not_help(capsys):
    """-ctk f16 is the KV type (taken), never -c with 'tk'; -hf never prints the help and exits 0."""
    a = parsed("-ctk", "q8_0", "-ctv", "q4_0")
    assert (a.cache_type_k, a.cache_type_v) == ("q8_0", "q4_0")
    err = refused(capsys, "-hf", "repo")
    assert "usage:" in err and "-hf:" in err
    for command in ("generate", "bench"):  # every command has them
        argv = ("-p", "x") if command == "generate" else ()
        assert "KV cache of type 'q5_1' is not supported: choose f16, q8_0, q4_0" in refused(
            capsys, *argv, "-ctk", "q5_1", command=command)
        assert "-hf: downloading a model is not supported" in refused(capsys, *argv, "-hf", "r", command=command)


def test_bench_takes_prompt_sizes_as_llama_bench_does(capsys):
    """--pp N[,N...] (llama-bench's -p): a column per size; 64 unless told (not read as one 64512)."""
    assert parse_args(["bench", *MODEL]).pp == (64,)
    assert parse_args(["bench", *MODEL, "--pp", "64,512"]).pp == (64, 512)
    assert "names a size twice" in refused(capsys, "--pp", "64,64", command="bench")
    assert "must be at least 1, not 0" in refused(capsys, "--pp", "64,0", command="bench")
    assert "'x' is not an integer" in refused(capsys, "--pp", "64,x", command="bench")


def test_bench_rows_of_sums():
    """bench's tensor row runs the default sums (exact where they can be); --split-sums adds a split-sums
    row; the old --exact-sums (a row of exact sums beside split ones) is refused saying what took its place."""
    from coordinator.serving.benchmark import setups
    assert parse_args(["bench", *MODEL]).split_sums is False
    rows = setups(["a:1", "b:2"], 1, None, "on", "on", "tensor", parse_args(["bench", *MODEL, "--split-sums"]).split_sums)
    assert rows["rpc x2 tensor"][1] == {"split": None, "split_mode": "tensor"}  # exact_sums not given: the default
    assert rows["rpc x2 tensor split sums"][1] == {"split": None, "split_mode": "tensor", "exact_sums": False}


def test_bench_exact_sums_is_refused_saying_why(capsys):
    assert "--exact-sums: the tensor row has exact sums by default now" in refused(capsys, "--exact-sums",
                                                                                   command="bench")
