"""A real `runnerlab serve` app on uvicorn, in a thread of the test process, on a free
localhost port: the tests talk to it over HTTP exactly as any client would."""

from __future__ import annotations

import threading
import time

import uvicorn

from shared.harness.serve_cli import bind_socket
from shared.serving.api.app import build_app


class LiveServer:
    def __init__(self, engine, model_name: str = "test-model") -> None:
        self.engine = engine
        self.model_name = model_name
        self.app = build_app(engine, model_name)
        self._sock = bind_socket("127.0.0.1", 0)
        host, port = self._sock.getsockname()[:2]
        self.base_url = f"http://{host}:{port}"
        self._server = uvicorn.Server(uvicorn.Config(self.app, log_level="warning",
                                                     lifespan="on"))
        self._thread = threading.Thread(target=self._server.run,
                                        kwargs={"sockets": [self._sock]}, daemon=True)

    @property
    def state(self):
        return self.app.state.runnerlab

    def __enter__(self) -> LiveServer:
        self._thread.start()
        deadline = time.monotonic() + 30
        while not self._server.started:
            if time.monotonic() > deadline or not self._thread.is_alive():
                raise RuntimeError("the test server did not start")
            time.sleep(0.01)
        return self

    def __exit__(self, *exc) -> None:
        self._server.should_exit = True
        self._thread.join(30)
        self._sock.close()
        assert not self._thread.is_alive(), "the test server did not stop"

    def wait_idle(self, timeout_s: float = 30.0) -> None:
        """Until the engine has nothing unfinished (aborts reported, blocks freed)."""
        deadline = time.monotonic() + timeout_s
        while self.engine.has_unfinished_requests() or self.state.async_engine._streams:
            if time.monotonic() > deadline:
                raise AssertionError("the engine still has unfinished requests")
            time.sleep(0.02)
