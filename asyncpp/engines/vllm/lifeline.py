"""The driver's lifeline: vLLM's processes end when the process that started the engine ends.

vLLM's workers watch its engine core (a pipe), but the engine core does not watch the driver: a
driver killed by a signal (SIGKILL, or SIGTERM with its default action, before any cleanup can run)
left the engine core and its workers running, holding their memory and polling their queues.
asyncpp's workers watch the driver with a pidfd. When it ends they send the engine core SIGTERM
(vLLM's own shutdown, which ends the workers through their pipe), then SIGKILL after a grace period.

The driver is named by :data:`ENV` (its boot id, pid and start time), set while the engine starts:
a worker on another host, or a driver whose pid was reused, is never mistaken for the live driver.

A driver whose start is interrupted (Ctrl-C, or the server's SIGTERM) while vLLM's start goes on
in the engine's thread ends the engine cores that start made (:func:`end_engine_cores`): until its
workers run, an engine core waits minutes for a driver that is gone.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import select
import signal
import threading
import time

from .watch import stat_fields

ENV = "ASYNCPP_DRIVER"
GRACE_S = 10.0  # for vLLM's shutdown after SIGTERM, before SIGKILL

log = logging.getLogger("asyncpp.vllm")


def _boot_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return ""


def start_time(pid: int) -> int | None:
    """The process's start time (clock ticks after boot, ``/proc/<pid>/stat`` field 22), or None
    when there is no such process."""
    fields = stat_fields(pid)
    return None if fields is None else int(fields[19])


def driver_token(pid: int | None = None) -> str:
    """The value of :data:`ENV` that names process ``pid`` (default: this one) as the driver."""
    pid = os.getpid() if pid is None else pid
    return f"{_boot_id()}:{pid}:{start_time(pid)}"


def host_id() -> str:
    """What names this host's process table: its boot id and this process's pid namespace (a
    pid means the same process only where both are the same)."""
    try:
        ns = os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        ns = 0
    return f"{_boot_id()}/{ns}"


def end_node(peer: str = "") -> None:
    """In a worker of a headless node: the driver's connection is lost (the head node has
    closed its engine, or is gone): end this node (the node process, this worker's parent)."""
    at = f" ({peer})" if peer else ""
    _end(os.getppid(), f"asyncpp: the connection to the engine's head node{at} is lost; ending this node")


def _end(
    target: int, why: str = "asyncpp: the process that started this engine has ended; shutting vLLM down"
) -> None:
    """SIGTERM ``target``; SIGKILL it if it is still there after :data:`GRACE_S`."""
    log.warning(why)
    try:
        os.kill(target, signal.SIGTERM)
        deadline = time.monotonic() + GRACE_S
        while time.monotonic() < deadline:
            time.sleep(0.1)
            os.kill(target, 0)
        os.kill(target, signal.SIGKILL)
    except ProcessLookupError:
        return


def watch_driver(token: str | None = None, parent_is_engine: bool = True) -> threading.Thread | None:
    """In one of vLLM's processes: end the engine (this process's parent, or this process when
    its parent is the driver itself or, with ``parent_is_engine`` False, is no engine core of
    vLLM's: a Ray worker's) once the driver named by ``token`` (default: :data:`ENV`) ends.
    Returns the watching thread, or None when there is nothing to watch: no token, a driver on
    another host, or a driver that is this very process."""
    token = os.environ.get(ENV) if token is None else token
    if not token:
        return None
    boot, pid_text, started = token.rsplit(":", 2)
    pid = int(pid_text)
    if boot != _boot_id() or pid == os.getpid():
        return None
    parent = os.getppid()
    target = os.getpid() if parent == pid or not parent_is_engine else parent
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        fd = None
    if fd is not None and str(start_time(pid)) != started:  # the pid names another process now
        os.close(fd)
        fd = None

    return _end_when(fd, target, "asyncpp-lifeline")


def watch_parent() -> threading.Thread | None:
    """In a vLLM worker: end this process (SIGTERM, then SIGKILL) if its parent, the process that
    started it, ends. vLLM's workers watch their parent themselves only once they are ready: a
    worker still waiting for the other nodes of a multi-node engine whose start was given up
    would otherwise wait on."""
    parent = os.getppid()
    try:
        fd = os.pidfd_open(parent)
    except (AttributeError, OSError):
        return None
    if os.getppid() != parent:  # it ended before the watch began
        os.close(fd)
        fd = None

    why = "asyncpp: the process that started this vLLM worker has ended; ending it"
    return _end_when(fd, os.getpid(), "asyncpp-parent", why)


def _end_when(fd: int | None, target: int, name: str, *why: str) -> threading.Thread:
    """A thread that waits for the process of pidfd ``fd`` to end (None: it has), then ends
    ``target`` (:func:`_end`)."""

    def wait() -> None:
        if fd is not None:
            select.select([fd], [], [])
            os.close(fd)
        _end(target, *why)

    thread = threading.Thread(target=wait, name=name, daemon=True)
    thread.start()
    return thread


def children() -> set[int]:
    """The pids of this process's live multiprocessing children."""
    return {p.pid for p in multiprocessing.active_children() if p.pid is not None}


def end_engine_cores(before: set[int]) -> None:
    """In the driver: terminate (SIGTERM) vLLM's engine-core processes started since ``before``
    (:func:`children` then), and wait for them a little."""
    made = [
        p
        for p in multiprocessing.active_children()
        if p.pid not in before and p.name.startswith("EngineCore")
    ]
    for p in made:
        p.terminate()
    for p in made:
        p.join(GRACE_S)
        if p.is_alive():
            p.kill()
