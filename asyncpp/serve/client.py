"""The client side of ``asyncpp serve``: an engine whose runs happen on a server, over HTTP.

``async with asyncpp.trace(remote) as t: h = t.invoke(prompt, "steer", layer=2, vec=v)`` names a
block the server's operator registered and passes data; the trace is one ``POST /v1/trace``
whose body and answer are in the data-only wire format (tensors as safetensors, the rest JSON).
Nothing the server sends is unpickled: a block's error comes back as its type name and message,
and is raised as that asyncpp or builtin exception class when it is one of those, else as
:class:`RemoteBlockError`.

Streams (``async for v in h.stream()``) are one ``POST /v1/trace`` with ``"stream": true``, whose
answer is server-sent events (one per value a block emits, then the trace's answer); a small thread
with its own event loop reads them, so they reach callers on asyncio, uvloop and trio alike.
"""

from __future__ import annotations

import asyncio
import base64
import builtins
import contextlib
import threading
import warnings
from collections.abc import Callable
from typing import Any

import torch

from ..engines.base import Engine, InvokeOutcome, RunOutcome, RunSpec, no_block
from ..kernel import errors as kernel_errors
from ..kernel.errors import AsyncppError
from . import wire

_SAMPLING = ("temperature", "top_p", "top_k", "seed", "ignore_eos", "min_tokens", "stop_token_ids")


class RemoteError(AsyncppError):
    """The server refused a request (``status`` is the HTTP status, ``type`` the server's error
    type)."""

    def __init__(self, status: int, type_name: str, message: str):
        super().__init__(f"the server answered {status} ({type_name}): {message}")
        self.status, self.type, self.message = status, type_name, message


class RemoteBlockError(AsyncppError):
    """A block failed on the server with an error that is not an asyncpp or builtin exception."""


def _error_class(name: str) -> type[BaseException] | None:
    """The exception class a remote error's type name stands for, among asyncpp's own errors and
    Python's builtin exceptions only (nothing else is looked up or imported)."""
    import asyncpp

    for space in (asyncpp, kernel_errors, builtins):
        cls = getattr(space, name, None)
        if isinstance(cls, type) and issubclass(cls, Exception):
            return cls
    return None


def remote_exception(info: dict) -> BaseException:
    """A block's error as sent by the server, as an exception to raise here."""
    name, message = str(info.get("type", "Error")), str(info.get("message", ""))
    cls = _error_class(name)
    try:
        err = cls(message) if cls is not None else RemoteBlockError(f"{name}: {message}")
    except Exception:  # a class whose constructor wants more than a message
        err = RemoteBlockError(f"{name}: {message}")
    err.add_note("(raised by the block on the asyncpp server)")
    return err


