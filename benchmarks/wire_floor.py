"""The gloo round trip between an engine's first two pipeline stages, measured inside the engine.

A worker extension for benchmarks (issue 16): ``worker_extension_cls="wire_floor.WireFloor"``, with
this folder on ``PYTHONPATH`` of the engine's processes. ``bench_wire_floor(nbytes, rounds)``, called
on every worker at once (``collective_rpc``), makes the workers of stages 0 and 1 (the first of
each: tensor-parallel rank 0) do ``rounds`` gloo send / receive round trips of ``nbytes`` on vLLM's
pipeline group; stage 0's worker returns their median in seconds, the others None: the wire
between the very processes a pull crosses (pp_pull.py reports it beside its floor, which two fresh
processes measure).
"""

from __future__ import annotations

import statistics
import time
from typing import Any

_TAG = 16016  # a tag of its own, apart from vLLM's sends on the same group


def round_trips(buf: Any, peer: int, first: bool, rounds: int, group: Any = None, tag: int = 0) -> float:
    """Median seconds of ``rounds`` gloo send / receive round trips of ``buf`` with ``peer`` (the
    ``first`` side sends first), after three that warm the pair up."""
    import torch.distributed as dist

    times = []
    for r in range(rounds + 3):
        t0 = time.perf_counter()
        if first:
            dist.send(buf, peer, group=group, tag=tag)
            dist.recv(buf, peer, group=group, tag=tag)
        else:
            dist.recv(buf, peer, group=group, tag=tag)
            dist.send(buf, peer, group=group, tag=tag)
        if r >= 3:
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


class WireFloor:
    """Worker extension: gloo round trips between pipeline stages 0 and 1."""

    def bench_wire_floor(self, nbytes: int, rounds: int) -> float | None:
        import torch
        from vllm.distributed.parallel_state import get_pp_group, get_tp_group

        pp = get_pp_group()
        if pp.world_size < 2 or pp.rank_in_group > 1 or get_tp_group().rank_in_group != 0:
            return None
        first = pp.rank_in_group == 0
        peer = pp.ranks[1 if first else 0]
        buf = torch.zeros(nbytes, dtype=torch.uint8)
        median = round_trips(buf, peer, first, rounds, group=pp.cpu_group, tag=_TAG)
        return median if first else None
