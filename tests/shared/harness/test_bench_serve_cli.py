"""`runnerlab bench serve`: every flag honoured or refused (exit 2, one line naming the
flag), engine flags forwarded verbatim, nano-vllm's draws reproduced, a --base-url run
end to end against the scripted server, servers that fail or will not stop cleaned up
(no process left), and the real thing: V1 and V2 servers under two request rates."""

from __future__ import annotations

import contextlib
import json
import socket
import subprocess
import sys
import textwrap
import time

import psutil
import pytest

from policy.cli_args import OneLineArgumentParser
from policy.engine_args import EngineArgs, add_engine_args
from shared.harness import bench_serve_server
from shared.harness import workloads as wl
from shared.harness.bench_serve import bench_serve_main, build_parser, engine_flag_argv
from shared.harness.bench_serve_client import chat_requests, nano_vllm_requests
from tests.shared.harness.test_bench_serve_client import scripted  # noqa: F401 (a fixture)

PROG = "runnerlab bench serve"
BASE = ["--model", "tiny-llama", "--device", "cpu"]


def one_line_error(capsys) -> str:
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert err.startswith(f"{PROG}: error: "), err
    return err.strip().removeprefix(f"{PROG}: error: ")


@pytest.mark.parametrize(("argv", "expected"), [
    (["--model-runner", "v1"], "--model-runner: bench serve starts one server per runner; use --runners"),
    (["--runners", "v1,v3"], "--runners: unknown runner v3; accepted: v1, v2"),
    (["--request-rate", "4,0"], "--request-rate: '0' is not a request rate"),
    (["--request-rate", "fast"], "--request-rate: 'fast' is not a request rate"),
    (["--request-rate", "nan"], "--request-rate: 'nan' is not a request rate"),
    (["--input-len", "50,10"], "--input-len: '50,10' is not a length range"),
    (["--output-len", "0,4"], "--output-len: '0,4' is not a length range"),
    (["--num-prompts", "0"], "--num-prompts: 0 is not valid; expected an integer >= 1"),
    (["--max-concurrency", "0"], "--max-concurrency: 0 is not valid"),
    (["--timeout-s", "-1"], "--timeout-s: '-1' is not valid; expected seconds > 0"),
    (["--workload", "sharegpt"], "--workload: invalid choice: 'sharegpt'"),
    (["--base-url", "http://h:1", "--runners", "v1"], "--runners: with --base-url no server"),
    (["--base-url", "http://h:1", "--dtype", "float32"], "--dtype: with --base-url the running"),
    (["--label", "x"], "--label names the row of a --base-url server"),
    (["--workload", "chat", "--input-len", "4,8"], "--input-len: the chat workload's prompts"),
    (["--save-requests"], "--save-requests: the raw records go into the --json report"),
    (["--json", "/no/such/dir/r.json"], "--json: the directory of '/no/such/dir/r.json' does not exist"),
    (["--png", "/no/such/dir/r.png"], "--png: the directory of '/no/such/dir/r.png' does not exist"),
])
def test_refusals_name_the_flag(argv, expected, capsys) -> None:
    assert bench_serve_main(BASE + argv) == 2
    assert one_line_error(capsys).startswith(expected)


@pytest.mark.parametrize(("argv", "expected"), [
    ([], "--input-len/--output-len: the longest request is 2048 tokens, more than "
         "max_model_len=512; lower the MAX"),
    (["--input-len", "8,16", "--output-len", "4", "--runners", "v2", "--speculative-config",
      '{"method": "ngram", "num_speculative_tokens": 2}'],
     "--runners v2: Model runner V2 (chosen by the argument model_runner='v2') does not "
     "support: ngram speculative decoding"),
    (["--input-len", "8", "--block-size", "12"], "block_size=12 is not valid"),
    (["--input-len", "8", "--gpu-memory-utilization", "0.5"],
     "--gpu-memory-utilization has no effect on the CPU"),
])
def test_engine_refusals_come_before_any_server_starts(argv, expected, capsys) -> None:
    before = set(psutil.Process().children(recursive=True))
    assert bench_serve_main(BASE + argv) == 2
    assert one_line_error(capsys).startswith(expected)
    assert set(psutil.Process().children(recursive=True)) == before


