"""What a compiled engine's taps cost, and what the native front door saves (issue 14).

A compiled vLLM engine calls ``torch.ops.asyncpp.tap.default(values, site, layout, stage)`` from
its graph's Python code at every tap, some 14 times a step on the embedded tiny Llama. With native
controllers the overload's entry is replaced by the native front door (``tap_front``,
csrc/tap_op.cpp), which serves a plain call without torch's dispatcher. Two measures, each side by
side in one run:

1. **One cold tap** (nobody waits on it), called as the graph calls it, through torch's dispatcher
   (to the operator's C++ kernel) and through the front door: the best of 5 x 20,000 calls, with
   one and two tensors.
2. **In one engine**: an asyncpp compiled engine on the tiny model, the front door put in place and
   taken away batch by batch (the worker extension ``TapSwitch``, with the step clock of
   step_clock.py), the order alternating every round. Per batch, the median CPU of its steps that
   decode the whole batch (B tokens); per round, the ratio dispatcher / front door (above 1: the
   door is cheaper); reported: the median ratio over rounds with its range, and each way's lowest
   step. Greedy tokens must be the same both ways.

Usage::

    .venv/bin/python benchmarks/tap_cost.py                 # 10 rounds, B = 1, 16, 32
    .venv/bin/python benchmarks/tap_cost.py --rounds 10 --write
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import gc
import os
import sys
import time
from pathlib import Path
from statistics import median
from typing import Any

import bench_common
from step_clock import StepClock

SECTION = "## A compiled engine's taps: the native front door (benchmarks/tap_cost.py, issue 14)"
WORKLOADS = ("plain", "empty", "reads", "steer")  # vllm_stock.py's workloads and blocks


class TapSwitch(StepClock):
    """Worker extension: the step clock, and the front door put in place or taken away."""

    def bench_front_door(self, on: bool) -> bool:
        """Whether the front door serves the taps now (after putting it in place, or not)."""
        import torch

        from asyncpp.engines.vllm import taps

        native = taps._native
        if native is None:
            return False
        if on:
            taps._open_front_door(native)
        else:
            taps._close_front_door(native)
        return torch.ops.asyncpp.tap.default._op is native.tap_front


def micro() -> dict[tuple[str, str], float]:
    """Microseconds per cold tap: (way, "one" | "two" tensors) -> the best of 5 x 20,000 calls."""
    import torch

    from asyncpp.engines.vllm import taps
    from asyncpp.native import load

    native = load()
    overload = torch.ops.asyncpp.tap.default
    h, r = torch.randn(4, 128), torch.randn(4, 128)
    calls = {"one": ([h], 3, [taps.BARE], 2), "two": ([h, r], 4, [1, 1], 2)}
    best: dict[tuple[str, str], float] = {}
    native.tap_register()
    native.tap_bind(set(), {99}, [0] * 8, taps._tap)
    try:
        with torch.inference_mode():
            for _ in range(5):
                for way in ("dispatcher", "front door"):
                    if way == "front door":
                        taps._open_front_door(native)
                    try:
                        for name, args in calls.items():
                            t = time.perf_counter_ns()
                            for _ in range(20_000):
                                overload(*args)
                            us = (time.perf_counter_ns() - t) / 20_000 / 1000
                            best[way, name] = min(best.get((way, name), us), us)
                    finally:
                        taps._close_front_door(native)
    finally:
        native.tap_unbind()
        native.tap_register(False)
    return best


async def in_engine(live: Any, rounds: int, batches: list[int], n: int) -> dict[str, Any]:
    """Per (workload, B, door on/off): the median decode-step CPU of each round's batch, and
    whether the greedy tokens agreed both ways."""
    import vllm_stock as vs

    async def door(on: bool) -> None:
        rpc = asyncio.run_coroutine_threadsafe(
            live.llm.collective_rpc("bench_front_door", args=(on,)), live.loop
        )
        if (await asyncio.wrap_future(rpc)) != [on]:
            raise RuntimeError("the worker did not switch its taps' front door")

    steps: dict[tuple[str, int, bool], list[float]] = {}
    same = True
    for b in batches:  # a warm-up batch per size
        await vs.run_batch(live, "plain", vs.make_prompts(b, 0, -1), n)
    for r in range(rounds):
        for workload in WORKLOADS:
            for b in batches:
                prompts = vs.make_prompts(b, 0, r)
                tokens = []
                for on in (True, False) if r % 2 == 0 else (False, True):
                    await door(on)
                    await vs.step_log(live, b)
                    tokens.append(await vs.run_batch(live, workload, prompts, n))
                    _, decode = await vs.step_log(live, b)
                    steps.setdefault((workload, b, on), []).append(median(decode))
                same = same and tokens[0] == tokens[1]
        print(f"  round {r + 1}/{rounds}", flush=True)
    await door(True)
    return {"steps": steps, "same": same}


def render(
    best: dict, res: dict, batches: list[int], info: dict[str, str], seconds: float
) -> tuple[str, list[str]]:
    fails = []
    micro_rows = [
        [
            f"{name} tensor{'s' if name == 'two' else ''}",
            f"{best['dispatcher', name]:.2f}",
            f"{best['front door', name]:.2f}",
            f"{best['dispatcher', name] / best['front door', name]:.1f}x",
        ]
        for name in ("one", "two")
    ]
    rows = []
    steps = res["steps"]
    for workload in WORKLOADS:
        for b in batches:
            on, off = steps[workload, b, True], steps[workload, b, False]
            ratios = sorted(y / x for x, y in zip(on, off, strict=True))
            rows.append(
                [
                    workload,
                    str(b),
                    f"{min(off) * 1e6:.0f} / {min(on) * 1e6:.0f}",
                    f"{(min(off) - min(on)) * 1e6:+.0f}",
                    f"{median(ratios):.3f} [{ratios[0]:.3f}, {ratios[-1]:.3f}]",
                ]
            )
    if not res["same"]:
        fails.append("greedy tokens differed between the front door and the dispatcher")
    for name in ("one", "two"):
        if best["front door", name] >= best["dispatcher", name]:
            fails.append(f"a cold tap ({name}) is not cheaper through the front door")
    date = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    text = f"""{SECTION}

