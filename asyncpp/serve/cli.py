"""``asyncpp serve``: a vLLM engine behind asyncpp's HTTP API (also ``python -m asyncpp.serve``).

::

    asyncpp serve [MODEL] [--host 127.0.0.1] [--port 8000] [--blocks FILE_OR_MODULE ...]
                  [--tokens FILE] [--allow-code] [--max-body-bytes N] [--max-concurrent N]
                  [--max-new-tokens N] [--max-invokes N] [--block-budget SECONDS]
                  [--log-level LEVEL]
                  [any VllmEngine / vLLM engine option as --kebab-case VALUE]

Options it does not know are the engine's: ``--dtype float32 --tensor-parallel-size 2`` becomes
``VllmEngine(dtype="float32", tensor_parallel_size=2)`` (a value is read as JSON where it parses:
``2`` is an int, ``true`` a bool, ``'[1, 2]'`` a list; else it is a string; an option without a
value is ``True``). With no MODEL it serves the embedded tiny model.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import math
import signal
import socket
import sys
import threading
from collections.abc import Iterator, Sequence
from typing import Any

from ..engines.vllm.options import is_loopback

__all__ = ["DEFAULT_BLOCK_BUDGET", "is_loopback", "main", "parse_args"]

DEFAULT_BLOCK_BUDGET = 2.0  # seconds per block per generation step

_VALUE_OPTIONS = {
    "--host",
    "--port",
    "--blocks",
    "--tokens",
    "--max-body-bytes",
    "--max-concurrent",
    "--max-new-tokens",
    "--max-invokes",
    "--block-budget",
    "--log-level",
}
_FLAG_OPTIONS = {"--allow-code", "--headless", "--help", "-h"}


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="asyncpp serve",
        description=(
            "Serve a model on a vLLM engine over HTTP: clients run the blocks registered with --blocks "
            "(and, with --allow-code, trusted tokens their own code). Options not listed here are passed "
            "to asyncpp.VllmEngine (--dtype float32 -> dtype='float32')."
        ),
    )
    p.add_argument(
        "model", nargs="?", default=None, help="model folder or name (default: the embedded tiny model)"
    )
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="port (default: 8000; 0: any free port)")
    p.add_argument(
        "--blocks", action="append", default=[], metavar="FILE_OR_MODULE",
        help="a module of registered blocks (a .py file or a dotted name); may be repeated",
    )  # fmt: skip
    p.add_argument(
        "--tokens", default=None, metavar="FILE",
        help="bearer tokens (JSON; default: the file $ASYNCPP_TOKENS names). Without tokens the server "
        "only listens on a loopback host",
    )  # fmt: skip
    p.add_argument(
        "--allow-code", action="store_true",
        help="let trusted tokens ship their own block code: this is code execution on the server",
    )  # fmt: skip
    p.add_argument("--max-body-bytes", type=int, default=None, help="largest request body (default: 16 MiB)")
    p.add_argument(
        "--max-concurrent", type=int, default=None, help="default per-token concurrent requests (16)"
    )
    p.add_argument(
        "--max-new-tokens", type=int, default=None, help="default per-token max_new_tokens cap (512)"
    )
    p.add_argument("--max-invokes", type=int, default=None, help="default per-token invokes per request (16)")
    p.add_argument(
        "--block-budget", type=float, default=None, metavar="SECONDS",
        help=f"seconds a block's code may run per generation step before it is stopped and its request "
        f"fails (default: {DEFAULT_BLOCK_BUDGET:g}, none on tensor-parallel engines; 0: no budget)",
    )  # fmt: skip
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    p.add_argument(
        "--headless", action="store_true",
        help="run node --node-rank K (1 or more) of a multi-node engine: its vLLM workers only, no "
        "server; give the head's --nnodes, --master-addr, --master-port and the same model and engine "
        "options (docs/scale-out.md)",
    )  # fmt: skip
    return p


def _value(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        pass
    low = text.lower()
    if low in ("true", "false"):
        return low == "true"
    if low in ("none", "null"):
        return None
    return text


def _split(argv: Sequence[str]) -> tuple[list[str], dict[str, Any]]:
    """asyncpp's own arguments (for argparse) and the engine's options (snake_case names)."""
    own: list[str] = []
    engine: dict[str, Any] = {}
    i, n = 0, len(argv)
    while i < n:
        arg = argv[i]
        if arg == "--":
            own.extend(argv[i:])
            break
        if not arg.startswith("--") or arg == "--":
            own.append(arg)
            i += 1
            continue
        opt, eq, inline = arg.partition("=")
        if opt in _VALUE_OPTIONS:
            own.append(arg)
            if not eq and i + 1 < n:
                own.append(argv[i + 1])
                i += 1
        elif opt in _FLAG_OPTIONS:
            own.append(arg)
        else:
            key = opt[2:].replace("-", "_")
            if not key.isidentifier():
                raise SystemExit(f"asyncpp serve: error: {opt!r} is not an option name")
            if eq:
                value: Any = _value(inline)
            elif i + 1 < n and not argv[i + 1].startswith("--"):
                value = _value(argv[i + 1])
                i += 1
            else:
                value = True
            if key in engine:
                raise SystemExit(f"asyncpp serve: error: {opt} is given twice")
            engine[key] = value
        i += 1
    return own, engine


def parse_args(argv: Sequence[str] | None = None) -> tuple[argparse.Namespace, dict[str, Any]]:
    """``(asyncpp's options, the engine's options)`` for ``argv`` (default: ``sys.argv[1:]``,
    without a leading ``serve``)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "serve":
        argv = argv[1:]
    own, engine = _split(argv)
    args = _parser().parse_args(own)
    if "model" in engine:
        if args.model is not None:
            raise SystemExit("asyncpp serve: error: give the model once (MODEL or --model)")
        args.model = engine.pop("model")
    return args, engine