def test_a_shape_only_preset_without_dummy_weights_is_refused(capsys) -> None:
    argv = ["--model", "qwen3-0.6b", "--device", "cpu", "--input-len", "8", "--output-len", "4"]
    assert bench_serve_main(argv) == 2
    assert "load_format='auto' is not valid for the shape-only preset" in one_line_error(capsys)


def test_every_engine_flag_but_seed_is_offered_and_forwarded_verbatim() -> None:
    parser = build_parser()
    offered = {a.dest for a in parser._actions} & set(EngineArgs.model_fields)
    # --seed is the workload's; a new EngineArgs field clashing with a benchmark flag fails here
    assert offered == set(EngineArgs.model_fields) - {"seed"}
    argv = ["--model", "m", "--dtype", "float32", "--max-model-len", "64",
            "--no-enable-prefix-caching", "--async-scheduling", "--cudagraph-capture-sizes",
            "1", "2", "4", "--kernel-options", '{"pdl": false}', "--gpu-memory-utilization",
            "0.5", "--seed", "7"]
    args = parser.parse_args(argv)
    assert args.workload_seed == 7 and not hasattr(args, "seed")
    forwarded = engine_flag_argv(args)
    server = OneLineArgumentParser(prog="serve")
    add_engine_args(server)
    again = server.parse_args(["--model", "m", *forwarded])
    for name in ("dtype", "max_model_len", "enable_prefix_caching", "async_scheduling",
                 "cudagraph_capture_sizes", "kernel_options", "gpu_memory_utilization"):
        assert getattr(again, name) == getattr(args, name), name
    assert not hasattr(again, "seed") and not hasattr(again, "model_runner")


def test_the_nano_vllm_draws_are_nano_vllms() -> None:
    prompts, max_tokens = wl.nano_vllm_workload(num_requests=12, min_len=3, max_len=40)
    specs = nano_vllm_requests(12, (3, 40), (3, 40), seed=0, vocab_size=None)
    assert [list(s.prompt) for s in specs] == prompts
    assert [s.max_tokens for s in specs] == max_tokens
    assert all(s.ignore_eos and s.temperature == 0.6 for s in specs)
    folded = nano_vllm_requests(12, (3, 40), (3, 40), seed=0, vocab_size=512)
    assert [list(s.prompt) for s in folded] == [[t % 512 for t in p] for p in prompts]
    other = nano_vllm_requests(12, (3, 40), (5, 9), seed=1, vocab_size=None)
    assert other[0].prompt != specs[0].prompt and all(5 <= s.max_tokens <= 9 for s in other)
    chat = chat_requests(30, (4, 8), seed=0)
    assert chat == chat_requests(30, (4, 8), seed=0) and len({s.prompt for s in chat}) > 10
    assert all(isinstance(s.prompt, str) and not s.ignore_eos for s in chat)


def test_a_base_url_run_end_to_end(scripted, tmp_path, capsys) -> None:  # noqa: F811
    url, _ = scripted
    out = tmp_path / "r.json"
    argv = ["--model", "tiny-llama", "--base-url", url, "--label", "fake", "--num-prompts", "6",
            "--input-len", "4,8", "--output-len", "2,5", "--request-rate", "50,inf",
            "--json", str(out), "--save-requests"]
    assert bench_serve_main(argv) == 0
    report = json.loads(out.read_text())
    assert report["served_model"] == {"fake": "scripted"} and report["engine_flags"] == []
    assert [(e["runner"], e["request_rate"]) for e in report["results"]] == [
        ("fake", 50.0), ("fake", "inf")]
    for entry in report["results"]:
        assert entry["metrics"]["completed"] == 6 and entry["metrics"]["failed"] == 0
        assert all(r["output_tokens"] == r["max_tokens"] for r in entry["requests"])
    table = capsys.readouterr().out
    assert "fake" in table and " inf " in table


def test_failed_requests_make_exit_status_1(scripted, capsys) -> None:  # noqa: F811
    url, _ = scripted
    argv = ["--model", "tiny-llama", "--base-url", url, "--num-prompts", "3", "--input-len",
            "4", "--output-len", "3", "--timeout-s", "0.01"]
    assert bench_serve_main(argv) == 1
    assert "a warm-up request failed: timed out after 0.01 s" in capsys.readouterr().err
    assert bench_serve_main(argv + ["--num-warmups", "0"]) == 1
    captured = capsys.readouterr()
    assert "failed requests: server @ inf: 3 x timed out" in captured.err
    assert captured.out.splitlines()[2].split()[:4] == ["server", "inf", "0", "3"]