Command: `{bench_common.command_line(__file__)}` ({date}; {seconds:.0f} s). What is measured, and
why, is in the script's docstring.

{bench_common.machine_lines(info)}

**One cold tap**, called as the compiled graph calls it (best of 5 x 20,000 calls):

{bench_common.md_table(["the tap's values", "through torch's dispatcher, us", "through the front door, us", "dispatcher / door"], micro_rows)}

**In one engine** (asyncpp compiled, tiny model; the front door put in place and taken away batch
by batch): the CPU of a step that decodes the whole batch, each way's lowest over
{len(steps[WORKLOADS[0], batches[0], True])} rounds, and the round-by-round ratio dispatcher / door
(median [min, max]; above 1: the door is cheaper). Greedy tokens the same both ways:
{"yes" if res["same"] else "NO"}.

{bench_common.md_table(["workload", "B", "decode step, us: dispatcher / door", "door saves, us", "ratio dispatcher / door"], rows)}

{bench_common.verdict(fails)}
"""
    return text, fails


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=10, help="rounds in the engine (default 10)")
    ap.add_argument("--batches", default="1,16,32", help="batch sizes B, comma-separated (default 1,16,32)")
    ap.add_argument("--max-new-tokens", type=int, default=64, help="tokens per request (default 64)")
    ap.add_argument("--write", action="store_true", help="update the section in docs/performance.md")
    args = ap.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    if args.rounds < 1 or not batches or min(batches) < 1:
        ap.error("--rounds and the batch sizes must be positive")
    import vllm_stock as vs

    os.environ.update(vs.ENV_FORCED)
    for k, v in vs.ENV_DEFAULTS.items():
        os.environ.setdefault(k, v)
    here = str(Path(__file__).resolve().parent)  # the engine's processes import TapSwitch from here
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (here, os.environ.get("PYTHONPATH")) if p)
    vs._import_vllm()
    import vllm

    from asyncpp.models import tiny_model_dir

    info = bench_common.machine_info(extra={"vllm": vllm.__version__})
    t0 = time.perf_counter()
    best = micro()
    print("one cold tap, us:", {f"{w}, {n}": round(v, 2) for (w, n), v in best.items()}, flush=True)
    live = vs.start_engine(vs._spec("asyncpp", "asyncpp", "compiled"), tiny_model_dir(), "tap_cost.TapSwitch")
    try:
        res = asyncio.run(in_engine(live, args.rounds, batches, args.max_new_tokens))
    finally:
        vs.close_engine(live)
        del live  # (closed before the interpreter exits, not by vLLM's finalizer then)
        gc.collect()
    text, fails = render(best, res, batches, info, time.perf_counter() - t0)
    return bench_common.finish(SECTION, text, fails, args.write)


if __name__ == "__main__":
    sys.exit(main())
