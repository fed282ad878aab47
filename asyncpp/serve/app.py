"""The HTTP app of an asyncpp server: registered blocks (and, for trusted tokens, shipped code) run
as traces on one engine.

``create_app(engine, registry)`` returns a FastAPI app; ``asyncpp serve`` runs it with uvicorn,
and an existing ASGI application can mount it (``parent.mount("/asyncpp", create_app(...))``).

Routes (bodies of ``POST /v1/trace``, and its answers, are :mod:`asyncpp.serve.wire` bodies, binary
or JSON, answered in the request's content type; errors are always JSON
``{"error": {"type", "message"}}``):

- ``GET /health``: ``{"status": "ok"}`` (no auth; 503 ``{"status": "dead"}`` once the engine died);
- ``GET /v1/blocks``: ``{"blocks": registry.describe()}``;
- ``POST /v1/trace``: one trace (``asyncpp.trace`` or ``asyncpp.generate``) with the request's
  invokes; each invoke's result or error, and its sampled tokens;
- ``GET /v1/stats``: for trusted tokens, the server's request counts and ``engine.worker_stats()``.

A request is checked in this order, and the first failure answers: the bearer token (401), the
token's concurrent requests (429), the body's size (413), its decoding (400; 413 past a
:class:`~asyncpp.serve.wire.WireLimits` limit), shipped code without permission (403, before any of
it is decoded), the request's schema and the token's limits (400), each block's name and arguments
(422), the engine (503). A block that raises fails only its own invoke (in a 200 answer). A client
that disconnects cancels its trace, which aborts its vLLM requests.
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import logging
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ..engines.base import no_block
from ..kernel.errors import AsyncppError, EngineDeadError
from . import wire
from .auth import Token, Tokens
from .openai_routes import add_openai_routes
from .registry import BlockArgumentError, Registry, UnknownBlockError, json_kind
from .requests import Refusal, authenticate, read_body, take_slot

if TYPE_CHECKING:  # pragma: no cover
    from fastapi import FastAPI, Request

__all__ = ["ServeLimits", "create_app"]

log = logging.getLogger("asyncpp.serve")

_SAMPLING_KEYS = ("temperature", "top_p", "top_k", "seed", "ignore_eos", "min_tokens", "stop_token_ids")
_REQUEST_KEYS = {"generate", "max_new_tokens", "sampling", "invokes", "stream"}
_INVOKE_KEYS = {"prompt", "block", "args", "code"}
_OFFLOAD_BYTES = 256 * 2**10  # bodies larger than this are decoded and encoded off the event loop


@dataclass(frozen=True)
class ServeLimits:
    """A server's limits. ``max_concurrent``, ``max_new_tokens`` and ``max_invokes`` are the
    defaults for tokens that set none (and the limits of unauthenticated clients, all together
    for ``max_concurrent``); a token's own values replace them."""

    max_body_bytes: int = 16 * 2**20
    max_concurrent: int = 16
    max_new_tokens: int = 512
    max_invokes: int = 16
    max_stop_token_ids: int = 64
    wire: wire.WireLimits = field(default_factory=wire.WireLimits)

    def __post_init__(self) -> None:
        for name in ("max_body_bytes", "max_concurrent", "max_new_tokens", "max_invokes"):
            value = getattr(self, name)
            if type(value) is not int or value < 1:
                raise ValueError(f"ServeLimits.{name} must be an int >= 1, got {value!r}")
        # the decoder's byte limit is the body limit
        object.__setattr__(self, "wire", dataclasses.replace(self.wire, max_bytes=self.max_body_bytes))


@dataclass
class _Invoke:
    prompt: Any
    block: Callable[..., Any]
    args: tuple = ()
    kwargs: dict[str, Any] = field(default_factory=dict)


@dataclass
class _Request:
    generate: bool
    max_new_tokens: int | None
    sampling: dict[str, Any]
    invokes: list[dict[str, Any]]
    stream: bool = False


