"""Bearer tokens of an asyncpp server, each with its own limits and whether it is trusted.

A tokens file (``asyncpp serve --tokens FILE``, or the path in ``ASYNCPP_TOKENS``) is JSON::

    {"tokens": [
        {"token": "s3cret-alice", "name": "alice", "max_concurrent": 4, "max_new_tokens": 256,
         "max_invokes": 16},
        {"token": "s3cret-ops", "name": "ops", "trusted": true}
    ]}

``token`` and ``name`` are required (non-empty strings, each unique in the file); ``trusted``
(default ``false``) lets a token ship its own block code to a server started with
``--allow-code``, which is code execution on the server. A limit left out takes the server's
default (:class:`asyncpp.serve.app.ServeLimits`). Anything else in the file is an error, so a typo
never silently drops a limit.

Tokens are compared in constant time (``hmac.compare_digest`` of SHA-256 digests, against every
configured token, with no early exit), so a response's timing says nothing about how much of a guess was right.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..kernel.errors import AsyncppError

__all__ = ["ENV_VAR", "Token", "TokenError", "Tokens", "load_tokens"]

ENV_VAR = "ASYNCPP_TOKENS"

_LIMIT_KEYS = ("max_concurrent", "max_new_tokens", "max_invokes")
_KEYS = {"token", "name", "trusted", *_LIMIT_KEYS}


class TokenError(AsyncppError, ValueError):
    """A tokens file (or its entries) is malformed; the message names the file and the entry."""


@dataclass(frozen=True)
class Token:
    """One client credential. A limit that is ``None`` takes the server's default."""

    token: str
    name: str
    trusted: bool = False
    max_concurrent: int | None = None
    max_new_tokens: int | None = None
    max_invokes: int | None = None

    def __repr__(self) -> str:  # never show the secret
        return f"Token(name={self.name!r}, trusted={self.trusted})"


class Tokens:
    """The configured tokens; :meth:`authenticate` maps an ``Authorization`` header to one."""

    def __init__(self, tokens: Iterable[Token]):
        self._tokens = tuple(tokens)
        if not self._tokens:
            raise TokenError("no tokens given (an empty token list would lock every client out)")
        seen_tok: set[str] = set()
        seen_name: set[str] = set()
        for t in self._tokens:
            if t.token in seen_tok:
                raise TokenError(f"token {t.name!r}: the same token string is given twice")
            if t.name in seen_name:
                raise TokenError(f"two tokens are named {t.name!r}")
            seen_tok.add(t.token)
            seen_name.add(t.name)
        self._digests = tuple(_digest(t.token.encode("utf-8")) for t in self._tokens)

    def __iter__(self):
        return iter(self._tokens)

    def __len__(self) -> int:
        return len(self._tokens)

    @property
    def any_trusted(self) -> bool:
        return any(t.trusted for t in self._tokens)

    def authenticate(self, authorization: str | None) -> Token | None:
        """The token an ``Authorization: Bearer <token>`` header names, or ``None``.

        Every configured token is compared (in constant time each), whatever matched first."""
        if not authorization:
            return None
        scheme, _, given = authorization.strip().partition(" ")
        if scheme.lower() != "bearer":
            return None
        digest = _digest(given.strip().encode("utf-8", "surrogateescape"))
        found = None
        for t, known in zip(self._tokens, self._digests):
            if hmac.compare_digest(digest, known) and found is None:
                found = t
        return found

    @classmethod
    def from_data(cls, data: Any, where: str = "tokens") -> Tokens:
        """Tokens from the decoded JSON of a tokens file (see the module docstring)."""
        if not isinstance(data, Mapping) or set(data) != {"tokens"}:
            raise TokenError(f'{where}: expected an object {{"tokens": [...]}}')
        entries = data["tokens"]
        if not isinstance(entries, list):
            raise TokenError(f'{where}: "tokens" must be a list of objects')
        out = []
        for i, entry in enumerate(entries):
            at = f"{where}: tokens[{i}]"
            if not isinstance(entry, Mapping):
                raise TokenError(f"{at}: expected an object")
            unknown = set(entry) - _KEYS
            if unknown:
                raise TokenError(f"{at}: unknown keys {sorted(unknown)} (allowed: {sorted(_KEYS)})")
            for key in ("token", "name"):
                value = entry.get(key)
                if not isinstance(value, str) or not value.strip():
                    raise TokenError(f"{at}: {key!r} must be a non-empty string")
            if entry["token"] != entry["token"].strip() or any(c.isspace() for c in entry["token"]):
                raise TokenError(f"{at} ({entry['name']!r}): a token may not contain whitespace")
            trusted = entry.get("trusted", False)
            if type(trusted) is not bool:
                raise TokenError(f"{at} ({entry['name']!r}): 'trusted' must be true or false")
            limits = {}
            for key in _LIMIT_KEYS:
                value = entry.get(key)
                if value is not None and (type(value) is not int or value < 1):
                    raise TokenError(f"{at} ({entry['name']!r}): {key!r} must be an int >= 1")
                limits[key] = value
            out.append(Token(entry["token"], entry["name"], trusted, **limits))
        return cls(out)


def _digest(raw: bytes) -> bytes:
    """Tokens are compared as SHA-256 digests: equal lengths, so the comparison time says nothing
    about a guess's length either."""
    return hashlib.sha256(raw).digest()


def load_tokens(path: str | os.PathLike | None = None) -> Tokens | None:
    """The tokens of ``path``, else of the file ``$ASYNCPP_TOKENS`` names, else ``None``."""
    if path is None:
        path = os.environ.get(ENV_VAR) or None
        if path is None:
            return None
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except OSError as e:
        raise TokenError(f"tokens file {str(p)!r}: cannot be read ({e.strerror or e})") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise TokenError(f"tokens file {str(p)!r} is not valid JSON: {e.msg} at line {e.lineno}") from None
    return Tokens.from_data(data, f"tokens file {str(p)!r}")
