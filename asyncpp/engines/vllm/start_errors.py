"""asyncpp's own errors in vLLM's processes while an engine starts, raised again in the caller.

vLLM reports any failed start as "Engine core initialization failed", with the real cause
printed by the process where it happened. When that cause is asyncpp's (a module that cannot be a
tap, a script without a main guard), the caller should get that error, not vLLM's. While an
engine starts, its processes inherit a folder (``ASYNCPP_START_ERRORS``); asyncpp's code there
writes the error it raises into it, and the engine raises it again from vLLM's.

Errors raised while dynamo traces the model (a tap's checks run inside vLLM's compiled model)
reach the worker as dynamo's "observed exception", which keeps only the error's class name and
message: both are recovered from it.
"""

from __future__ import annotations

import ast
import contextlib
import functools
import json
import os
import re
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from ...kernel.errors import AsyncppError

ENV = "ASYNCPP_START_ERRORS"

_OBSERVED = re.compile(r"Observed(\w+)Error")
_RAISED = re.compile(r"raised exception (\w+)\((.*)\)\s*$", re.S)


def report(err: BaseException) -> None:
    """Write asyncpp's error in ``err``'s chain (if any) for the starting engine to raise."""
    folder = os.environ.get(ENV)
    found = asyncpp_error_in(err) if folder else None
    if found is None:
        return
    name, message = found
    path = Path(folder, f"{os.getpid()}.json")
    with contextlib.suppress(OSError):
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"type": name, "message": message}))
        tmp.replace(path)


def reported(method: Callable) -> Callable:
    """``method``, reporting asyncpp's errors it raises (a worker's start-up steps)."""

    @functools.wraps(method)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return method(*args, **kwargs)
        except BaseException as err:
            report(err)
            raise

    return wrapper


def asyncpp_error_in(err: BaseException) -> tuple[str, str] | None:
    """(class name, message) of the first asyncpp error in ``err``'s chain of causes."""
    seen = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        if isinstance(err, AsyncppError):
            return type(err).__name__, str(err)
        found = _observed(err)
        if found is not None:
            return found
        err = err.__cause__ or err.__context__
    return None


def _observed(err: BaseException) -> tuple[str, str] | None:
    """Dynamo's stand-in for an asyncpp error raised in traced code, as (name, message)."""
    m = _OBSERVED.fullmatch(type(err).__name__)
    if m is None or _error_class(m.group(1)) is None or not err.args:
        return None
    raised = _RAISED.match(str(err.args[0]))
    if raised is None or raised.group(1) != m.group(1):
        return None
    try:
        message = ast.literal_eval(raised.group(2))
    except (ValueError, SyntaxError):
        message = raised.group(2)
    return m.group(1), str(message)


def _error_class(name: str) -> type[AsyncppError] | None:
    todo = [AsyncppError]
    while todo:
        cls = todo.pop()
        if cls.__name__ == name:
            return cls
        todo.extend(cls.__subclasses__())
    return None


@contextlib.contextmanager
def collecting() -> Iterator[Callable[[], AsyncppError | None]]:
    """While an engine starts: a folder its processes report into (in ``os.environ``), and a
    function giving the first error reported, rebuilt as its own class."""
    folder = tempfile.mkdtemp(prefix="asyncpp-start-")
    saved = os.environ.get(ENV)
    os.environ[ENV] = folder

    def first() -> AsyncppError | None:
        for path in sorted(Path(folder).glob("*.json"), key=lambda p: p.stat().st_mtime):
            try:
                data = json.loads(path.read_text())
            except (OSError, ValueError):
                continue
            cls = _error_class(str(data.get("type"))) or AsyncppError
            try:
                return cls(str(data.get("message")))
            except Exception:
                return AsyncppError(str(data.get("message")))
        return None

    try:
        yield first
    finally:
        if saved is None:
            os.environ.pop(ENV, None)
        else:
            os.environ[ENV] = saved
        shutil.rmtree(folder, ignore_errors=True)
