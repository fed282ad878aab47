"""A quiet console for the vLLM engine: what vLLM and its processes print while the engine runs.

By default a ``VllmEngine`` shows vLLM's errors only, plus one progress line of its own while it
starts. vLLM's worker processes are spawned, so what they print is decided by the environment they
start with (``VLLM_LOGGING_LEVEL``, ``PYTHONWARNINGS``, ``TORCH_CPP_LOG_LEVEL``): it is set only
while the engine starts, and only where the user has not set it. A few lines that vLLM writes
while its modules are imported, before any of its settings apply, are dropped from the processes'
standard error by a filter (:class:`StderrFilter`). ``vllm_logs=True`` or ``ASYNCPP_VLLM_LOGS=1``
turns all of this off and shows vLLM's own logs.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

from ...kernel.errors import AsyncppError
from . import lifeline, start_errors

LOGS_ENV = "ASYNCPP_VLLM_LOGS"  # "1": show vLLM's own logs (VllmEngine(vllm_logs=None) reads it)

# python warnings vLLM's processes raise while importing vLLM (PYTHONWARNINGS takes module names
# literally, so these are exact)
QUIET_WARNINGS = (
    "ignore::FutureWarning:vllm.triton_utils.dispatcher",  # torch.distributed.reduce_op is deprecated
    "ignore::UserWarning:vllm.distributed.device_communicators.cpu_communicator",  # non-writable buffer
)

# lines vLLM's processes write to stderr before its logging is configured (Python's last-resort
# handler): nothing the user can act on
DROPPED_LINES = (b"Triton is installed, but doesn't include CPU backend. Disabling Triton.",)


def want_logs(option: bool | None) -> bool:
    """The engine's choice: the ``vllm_logs`` argument, else ``ASYNCPP_VLLM_LOGS``."""
    if option is not None:
        return bool(option)
    return os.environ.get(LOGS_ENV, "").strip().lower() not in ("", "0", "false", "no", "off")


def refuse_in_spawned_child(what: str) -> None:
    """Refuse to start vLLM's processes from a process that ``multiprocessing`` is still starting.

    vLLM starts its processes with "spawn", which runs the script's main module again in each of
    them: a script that starts an engine (or a node) outside ``if __name__ == "__main__":`` would
    start one more in every child, where multiprocessing refuses it with a message that does not
    say why. ``what`` names the call in the error."""
    if getattr(multiprocessing.current_process(), "_inheriting", False):
        main = sys.modules.get("__mp_main__") or sys.modules.get("__main__")
        script = getattr(main, "__file__", None) or "the script"
        err = AsyncppError(
            f"{what} was called while {script} was imported to start one of vLLM's processes: vLLM "
            f"starts them with 'spawn', which runs the main script again in each. Make the engine "
            f'(and run the traces) under `if __name__ == "__main__":` in {script}; blocks and '
            f"helpers can stay at module level"
        )
        start_errors.report(err)  # (the engine that is starting raises it in the script's process)
        raise err


def child_env(logs: bool, workers: int = 1) -> dict[str, str]:
    """The environment variables set while the engine starts (vLLM's processes inherit them).

    With several workers, vLLM's default thread binding (``auto``: each worker's OpenMP threads
    on cores of one NUMA node, after reserving one core per worker for the engine core process)
    asserts a NUMA node per worker, which a one-node machine does not have: those engines run
    with ``nobind``. A one-worker engine keeps vLLM's default.

    Unbound OpenMP threads wait passively (``OMP_WAIT_POLICY=PASSIVE``): by default they spin
    after every parallel region, on the very cores vLLM's engine core and this process need next.
    On a 2-core machine one 64-token generation took 97 to 494 ms (median 177) spinning, 87 to 182
    ms (median 110) waiting passively (docs/performance.md, "The standard view's cost")."""
    env = {LOGS_ENV: "1" if logs else "0"}  # the engine's choice, read by asyncpp's worker
    env[lifeline.ENV] = lifeline.driver_token()  # vLLM's processes end when this one does
    # vLLM 0.32 cannot load the ahead-of-time compiled artifacts it saves on its CPU platform
    # ("'function' object has no attribute 'finalize_loading'"): a compiled engine would compile
    # anyway, and save an artifact again. Without them inductor's own cache serves a later start.
    env["VLLM_USE_AOT_COMPILE"] = "0"
    if workers > 1:
        env["VLLM_CPU_OMP_THREADS_BIND"] = "nobind"
    if env.get("VLLM_CPU_OMP_THREADS_BIND", os.environ.get("VLLM_CPU_OMP_THREADS_BIND")) == "nobind":
        env["OMP_WAIT_POLICY"] = "PASSIVE"
    if logs:
        return env
    env.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    env["TORCH_CPP_LOG_LEVEL"] = "ERROR"  # c10 warnings of vLLM's C++ kernels ("NUMA binding: ...")
    env["PYTHONWARNINGS"] = ",".join(QUIET_WARNINGS)
    return env