class RemoteEngine(Engine):
    """An asyncpp server (``asyncpp serve``) as an engine: traces run there, over HTTP.

    :param url: the server's base URL, e.g. ``http://127.0.0.1:8000`` (or where its app is mounted).
    :param token: the bearer token the server gave you (default: none, for a server without auth).
    :param timeout: seconds to wait for one trace.
    :param binary: send and receive the binary wire format (tensors as safetensors); ``False``
        uses JSON with base64 tensors.
    """

    named_blocks = True  # t.invoke(prompt, "block name", **args)
    tree = None  # blocks run on the server; the client holds no location tree
    supports_streaming = True  # blocks' asyncpp.emit() values arrive live, as server-sent events
    streams_tokens = True  # and so do the tokens each request samples

    def __init__(self, url: str, token: str | None = None, *, timeout: float = 300.0, binary: bool = True):
        self.url = url.rstrip("/")
        self.token = token
        self.timeout = timeout
        self.binary = binary
        self._blocks: dict[str, list[str]] | None = None  # block name -> parameter names

    # --- the request ------------------------------------------------------------------------

    def _headers(self) -> dict[str, str]:
        h = {"Content-Type": wire.CONTENT_TYPE if self.binary else wire.JSON_CONTENT_TYPE}
        h["Accept"] = h["Content-Type"]
        if self.token:
            h["Authorization"] = f"Bearer {self.token}"
        return h

    def check_options(self, spec: RunSpec) -> None:
        """A remote trace takes the sampling options the server accepts (its values are checked
        there)."""
        unknown = sorted(set(spec.model_kwargs) - set(_SAMPLING))
        if unknown:
            raise ValueError(
                f"a remote trace takes the sampling options {', '.join(_SAMPLING)}; not {unknown}"
            )

    def _body(self, spec: RunSpec, params: dict[str, list[str]], *, stream: bool = False) -> bytes:
        sampling = dict(spec.model_kwargs)  # (checked when the trace was made: check_options)
        invokes = []
        for inv in spec.invokes:
            entry: dict[str, Any] = {"prompt": _prompt(inv.input)}
            if isinstance(inv.block, str):
                entry["block"] = inv.block
                entry["args"] = _arguments(inv.block, inv.args, inv.kwargs, params)
            elif inv.block is no_block:
                entry["block"] = None  # the server runs the prompt with no block
            else:  # the client's own code: only a server that trusts this token runs it
                from ..engines.vllm.packing import pack_block

                entry["block"] = None
                entry["code"] = base64.b64encode(pack_block(inv.block, inv.args, inv.kwargs)).decode()
            invokes.append(entry)
        request: dict[str, Any] = {"generate": spec.generate, "sampling": sampling, "invokes": invokes}
        if spec.generate:
            request["max_new_tokens"] = spec.max_new_tokens
        if stream:
            request["stream"] = True
        return wire.encode(request) if self.binary else wire.encode_json(request)

    def _outcome(self, spec: RunSpec, status: int, content_type: str, body: bytes) -> RunOutcome:
        try:
            answer = wire.decode_body(body, content_type or wire.JSON_CONTENT_TYPE)
        except wire.WireError as err:
            raise RemoteError(status, "WireError", f"the server's answer could not be read: {err}") from None
        if status != 200:
            info = answer.get("error", {}) if isinstance(answer, dict) else {}
            raise _status_error(status, str(info.get("type", "Error")), str(info.get("message", answer)))
        return self._from_answer(spec, status, answer)

    def _from_answer(self, spec: RunSpec, status: int, answer: Any) -> RunOutcome:
        if type(answer) is not dict or type(answer.get("invokes")) is not list:
            raise RemoteError(status, "WireError", "the server's answer has no 'invokes' list")
        if len(answer["invokes"]) != len(spec.invokes):
            raise RemoteError(status, "WireError", "the server's answer has another number of invokes")
        outcome = RunOutcome([InvokeOutcome() for _ in spec.invokes])
        for o, got in zip(outcome.invokes, answer["invokes"]):
            o.result = got.get("result")
            if got.get("error") is not None:
                o.error = remote_exception(got["error"])
            tokens = got.get("tokens")
            if tokens is not None:
                o.tokens = torch.tensor([tokens], dtype=torch.long)
            o.output = got.get("text")
        return outcome

    # --- the engine contract -------------------------------------------------------------------

    def run(self, spec: RunSpec) -> RunOutcome:
        import httpx

        with httpx.Client(timeout=self.timeout) as client:
            params = self._parameters_sync(client, spec)
            r = client.post(f"{self.url}/v1/trace", content=self._body(spec, params), headers=self._headers())
            return self._outcome(spec, r.status_code, r.headers.get("content-type", ""), r.content)

    async def run_async(self, spec: RunSpec) -> RunOutcome:
        import httpx

        async with httpx.AsyncClient(timeout=self.timeout) as client:
            params = await self._parameters_async(client, spec)
            body = self._body(spec, params)
            r = await client.post(f"{self.url}/v1/trace", content=body, headers=self._headers())
            return self._outcome(spec, r.status_code, r.headers.get("content-type", ""), r.content)

    def submit(
        self, spec: RunSpec, post: Callable[..., Any], settle: Callable[[bool, Any], None]
    ) -> Callable[[], Any]:
        """Stream one trace (``"stream": true``): a thread of its own runs the request on its own
        event loop, calls ``spec.sink(invoke, value)`` for every ``emit`` event as it arrives (and
        ``spec.token_sink(invoke, ids)`` for every ``tokens`` event), and
        at the end ``post(settle, ok, outcome or error)``. Returns a function that abandons the run
        (it closes the connection: the server then aborts the trace)."""
        loop = asyncio.new_event_loop()
        task: list[asyncio.Task] = []
        abandoned = threading.Event()

        def work() -> None:
            asyncio.set_event_loop(loop)
            try:
                task.append(loop.create_task(self._stream(spec)))
                if abandoned.is_set():
                    task[0].cancel()
                try:
                    ok, value = True, loop.run_until_complete(task[0])
                except BaseException as e:  # (CancelledError too: the caller gave the run up)
                    ok, value = False, e
            finally:
                try:
                    loop.run_until_complete(loop.shutdown_asyncgens())
                finally:
                    loop.close()
            try:
                post(settle, ok, value)
            except RuntimeError:  # the caller's loop has closed: nobody is listening
                pass

        def abandon() -> None:
            abandoned.set()
            try:
                loop.call_soon_threadsafe(lambda: task[0].cancel() if task else None)
            except RuntimeError:  # the run has ended (its loop is closed)
                pass

        threading.Thread(target=work, name="asyncpp-remote-stream", daemon=True).start()
        return abandon

    async def _stream(self, spec: RunSpec) -> RunOutcome:
        import httpx

        sink = spec.sink
        emitted: list[list[Any]] = [[] for _ in spec.invokes]
        async with httpx.AsyncClient(timeout=self.timeout) as client:
            params = await self._parameters_async(client, spec)
            body = self._body(spec, params, stream=True)
            headers = {**self._headers(), "Accept": "text/event-stream"}
            async with client.stream("POST", f"{self.url}/v1/trace", content=body, headers=headers) as r:
                content_type = r.headers.get("content-type", "")
                if r.status_code != 200 or not content_type.startswith("text/event-stream"):
                    raw = await r.aread()
                    outcome = self._outcome(spec, r.status_code, content_type, raw)
                    if r.status_code == 200:
                        raise RemoteError(200, "WireError", "the server did not stream this trace")
                    return outcome  # (not reached: a refusal raises)
                events = _events(r.aiter_lines())
                async with contextlib.aclosing(events):
                    async for kind, data in events:
                        if kind == "emit":
                            item = _decode(data)
                            i = item.get("invoke") if type(item) is dict else None
                            if type(i) is not int or not 0 <= i < len(spec.invokes):
                                raise RemoteError(
                                    200, "WireError", "an emit event names no invoke of this trace"
                                )
                            if item.get("error") is not None:
                                warnings.warn(
                                    f"asyncpp: a value emitted by invoke #{i} was lost on the server: "
                                    f"{item['error'].get('message')}",
                                    RuntimeWarning,
                                    stacklevel=1,
                                )
                                continue
                            emitted[i].append(item.get("value"))
                            if sink is not None:
                                sink(i, item.get("value"))
                        elif kind == "tokens":
                            item = _decode(data)
                            i = item.get("invoke") if type(item) is dict else None
                            ids = item.get("tokens") if type(item) is dict else None
                            if (
                                type(i) is not int
                                or not 0 <= i < len(spec.invokes)
                                or type(ids) is not list
                                or any(type(x) is not int for x in ids)
                            ):
                                raise RemoteError(
                                    200, "WireError", "a tokens event from the server is malformed"
                                )
                            if spec.token_sink is not None:
                                spec.token_sink(i, ids)
                        elif kind == "done":
                            outcome = self._from_answer(spec, 200, _decode(data))
                            for o, values in zip(outcome.invokes, emitted):
                                o.emitted = values
                            return outcome
                        elif kind == "error":
                            info = _decode(data)
                            info = info if type(info) is dict else {}
                            code = info.get("status")
                            raise _status_error(
                                code if type(code) is int else 500,
                                str(info.get("type", "Error")),
                                str(info.get("message", "")),
                            )
                        # other events (from a newer server) are not for this client
        raise RemoteError(200, "WireError", "the server's event stream ended before the trace's answer")

    def close(self) -> None:
        """Nothing to release: each trace opens and closes its own connection."""

    # --- registered blocks ----------------------------------------------------------------------

    def blocks(self) -> list[dict]:
        """The server's registered blocks and their parameters (``GET /v1/blocks``)."""
        import httpx

        with httpx.Client(timeout=self.timeout) as client:
            return self._read_blocks(client.get(f"{self.url}/v1/blocks", headers=self._auth()))

    def _auth(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.token}"} if self.token else {}

    def _read_blocks(self, r: Any) -> list[dict]:
        if r.status_code != 200:
            info = r.json().get("error", {}) if "json" in r.headers.get("content-type", "") else {}
            raise _status_error(
                r.status_code, str(info.get("type", "Error")), str(info.get("message", r.text))
            )
        blocks = r.json()["blocks"]
        self._blocks = {b["name"]: [p["name"] for p in b["params"]] for b in blocks}
        return blocks

    def _needs_names(self, spec: RunSpec) -> bool:
        return self._blocks is None and any(isinstance(i.block, str) and i.args for i in spec.invokes)

    def _parameters_sync(self, client: Any, spec: RunSpec) -> dict[str, list[str]]:
        if self._needs_names(spec):
            self._read_blocks(client.get(f"{self.url}/v1/blocks", headers=self._auth()))
        return self._blocks or {}

    async def _parameters_async(self, client: Any, spec: RunSpec) -> dict[str, list[str]]:
        if self._needs_names(spec):
            self._read_blocks(await client.get(f"{self.url}/v1/blocks", headers=self._auth()))
        return self._blocks or {}

    def __repr__(self) -> str:
        return f"<RemoteEngine {self.url}>"


