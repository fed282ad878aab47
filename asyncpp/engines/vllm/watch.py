"""Watching vLLM's processes from the driver: the moment one of them ends, the engine is dead.

vLLM notices a dead worker itself, but on a pipeline- or tensor-parallel engine a worker that
waits on the dead one (for its stage's tensors, or in a collective) never returns, and vLLM's
executor gives it 5 seconds, then SIGTERM and 4 more seconds, before it reports the engine dead.
The driver knows every worker's pid (``asyncpp_stats``) and the engine core's, and waits on them
with pidfds in a thread: a death is seen when it happens, whatever the other processes are doing.
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import threading
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class Proc:
    """One of vLLM's processes, as the error message names it."""

    name: str  # "vLLM worker rank 0", "vLLM's engine core"
    pid: int
    worker: bool
    where: str = ""  # ", pipeline stage 1, tensor-parallel rank 0" (after the pid)


def stat_fields(pid: int) -> list[bytes] | None:
    """The fields of ``/proc/<pid>/stat`` after the command name (the state first, field 3), or
    None when there is no such process."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    return stat[stat.rindex(b")") + 2 :].split()


def exit_status(pid: int) -> str | None:
    """How a process that has just ended ended ("killed by signal 9 (SIGKILL)", "exited with status
    1"), read from ``/proc`` while it is a zombie; None once its parent has reaped it."""
    fields = stat_fields(pid)
    if not fields or fields[0] != b"Z":
        return None
    try:
        code = int(fields[-1])  # the status in waitpid's form (Linux 3.5+)
    except ValueError:
        return None
    return describe_status(code)


def describe_status(code: int) -> str:
    """A waitpid status in words."""
    sig = code & 0x7F
    if sig:
        try:
            name = f" ({signal.Signals(sig).name})"
        except ValueError:
            name = ""
        core = ", core dumped" if code & 0x80 else ""
        return f"killed by signal {sig}{name}{core}"
    return f"exited with status {code >> 8}"


class Watch:
    """A thread that waits for any of ``procs`` to end and calls ``on_death(proc, status)`` once,
    for the first one (``status`` is :func:`exit_status`'s, or None). :meth:`stop` ends it without
    a call; :meth:`kill_workers` kills the workers still alive (race-free, through their pidfds)."""

    def __init__(self, procs: list[Proc], on_death: Callable[[Proc, str | None], None]):
        self.on_death = on_death
        self.fds: dict[int, Proc] = {}
        for proc in procs:
            try:
                self.fds[os.pidfd_open(proc.pid)] = proc
            except (AttributeError, OSError):  # no pidfds (Linux < 5.3), or already gone
                if not _alive(proc.pid):
                    self.fds[-1 - len(self.fds)] = proc  # reported at once by the thread
        self._stop_read, self._stop_write = os.pipe()
        self._lock = threading.Lock()
        self._stopped = False
        self._thread = threading.Thread(target=self._run, name="asyncpp-vllm-watch", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        with self._lock:
            if self._stopped:
                return
            self._stopped = True
            os.write(self._stop_write, b"x")
        self._thread.join(5)

    def kill_workers(self, but: Proc | None = None) -> None:
        """SIGKILL every worker but ``but``: they cannot go on without it, and one that waits for
        it in a collective spins until vLLM kills it, 9 seconds later."""
        for fd, proc in self.fds.items():
            if proc.worker and proc is not but and fd >= 0:
                with contextlib.suppress(OSError):
                    signal.pidfd_send_signal(fd, signal.SIGKILL)

    def _run(self) -> None:
        try:
            gone = [fd for fd in self.fds if fd < 0]
            if not gone:
                ready, _, _ = select.select([self._stop_read, *self.fds], [], [])
                if self._stop_read in ready:
                    return
                gone = ready
            proc = self.fds[gone[0]]
            status = exit_status(proc.pid)
            with self._lock:
                if self._stopped:
                    return
            self.on_death(proc, status)
        finally:
            with self._lock:
                self._stopped = True
                for fd in self.fds:
                    if fd >= 0:
                        with contextlib.suppress(OSError):
                            os.close(fd)
                self.fds = {-1 - i: p for i, p in enumerate(self.fds.values())}
                os.close(self._stop_read)
                os.close(self._stop_write)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
