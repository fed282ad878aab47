"""The client side of ``asyncpp serve``: an engine whose runs happen on a server, over HTTP.

``async with asyncpp.trace(remote) as t: h = t.invoke(prompt, "steer", layer=2, vec=v)`` names a
block the server's operator registered and passes data; the trace is one ``POST /v1/trace``
whose body and answer are in the data-only wire format (tensors as safetensors, the rest JSON).
Nothing the server sends is unpickled: a block's error comes back as its type name and message,
and is raised as that asyncpp or builtin exception class when it is one of those, else as
:class:`RemoteBlockError`.
"""

from __future__ import annotations

import base64
import builtins
from typing import Any

import torch

from ..engines.base import Engine, InvokeOutcome, RunOutcome, RunSpec
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

    def _body(self, spec: RunSpec, params: dict[str, list[str]]) -> bytes:
        sampling = dict(spec.model_kwargs)
        unknown = sorted(set(sampling) - set(_SAMPLING))
        if unknown:
            raise ValueError(
                f"a remote trace takes the sampling options {', '.join(_SAMPLING)}; not {unknown}"
            )
        invokes = []
        for inv in spec.invokes:
            entry: dict[str, Any] = {"prompt": _prompt(inv.input)}
            if isinstance(inv.block, str):
                entry["block"] = inv.block
                entry["args"] = _arguments(inv.block, inv.args, inv.kwargs, params)
            else:  # the client's own code: only a server that trusts this token runs it
                from ..engines.vllm.transport import pack_block

                entry["block"] = None
                entry["code"] = base64.b64encode(pack_block(inv.block, inv.args, inv.kwargs)).decode()
            invokes.append(entry)
        request: dict[str, Any] = {"generate": spec.generate, "sampling": sampling, "invokes": invokes}
        if spec.generate:
            request["max_new_tokens"] = spec.max_new_tokens
        return wire.encode(request) if self.binary else wire.encode_json(request)

    def _outcome(self, spec: RunSpec, status: int, content_type: str, body: bytes) -> RunOutcome:
        try:
            answer = wire.decode_body(body, content_type or wire.JSON_CONTENT_TYPE)
        except wire.WireError as err:
            raise RemoteError(status, "WireError", f"the server's answer could not be read: {err}") from None
        if status != 200:
            info = answer.get("error", {}) if isinstance(answer, dict) else {}
            raise _status_error(status, str(info.get("type", "Error")), str(info.get("message", answer)))
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


def _status_error(status: int, type_name: str, message: str) -> BaseException:
    """An HTTP error answer as the exception a local engine would raise, where there is one."""
    if status == 422 and type_name in ("BlockArgumentError", "UnknownBlockError"):
        from .registry import BlockArgumentError

        return BlockArgumentError(message)
    if status == 400 and type_name == "InputError":
        from ..engines.local.inputs import InputError

        return InputError(message)
    if status == 503 and type_name == "EngineDeadError":
        return kernel_errors.EngineDeadError(message)
    return RemoteError(status, type_name, message)


__all__ = ["RemoteBlockError", "RemoteEngine", "RemoteError", "remote_exception"]
