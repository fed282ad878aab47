"""What every route of the server does with a request before its own work: refusals, the bearer
token, and reading a bounded body. Shared by the trace routes (app.py) and the OpenAI routes."""

from __future__ import annotations

from typing import TYPE_CHECKING

from .auth import Token, Tokens

if TYPE_CHECKING:
    from starlette.requests import Request

ANONYMOUS = Token(token="", name="anonymous", trusted=False)  # a server without tokens


class Refusal(Exception):
    """An answer other than 200: its status, error type and message (each route renders it in
    its own protocol's error shape)."""

    def __init__(self, status: int, kind: str, message: str, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status = status
        self.kind = kind
        self.message = message
        self.headers = headers


def authenticate(tokens: Tokens | None, request: Request) -> Token:
    """The request's token (``ANONYMOUS`` on a server without tokens), else a 401 refusal."""
    if tokens is None:
        return ANONYMOUS
    header = request.headers.get("authorization")
    token = tokens.authenticate(header)
    if token is None:
        why = "missing bearer token" if not header else "invalid bearer token"
        raise Refusal(
            401, "AuthenticationError", f"{why} (send 'Authorization: Bearer <token>')",
            {"WWW-Authenticate": "Bearer"},
        )  # fmt: skip
    return token


async def read_body(request: Request, max_bytes: int, bad_kind: str = "RequestError") -> bytes:
    """The request's body, refused (413) past ``max_bytes`` by its Content-Length or by the bytes
    actually read; a Content-Length that is not a number is a 400 of type ``bad_kind``."""
    length = request.headers.get("content-length")
    if length is not None:
        try:
            declared = int(length)
        except ValueError:
            raise Refusal(400, bad_kind, "the Content-Length header is not a number") from None
        if declared > max_bytes:
            raise Refusal(
                413, "WireLimitError", f"the body has {declared} bytes, more than the limit of {max_bytes}"
            )
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > max_bytes:
            raise Refusal(413, "WireLimitError", f"the body has more than the limit of {max_bytes} bytes")
        chunks.append(chunk)
    return b"".join(chunks)


def take_slot(in_flight: dict[str, int], token: Token, default_limit: int) -> None:
    """Count one more request in flight for ``token`` (the caller gives it back when the request
    has ended), or refuse it (429) when the token already has its limit in flight."""
    most = token.max_concurrent or default_limit
    if in_flight.get(token.name, 0) >= most:
        raise Refusal(
            429, "TooManyRequests",
            f"this token already has {most} requests in flight (its limit); retry when one ends",
            {"Retry-After": "1"},
        )  # fmt: skip
    in_flight[token.name] = in_flight.get(token.name, 0) + 1