def _prompt(value: Any) -> Any:
    if isinstance(value, str):
        return value
    if isinstance(value, torch.Tensor):
        value = value.tolist()
    if isinstance(value, (list, tuple)) and all(isinstance(v, int) for v in value):
        return list(value)
    raise AsyncppError(
        f"a remote invoke takes one prompt, a string or a list of token ids; got {type(value).__name__}"
    )


def _arguments(name: str, args: tuple, kwargs: dict, params: dict[str, list[str]]) -> dict:
    """Keyword arguments for the named block (positional ones matched to its parameters)."""
    out = dict(kwargs)
    if args:
        names = params.get(name)
        if names is None:
            raise AsyncppError(
                f"the server has no block {name!r} (its blocks: {', '.join(params) or 'none'})"
            )
        if len(args) > len(names):
            raise TypeError(f"block {name!r} takes {len(names)} arguments, {len(args)} were given")
        for n, v in zip(names, args):
            if n in out:
                raise TypeError(f"block {name!r} got two values for {n!r}")
            out[n] = v
    return out


_MAX_EVENT_BYTES = wire.DEFAULT_LIMITS.max_bytes


def _decode(data: str) -> Any:
    try:
        return wire.decode_json(data)
    except wire.WireError as err:
        raise RemoteError(200, "WireError", f"an event from the server could not be read: {err}") from None


