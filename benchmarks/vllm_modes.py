"""Which mode is the default: asyncpp's vLLM engine in each mode on the same workloads (issue 14).

One run, one model, three engines alive together and measured in turn, round by round (so that a
drift of the machine falls on all three alike): ``asyncpp.VllmEngine(model, dtype="float32",
mode=...)`` for ``eager``, ``compiled`` and ``auto`` (the default), with the machinery of
benchmarks/vllm_stock.py (its prompts, batches, process CPU clocks and request options). Workloads, B requests at once, 64 new tokens each, greedy:

* **plain**: requests without a block;
* **reads**: a block that awaits every decoder layer's output every step (taps: compiled steps on
  an auto engine);
* **steer**: a block that adds 0.01 to layer 1's output at the last position every step (a tap);
* **sub**: a block that reads layer 1's MLP output every step: no tap by default, so an auto engine
  runs those requests' steps eagerly (a compiled engine refuses the block: not measured there);
* **mixed**: half the batch ``reads``, half ``sub`` (every step of an auto engine is eager while a
  ``sub`` request is in it).

Reported: generated tokens per CPU second of all the engine's processes (median over rounds), each
mode against the compiled engine and against the eager one; and, the steady measure (one engine's
lifetime varies by up to 15 % against another's here), each workload against the same engine's
plain requests in the same round; and each engine's start and compile seconds. Usage::

    .venv/bin/python benchmarks/vllm_modes.py                 # print the table
    .venv/bin/python benchmarks/vllm_modes.py --write         # and update docs/performance.md
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_common  # noqa: E402
import vllm_stock as vs  # noqa: E402

SECTION = "## vLLM engine modes: which is the default (benchmarks/vllm_modes.py, issue 14)"
MODES = ("eager", "compiled", "auto")
WORKLOADS = ("plain", "reads", "steer", "sub", "mixed")


# (defined here, in __main__: pickled by value into every request)
async def read_every_layer(m: Any) -> None:
    async for _step in m.steps():
        for layer in m.model.layers:
            await layer.output


async def steer_one_layer(m: Any) -> None:
    async for _step in m.steps():
        h, _r = await m.model.layers[1].output
        h[-1] += 0.01


async def read_sub_module(m: Any) -> None:
    async for _step in m.steps():
        await m.model.layers[1].mlp.output


BLOCKS = {"reads": read_every_layer, "steer": steer_one_layer, "sub": read_sub_module}


def runs_on(mode: str, workload: str) -> bool:
    return mode != "compiled" or workload not in ("sub", "mixed")


async def batch(live: Any, workload: str, prompts: list[list[int]], n: int) -> list[list[int]]:
    if workload == "plain":
        return await vs.plain_batch(live, prompts, n)
    if workload == "mixed":
        half = len(prompts) // 2
        a, b = await asyncio.gather(
            vs.trace_batch(live, prompts[:half], BLOCKS["reads"], n),
            vs.trace_batch(live, prompts[half:], BLOCKS["sub"], n),
        )
        return a + b
    return await vs.trace_batch(live, prompts, BLOCKS[workload], n)


async def measure(live: Any, args: argparse.Namespace, out: dict, rnd: int) -> None:
    """One round of every workload on one engine (round -1: the warm-up, not kept)."""
    mode = live.spec.mode
    workloads = [w for w in WORKLOADS if runs_on(mode, w)]
    prompts = vs.make_prompts(args.batch, args.seed, rnd)
    k = max(rnd, 0) % len(workloads)
    gc.collect()
    for w in workloads[k:] + workloads[:k]:
        c0 = live.procs.sample()[0]
        t0 = time.perf_counter()
        tokens = await batch(live, w, prompts, args.max_new_tokens)
        wall = time.perf_counter() - t0
        cpu = live.procs.sample()[0] - c0
        made = sum(len(t) for t in tokens)
        if rnd >= 0:
            out.setdefault((mode, w), []).append((made / cpu, made / wall))
    if rnd >= 0:
        figures = ", ".join(f"{w} {out[(mode, w)][-1][0]:.0f}" for w in workloads)
        print(f"  {mode} round {rnd + 1}/{args.rounds}: tok/CPU-s {figures}", flush=True)


def table(out: dict, engines: dict[str, dict[str, float]]) -> str:
    def med(mode: str, w: str, i: int = 0) -> float | None:
        got = out.get((mode, w))
        return statistics.median(x[i] for x in got) if got else None

    rows = [
        "| workload | eager | compiled | auto | auto / compiled | auto / eager | wall tok/s (eager / compiled / auto) |",
        "|---|---|---|---|---|---|---|",
    ]
    for w in WORKLOADS:
        cells = [med(m, w) for m in MODES]
        walls = [med(m, w, 1) for m in MODES]
        eager, compiled, auto = cells

        def ratio(a: float | None, b: float | None) -> str:
            return f"{a / b:.2f}" if a and b else "n/a"

        rows.append(
            f"| {w} | "
            + " | ".join("refused" if c is None else f"{c:.0f}" for c in cells)
            + f" | {ratio(auto, compiled)} | {ratio(auto, eager)} | "
            + " / ".join("-" if x is None else f"{x:.0f}" for x in walls)
            + " |"
        )
    starts = ", ".join(
        f"{m}: start {e['start']:.1f} s (compile {e['compile']:.1f} s)" for m, e in engines.items()
    )
    own = [
        "| workload / plain, same engine and round | eager | compiled | auto |",
        "|---|---|---|---|",
    ]
    for w in WORKLOADS[1:]:
        cells = []
        for m in MODES:
            got, plain = out.get((m, w)), out.get((m, "plain"))
            if not got:
                cells.append("refused")
                continue
            ratios = [a[0] / b[0] for a, b in zip(got, plain, strict=True)]
            cells.append(f"{statistics.median(ratios):.2f} [{min(ratios):.2f}, {max(ratios):.2f}]")
        own.append(f"| {w} | " + " | ".join(cells) + " |")
    return "\n".join(rows) + "\n\n" + "\n".join(own) + f"\n\nEngines: {starts}.\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="tiny", choices=["tiny", "small"], help="the model (default tiny)")
    ap.add_argument("--batch", type=int, default=32, help="requests per batch (default 32)")
    ap.add_argument("--rounds", type=int, default=3, help="timed rounds per engine (default 3)")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--write", action="store_true", help="update the section in docs/performance.md")
    args = ap.parse_args()
    os.environ.update(vs.ENV_FORCED)
    for k, v in vs.ENV_DEFAULTS.items():
        os.environ.setdefault(k, v)
    vs._import_vllm()
    from asyncpp.models import tiny_model_dir

    model = tiny_model_dir(vs.MODELS[args.model])
    out: dict = {}
    engines: dict[str, dict[str, float]] = {}
    t0 = time.perf_counter()
    lives = []
    try:
        for mode in MODES:
            live = vs.start_engine(vs._spec("asyncpp", "asyncpp", mode), model)
            lives.append(live)
            engines[mode] = {"start": live.start_seconds, "compile": live.asyncpp_compile_seconds or 0.0}
            print(f"{mode}: started in {live.start_seconds:.1f} s", flush=True)

        async def rounds() -> None:
            for rnd in range(-1, args.rounds):
                k = max(rnd, 0) % len(lives)
                for live in lives[k:] + lives[:k]:
                    await measure(live, args, out, rnd)

        asyncio.run(rounds())
    finally:
        for live in lives:
            vs.close_engine(live)
    text = table(out, engines)
    cmd = "python benchmarks/vllm_modes.py " + " ".join(sys.argv[1:])
    body = (
        f"{SECTION}\n\nAsyncpp's `VllmEngine` in each mode on the same requests: {vs.MODEL_LABEL[args.model]}, "
        f"float32, B={args.batch} requests at once, {args.max_new_tokens} new tokens each, greedy, new "
        f"prompts every round; generated tokens per CPU second of all the engine's processes (median of "
        f"{args.rounds} rounds, the three engines alive together and measured in turn; higher is better). `sub` reads a sub-module (no tap): a compiled engine "
        f"refuses it, an auto one runs those requests' steps eagerly; `mixed` is half `reads`, half "
        f"`sub`. Command: `{cmd.strip()}` ({time.perf_counter() - t0:.0f} s).\n\n{text}"
    )
    print(body)
    if args.write:
        bench_common.write_section(SECTION, body, vs.DOC)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