def _bind(host: str, port: int) -> socket.socket:
    host = host.strip("[]")
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    err: OSError | None = None
    for family, kind, proto, _, addr in infos:
        sock = socket.socket(family, kind, proto)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            sock.bind(addr)
            sock.listen(2048)
            sock.set_inheritable(True)
            return sock
        except OSError as e:
            sock.close()
            err = e
    raise err or OSError(f"cannot listen on {host}:{port}")


def _say(text: str, *, err: bool = False) -> None:
    print(f"asyncpp: {text}", file=sys.stderr if err else sys.stdout, flush=True)


def main(argv: Sequence[str] | None = None) -> int:
    """The console script: ``asyncpp serve ...`` (``serve`` may be left out; see the module docstring)."""
    return serve(list(sys.argv[1:] if argv is None else argv))


def serve(argv: Sequence[str]) -> int:
    args, engine_options = parse_args(argv)
    _logging(args.log_level)
    if args.headless:
        return _headless(args, engine_options)

    from .app import ServeLimits, create_app
    from .auth import TokenError, load_tokens
    from .registry import Registry, load_module

    try:
        tokens = load_tokens(args.tokens)
    except TokenError as e:
        _say(f"error: {e}", err=True)
        return 2
    if tokens is None:
        if not is_loopback(args.host):
            _say(
                f"error: refusing to serve on {args.host} without tokens: anyone who can reach it could "
                "run the model. Give --tokens FILE (or ASYNCPP_TOKENS), or listen on 127.0.0.1",
                err=True,
            )
            return 2
        _say(
            f"warning: no tokens configured: every client of {args.host} is served without "
            "authentication (loopback only)",
            err=True,
        )
    if args.allow_code:
        if tokens is None or not tokens.any_trusted:
            _say("warning: --allow-code, but no token is trusted: shipped code is refused anyway", err=True)
        else:
            names = ", ".join(t.name for t in tokens if t.trusted)
            _say(f"warning: --allow-code: trusted tokens ({names}) can run any code on this server", err=True)
    registry = Registry()
    try:
        for target in args.blocks:
            registry.update(load_module(target))
    except Exception as e:
        _say(f"error: cannot load blocks {target!r}: {type(e).__name__}: {e}", err=True)
        return 2
    limit_args = {
        k: v
        for k, v in {
            "max_body_bytes": args.max_body_bytes,
            "max_concurrent": args.max_concurrent,
            "max_new_tokens": args.max_new_tokens,
            "max_invokes": args.max_invokes,
        }.items()
        if v is not None
    }
    try:
        limits = ServeLimits(**limit_args)
    except ValueError as e:
        _say(f"error: {e}", err=True)
        return 2
    try:
        sock = _bind(args.host, args.port)
    except OSError as e:
        _say(f"error: cannot listen on {args.host}:{args.port}: {e.strerror or e}", err=True)
        return 2

    import asyncpp

    budget = args.block_budget
    if budget is None:
        budget = DEFAULT_BLOCK_BUDGET
        if int(engine_options.get("tensor_parallel_size", 1) or 1) > 1:
            budget = 0
            _say("warning: no block time budget on a tensor-parallel engine (see docs/serving.md)", err=True)
    if not math.isfinite(budget) or budget < 0:
        sock.close()
        _say(f"error: --block-budget must be a number of seconds >= 0, got {budget}", err=True)
        return 2
    budget = budget if budget > 0 else None
    try:
        with _sigterm_exits():
            engine = asyncpp.VllmEngine(args.model, block_budget=budget, **engine_options)
    except (TypeError, ValueError) as e:
        sock.close()
        _say(f"error: bad engine option: {e}", err=True)
        return 2
    except SystemExit:
        sock.close()
        _say("stopped while the engine was starting", err=True)
        raise
    try:
        app = create_app(
            engine, registry, tokens=tokens, allow_code=args.allow_code, limits=limits, model_name=args.model
        )
        _run(app, sock, args, app.state.asyncpp["model"])
    finally:
        engine.close()
        sock.close()
        _say("stopped", err=True)
    return 0


