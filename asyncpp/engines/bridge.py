"""The bridge between the caller's event loop and the model's thread.

A trace's run executes on the engine's long-lived model thread; the caller awaits a future that the
model thread resolves through the loop's thread-safe entry point. Works under asyncio and uvloop
(``call_soon_threadsafe``) and under trio (``TrioToken.run_sync_soon``); anyio runs on either.

Cancelling the awaiting task does not interrupt a forward already running: the run finishes on the
model thread, its blocks are closed as usual, and its outcome is dropped.

Nothing here outlives a run: the model thread drops the job (its closure holds the engine) before
the caller can see the outcome, and the outcome travels in a box rather than as the future's
result (which the event loop's wake-up callback would hold until the caller next suspends). So an
engine, and with it its model and its thread, is freed when the caller drops its last reference.
"""

from __future__ import annotations

import asyncio
import queue
import sys
import threading
from collections.abc import Callable
from typing import Any


class ModelThread:
    """One long-lived daemon thread that runs jobs in submission order.

    The thread keeps nothing of a job once it has handed the job's outcome over: a finished run's
    closure (its engine, its spec, its blocks' errors and their tracebacks) lives only as long as
    the caller keeps it, and an engine nobody holds any more is freed (and this thread stopped by
    its finalizer) without ``close()``.
    """

    def __init__(self, name: str):
        self._name = name
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._start_lock = threading.Lock()

    def submit(
        self, fn: Callable[[], Any], post: Callable[..., Any], settle: Callable[[bool, Any], None]
    ) -> None:
        """Run ``fn()`` on the thread; then ``post(_deliver, job)`` hands ``settle(ok, value)`` to
        the caller's event loop (``loop.call_soon_threadsafe``, ``TrioToken.run_sync_soon``), which
        calls it there. ``ok`` is False when ``fn`` raised, and ``value`` is then the error."""
        if self._thread is None:
            with self._start_lock:
                if self._thread is None:
                    t = threading.Thread(target=self._main, name=self._name, daemon=True)
                    t.start()
                    self._thread = t
        self._jobs.put([fn, post, settle])

    def stop(self) -> None:
        """Let the thread finish the jobs it has and exit (without waiting for it when called on
        the thread itself: from a block of one of its runs)."""
        thread = self._thread
        if thread is not None:
            self._jobs.put(None)
            self._thread = None
            if thread is not threading.current_thread():
                thread.join()

    def stop_soon(self) -> None:
        """Ask the thread to exit after its queued jobs, without waiting."""
        if self._thread is not None:
            self._jobs.put(None)

    def _main(self) -> None:
        jobs = self._jobs
        while True:
            job = jobs.get()
            if job is None:
                return
            fn, post = job[0], job[1]
            job[0] = job[1] = None
            try:
                job[0] = True, fn()
            except BaseException as err:  # delivered to the awaiting task, without this frame
                job[0] = False, err.with_traceback(err.__traceback__.tb_next if err.__traceback__ else None)
            fn = None
            try:
                post(_deliver, job)
            except RuntimeError:  # the caller's loop is closed (or trio's run ended): nobody waits
                job.clear()
            # from here on the caller may hold the outcome alone: drop every reference to it first
            # (_deliver empties ``job`` on the caller's thread before it settles the caller)
            job = post = None


def _deliver(job: list) -> None:
    """On the caller's event loop: take the outcome out of ``job`` and settle the caller."""
    (ok, value), settle = job[0], job[2]
    job.clear()
    settle(ok, value)


async def run_on_thread(thread: ModelThread, fn: Callable[[], Any]) -> Any:
    """Run ``fn`` on ``thread`` and await its result without blocking the running event loop."""
    try:
        loop = asyncio.get_running_loop()
    except RuntimeError:
        loop = None
    if loop is not None:
        return await _asyncio_run(loop, thread, fn)
    if "trio" in sys.modules:
        return await _trio_run(thread, fn)
    raise RuntimeError("asyncpp: async traces need a running asyncio, uvloop or trio event loop")


async def _asyncio_run(loop: asyncio.AbstractEventLoop, thread: ModelThread, fn: Callable[[], Any]) -> Any:
    fut = loop.create_future()
    box: list = []

    def settle(ok: bool, value: Any) -> None:
        if not fut.done():  # (done: the awaiting task was cancelled, the outcome is dropped)
            box.append((ok, value))
            fut.set_result(None)

    thread.submit(fn, loop.call_soon_threadsafe, settle)
    del fn
    await fut
    return _unbox(box)


async def _trio_run(thread: ModelThread, fn: Callable[[], Any]) -> Any:
    import trio

    done = trio.Event()
    box: list = []

    def settle(ok: bool, value: Any) -> None:
        box.append((ok, value))
        done.set()

    thread.submit(fn, trio.lowlevel.current_trio_token().run_sync_soon, settle)
    del fn
    await done.wait()
    return _unbox(box)


def _unbox(box: list) -> Any:
    """The outcome ``settle`` put in ``box``: returned, or raised. (The outcome goes through a box
    rather than the future: the loop's callback that resumes the awaiting task holds the future
    until the task next suspends, and so would keep a run's engine alive through the tracebacks
    of its errors while the caller goes on.)"""
    ok, value = box.pop()
    if ok:
        return value
    try:
        raise value
    finally:
        del value


async def await_future(fut: Any) -> Any:
    """Await a ``concurrent.futures.Future`` (set by another thread) from asyncio, uvloop or trio;
    cancelling the awaiting task cancels the future."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        pass
    else:
        return await asyncio.wrap_future(fut)
    import trio

    token = trio.lowlevel.current_trio_token()
    done = trio.Event()

    def wake(_: Any) -> None:
        try:
            token.run_sync_soon(done.set)
        except trio.RunFinishedError:
            pass

    fut.add_done_callback(wake)
    try:
        await done.wait()
    except BaseException:  # cancelled: the work is given up too (as asyncio.wrap_future does)
        fut.cancel()
        raise
    return fut.result()
