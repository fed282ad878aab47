"""OpenAI-compatible generation on an asyncpp server, served by vLLM's own OpenAI serving classes.

Routes (added to :func:`asyncpp.serve.app.create_app`'s app by :func:`add_openai_routes`):

- ``GET /v1/models``: vLLM's ``OpenAIServingModels`` (one model, the server's model name);
- ``POST /v1/completions``, ``POST /v1/chat/completions``: vLLM's ``OpenAIServingCompletion`` and
  ``OpenAIServingChat``, streaming (SSE) or not, answering the ``openai`` client unchanged.

**How vLLM's classes reach the engine.** A ``VllmEngine`` owns its ``AsyncLLM`` on a private
event loop in a thread of its own; the app runs on uvicorn's loop. vLLM's serving classes are built
over :class:`EngineClient`, an adapter that forwards plain attributes (``model_config``,
``renderer``, ``errored``, ...) to the ``AsyncLLM``, runs each of its coroutine methods on the
engine's loop (``asyncio.run_coroutine_threadsafe``), and turns ``generate`` into a task on the
engine's loop whose outputs are handed back to the caller's loop through a queue. Closing or
cancelling the caller's generator (a client that disconnects) cancels that task, which makes vLLM
abort the request. Tokenization and detokenization run on uvicorn's loop (vLLM's renderer runs them
in its own thread pool).

**Interventions.** A request body may carry ``"asyncpp": {"block": NAME, "args": {...}}`` (the
``openai`` client sends it with ``extra_body``; the arguments are wire-JSON values, tensors as
``{"__tensor__": {...}}``). The block is bound with the server's registry (422 for an unknown block
or bad arguments) and attached to the request's ``SamplingParams.extra_args`` as ``VllmEngine``
attaches it; when the request ends its outcome comes from the workers with the request's end and
the answer carries ``"asyncpp": {"block", "result", "error", "emitted"}`` (``result`` and each
value the block emitted in the JSON wire encoding's object form; ``error`` null or ``{type,
message}``). A streamed answer sends it as one last chunk (with no choices) before ``[DONE]``, and
the values the block emits as they come: before each token chunk, a chunk with no choices and
``"asyncpp": {"emitted": [values emitted since the previous chunk]}``.
Shipped code is never accepted here, and extra_args keys asyncpp uses are removed from every
request's ``vllm_xargs``, so a client can never attach anything but a registered block.

Errors use OpenAI's shape, ``{"error": {"message", "type", "param", "code"}}``: 401 bad token, 429
too many requests in flight for the token (counted together with ``/v1/trace``), 413 body too
large, 400 malformed body or ``max_tokens`` over the token's ``max_new_tokens`` (a request without
``max_tokens`` gets that limit), 403 shipped code, 422 block or arguments, 503 dead engine.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import inspect
import json
import logging
import uuid
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from . import wire
from .auth import Token, Tokens
from .registry import BlockArgumentError, Registry, UnknownBlockError, json_kind
from .requests import Refusal, authenticate, read_body, take_slot

if TYPE_CHECKING:  # pragma: no cover
    from fastapi import FastAPI, Request

__all__ = ["CHAT_TEMPLATE", "EngineClient", "add_openai_routes"]

log = logging.getLogger("asyncpp.serve")

FIELD = "asyncpp"  # the request's and the answer's extra field
_ATTACH_KEYS = {"block", "args"}

# for tokenizers without a chat template of their own (the embedded tiny model's)
CHAT_TEMPLATE = (
    "{% for message in messages %}{{ message['role'] }}: {{ message['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)


@dataclass
class _Attach:
    """A registered block bound to one request, and its outcome once the request has ended."""

    name: str
    payload: bytes
    aid: str
    num: int
    claimed: bool = False
    done: bool = False
    result: Any = None
    error: BaseException | None = None
    emitted: list = field(default_factory=list)
    live: list = field(default_factory=list)  # emitted values not yet sent (streamed answers)


_ATTACH: contextvars.ContextVar[_Attach | None] = contextvars.ContextVar("asyncpp_attach", default=None)


class EngineClient:
    """vLLM's ``EngineClient`` for the serving classes, over a ``VllmEngine``'s ``AsyncLLM``, which
    lives on the engine's own event loop: coroutine methods and ``generate`` run there."""

    def __init__(self, engine: Any):
        self._engine = engine
        self._llm = engine.async_llm
        self._loop = engine.loop

    def __getattr__(self, name: str) -> Any:
        value = getattr(self._llm, name)
        if inspect.iscoroutinefunction(value):
            loop = self._loop

            async def hop(*args: Any, **kwargs: Any) -> Any:
                fut = asyncio.run_coroutine_threadsafe(value(*args, **kwargs), loop)
                return await asyncio.wrap_future(fut)

            return hop
        return value

    def generate(self, prompt: Any, sampling_params: Any, request_id: str, **kwargs: Any) -> Any:
        """``AsyncLLM.generate`` on the engine's loop, its outputs streamed to the caller's loop. The
        request's registered block (if its route attached one) rides in ``extra_args``."""
        from ..engines.vllm.keys import EXTRA_KEY, ID_KEY, LIVE_KEY, NUM_KEY, OURS

        extra = {
            k: v for k, v in (getattr(sampling_params, "extra_args", None) or {}).items() if k not in OURS
        }  # a client's vllm_xargs never carry asyncpp's keys
        attach = _ATTACH.get()
        if attach is not None:
            if attach.claimed:  # one request per attached block (checked before: n == 1, one prompt)
                raise RuntimeError("asyncpp: a block attached to one request was given to a second one")
            attach.claimed = True
            extra.update({EXTRA_KEY: attach.payload, ID_KEY: attach.aid, NUM_KEY: attach.num, LIVE_KEY: True})
        sampling_params.extra_args = extra or None
        return self._stream(prompt, sampling_params, request_id, kwargs, attach)

    async def _stream(self, prompt: Any, sp: Any, rid: str, kwargs: dict, attach: _Attach | None) -> Any:
        caller = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()

        def push(item: tuple[str, Any]) -> None:
            with contextlib.suppress(RuntimeError):  # the caller's loop has closed
                caller.call_soon_threadsafe(queue.put_nowait, item)

        fut = asyncio.run_coroutine_threadsafe(self._drive(prompt, sp, rid, kwargs, attach, push), self._loop)
        try:
            while True:
                kind, value = await queue.get()
                if kind == "out":
                    yield value
                elif kind == "emit":
                    attach.live.append(value)  # (the streamed answer sends it before the next chunk)
                elif kind == "error":
                    raise value
                else:
                    return
        finally:
            fut.cancel()  # (a no-op once it has ended) the caller went: vLLM aborts the request

    async def _drive(
        self, prompt: Any, sp: Any, rid: str, kwargs: dict, attach: _Attach | None, push: Any
    ) -> None:
        """On the engine's loop: run the request; then take its block's outcome from its end on
        the stream channel (a request that did not run to its end is collected from the workers
        at once, so that they drop its state)."""
        engine, llm = self._engine, self._llm
        # each value the block emits reaches the caller's loop before the step's output does
        sink = (lambda _i, value: push(("emit", value))) if attach is not None else None
        stream = engine.open_stream(attach.aid, sink) if attach is not None else None
        finished = False
        delta = getattr(sp.output_kind, "name", "") == "DELTA"
        sampled = 0
        try:
            try:
                async for out in llm.generate(prompt, sp, rid, **kwargs):
                    if attach is not None and out.outputs:
                        got = len(out.outputs[0].token_ids)
                        sampled = sampled + got if delta else got
                        await engine.caught_up(stream, sampled)  # these steps' values before their output
                    push(("out", out))
                finished = True
            finally:
                if attach is not None and not finished:
                    await engine.collect_early([attach.aid])
            if attach is not None:
                ((result, error),) = await engine.settle([stream])
                attach.result, attach.error, attach.emitted = result, error, list(stream.values)
                attach.done = True
        except BaseException as e:
            if not isinstance(e, asyncio.CancelledError):
                push(("error", e))
            raise
        finally:
            if attach is not None:
                engine.drop_stream(attach.aid)
            push(("end", None))


