"""The bridge between the caller's event loop and the model's thread.

A trace's run executes on the engine's long-lived model thread; the caller awaits a future that the
model thread resolves through the loop's thread-safe entry point. Works under asyncio and uvloop
(``call_soon_threadsafe``) and under trio (``TrioToken.run_sync_soon``); anyio runs on either.

Cancelling the awaiting task does not interrupt a forward already running: the run finishes on the
model thread, its blocks are closed as usual, and its outcome is dropped.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import queue
import sys
import threading
from collections.abc import Callable
from typing import Any


class ModelThread:
    """One long-lived daemon thread that runs jobs in submission order."""

    def __init__(self, name: str):
        self._name = name
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._start_lock = threading.Lock()

    def submit(self, job: Callable[[], None]) -> None:
        if self._thread is None:
            with self._start_lock:
                if self._thread is None:
                    t = threading.Thread(target=self._main, name=self._name, daemon=True)
                    t.start()
                    self._thread = t
        self._jobs.put(job)

    def stop(self) -> None:
        """Let the thread finish the jobs it has and exit."""
        if self._thread is not None:
            self._jobs.put(None)
            self._thread.join()
            self._thread = None

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
            job()


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

    def settle(ok: bool, value: Any) -> None:
        if fut.done():
            return
        if ok:
            fut.set_result(value)
        else:
            fut.set_exception(value)

    def job() -> None:
        try:
            ok, value = True, fn()
        except BaseException as err:  # delivered to the awaiting task
            ok, value = False, err
        try:
            loop.call_soon_threadsafe(settle, ok, value)
        except RuntimeError:  # the caller's loop is closed: nobody is waiting
            pass

    thread.submit(job)
    return await fut


async def _trio_run(thread: ModelThread, fn: Callable[[], Any]) -> Any:
    fut: concurrent.futures.Future = concurrent.futures.Future()

    def job() -> None:
        try:
            fut.set_result(fn())
        except BaseException as err:
            fut.set_exception(err)

    thread.submit(job)
    return await await_future(fut)


async def await_future(fut: Any) -> Any:
    """Await a ``concurrent.futures.Future`` (set by another thread) from asyncio, uvloop or trio."""
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
    await done.wait()
    return fut.result()
