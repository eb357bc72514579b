"""`runnerlab serve --model M [engine flags]`: the OpenAI-compatible server on uvicorn.

The engine is built (weights, KV cache, CUDA graphs) before the socket is bound, so a
client that can connect finds a ready server; `--port 0` binds a free port, and the
line "runnerlab serve: listening on http://HOST:PORT" on stderr says which. SIGINT /
SIGTERM stop uvicorn gracefully: the lifespan's shutdown stops the engine loop and any
tensor-parallel workers.
"""

from __future__ import annotations

import argparse
import logging
import socket
import sys

from policy.cli_args import OneLineArgumentParser, cpu_noop_refusal, usage_error

SERVE = "runnerlab serve"
logger = logging.getLogger("runnerlab")


def _parser() -> argparse.ArgumentParser:
    from policy.explain import add_engine_args

    parser = OneLineArgumentParser(prog=SERVE, description="An OpenAI-compatible server.")
    add_engine_args(parser)
    g = parser.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1; "
                   "0.0.0.0 for every interface)")
    g.add_argument("--port", type=int, default=8000, help="port (0: a free one)")
    g.add_argument("--served-model-name", default=None,
                   help="the model name clients send (default: --model)")
    g.add_argument("--uvicorn-log-level", default="warning",
                   choices=["critical", "error", "warning", "info", "debug", "trace"])
    return parser


def bind_socket(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    # Listening now, before uvicorn's start-up: the "listening on" line is printed next,
    # and a client that reads it and connects at once must be queued by the kernel, not
    # refused (uvicorn accepts from this socket once its app has started).
    sock.listen(2048)
    return sock


def serve_main(argv: list[str]) -> int:
    parser = _parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:
        return int(exc.code or 0)
    if not 0 <= args.port <= 65535:
        return usage_error(SERVE, f"--port {args.port}: a port is in [0, 65535]")

    from policy.explain import engine_args_from_namespace
    from shared.contract.sampling_params import SamplingParamsError
    from shared.serving.engine import EngineInputError, LLMEngine

    try:
        engine_args = engine_args_from_namespace(args)  # reads the EngineArgs flags only
        refusal = cpu_noop_refusal(args, engine_args.device)
        if refusal:
            return usage_error(SERVE, refusal)
        engine = LLMEngine.from_engine_args(engine_args)
    except (EngineInputError, SamplingParamsError, ValueError) as exc:
        return usage_error(SERVE, exc)
    except OSError as exc:
        print(f"{SERVE}: error: {exc}", file=sys.stderr)
        return 1
    try:
        sock = bind_socket(args.host, args.port)
    except OSError as exc:
        engine.shutdown()
        return usage_error(SERVE, f"--host {args.host} --port {args.port}: cannot bind: {exc}")
    return run_server(engine, args.served_model_name or engine_args.model, sock,
                      args.uvicorn_log_level)


def run_server(engine, model_name: str, sock: socket.socket, log_level: str) -> int:
    import uvicorn

    from shared.serving.api.app import build_app

    host, port = sock.getsockname()[:2]
    config = uvicorn.Config(build_app(engine, model_name), log_level=log_level,
                            lifespan="on", timeout_graceful_shutdown=10)
    server = uvicorn.Server(config)
    print(f"{SERVE}: listening on http://{host}:{port} (model {model_name!r}, runner "
          f"{engine.runner_name})", file=sys.stderr, flush=True)
    try:
        server.run(sockets=[sock])
    except KeyboardInterrupt:
        # uvicorn shut down gracefully on SIGINT (the lifespan stopped the engine loop),
        # then re-raised the signal: a stop the user asked for is a clean exit
        pass
    finally:
        sock.close()
        engine.shutdown()
    return 0
