"""A clock inside a vLLM worker's step calls, for benchmarks (issue 14).

Mixed into any vLLM worker with the engine option
``worker_extension_cls="step_clock.StepClock"`` (this folder on ``PYTHONPATH`` of the engine's
processes): stock vLLM's own worker and asyncpp's alike, so both are timed the same way. The
first ``collective_rpc("bench_step_clock")`` wraps the worker's ``execute_model`` and
``sample_tokens`` (on the instance: vLLM's worker loop looks them up by name); every call returns
``(cpu_ns, wall_ns, calls)`` so far, the process CPU time (every thread) and wall time spent inside
those calls.

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
    """Worker extension: CPU and wall nanoseconds inside the worker's step calls."""

    def bench_step_clock(self) -> tuple[int, int, int]:
        """Install the clock on first use; the totals so far."""
        totals = self.__dict__.get("_bench_step_totals")
        if totals is None:
            totals = self.__dict__["_bench_step_totals"] = [0, 0, 0]
            log: list[list[int]] = []
            self.__dict__["_bench_step_log"] = log
            self.execute_model = _timed(self.execute_model, totals, log, True)
            self.sample_tokens = _timed(self.sample_tokens, totals, log, False)
        return totals[0], totals[1], totals[2]

    def bench_step_log(self) -> list[list[int]]:
        """Every step since the last call, as [tokens scheduled, CPU ns]; the log is emptied."""
        log = self.__dict__.get("_bench_step_log", [])
        out = list(log)
        log.clear()
        return out


def _timed(
    call: Callable[..., Any], totals: list[int], log: list[list[int]], starts: bool
) -> Callable[..., Any]:
    cpu, wall = time.clock_gettime_ns, time.perf_counter_ns

    def timed(*args: Any, **kwargs: Any) -> Any:
        c0, w0 = cpu(_CPU), wall()
        try:
            return call(*args, **kwargs)
        finally:
            c = cpu(_CPU) - c0
            totals[0] += c
            totals[1] += wall() - w0
            totals[2] += 1
            if starts:
                log.append([getattr(args[0], "total_num_scheduled_tokens", -1) if args else -1, c])
            elif log:
                log[-1][1] += c

    return timed