async def _events(lines: Any) -> Any:
    """``(event, data)`` for every event of a ``text/event-stream`` (comments and ``id``/``retry``
    fields skipped; an event without ``data`` dispatches nothing, as the standard says)."""
    kind, data, size = "message", [], 0
    async for line in lines:
        line = line.rstrip("\r\n")
        if not line:
            if data:
                yield kind, "\n".join(data)
            kind, data, size = "message", [], 0
            continue
        if line.startswith(":"):
            continue
        field_name, _, value = line.partition(":")
        value = value[1:] if value.startswith(" ") else value
        if field_name == "event":
            kind = value
        elif field_name == "data":
            size += len(value) + 1
            if size > _MAX_EVENT_BYTES:
                raise RemoteError(200, "WireLimitError", "an event from the server is too large")
            data.append(value)
        elif field_name not in ("id", "retry"):
            raise RemoteError(
                200, "WireError", f"the server's event stream has an unknown field {field_name!r}"
            )


def _status_error(status: int, type_name: str, message: str) -> BaseException:
    """An HTTP error answer as the exception a local engine would raise, where there is one."""
    if status == 422 and type_name in ("BlockArgumentError", "UnknownBlockError"):
        from .registry import BlockArgumentError

        return BlockArgumentError(message)
    if status == 400 and type_name == "InputError":
        from ..engines.inputs import InputError

        return InputError(message)
    if status == 503 and type_name == "EngineDeadError":
        return kernel_errors.EngineDeadError(message)
    return RemoteError(status, type_name, message)


__all__ = ["RemoteBlockError", "RemoteEngine", "RemoteError", "remote_exception"]
