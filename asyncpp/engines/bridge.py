"""The bridge between the caller's event loop and the model's thread.

A trace's run executes on the engine's long-lived model thread; the caller awaits an event that the
model thread sets through the loop's thread-safe entry point. One code path for asyncio, uvloop and
trio, on anyio's low-level API: the caller's loop is ``anyio.lowlevel.current_token()``, the model
thread posts to it with the backend's ``run_sync_soon`` (without waiting for the loop to run the
callback: the model thread goes on with the next job), and the caller waits on an ``anyio.Event``.

Cancelling the awaiting task does not interrupt a forward already running: the run finishes on the
model thread, its blocks are closed as usual, and its outcome is dropped. A loop that has finished
by the time the run ends is not posted to: nobody waits, and the outcome is dropped too.

Nothing here outlives a run: the model thread drops the job (its closure holds the engine) before
the caller can see the outcome, and the outcome travels in a box, not as a value that the loop's
wake-up callback would hold until the caller next suspends. So an engine, and with it its model
and its thread, is freed when the caller drops its last reference.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from typing import Any

import anyio
import anyio.lowlevel

NO_LOOP = "asyncpp: async traces need a running asyncio, uvloop or trio event loop"


def current_loop() -> anyio.lowlevel.EventLoopToken:
    """The running event loop (asyncio, uvloop or trio), as anyio's token for it; a RuntimeError
    saying so outside of one."""
    try:
        return anyio.lowlevel.current_token()
    except anyio.NoEventLoopError:
        raise RuntimeError(NO_LOOP) from None


def poster(token: anyio.lowlevel.EventLoopToken) -> Callable[..., None]:
    """``post(func, *args)``: call ``func(*args)`` soon on the loop of ``token``, from any thread,
    without waiting for it. Raises RuntimeError (``anyio.RunFinishedError`` or the backend's own)
    when that loop has finished."""
    run_sync_soon, native = token.backend_class.run_sync_soon, token.native_token

    def post(func: Callable[..., Any], *args: Any) -> None:
        run_sync_soon(func, args, native)

    return post


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
        the caller's event loop (``poster(current_loop())``), which calls it there. ``ok`` is
        False when ``fn`` raised, and ``value`` is then the error."""
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
            except RuntimeError:  # the caller's loop has finished (RunFinishedError): nobody waits
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
    token = current_loop()
    post = poster(token)
    done = token.backend_class.create_event()  # an anyio.Event (anyio.Event() sniffs again)
    box: list | None = []

    def settle(ok: bool, value: Any) -> None:
        if box is not None:  # (None: the awaiting task was cancelled, the outcome is dropped)
            box.append((ok, value))
            done.set()

    thread.submit(fn, post, settle)
    del fn, post
    try:
        await done.wait()
    except BaseException:
        box = None
        raise
    return _unbox(box)


def _unbox(box: list) -> Any:
    """The outcome ``settle`` put in ``box``: returned, or raised. (The outcome goes through a box
    rather than as the value that resumes the awaiting task: the loop's callback that resumes it
    holds that value until the task next suspends, and so would keep a run's engine alive through
    the tracebacks of its errors while the caller goes on.)"""
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
    token = current_loop()
    post = poster(token)
    done = token.backend_class.create_event()

    def wake(_: Any) -> None:
        try:
            post(done.set)
        except RuntimeError:  # the loop has finished: nobody waits
            pass

    fut.add_done_callback(wake)
    del wake
    try:
        await done.wait()
    except BaseException:  # cancelled: the work is given up too (as asyncio.wrap_future does)
        fut.cancel()
        raise
    return fut.result()