def _bad(message: str) -> Refusal:
    return Refusal(400, "RequestError", message)


def _is_int(v: Any) -> bool:
    return type(v) is int


def _check_sampling(sampling: Any, max_tokens: int, limits: ServeLimits) -> dict[str, Any]:
    if sampling is None:
        return {}
    if type(sampling) is not dict:
        raise _bad(f"'sampling' must be an object, got {json_kind(sampling)}")
    unknown = sorted(set(sampling) - set(_SAMPLING_KEYS))
    if unknown:
        raise _bad(f"'sampling' has unknown keys {unknown} (allowed: {', '.join(_SAMPLING_KEYS)})")
    out = dict(sampling)
    for key in ("temperature", "top_p"):
        if key in out:
            v = out[key]
            if type(v) not in (int, float) or not math.isfinite(v):
                raise _bad(f"sampling.{key} must be a number, got {json_kind(v)}")
            out[key] = float(v)
    if "temperature" in out and not 0.0 <= out["temperature"] <= 2.0:
        raise _bad(f"sampling.temperature must be in [0, 2], got {out['temperature']}")
    if "top_p" in out and not 0.0 < out["top_p"] <= 1.0:
        raise _bad(f"sampling.top_p must be in (0, 1], got {out['top_p']}")
    if "top_k" in out and (not _is_int(out["top_k"]) or out["top_k"] < -1):
        raise _bad(f"sampling.top_k must be an int >= -1 (-1 or 0: off), got {out['top_k']!r}")
    if "seed" in out and (not _is_int(out["seed"]) or not 0 <= out["seed"] < 2**63):
        raise _bad(f"sampling.seed must be an int in [0, 2**63), got {out['seed']!r}")
    if "ignore_eos" in out and type(out["ignore_eos"]) is not bool:
        raise _bad(f"sampling.ignore_eos must be true or false, got {json_kind(out['ignore_eos'])}")
    if "min_tokens" in out:
        v = out["min_tokens"]
        if not _is_int(v) or not 0 <= v <= max_tokens:
            raise _bad(
                f"sampling.min_tokens must be an int in [0, {max_tokens}] (the tokens sampled), got {v!r}"
            )
    if "stop_token_ids" in out:
        v = out["stop_token_ids"]
        if type(v) is not list or any(not _is_int(x) or not 0 <= x < 2**31 for x in v):
            raise _bad("sampling.stop_token_ids must be a list of token ids (ints >= 0)")
        if len(v) > limits.max_stop_token_ids:
            raise _bad(f"sampling.stop_token_ids has {len(v)} ids, more than {limits.max_stop_token_ids}")
    return out


def _scan_code(payload: Any) -> bool:
    """Whether any invoke of a (decoded, not yet checked) request ships code."""
    if type(payload) is not dict or type(payload.get("invokes")) is not list:
        return False
    return any(type(inv) is dict and "code" in inv for inv in payload["invokes"])