def _error_body(status: int, kind: str, message: str) -> dict[str, Any]:
    return {"error": {"message": message, "type": kind, "param": None, "code": status}}


def _wire_object(value: Any) -> Any:
    """``value`` in the JSON wire encoding's object form (tensors as ``{"__tensor__": ...}``)."""
    return json.loads(wire.encode_json(value))


def add_openai_routes(
    app: FastAPI,
    engine: Any,
    registry: Registry,
    tokens: Tokens | None,
    limits: Any,
    model_name: str,
    *,
    in_flight: dict[str, int] | None = None,
    counts: dict[str, int] | None = None,
) -> None:
    """Add ``/v1/models``, ``/v1/completions`` and ``/v1/chat/completions`` to ``app``.

    ``in_flight`` (token name -> requests in flight) and ``counts`` are shared with the app's other
    routes, so that a token's ``max_concurrent`` counts all of its requests. On an engine other
    than a ``VllmEngine`` the routes answer 501."""
    from fastapi.responses import JSONResponse, Response, StreamingResponse

    in_flight = in_flight if in_flight is not None else {}
    counts = counts if counts is not None else {"requests": 0, "aborted": 0}
    state: dict[str, Any] = {}

    def refuse(status: int, kind: str, message: str, headers: dict[str, str] | None = None) -> Response:
        return JSONResponse(_error_body(status, kind, message), status_code=status, headers=headers)

    def serving() -> dict[str, Any]:
        """vLLM's serving objects, made at the first request (they need the engine's AsyncLLM)."""
        if state:
            return state
        if getattr(engine, "async_llm", None) is None or getattr(engine, "loop", None) is None:
            raise Refusal(501, "NotImplemented", "OpenAI-compatible routes need a VllmEngine")
        from vllm.entrypoints.openai.chat_completion.serving import OpenAIServingChat
        from vllm.entrypoints.openai.completion.serving import OpenAIServingCompletion
        from vllm.entrypoints.openai.models.protocol import BaseModelPath
        from vllm.entrypoints.openai.models.serving import OpenAIServingModels
        from vllm.renderers.online_renderer import OnlineRenderer

        client = EngineClient(engine)
        template = None
        tok = getattr(engine, "tokenizer", None)
        if tok is None or not getattr(tok, "chat_template", None):
            template = CHAT_TEMPLATE
        models = OpenAIServingModels(
            engine_client=client,
            base_model_paths=[BaseModelPath(name=model_name, model_path=str(engine.options["model"]))],
        )
        renderer = OnlineRenderer(
            model_config=client.model_config,
            renderer=client.renderer,
            request_logger=None,
            chat_template=template,
            chat_template_content_format="string",
        )
        state["models"] = models
        state["completion"] = OpenAIServingCompletion(
            client, models, online_renderer=renderer, request_logger=None
        )
        state["chat"] = OpenAIServingChat(
            client,
            models,
            "assistant",
            online_renderer=renderer,
            request_logger=None,
            chat_template=template,
            chat_template_content_format="string",
        )
        return state

    def check(body: Any, token: Token, chat: bool) -> tuple[Any, _Attach | None]:
        """The request's protocol model (vLLM's), its max_tokens capped, and its bound block."""
        if type(body) is not dict:
            raise Refusal(400, "BadRequestError", f"the request must be a JSON object, got {json_kind(body)}")
        spec = body.pop(FIELD, None)
        cap = token.max_new_tokens or limits.max_new_tokens
        keys = ("max_completion_tokens", "max_tokens") if chat else ("max_tokens",)
        given = [body[k] for k in keys if body.get(k) is not None]
        for n in given:
            if type(n) is not int or n < 1:
                raise Refusal(400, "BadRequestError", f"max_tokens must be an int >= 1, got {n!r}")
            if n > cap:
                raise Refusal(
                    400, "BadRequestError", f"max_tokens is {n}, more than this token's limit of {cap}"
                )
        if not given:
            body[keys[0]] = cap
        if spec is not None:
            if type(spec) is not dict:
                raise Refusal(400, "BadRequestError", f"'{FIELD}' must be an object, got {json_kind(spec)}")
            if "code" in spec:
                raise Refusal(
                    403, "PermissionError",
                    f"the OpenAI routes never run shipped code; name a registered block in '{FIELD}.block'",
                )  # fmt: skip
            unknown = sorted(set(spec) - _ATTACH_KEYS)
            if unknown:
                raise Refusal(
                    400, "BadRequestError", f"'{FIELD}' has unknown keys {unknown} (allowed: args, block)"
                )
            if type(spec.get("block")) is not str:
                raise Refusal(400, "BadRequestError", f"'{FIELD}.block' must be a block name (a string)")
            if type(spec.get("args", {})) is not dict:
                raise Refusal(400, "BadRequestError", f"'{FIELD}.args' must be an object")
            if body.get("n", 1) not in (1, None) or body.get("use_beam_search"):
                raise Refusal(
                    400,
                    "BadRequestError",
                    "a request with a block samples one sequence (n=1, no beam search)",
                )
            prompt = body.get("prompt")
            if not chat and type(prompt) is list and prompt and type(prompt[0]) is not int:
                if len(prompt) != 1:
                    raise Refusal(400, "BadRequestError", "a request with a block has one prompt")
        try:
            if chat:
                from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest as Model
            else:
                from vllm.entrypoints.openai.completion.protocol import CompletionRequest as Model
            req = Model.model_validate(body)
        except Exception as e:  # pydantic's ValidationError, or vLLM's own checks
            raise Refusal(400, "BadRequestError", str(e)) from None
        attach = None
        if spec is not None:
            try:
                args = wire.decode_json(json.dumps(spec.get("args", {})), limits.wire)
            except wire.WireLimitError as e:
                raise Refusal(413, "WireLimitError", f"{FIELD}.args: {e}") from None
            except (wire.WireError, ValueError) as e:
                raise Refusal(400, "WireError", f"{FIELD}.args: {e}") from None
            try:
                bound = registry.bind(spec["block"], args)
            except BlockArgumentError as e:
                kind = "UnknownBlockError" if isinstance(e, UnknownBlockError) else "BlockArgumentError"
                raise Refusal(422, kind, str(e)) from None
            from ..engines.vllm.packing import pack_block

            num = engine.new_request_number()
            attach = _Attach(
                name=spec["block"],
                payload=pack_block(bound.block, (), bound.kwargs),
                aid=f"asyncpp-oai-{num}-{uuid.uuid4().hex[:8]}",
                num=num,
            )
        return req, attach

    def outcome(attach: _Attach) -> dict[str, Any]:
        out: dict[str, Any] = {"block": attach.name, "result": None, "error": None, "emitted": []}
        if not attach.done:
            out["error"] = {"type": "RuntimeError", "message": "the block's outcome was not collected"}
            return out
        if attach.error is not None:
            out["error"] = {"type": type(attach.error).__name__, "message": str(attach.error)}
            return out
        try:
            out["result"] = _wire_object(attach.result)
            out["emitted"] = _wire_object(attach.emitted)
        except wire.WireError as e:
            out["result"], out["emitted"] = None, []
            out["error"] = {"type": "WireError", "message": f"the block's result cannot be sent: {e}"}
        return out

    async def generation(request: Request, chat: bool) -> Response:
        try:
            token = authenticate(tokens, request)
            take_slot(in_flight, token, limits.max_concurrent)
        except Refusal as r:
            return refuse(r.status, r.kind, r.message, r.headers)
        counts["requests"] = counts.get("requests", 0) + 1
        streaming = False
        try:
            response = await handle(request, token, chat)
            streaming = isinstance(response, StreamingResponse)
            return response
        except Refusal as r:
            return refuse(r.status, r.kind, r.message, r.headers)
        except Exception:
            log.exception("asyncpp serve: an OpenAI request failed on the server")
            return refuse(500, "InternalError", "the server failed to run this request (see its log)")
        finally:
            if not streaming:
                in_flight[token.name] -= 1

    async def handle(request: Request, token: Token, chat: bool) -> Response:
        serve = serving()
        raw = await read_body(request, limits.max_body_bytes, "BadRequestError")
        try:
            body = json.loads(raw)
        except ValueError as e:
            raise Refusal(400, "BadRequestError", f"the body is not valid JSON ({e})") from None
        req, attach = check(body, token, chat)
        if getattr(engine, "dead", False):
            raise Refusal(503, "EngineDeadError", "the server's engine is dead")
        handler = serve["chat"].create_chat_completion if chat else serve["completion"].create_completion
        _ATTACH.set(attach)  # (read when the handler calls EngineClient.generate, in this context)
        task = asyncio.ensure_future(handler(req, request))
        watch = asyncio.ensure_future(_disconnected(request))
        try:
            await asyncio.wait((task, watch), return_when=asyncio.FIRST_COMPLETED)
        finally:
            if not task.done():
                task.cancel()  # the client went (or the server stops): vLLM aborts the request
                with contextlib.suppress(BaseException):
                    await task
            if not watch.done():
                watch.cancel()
        if watch.done() and not watch.cancelled() or task.cancelled():
            counts["aborted"] = counts.get("aborted", 0) + 1
            return Response(status_code=499)
        result = task.result()
        from vllm.entrypoints.serve.engine.protocol import ErrorResponse

        if isinstance(result, ErrorResponse):
            return JSONResponse(result.model_dump(), status_code=result.error.code)
        if not req.stream:
            data = result.model_dump()
            if attach is not None:
                data[FIELD] = outcome(attach)
            return JSONResponse(data)
        return _SSE(sse(result, attach, chat, req), token.name)

    async def sse(gen: Any, attach: _Attach | None, chat: bool, req: Any) -> Any:
        def extra(field_value: dict[str, Any]) -> str:
            chunk = {
                "id": f"asyncpp-{attach.aid}",
                "object": "chat.completion.chunk" if chat else "text_completion",
                "created": 0,
                "model": req.model or model_name,
                "choices": [],
                FIELD: field_value,
            }
            return f"data: {json.dumps(chunk)}\n\n"

        try:
            async for chunk in gen:
                if attach is not None and attach.live:  # values emitted since the last chunk
                    values, attach.live = attach.live, []
                    try:
                        yield extra({"emitted": _wire_object(values)})
                    except wire.WireError as e:
                        err = {"type": "WireError", "message": f"an emitted value cannot be sent: {e}"}
                        yield extra({"emitted": [], "error": err})
                if attach is not None and chunk.startswith("data: [DONE]"):
                    yield extra(outcome(attach))
                yield chunk
        finally:
            with contextlib.suppress(BaseException):
                await gen.aclose()  # closes vLLM's generators: an unfinished request is aborted

    class _SSE(StreamingResponse):
        def __init__(self, content: Any, who: str):
            super().__init__(content=content, media_type="text/event-stream")
            self._gen, self._who = content, who

        async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
            try:
                await super().__call__(scope, receive, send)
            finally:
                in_flight[self._who] -= 1
                with contextlib.suppress(BaseException):
                    await self._gen.aclose()

    async def completions(request: Request) -> Response:
        return await generation(request, chat=False)

    async def chat_completions(request: Request) -> Response:
        return await generation(request, chat=True)

    async def models(request: Request) -> Response:
        try:
            authenticate(tokens, request)
            serve = serving()
        except Refusal as r:
            return refuse(r.status, r.kind, r.message, r.headers)
        listed = await serve["models"].show_available_models()
        return JSONResponse(listed.model_dump())

    app.add_route("/v1/models", models, methods=["GET"])
    app.add_route("/v1/completions", completions, methods=["POST"])
    app.add_route("/v1/chat/completions", chat_completions, methods=["POST"])


async def _disconnected(request: Any) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return
