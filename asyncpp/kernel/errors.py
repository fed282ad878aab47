"""Errors raised by asyncpp, all subclasses of :class:`AsyncppError`.

Each error is raised at the user's own line where possible: order errors and foreign-await errors are
thrown into the block at its ``await``; never-reached errors are thrown into the block at the
``await`` it was parked on when the run ended.
"""

from __future__ import annotations


class AsyncppError(Exception):
    """Base class of every error asyncpp raises."""


class PathError(AsyncppError, AttributeError):
    """A module path does not exist in the model (names the path and the nearest valid ones)."""


class OrderError(AsyncppError):
    """A block waited on a location the model has already passed in this run."""


class NeverReachedError(AsyncppError):
    """A block was still waiting on a location (or a value) when the run ended."""


class ForeignAwaitError(AsyncppError, TypeError):
    """A block awaited something that is not an asyncpp awaitable (an asyncio future, a sleep)."""


class MissingAwaitError(AsyncppError, TypeError):
    """A location object was used as a value: the ``await`` in front of it is missing."""


class WriteError(AsyncppError, ValueError):
    """A replacement value does not fit the location it is written to."""


class TapError(AsyncppError, LookupError):
    """A compiled vLLM engine cannot serve this location: it is not one of the engine's taps (the
    message names the engine's taps and the option that adds one)."""


class InternalError(AsyncppError):
    """A bug in asyncpp itself, not in the user's code. Please report it."""


class EngineDeadError(AsyncppError):
    """An engine's process died (a vLLM worker, or its engine core): the engine cannot run traces
    any more, and every later trace on it fails at once with this error. Create a new engine."""


class BlockTimeoutError(AsyncppError):
    """A block's code ran longer than its time budget in one generation step (see
    ``VllmEngine(block_budget=...)`` and ``asyncpp serve --block-budget``): it was interrupted at
    the line it was running, and only its own request fails."""