def _check_request(payload: Any, token: Token, limits: ServeLimits) -> _Request:
    if type(payload) is not dict:
        raise _bad(f"the request must be an object, got {json_kind(payload)}")
    unknown = sorted(set(payload) - _REQUEST_KEYS)
    if unknown:
        raise _bad(f"the request has unknown keys {unknown} (allowed: {', '.join(sorted(_REQUEST_KEYS))})")
    generate = payload.get("generate", False)
    if type(generate) is not bool:
        raise _bad(f"'generate' must be true or false, got {json_kind(generate)}")
    stream = payload.get("stream", False)
    if type(stream) is not bool:
        raise _bad(f"'stream' must be true or false, got {json_kind(stream)}")
    cap = token.max_new_tokens or limits.max_new_tokens
    n = payload.get("max_new_tokens")
    if generate:
        if n is None:
            raise _bad("'max_new_tokens' is required with 'generate': true")
        if not _is_int(n) or n < 1:
            raise _bad(f"'max_new_tokens' must be an int >= 1, got {n!r}")
        if n > cap:
            raise _bad(f"'max_new_tokens' is {n}, more than this token's limit of {cap}")
    elif "max_new_tokens" in payload:
        raise _bad("'max_new_tokens' is only for 'generate': true (a trace samples one token)")
    sampling = _check_sampling(payload.get("sampling"), n if generate else 1, limits)
    invokes = payload.get("invokes")
    if type(invokes) is not list or not invokes:
        raise _bad("'invokes' must be a non-empty list of invokes")
    most = token.max_invokes or limits.max_invokes
    if len(invokes) > most:
        raise _bad(f"the request has {len(invokes)} invokes, more than this token's limit of {most}")
    checked = []
    for i, inv in enumerate(invokes):
        at = f"invokes[{i}]"
        if type(inv) is not dict:
            raise _bad(f"{at} must be an object, got {json_kind(inv)}")
        unknown = sorted(set(inv) - _INVOKE_KEYS)
        if unknown:
            raise _bad(f"{at} has unknown keys {unknown} (allowed: {', '.join(sorted(_INVOKE_KEYS))})")
        if "prompt" not in inv:
            raise _bad(f"{at} needs a 'prompt' (a string, or a list of token ids)")
        prompt = inv["prompt"]
        if type(prompt) is list:
            if any(not _is_int(x) or not 0 <= x < 2**31 for x in prompt):
                raise _bad(f"{at}.prompt: a list prompt must hold token ids (ints >= 0)")
        elif type(prompt) is not str:
            raise _bad(f"{at}.prompt must be a string or a list of token ids, got {json_kind(prompt)}")
        block = inv.get("block")
        if block is not None and type(block) is not str:
            raise _bad(f"{at}.block must be a block name (a string) or null, got {json_kind(block)}")
        args = inv.get("args", {})
        if type(args) is not dict:
            raise _bad(f"{at}.args must be an object of parameter names to values, got {json_kind(args)}")
        if "code" in inv:
            if type(inv["code"]) is not str:
                raise _bad(f"{at}.code must be a base64 string, got {json_kind(inv['code'])}")
            if block is not None or args:
                raise _bad(f"{at}: an invoke ships either 'code' or a 'block' with 'args', not both")
        checked.append({"prompt": prompt, "block": block, "args": args, "code": inv.get("code")})
    return _Request(generate, n if generate else None, sampling, checked, stream)


def _error(kind: str, message: str) -> dict[str, str]:
    return {"type": kind, "message": message}


def _token_list(h: Any) -> list[int]:
    tokens = getattr(h, "tokens", None)
    if tokens is None:
        return []
    try:
        return [int(x) for x in tokens[0].tolist()]
    except Exception:  # an engine whose tokens have another shape
        return []