def _headless(args: argparse.Namespace, engine_options: dict[str, Any]) -> int:
    """``asyncpp serve --headless --node-rank K ...``: one of the other nodes of a multi-node engine."""
    from ..engines.vllm import run_node

    missing = [f"--{k.replace('_', '-')}" for k in ("nnodes", "node_rank") if k not in engine_options]
    if missing:
        _say(f"error: --headless needs {' and '.join(missing)} (see docs/scale-out.md)", err=True)
        return 2
    try:
        run_node(args.model, **engine_options)
    except (TypeError, ValueError) as e:
        _say(f"error: bad engine option: {e}", err=True)
        return 2
    except TimeoutError as e:
        _say(f"error: {e}", err=True)
        return 1
    return 0


@contextlib.contextmanager
def _sigterm_exits() -> Iterator[None]:
    """SIGTERM raises SystemExit (status 143) inside the ``with``, as Ctrl-C raises
    KeyboardInterrupt: a server stopped while its engine starts ends vLLM's processes too."""

    def stop(signum: int, frame: Any) -> None:
        raise SystemExit(128 + signum)

    old = signal.signal(signal.SIGTERM, stop)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, old)


def _run(app: Any, sock: socket.socket, args: argparse.Namespace, model: str) -> None:
    import uvicorn

    host, port = sock.getsockname()[:2]
    shown = f"[{host}]" if ":" in host else host

    class Server(uvicorn.Server):
        async def startup(self, sockets: Any = None) -> None:
            await super().startup(sockets)
            if self.started:
                _say(f"serving {model} on http://{shown}:{port}")

        @contextlib.contextmanager
        def capture_signals(self) -> Iterator[None]:
            # uvicorn re-raises SIGINT/SIGTERM once it has shut down, which would end the process
            # before the engine is closed: handle them here, and return normally
            if threading.current_thread() is not threading.main_thread():
                yield
                return
            sigs = (signal.SIGINT, signal.SIGTERM)
            old = {s: signal.signal(s, self.handle_exit) for s in sigs}
            try:
                yield
            finally:
                for s, h in old.items():
                    signal.signal(s, h)

    config = uvicorn.Config(
        app,
        log_level=args.log_level,
        timeout_graceful_shutdown=30,
        lifespan="off",
        access_log=args.log_level in ("info", "debug"),
    )
    Server(config).run(sockets=[sock])


def _logging(level: str) -> None:
    log = logging.getLogger("asyncpp.serve")
    if not log.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("asyncpp: %(levelname)s %(message)s"))
        log.addHandler(handler)
        log.propagate = False
    log.setLevel(level.upper())
