"""The `runnerlab serve` subprocesses of `runnerlab bench serve`: started on a free local
port, waited for (GET /health), checked while the benchmark runs, and stopped whatever
happens (SIGINT, then SIGKILL, then the rest of its process group), so that no server
outlives the benchmark."""

from __future__ import annotations

import contextlib
import os
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx

PROG = "runnerlab bench serve"

PROJECT_ROOT = Path(__file__).resolve().parents[2]
STOP_TIMEOUT_S = 30.0  # after SIGINT, before SIGKILL
LOG_TAIL_LINES = 25


class ServerError(Exception):
    """A server that did not start, died, or failed its warm-up."""


def free_port() -> int:
    """A port nothing listens on now (the kernel's pick for port 0). Another process can
    still take it before the server binds; the server then exits, and managed_server
    tries another."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def serve_argv(model: str, runner: str, port: int, engine_flags: list[str]) -> list[str]:
    return [sys.executable, "-m", "shared.harness.cli", "serve", "--model", model,
            "--model-runner", runner, "--host", "127.0.0.1", "--port", str(port),
            *engine_flags]


def _die_with_parent() -> Callable[[], None] | None:
    """Linux: a preexec function after which the server gets SIGTERM when this process dies
    without running its finally blocks (SIGKILL), so that no server outlives the benchmark.
    libc is loaded here, in the parent: the child between fork and exec only calls it."""
    if sys.platform != "linux":
        return None
    import ctypes

    prctl, PR_SET_PDEATHSIG = ctypes.CDLL(None, use_errno=True).prctl, 1
    return lambda: prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def _log_tail(log) -> str:
    log.flush()
    log.seek(0)
    lines = log.read().decode("utf-8", "replace").splitlines()[-LOG_TAIL_LINES:]
    return "\n".join("    " + line for line in lines) or "    (empty)"


def _check_alive(proc: subprocess.Popen, label: str, log) -> None:
    if proc.poll() is not None:
        raise ServerError(f"the {label} server exited with status {proc.returncode}; "
                          f"the end of its log:\n{_log_tail(log)}")


def wait_healthy(proc: subprocess.Popen, base_url: str, label: str, log,
                 timeout_s: float) -> None:
    """Poll GET /health until 200; fail when the process exits or the time is up."""
    deadline = time.monotonic() + timeout_s
    with httpx.Client(timeout=5.0, trust_env=False) as http:
        while True:
            _check_alive(proc, label, log)
            try:
                if http.get(base_url + "/health").status_code == 200:
                    return
            except httpx.HTTPError:
                pass  # not listening yet
            if time.monotonic() > deadline:
                raise ServerError(
                    f"the {label} server was not ready after {timeout_s:g} s (raise "
                    f"--startup-timeout-s); the end of its log:\n{_log_tail(log)}")
            time.sleep(0.25)


def stop_server(proc: subprocess.Popen) -> None:
    """SIGINT (a graceful shutdown), SIGKILL after STOP_TIMEOUT_S; then whatever is left of
    its process group (its own children), so that nothing is left behind."""
    try:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            proc.wait(STOP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        pass
    finally:  # also when a second Ctrl-C cuts the wait short
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)


# How many ports managed_server tries: free_port's pick can be taken before the server
# binds it (another process between our probe and its bind), and the server then exits.
PORT_ATTEMPTS = 3
_PORT_TAKEN = ("address already in use", "[errno 98]", "[errno 48]")  # Linux, macOS


def _port_was_taken(log) -> bool:
    log.flush()
    log.seek(0)
    text = log.read().decode("utf-8", "replace").lower()
    return any(marker in text for marker in _PORT_TAKEN)


@contextlib.contextmanager
def managed_server(model: str, runner: str, engine_flags: list[str], startup_timeout_s: float
                   ) -> Iterator[tuple[str, Callable[[], None]]]:
    """A `runnerlab serve` subprocess for one runner, ready; -> its base URL and a check
    that raises ServerError (with its log) once it has died. Stopped on the way out,
    whatever happened (a failure, Ctrl-C). A server that exits because its port was taken
    meanwhile is started again on another (PORT_ATTEMPTS in all)."""
    env = dict(os.environ)  # the server imports this checkout, whatever is installed
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(PROJECT_ROOT), env.get("PYTHONPATH")]))
    for attempt in range(1, PORT_ATTEMPTS + 1):
        port = free_port()
        base_url = f"http://127.0.0.1:{port}"
        argv = serve_argv(model, runner, port, engine_flags)
        print(f"{PROG}: starting {' '.join(map(shlex.quote, argv[1:]))}", file=sys.stderr)
        # the log goes to a file: a pipe nobody reads would block a chatty server
        with tempfile.TemporaryFile() as log:
            # its own session: a Ctrl-C here reaches this process only, which stops it
            proc = subprocess.Popen(
                argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, env=env,
                start_new_session=True, preexec_fn=_die_with_parent())
            try:
                try:
                    wait_healthy(proc, base_url, runner, log, startup_timeout_s)
                    # whoever took the port may be what answered /health: ours must live
                    _check_alive(proc, runner, log)
                except ServerError:
                    if attempt < PORT_ATTEMPTS and proc.poll() is not None and _port_was_taken(log):
                        print(f"{PROG}: port {port} was taken before the {runner} server "
                              "bound it; another port", file=sys.stderr)
                        continue
                    raise
                yield base_url, lambda p=proc, lg=log: _check_alive(p, runner, lg)
                return
            finally:
                stop_server(proc)


@contextlib.contextmanager
def terminate_on_sigterm() -> Iterator[None]:
    """SIGTERM raises KeyboardInterrupt while the benchmark runs, so that its finally
    blocks stop the servers; the previous handler is restored after."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def interrupt(signum, frame):
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