def create_app(
    engine: Any,
    registry: Registry | None = None,
    *,
    tokens: Tokens | None = None,
    allow_code: bool = False,
    limits: ServeLimits | None = None,
    model_name: str | None = None,
) -> FastAPI:
    """The FastAPI app that serves ``engine`` (a ``VllmEngine``, or any asyncpp engine).

    :param registry: the blocks clients may name (default: none; invokes then only generate).
    :param tokens: the bearer tokens (:func:`asyncpp.serve.auth.load_tokens`); ``None``: no
        authentication at all (every client is the untrusted ``anonymous``). The app does not decide
        where it may listen: ``asyncpp serve`` refuses a non-loopback host without tokens.
    :param allow_code: accept shipped block code from trusted tokens (code execution on the server).
    :param limits: :class:`ServeLimits` (default ones if ``None``).
    :param model_name: the ``"model"`` of answers (default: from the engine's options).

    The app does not own the engine: closing it is the caller's job (``asyncpp serve`` closes it on
    shutdown).
    """
    import anyio
    from fastapi import FastAPI
    from fastapi.responses import JSONResponse, Response
    from starlette.exceptions import HTTPException as StarletteHTTPException

    import asyncpp

    registry = registry if registry is not None else Registry()
    limits = limits or ServeLimits()
    name = model_name or _model_name(engine)
    in_flight: dict[str, int] = {}
    counts = {"requests": 0, "aborted": 0}
    app = FastAPI(title="asyncpp", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.asyncpp = {"engine": engine, "registry": registry, "limits": limits, "model": name}

    def refuse(status: int, kind: str, message: str, headers: dict[str, str] | None = None) -> Response:
        return JSONResponse({"error": _error(kind, message)}, status_code=status, headers=headers)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> Response:
        kind = {404: "NotFound", 405: "MethodNotAllowed"}.get(exc.status_code, "HTTPError")
        return refuse(exc.status_code, kind, str(exc.detail), getattr(exc, "headers", None))

    def dead() -> bool:
        return bool(getattr(engine, "dead", False))

    # plain Starlette routes (no FastAPI parameter analysis: the handlers read the request themselves)
    async def health(request: Request) -> Response:
        if dead():
            return JSONResponse({"status": "dead"}, status_code=503)
        return JSONResponse({"status": "ok"})

    async def blocks(request: Request) -> Response:
        try:
            authenticate(tokens, request)
        except Refusal as r:
            return refuse(r.status, r.kind, r.message, r.headers)
        return JSONResponse({"blocks": registry.describe()})

    async def stats(request: Request) -> Response:
        try:
            token = authenticate(tokens, request)
            if tokens is not None and not token.trusted:
                raise Refusal(403, "PermissionError", "server statistics are for trusted tokens only")
        except Refusal as r:
            return refuse(r.status, r.kind, r.message, r.headers)
        workers: dict[str, Any] = {}
        worker_stats = getattr(engine, "worker_stats", None)
        if worker_stats is not None and not dead():  # (answered between engine steps)
            try:
                workers["workers"] = await anyio.to_thread.run_sync(worker_stats)
            except Exception as e:
                workers["workers_error"] = _error(type(e).__name__, str(e))
        return JSONResponse({"in_flight": sum(in_flight.values()), **counts, **workers})

    async def offload(fn: Callable[..., Any], *args: Any, big: bool) -> Any:
        return await anyio.to_thread.run_sync(lambda: fn(*args)) if big else fn(*args)

    def bind_invokes(req: _Request, token: Token) -> list[_Invoke]:
        out = []
        for i, inv in enumerate(req.invokes):
            if inv["code"] is not None:
                out.append(_Invoke(inv["prompt"], None, (), {}))  # unpacked after every check
                continue
            if inv["block"] is None:
                out.append(_Invoke(inv["prompt"], no_block))
                continue
            try:
                bound = registry.bind(inv["block"], inv["args"])
            except BlockArgumentError as e:
                kind = "UnknownBlockError" if isinstance(e, UnknownBlockError) else "BlockArgumentError"
                raise Refusal(422, kind, f"invokes[{i}]: {e}") from None
            out.append(_Invoke(inv["prompt"], bound.block, (), bound.kwargs))
        return out

    def unpack_code(req: _Request, invokes: list[_Invoke]) -> None:
        """Trusted code only (checked before): this unpickles, i.e. runs the client's code here."""
        from ..engines.vllm.packing import unpack_block

        for i, inv in enumerate(req.invokes):
            if inv["code"] is None:
                continue
            try:
                raw = base64.b64decode(inv["code"], validate=True)
            except (binascii.Error, ValueError) as e:
                raise _bad(f"invokes[{i}].code is not valid base64 ({e})") from None
            try:
                block, args, kwargs = unpack_block(raw)
            except Exception as e:
                raise Refusal(
                    422, "CodeError", f"invokes[{i}].code cannot be loaded: {type(e).__name__}: {e}"
                ) from None
            invokes[i].block, invokes[i].args, invokes[i].kwargs = block, tuple(args), dict(kwargs)

    def open_trace(req: _Request) -> Any:
        if req.generate:
            return asyncpp.generate(engine, max_new_tokens=req.max_new_tokens, **req.sampling)
        return asyncpp.trace(engine, **req.sampling)

    async def run(req: _Request, invokes: list[_Invoke]) -> list[Any]:
        ctx = open_trace(req)
        handles: list[Any] = []
        try:
            async with ctx as t:
                for i, inv in enumerate(invokes):
                    try:
                        handles.append(t.invoke(inv.prompt, inv.block, *inv.args, **inv.kwargs))
                    except Exception as e:  # the block does not fit the model (paths, signature)
                        raise Refusal(422, type(e).__name__, f"invokes[{i}]: {e}") from None
        except Refusal:
            raise
        except Exception:
            if handles and all(h.done for h in handles):
                return handles  # the first block error, re-raised at exit: each handle has its own
            raise
        return handles

    def answer(req: _Request, handles: list[Any], encode: Callable[[Any], bytes]) -> bytes:
        tok = getattr(engine, "tokenizer", None)
        items = []
        for h in handles:
            err = h.exception
            item: dict[str, Any] = {
                "result": None if err is not None else h.result,
                "error": None if err is None else _error(type(err).__name__, str(err)),
                "tokens": _token_list(h),
                "text": None,
            }
            if tok is not None:
                try:
                    item["text"] = tok.decode(item["tokens"], skip_special_tokens=True)
                except Exception:
                    pass
            items.append(item)
        try:
            return encode({"model": name, "invokes": items})
        except wire.WireError:
            for item in items:  # find the results that cannot travel; each fails its own invoke
                try:
                    encode(item["result"])
                except wire.WireError as e:
                    item["result"] = None
                    item["error"] = _error("WireError", f"the block's result cannot be sent: {e}")
            return encode({"model": name, "invokes": items})

    def failure(e: BaseException) -> tuple[int, str, str]:
        """The status, error type and message that a trace's failure answers (as without a stream)."""
        if isinstance(e, Refusal):
            return e.status, e.kind, e.message
        if isinstance(e, EngineDeadError):
            return 503, "EngineDeadError", str(e)
        if isinstance(e, asyncpp.InputError) or type(e).__name__ == "VLLMValidationError":
            return 400, type(e).__name__, str(e)
        if isinstance(e, AsyncppError) and dead():
            return 503, "EngineDeadError", str(e)
        log.error("asyncpp serve: a streamed request failed on the server", exc_info=e)
        return 500, "InternalError", "the server failed to run this request (see its log)"

    def emit_data(index: int, value: Any) -> bytes:
        try:
            return wire.encode_json({"invoke": index, "value": value})
        except wire.WireError as e:  # this value cannot travel: the stream says so, and goes on
            err = _error("WireError", f"the emitted value cannot be sent: {e}")
            return wire.encode_json({"invoke": index, "value": None, "error": err})

    class EventStream:
        """The answer of a streamed trace (``"stream": true``): server-sent events, written as the
        trace runs. Calls ``release`` once it has ended (the token's request slot)."""

        def __init__(self, req: _Request, invokes: list[_Invoke]):
            self.req, self.invokes = req, invokes
            self.release: Callable[[], None] = lambda: None

        async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
            try:
                await stream_trace(self.req, self.invokes, scope, receive, send)
            finally:
                self.release()

    async def stream_trace(
        req: _Request, invokes: list[_Invoke], scope: Any, receive: Any, send: Any
    ) -> None:
        """Run one trace, sending an ``emit`` event per value a block emits, as it is made, then
        ``done`` (the answer /v1/trace gives without a stream) or ``error``. What fails before the
        stream has begun answers as it would without one (4xx/5xx JSON)."""
        started = False
        disconnected = False
        result: tuple[str, Any] = ("cancelled", None)

        async def event(kind: bytes, data: bytes) -> None:
            nonlocal disconnected
            chunk = b"event: " + kind + b"\ndata: " + data + b"\n\n"  # (JSON has no raw newlines)
            try:
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            except OSError:  # the client has gone
                disconnected = True
                raise

        async with anyio.create_task_group() as tg:

            async def watch() -> None:
                nonlocal disconnected
                while True:
                    message = await receive()
                    if message["type"] == "http.disconnect":
                        disconnected = True
                        tg.cancel_scope.cancel()
                        return

            tg.start_soon(watch)
            handles: list[Any] = []
            try:
                async with open_trace(req) as t:
                    for i, inv in enumerate(invokes):
                        try:
                            handles.append(t.invoke(inv.prompt, inv.block, *inv.args, **inv.kwargs))
                        except Exception as e:  # the block does not fit the model (paths, signature)
                            raise Refusal(422, type(e).__name__, f"invokes[{i}]: {e}") from None
                    t.start()  # the run starts; t.events() below follows it
                    await send({
                        "type": "http.response.start", "status": 200,
                        "headers": [
                            (b"content-type", b"text/event-stream; charset=utf-8"),
                            (b"cache-control", b"no-cache"), (b"x-accel-buffering", b"no"),
                        ],
                    })  # fmt: skip
                    started = True
                    texts = [_TextDelta(getattr(engine, "tokenizer", None)) for _ in handles]
                    async for ev in t.events():
                        i = ev.invoke.index
                        if ev.kind == "emit":
                            await event(b"emit", emit_data(i, ev.value))
                        else:
                            data = {"invoke": i, "tokens": ev.value, "text": texts[i].add(ev.value)}
                            await event(b"tokens", wire.encode_json(data))
                result = ("ok", handles)
            except Exception as e:
                if disconnected:
                    result = ("cancelled", None)
                elif started and not isinstance(e, Refusal) and handles and all(h.done for h in handles):
                    result = ("ok", handles)  # the first block error, re-raised at exit
                else:
                    result = ("error", e)
            tg.cancel_scope.cancel()
        status, value = result
        if disconnected and status == "cancelled":
            counts["aborted"] += 1
            log.info("asyncpp serve: the client of a streamed trace disconnected; its requests were aborted")
            return
        if status == "ok":
            await event(b"done", await offload(answer, req, value, wire.encode_json, big=True))
        else:
            if status == "error":
                code, kind, message = failure(value)
            else:  # cancelled without a disconnect: the server is shutting down
                code, kind = 503, "Cancelled"
                message = "the server cancelled this request (it is shutting down)"
            if not started:
                await refuse(code, kind, message)(scope, receive, send)
                return
            await event(b"error", wire.encode_json({"type": kind, "message": message, "status": code}))
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    async def trace(request: Request) -> Response:
        try:
            token = authenticate(tokens, request)
            take_slot(in_flight, token, limits.max_concurrent)
        except Refusal as r:
            return refuse(r.status, r.kind, r.message, r.headers)
        counts["requests"] += 1
        held = True  # the token's slot, released here, or by a streamed answer once it has ended
        try:
            response = await handle(request, token)
            if isinstance(response, EventStream):
                held = False

                def release(name: str = token.name) -> None:
                    in_flight[name] -= 1

                response.release = release
            return response
        except Refusal as r:
            return refuse(r.status, r.kind, r.message, r.headers)
        except EngineDeadError as e:
            return refuse(503, "EngineDeadError", str(e))
        except Exception:
            log.exception("asyncpp serve: a request failed on the server")
            return refuse(500, "InternalError", "the server failed to run this request (see its log)")
        finally:
            if held:
                in_flight[token.name] -= 1

    async def handle(request: Request, token: Token) -> Response:
        content_type = request.headers.get("content-type")
        kind = (content_type or "").split(";", 1)[0].strip().lower()
        binary = kind == wire.CONTENT_TYPE
        body = await read_body(request, limits.max_body_bytes)
        big = len(body) > _OFFLOAD_BYTES
        try:
            payload = await offload(wire.decode_body, body, content_type, limits.wire, big=big)
        except wire.WireLimitError as e:
            raise Refusal(413, "WireLimitError", str(e)) from None
        except wire.WireError as e:
            raise Refusal(400, "WireError", str(e)) from None
        del body
        if _scan_code(payload):
            if not allow_code:
                raise Refusal(
                    403, "PermissionError",
                    "this server does not run shipped code (start it with --allow-code, and use a "
                    "trusted token); name a registered block instead (GET /v1/blocks)",
                )  # fmt: skip
            if not token.trusted:
                raise Refusal(403, "PermissionError", "this token may not ship code (it is not trusted)")
        req = _check_request(payload, token, limits)
        invokes = bind_invokes(req, token)
        if dead():
            raise EngineDeadError("the server's engine is dead; it cannot run traces any more")
        unpack_code(req, invokes)
        if req.stream:
            return EventStream(req, invokes)  # type: ignore[return-value]

        result: tuple[str, Any] = ("cancelled", None)
        disconnected = False
        async with anyio.create_task_group() as tg:

            async def watch() -> None:
                nonlocal disconnected
                while True:
                    message = await request.receive()
                    if message["type"] == "http.disconnect":
                        disconnected = True
                        tg.cancel_scope.cancel()
                        return

            tg.start_soon(watch)
            try:
                result = ("ok", await run(req, invokes))
            except Exception as e:
                result = ("error", e)
            tg.cancel_scope.cancel()
        if disconnected and result[0] == "cancelled":
            counts["aborted"] += 1
            log.info("asyncpp serve: the client of a trace disconnected; its requests were aborted")
            return Response(status_code=499)
        status, value = result
        if status == "error":
            if isinstance(value, Refusal | EngineDeadError):
                raise value
            if isinstance(value, asyncpp.InputError) or type(value).__name__ == "VLLMValidationError":
                raise Refusal(400, type(value).__name__, str(value))
            if isinstance(value, AsyncppError) and getattr(engine, "dead", False):
                raise EngineDeadError(str(value))
            raise value
        if status != "ok":  # cancelled without a disconnect: the server is shutting down
            raise Refusal(503, "Cancelled", "the server cancelled this request (it is shutting down)")
        encode = wire.encode if binary else wire.encode_json
        data = await offload(answer, req, value, encode, big=big)
        media = wire.CONTENT_TYPE if binary else wire.JSON_CONTENT_TYPE
        return Response(content=data, media_type=media)

    app.add_route("/health", health, methods=["GET"])
    app.add_route("/v1/blocks", blocks, methods=["GET"])
    app.add_route("/v1/stats", stats, methods=["GET"])
    app.add_route("/v1/trace", trace, methods=["POST"])
    add_openai_routes(app, engine, registry, tokens, limits, name, in_flight=in_flight, counts=counts)
    return app


class _TextDelta:
    """The text a request's newest tokens add (decoding all of its tokens so far: a token may
    complete a character an earlier one began, so trailing undecodable bytes wait for the next)."""

    def __init__(self, tokenizer: Any):
        self.tokenizer, self.ids, self.text = tokenizer, [], ""

    def add(self, ids: list[int]) -> str | None:
        if self.tokenizer is None:
            return None
        self.ids.extend(ids)
        try:
            now = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        except Exception:
            return None
        stable = now.rstrip("\ufffd")  # (trailing: a character still being spelled, perhaps)
        if not stable.startswith(self.text):
            return ""
        delta, self.text = stable[len(self.text) :], stable
        return delta


def _model_name(engine: Any) -> str:
    options = getattr(engine, "options", None)
    model = options.get("model") if isinstance(options, dict) else None
    if model is None:
        return type(engine).__name__
    try:
        from ..models import tiny_model_dir

        if str(model) == str(tiny_model_dir()):
            return "asyncpp-tiny-llama"
    except Exception:
        pass
    return str(model)