def test_an_unreachable_base_url_is_one_line_and_exit_1(capsys) -> None:
    with socket.socket() as s:  # a port with nothing listening
        s.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{s.getsockname()[1]}"
    argv = ["--model", "tiny-llama", "--base-url", url, "--input-len", "4", "--output-len", "2"]
    assert bench_serve_main(argv) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"{PROG}: error: server at {url}: GET /v1/models failed: ") and err.count("\n") == 1


# ---- server processes --------------------------------------------------------------

# a stand-in for `runnerlab serve`: answers /health, ignores SIGINT, has a child of its own
STUBBORN = textwrap.dedent("""
    import http.server, signal, subprocess, sys
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    class H(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200); self.end_headers()
        def log_message(self, *a): pass
    http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
""")


# a handler that answers every GET with 200, and the server on the port in argv[1]
OK_SERVER = textwrap.dedent("""
    import http.server, sys
    class H(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200); self.end_headers()
        def log_message(self, *a): pass
    server = http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), H)
""")
# answers one /health, then dies
ONE_REQUEST = OK_SERVER + 'server.handle_request()\nprint("bye", file=sys.stderr); sys.exit(4)\n'


def fake_serve(script: str):
    return lambda model, runner, port, flags: [sys.executable, "-c", script, str(port)]


def descendants() -> set:
    return set(psutil.Process().children(recursive=True))


def alive(procs: set) -> set:
    out = set()
    for p in procs:
        try:
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                out.add(p)
        except psutil.NoSuchProcess:
            pass
    return out


def assert_gone(before: set, spawned: set = frozenset()) -> None:
    """No new descendant, and none of `spawned` (which an orphan stops being) alive."""
    deadline = time.monotonic() + 5
    while (left := alive(descendants() - before) | alive(spawned)):
        assert time.monotonic() < deadline, f"left behind: {left}"
        time.sleep(0.05)


def test_a_server_that_exits_early_fails_with_its_log(monkeypatch) -> None:
    monkeypatch.setattr(bench_serve_server, "serve_argv", fake_serve(
        "import sys; print('engine: out of memory', file=sys.stderr); sys.exit(3)"))
    with pytest.raises(bench_serve_server.ServerError, match=r"exited with status 3; .*\n.*engine: out of memory"):
        with bench_serve_server.managed_server("m", "v1", [], startup_timeout_s=30):
            pass


# binds its port like uvicorn: a taken port is an OSError "[Errno 98] Address already in use"
BINDS = OK_SERVER + "server.serve_forever()\n"


def test_a_port_taken_before_the_server_binds_it_is_retried(monkeypatch) -> None:
    """free_port's pick taken meanwhile (a socket bound to it here, as by another process
    between the probe and the server's bind): the server exits, managed_server starts it
    again on another port. Every pick taken: the last failure is the error, with its log."""
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    picks = [taken.getsockname()[1]]
    real_free_port = bench_serve_server.free_port
    monkeypatch.setattr(bench_serve_server, "free_port",
                        lambda: picks.pop(0) if picks else real_free_port())
    monkeypatch.setattr(bench_serve_server, "serve_argv", fake_serve(BINDS))
    before = descendants()
    try:
        with bench_serve_server.managed_server("m", "v1", [], startup_timeout_s=30) as (url, check):
            assert url != f"http://127.0.0.1:{taken.getsockname()[1]}"
            check()
        assert_gone(before)
        monkeypatch.setattr(bench_serve_server, "free_port", lambda: taken.getsockname()[1])
        with pytest.raises(bench_serve_server.ServerError, match=r"(?s)exited with status 1.*Address already in use"):
            with bench_serve_server.managed_server("m", "v1", [], startup_timeout_s=30):
                pass
        assert_gone(before)
    finally:
        taken.close()


