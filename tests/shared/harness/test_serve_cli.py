"""`runnerlab serve` as a user runs it: a process that binds a port, answers, and stops on
SIGINT with exit status 0 and no process left; refusals are one line, exit status 2."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time

import httpx2 as httpx
import pytest

from shared.harness.cli import main

SERVE = [sys.executable, "-m", "shared.harness.cli", "serve", "--model", "tiny-llama",
         "--device", "cpu", "--dtype", "float", "--max-model-len", "64", "--port", "0",
         "--model-runner", "v1"]


def _wait_for_address(proc: subprocess.Popen, timeout_s: float = 120.0) -> str:
    deadline = time.monotonic() + timeout_s
    lines = []
    while time.monotonic() < deadline:
        line = proc.stderr.readline()
        if not line:
            break
        lines.append(line)
        found = re.search(r"listening on (http://\S+)", line)
        if found:
            return found.group(1)
    proc.kill()
    raise AssertionError("no 'listening on' line:\n" + "".join(lines[-20:]))


def test_serve_answers_and_stops_on_sigint():
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    proc = subprocess.Popen(SERVE, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL,
                            text=True, env=env)
    try:
        url = _wait_for_address(proc)
        assert httpx.get(url + "/health", timeout=30).status_code == 200
        r = httpx.post(url + "/v1/completions", timeout=60,
                       json={"model": "tiny-llama", "prompt": [1, 2, 3], "max_tokens": 3,
                             "ignore_eos": True, "return_token_ids": True})
        assert r.status_code == 200 and len(r.json()["choices"][0]["token_ids"]) == 3
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_the_socket_takes_connections_before_the_server_starts():
    """The "listening on" line is printed once bind_socket returns, before uvicorn starts:
    a client connecting then must be queued, not refused (CI saw the refusal)."""
    import socket

    from shared.harness.serve_cli import bind_socket

    sock = bind_socket("127.0.0.1", 0)
    try:
        with socket.create_connection(sock.getsockname()[:2], timeout=5):
            pass
    finally:
        sock.close()


@pytest.mark.parametrize("argv,words", [
    (["--model", "tiny-llama", "--port", "70000"], "--port 70000"),
    (["--model", "no-such-model"], "no-such-model"),
    (["--model", "tiny-llama", "--dtype", "fp8"], "--dtype"),
    (["--model", "tiny-llama", "--device", "cpu", "--gpu-memory-utilization", "0.5"],
     "--gpu-memory-utilization"),
])
def test_serve_refusals_are_one_line(argv, words, capsys):
    assert main(["serve", *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("runnerlab serve: error:") and words in err[0]


def test_version_and_bench_usage(capsys):
    from importlib.metadata import version

    assert main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == f"runnerlab {version('runnerlab')}"
    assert main(["bench", "nothing"]) == 2
    assert "bench serve" in capsys.readouterr().err
