"""Time budgets for blocks: a block's code may run for at most so many seconds per generation step.

A block runs on the model's thread, so a slow one (a ``time.sleep``, a long Python loop) stalls
every request of the batch. A :class:`StepBudget` times each resume of a block; when the block's
time in the current step passes the budget, a watchdog thread signals the model's thread
(``SIGUSR2``), whose handler raises :class:`BlockTimeoutError` at the line the block was running. The error fails that block only (its
request's result is the error); the model goes on with the other requests.

The interruption is raised only while the block's own code runs (never inside asyncpp's kernel or
engine code that the block called: it is retried at the watchdog's next look). Python code and
sleeps are interrupted within a quarter of the budget (at most 50 ms) of running out; one long
native call (a single huge matmul) finishes first. A block
that catches the error and goes on is closed at its next resume, with the same error.

Python runs signal handlers on the main thread only, so a budget needs the model to run on the
process's main thread (as a vLLM worker does), and SIGUSR2 to be free.
"""

from __future__ import annotations

import math
import os
import signal
import threading
import time
import weakref
from typing import Any

from .errors import AsyncppError, BlockTimeoutError

_SIGNAL = signal.SIGUSR2
_AGAIN_S = 0.1  # a block that caught the error and runs on is interrupted again after this
_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# asyncpp's own code that runs inside a block's resume and must not be interrupted half way (the
# locations' await machinery and the block-facing API may be: they raise into the block's line)
_UNSAFE = tuple(os.path.join(_PACKAGE, d) + os.sep for d in ("kernel", "engines", "pp", "native"))


class StepBudget:
    """Times the resumes of blocks against ``seconds`` per block per step (the interleaver calls
    :meth:`enter` before and :meth:`leave` after each outermost resume). A watchdog thread looks
    every ``seconds / 4`` (at most every 50 ms) at the resume in progress, and signals the main
    thread (SIGUSR2) once it is past its budget; the handler raises in the block."""

    __slots__ = (
        "seconds",
        "block",
        "t0",
        "deadline",
        "_previous",
        "_stop",
        "_thread",
        "_tick",
        "__weakref__",
    )

    @staticmethod
    def check(seconds: Any) -> float:
        """``seconds`` as a float, or ValueError if it is not a number of seconds > 0."""
        if (
            isinstance(seconds, bool)
            or not isinstance(seconds, int | float)
            or not math.isfinite(seconds)
            or seconds <= 0
        ):
            raise ValueError(f"a block budget is a number of seconds > 0, got {seconds!r}")
        return float(seconds)

    def __init__(self, seconds: float):
        seconds = self.check(seconds)
        if threading.current_thread() is not threading.main_thread():
            raise AsyncppError(
                "a block budget needs the model to run on the process's main thread (signals "
                f"interrupt the main thread only); this thread is {threading.current_thread().name!r}"
            )
        current = signal.getsignal(_SIGNAL)
        if current not in (signal.SIG_DFL, signal.SIG_IGN, None):
            raise AsyncppError(
                f"a block budget needs SIGUSR2, which this process already handles ({current!r})"
            )
        self.seconds = seconds
        self.block: Any = None  # the block being timed
        self.t0 = 0.0
        self.deadline = math.inf  # when the resume in progress runs out of budget
        self._tick = min(seconds / 4, 0.05)
        self._previous = signal.signal(_SIGNAL, self._interrupt)
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=_watch, args=(weakref.ref(self), self._stop, self._tick, threading.main_thread().ident),
            name="asyncpp-block-budget", daemon=True,
        )  # fmt: skip
        self._thread.start()

    def enter(self, block: Any, step: int) -> None:
        """``block`` is about to run in generation step ``step``."""
        if block.budget_step != step:
            block.budget_step = step
            block.budget_used = 0.0
        self.t0 = t0 = time.monotonic()
        self.block = block
        self.deadline = t0 + self.seconds - block.budget_used

    def leave(self) -> bool:
        """The block has parked or ended: say whether it ran past its budget."""
        self.deadline = math.inf
        block, self.block = self.block, None
        block.budget_used += time.monotonic() - self.t0
        return block.budget_used > self.seconds

    def error(self, block: Any, line: str | None = None) -> BlockTimeoutError:
        at = f" (interrupted at {line})" if line else ""
        return BlockTimeoutError(
            f"block {block.name!r} ran for more than its time budget of {self.seconds:g} s in one "
            f"generation step{at}; it was stopped, and only its own request fails. A block runs on "
            f"the model's thread, where a slow block stalls every request: do slow work before or "
            f"after the trace, or raise the budget (VllmEngine(block_budget=...), "
            f"asyncpp serve --block-budget)"
        )

    def close(self) -> None:
        """Stop the watchdog and give SIGUSR2 back."""
        if self._stop.is_set():
            return
        self._stop.set()
        self._thread.join(1)
        signal.signal(_SIGNAL, self._previous if self._previous is not None else signal.SIG_DFL)

    def _interrupt(self, signum: int, frame: Any) -> None:
        block = self.block
        if block is None or block.coro is None or time.monotonic() < self.deadline:
            return  # the resume ended (or another began) as the signal came
        if not _in_block_code(frame, block.coro):
            self.deadline = time.monotonic()  # (due again at the watchdog's next look)
            return
        block.budget_used = math.inf  # the block stays failed, even if it catches this
        self.deadline = time.monotonic() + _AGAIN_S  # and is interrupted again if it goes on
        raise self.error(block, f"{frame.f_code.co_filename}:{frame.f_lineno}")


def _watch(ref: Any, stop: threading.Event, tick: float, main: int) -> None:
    """The watchdog thread: signal the main thread while a resume is past its deadline."""
    while not stop.wait(tick):
        budget = ref()
        if budget is None:
            return
        if time.monotonic() > budget.deadline:
            signal.pthread_kill(main, _SIGNAL)
        del budget


def _in_block_code(frame: Any, coro: Any) -> bool:
    """Whether ``frame`` runs the block's own code: the block's coroutine frame is below it on the
    stack, with none of asyncpp's kernel or engine frames in between."""
    top = getattr(coro, "cr_frame", None)
    f = frame
    while f is not None:
        if f is top:
            return True
        if os.path.abspath(f.f_code.co_filename).startswith(_UNSAFE):
            return False
        f = f.f_back
    return False


__all__ = ["BlockTimeoutError", "StepBudget"]