def test_a_server_that_dies_after_it_was_ready_is_reported_with_its_log(monkeypatch) -> None:
    monkeypatch.setattr(bench_serve_server, "serve_argv", fake_serve(ONE_REQUEST))
    with bench_serve_server.managed_server("m", "v1", [], startup_timeout_s=30) as (url, check):
        deadline = time.monotonic() + 10
        with pytest.raises(bench_serve_server.ServerError, match=r"exited with status 4; .*\n.*bye"):
            while time.monotonic() < deadline:
                check()
                time.sleep(0.05)


def test_a_server_that_never_gets_ready_is_stopped(monkeypatch) -> None:
    before = descendants()
    monkeypatch.setattr(bench_serve_server, "serve_argv", fake_serve("import time; time.sleep(60)"))
    with pytest.raises(bench_serve_server.ServerError, match="not ready after 0.5 s"):
        with bench_serve_server.managed_server("m", "v1", [], startup_timeout_s=0.5):
            pass
    assert_gone(before)


def test_no_process_outlives_an_error_even_one_that_ignores_sigint(monkeypatch) -> None:
    before = descendants()
    monkeypatch.setattr(bench_serve_server, "serve_argv", fake_serve(STUBBORN))
    monkeypatch.setattr(bench_serve_server, "STOP_TIMEOUT_S", 0.5)
    with pytest.raises(RuntimeError, match="mid-benchmark"):
        with bench_serve_server.managed_server("m", "v1", [], startup_timeout_s=30) as (url, check):
            check()  # alive
            spawned = descendants() - before
            assert len(spawned) == 2  # the server and its child
            raise RuntimeError("mid-benchmark")
    assert_gone(before, spawned)


# a benchmark process, killed with SIGKILL (no finally runs) while its server is up
DRIVER = textwrap.dedent("""
    import sys, time
    from shared.harness import bench_serve_server
    script = sys.argv[1]
    bench_serve_server.serve_argv = lambda m, r, port, f: [sys.executable, "-c", script, str(port)]
    with bench_serve_server.managed_server("m", "v1", [], startup_timeout_s=30):
        print("ready", flush=True)
        time.sleep(60)
""")


@pytest.mark.skipif(sys.platform != "linux", reason="PR_SET_PDEATHSIG is Linux's")
def test_the_server_dies_with_a_killed_benchmark() -> None:
    health = STUBBORN.replace("signal.signal(signal.SIGINT, signal.SIG_IGN)", "").replace(
        'subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])', "")
    driver = subprocess.Popen([sys.executable, "-c", DRIVER, health], stdout=subprocess.PIPE,
                              text=True, cwd=bench_serve_server.PROJECT_ROOT)
    server = None
    try:
        assert driver.stdout.readline().strip() == "ready"
        (server,) = psutil.Process(driver.pid).children()
        driver.kill()
        driver.wait(10)
        server.wait(10)  # raises psutil.TimeoutExpired if the server outlived its parent
    finally:  # the test's own processes, whatever failed (kill() skips a reaped one)
        driver.kill()
        driver.wait()
        if server is not None:
            with contextlib.suppress(psutil.NoSuchProcess):
                server.kill()


@pytest.mark.slow
def test_v1_and_v2_servers_under_two_rates(tmp_path) -> None:
    before = descendants()
    out = tmp_path / "r.json"
    rc = bench_serve_main(["--model", "tiny-llama", "--dtype", "float32", "--device", "cpu",
                           "--num-prompts", "8", "--request-rate", "20,inf", "--runners",
                           "v1,v2", "--input-len", "8,24", "--output-len", "4,12",
                           "--json", str(out), "--save-requests"])
    assert rc == 0
    report = json.loads(out.read_text())
    assert [(e["runner"], e["request_rate"]) for e in report["results"]] == [
        ("v1", 20.0), ("v1", "inf"), ("v2", 20.0), ("v2", "inf")]
    expected = [s.max_tokens for s in nano_vllm_requests(8, (8, 24), (4, 12), 0, 512)]
    for entry in report["results"]:
        assert entry["metrics"]["completed"] == 8, entry["metrics"]["errors"]
        assert [r["output_tokens"] for r in entry["requests"]] == expected  # ignore_eos
        assert all(r["finish_reason"] == "length" for r in entry["requests"])
    assert_gone(before)