@contextlib.contextmanager
def starting_env(logs: bool, workers: int = 1) -> Iterator[dict[str, str]]:
    """Set :func:`child_env` in ``os.environ`` while the engine starts, then restore it.

    A variable the user has set is kept (``PYTHONWARNINGS`` gets asyncpp's entries appended, so
    the user's own filters still apply), except ``ASYNCPP_VLLM_LOGS`` and ``ASYNCPP_DRIVER``, which
    carry the engine's choice and this process's name to its workers."""
    env = child_env(logs, workers)
    saved = {k: os.environ.get(k) for k in env}
    for key, value in env.items():
        old = saved[key]
        if key in (LOGS_ENV, lifeline.ENV) or old is None:
            os.environ[key] = value
        elif key == "PYTHONWARNINGS":
            os.environ[key] = f"{old},{value}" if old else value
    try:
        yield env
    finally:
        for key, old in saved.items():
            if old is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = old


class StderrFilter:
    """Forwards what vLLM's processes write to standard error, less :data:`DROPPED_LINES`.

    While :meth:`redirect` is active, file descriptor 2 of this process is a pipe; the processes
    vLLM starts then inherit it for their whole life, and a thread copies what they write to the
    real standard error line by line. Everything but the dropped lines is forwarded, at once (a
    partial line is held back only while it could still become a dropped one). The thread ends
    when the last of those processes has exited."""

    def __init__(self, dropped: tuple[bytes, ...] = DROPPED_LINES):
        self.dropped = dropped
        self.dropped_count = 0
        self._thread: threading.Thread | None = None

    @contextlib.contextmanager
    def redirect(self) -> Iterator[None]:
        """fd 2 is the pipe inside the ``with`` (for the processes started there, and for this
        process's own writes, which are forwarded too); the real stderr again after it."""
        with contextlib.suppress(Exception):
            sys.stderr.flush()
        read, write = os.pipe()
        real = os.dup(2)
        saved = os.dup(2)
        os.dup2(write, 2)
        os.close(write)  # fd 2 is now this process's only write end
        self._thread = threading.Thread(
            target=self._pump, args=(read, real), name="asyncpp-vllm-stderr", daemon=True
        )
        self._thread.start()
        try:
            yield
        finally:
            with contextlib.suppress(Exception):
                sys.stderr.flush()
            os.dup2(saved, 2)  # closes the pipe's write end here: EOF once the children exit
            os.close(saved)

    def join(self, timeout: float | None = None) -> bool:
        """Wait for the thread to end (all the processes that inherited the pipe have exited)."""
        if self._thread is None:
            return True
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def _pump(self, read: int, real: int) -> None:
        pending = b""
        forwarding = True
        try:
            while True:
                chunk = os.read(read, 65536)
                if not chunk:
                    break
                pending += chunk
                *lines, pending = pending.split(b"\n")
                out = [line + b"\n" for line in lines if not self._drop(line)]
                if pending and not any(d.startswith(pending.rstrip(b"\r")) for d in self.dropped):
                    out.append(pending)
                    pending = b""
                if out and forwarding:
                    forwarding = _write_all(real, b"".join(out))
            if pending and forwarding and not self._drop(pending):
                _write_all(real, pending)
        finally:
            os.close(read)
            os.close(real)

    def _drop(self, line: bytes) -> bool:
        if line.rstrip(b"\r") in self.dropped:
            self.dropped_count += 1
            return True
        return False


def _write_all(fd: int, data: bytes) -> bool:
    try:
        while data:
            data = data[os.write(fd, data) :]
    except OSError:
        return False  # stderr went away: keep draining the pipe so the children never block
    return True


class Progress:
    """The engine's one line of progress on stderr: ``asyncpp: starting ... ready in 21.4 s``."""

    def __init__(self, what: str, *, own_line: bool):
        self.what = what
        self.own_line = own_line  # vLLM's own logs interleave: finish on a line of its own
        self.start = time.perf_counter()
        self._write(f"asyncpp: starting {what}..." + ("\n" if own_line else ""))

    def done(self, how: str = "ready in") -> float:
        """End the line: ``ready in 21.4 s`` (or ``failed after 3.0 s``)."""
        seconds = time.perf_counter() - self.start
        lead = f"asyncpp: {self.what}: " if self.own_line else " "
        self._write(f"{lead}{how} {seconds:.1f} s\n")
        return seconds

    @staticmethod
    def _write(text: str) -> None:
        with contextlib.suppress(Exception):
            sys.stderr.write(text)
            sys.stderr.flush()


def describe(options: dict[str, Any], default_model: bool, mode: str) -> str:
    model = "the embedded tiny Llama" if default_model else str(options["model"])
    tp = int(options.get("tensor_parallel_size", 1) or 1)
    pp = int(options.get("pipeline_parallel_size", 1) or 1)
    return f"vLLM engine on {model} (TP={tp}, PP={pp}, {mode})"
