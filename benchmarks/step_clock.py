"""A clock inside a vLLM worker's step calls, for benchmarks (issue 14).

Mixed into any vLLM worker with the engine option
``worker_extension_cls="step_clock.StepClock"`` (this folder on ``PYTHONPATH`` of the engine's
processes): stock vLLM's own worker and asyncpp's alike, so both are timed the same way. The
first ``collective_rpc("bench_step_log")`` wraps the worker's ``execute_model`` and
``sample_tokens`` (on the instance: vLLM's worker loop looks them up by name); every later call
returns the steps since the one before, each as its scheduled tokens and the process CPU time (every
thread) spent inside that step's two calls.

Why: vLLM's processes poll their queues while they wait (a worker spins for about a second after
each message), so on a 2-core machine the CPU time of a whole process follows the wall time and
whatever else the machine runs. The CPU time a worker spends *inside* its steps is the work a step
does: the model, vLLM's runner, and on asyncpp's worker every block it serves.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

_CPU = time.CLOCK_PROCESS_CPUTIME_ID


class StepClock:
    """Worker extension: the CPU time of each of the worker's steps."""

    def bench_step_log(self) -> list[list[int]]:
        """Every step since the last call, as [tokens scheduled, CPU ns], and empties the log (the
        first call installs the clock and returns nothing)."""
        log = self.__dict__.get("_bench_step_log")
        if log is None:
            log = self.__dict__["_bench_step_log"] = []
            self.execute_model = _timed(self.execute_model, log, True)
            self.sample_tokens = _timed(self.sample_tokens, log, False)
        out = list(log)
        log.clear()
        return out


def _timed(call: Callable[..., Any], log: list[list[int]], starts: bool) -> Callable[..., Any]:
    """``call`` timed: a step's ``execute_model`` starts an entry, its ``sample_tokens`` adds to it."""
    cpu = time.clock_gettime_ns

    def timed(*args: Any, **kwargs: Any) -> Any:
        c0 = cpu(_CPU)
        try:
            return call(*args, **kwargs)
        finally:
            c = cpu(_CPU) - c0
            if starts:
                log.append([getattr(args[0], "total_num_scheduled_tokens", -1) if args else -1, c])
            elif log:
                log[-1][1] += c

    return timed
