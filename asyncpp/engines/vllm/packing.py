"""Blocks travel to vLLM workers with their request, and results travel back, as bytes.

A block is pickled by value (cloudpickle) together with its arguments, so a block defined in a
script, a notebook or a test module runs on workers that cannot import that module. Results come
back pickled; an error comes back as the exception (when it pickles) plus the worker-side
traceback as text, attached to the exception raised at the caller.
"""

from __future__ import annotations

import pickle
import sys
import traceback
from collections.abc import Callable
from typing import Any

import cloudpickle

from ...kernel.errors import AsyncppError


class RemoteBlockError(AsyncppError):
    """A block failed on a worker and its exception could not be sent back as it was."""


def pack_block(block: Callable, args: tuple, kwargs: dict) -> bytes:
    """The block and its arguments as bytes, the block's own module pickled by value."""
    module = sys.modules.get(getattr(block, "__module__", "") or "")
    by_value = (
        module is not None
        and module.__name__ != "__main__"
        and not module.__name__.startswith(("asyncpp", "torch", "vllm"))
    )
    if by_value:
        try:
            cloudpickle.register_pickle_by_value(module)
        except (ValueError, TypeError):
            by_value = False
    code = getattr(block, "__code__", None)
    filename = code.co_filename if code is not None else None
    try:
        return cloudpickle.dumps((block, args, kwargs, filename))
    finally:
        if by_value:
            cloudpickle.unregister_pickle_by_value(module)


def unpack_block(data: bytes) -> tuple[Callable, tuple, dict]:
    block, args, kwargs, filename = pickle.loads(data)
    code = getattr(block, "__code__", None)
    if code is not None and filename:
        # cloudpickle blanks the file name of code it pickles by value; put it back so that
        # tracebacks from the worker name the user's file and show its lines
        block.__code__ = _refile(code, filename)
    return block, args, kwargs


def _refile(code: Any, filename: str) -> Any:
    consts = tuple(_refile(c, filename) if isinstance(c, type(code)) else c for c in code.co_consts)
    return code.replace(co_filename=filename, co_consts=consts)


def pack_outcome(result: Any, error: BaseException | None) -> bytes:
    """A block's outcome as bytes: ("ok", result) or ("error", exception or None, traceback text)."""
    if error is None:
        try:
            return cloudpickle.dumps(("ok", result))
        except Exception as err:  # an unpicklable result fails that request, clearly
            error = RemoteBlockError(f"the block's result could not be sent back from the worker: {err!r}")
    text = "".join(traceback.format_exception(error))
    try:
        return cloudpickle.dumps(("error", error, text))
    except Exception:
        return cloudpickle.dumps(("error", None, text))


def unpack_outcome(data: bytes) -> tuple[Any, BaseException | None]:
    """(result, error) from :func:`pack_outcome`'s bytes; a remote error carries its traceback."""
    kind, *rest = pickle.loads(data)
    if kind == "ok":
        return rest[0], None
    error, text = rest
    if error is None:
        error = RemoteBlockError("a block failed on a worker:\n" + text)
    else:
        error.add_note("Traceback on the worker (most recent call last):\n" + _frames_only(text))
    return None, error


def _frames_only(text: str) -> str:
    lines = text.rstrip().splitlines()
    if lines and lines[0].startswith("Traceback"):
        lines = lines[1:]
    return "\n".join(lines)
