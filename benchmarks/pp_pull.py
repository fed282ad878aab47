"""Cross-stage pulls at PP=2: what one pulled value costs, against the wire it travels on.

A vLLM engine (``VllmEngine(dtype="float32", mode="eager", pipeline_parallel_size=2)``) on the
embedded tiny Llama built with 6 layers (hidden 128; layers 0-2 on stage 0, 3-5 on stage 1). Two
kinds of pull, each a block run in its own trace on one prompt, with ``k`` = 0..3 values:

1. **upstream, in place**: the block reads ``k`` stage-0 values (the embeddings' output, then
   layers 0 and 1) and forces the last row of each with ``float(x[-1].sum())``. Stage 1 pulls them
   where it stands (their owner ran earlier in this round);
2. **downstream, awaited**: the block reads ``k`` stage-1 values (layers 3, 4 and 5) and awaits
   ``asyncpp.pull(out[0][-1])`` of each in turn. Stage 0 parks until stage 1 has them.

Every (kind, ``k``) variant runs once per round, in rotated order, over ``--rounds`` rounds
after a warm-up. Per-pull latency is the least-squares slope over ``k`` of the lower quartile of
the trace times (they are bimodal on this machine, with stalls of tens of ms, so medians jump; the
slope of the medians is reported too). Bytes per pull, over the values pulled, summed over the
ranks: the values' own bytes (``engine.worker_stats()[r]["pulled_value_bytes"]``), against the
bytes the block used (one row: hidden x 4 bytes), and all the pull traffic (``pull_bytes``: the
value plus a request header with its selection and a reply header with the value's shape words,
about 270 bytes). The floor is a gloo send / receive round trip
between two fresh processes on this machine, in the same run, for the sizes concerned. Targets
(issue 16): at most 0.5 ms per pull for values up to 32 KiB; bytes pulled at most 1.1x the bytes
used (the values' own bytes). A missed target prints ``FAIL: ...`` and the exit status is 1.

Usage::

    .venv/bin/python benchmarks/pp_pull.py               # 40 rounds (~4 min)
    .venv/bin/python benchmarks/pp_pull.py --rounds 10   # a quick look
    .venv/bin/python benchmarks/pp_pull.py --write       # record it in docs/performance.md
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import sys
import tempfile
import time
from typing import Any

import bench_common

SECTION = "## Pipeline-parallel pulls (benchmarks/pp_pull.py, issue 16)"
PULL_TARGET_MS = 0.5
BYTES_TARGET = 1.1
KS = (0, 1, 2, 3)
LAYERS = 6
FLOOR_SIZES = (512, 4096, 32768, 1 << 20)
PROMPT = "The quick brown fox jumps over the lazy dog"
perf = time.perf_counter


def upstream(k: int):
    async def block(m):
        locs = [m.model.embed_tokens, m.model.layers[0], m.model.layers[1]][:k]
        vals = [await loc.output for loc in locs]
        total = 0.0
        for i, v in enumerate(vals):
            x = v if i == 0 else v[0]
            total += float(x[-1].sum())  # on stage 1: a pull of the last row, in place
        return total

    return block


def downstream(k: int):
    import asyncpp

    async def block(m):
        vals = [await m.model.layers[3 + i].output for i in range(k)]
        total = 0.0
        for v in vals:
            total += float((await asyncpp.pull(v[0][-1])).sum())  # on stage 0: parks until stage 1 has it
        return total

    return block


def quartile(xs: list[float]) -> float:
    """The lower quartile: trace times here are bimodal (stalls of tens of ms), so the median jumps."""
    return statistics.quantiles(xs, n=4)[0] if len(xs) > 1 else xs[0]


# ------------------------------------------------------------------------------------------------
# the floor: gloo round trips between two processes


def _ping(rank: int, path: str, sizes: tuple[int, ...], rounds: int, out: Any) -> None:
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{path}", rank=rank, world_size=2)
    res = {}
    for n in sizes:
        buf = torch.zeros(n, dtype=torch.uint8)
        times = []
        for r in range(rounds + 3):
            t0 = perf()
            if rank == 0:
                dist.send(buf, 1)
                dist.recv(buf, 1)
            else:
                dist.recv(buf, 0)
                dist.send(buf, 0)
            if r >= 3:
                times.append(perf() - t0)
        res[n] = statistics.median(times)
    if rank == 0:
        out.put(res)
    dist.destroy_process_group()


def gloo_floor(sizes: tuple[int, ...], rounds: int = 200) -> dict[int, float]:
    """Median round trip (s) of a send and a receive of each size between two processes."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "store")
        procs = [ctx.Process(target=_ping, args=(r, path, sizes, rounds, q)) for r in range(2)]
        for p in procs:
            p.start()
        res = q.get(timeout=120)
        for p in procs:
            p.join(timeout=30)
    return res


# ------------------------------------------------------------------------------------------------


def measure(engine: Any, kinds: dict[str, Any], rounds: int) -> dict[str, dict[str, Any]]:
    """Every (kind, k) variant, interleaved in rotated order within each round."""
    import asyncpp

    def counters() -> tuple[int, int]:
        stats = engine.worker_stats()
        return sum(s["pull_bytes"] for s in stats), sum(s["pulled_value_bytes"] for s in stats)

    def once(make: Any, k: int) -> tuple[float, tuple[int, int]]:
        before = counters()
        t0 = perf()
        with asyncpp.trace(engine) as t:
            t.invoke(PROMPT, make(k))
        wall = perf() - t0
        return wall, tuple(a - b for a, b in zip(counters(), before, strict=True))

    variants = [(name, k) for name in kinds for k in KS]
    for name, k in variants:
        once(kinds[name], k)  # warm-up
    times: dict[tuple[str, int], list[float]] = {v: [] for v in variants}
    nbytes: dict[tuple[str, int], list[tuple[int, int]]] = {v: [] for v in variants}
    for r in range(rounds):
        j = r % len(variants)
        for name, k in variants[j:] + variants[:j]:
            wall, b = once(kinds[name], k)
            times[(name, k)].append(wall)
            nbytes[(name, k)].append(b)
    out = {}
    for name in kinds:
        med = {k: statistics.median(times[(name, k)]) * 1000 for k in KS}
        low = {k: quartile(times[(name, k)]) * 1000 for k in KS}

        def per_pull(i: int, name: str = name) -> float:  # i: 0 wire bytes, 1 the values' own
            base = statistics.median(b[i] for b in nbytes[(name, 0)])
            return statistics.fmean(
                (statistics.median(b[i] for b in nbytes[(name, k)]) - base) / k for k in KS if k
            )

        out[name] = {
            "median_ms": med,
            "low_ms": low,
            "median_slope_ms": bench_common.slope([float(k) for k in KS], [med[k] for k in KS]),
            "slope_ms": bench_common.slope([float(k) for k in KS], [low[k] for k in KS]),
            "increments": [low[KS[i + 1]] - low[KS[i]] for i in range(len(KS) - 1)],
            "wire_bytes_per_pull": per_pull(0),
            "bytes_per_pull": per_pull(1),
        }
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=40, help="timed rounds per k (default 40)")
    ap.add_argument("--write", action="store_true", help="update the section in docs/performance.md")
    args = ap.parse_args()
    if args.rounds < 1:
        ap.error("--rounds must be positive")
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    t_start = perf()
    info = bench_common.machine_info()
    floor = gloo_floor(FLOOR_SIZES)
    print("gloo round trip: " + ", ".join(f"{n} B {t * 1e3:.3f} ms" for n, t in floor.items()), flush=True)

    import asyncpp
    from asyncpp.models.tiny import TINY_CONFIG, tiny_model_dir

    hidden = TINY_CONFIG["hidden_size"]
    used = hidden * 4  # one float32 row
    path = tiny_model_dir({"num_hidden_layers": LAYERS})
    with asyncpp.VllmEngine(path, dtype="float32", mode="eager", pipeline_parallel_size=2) as engine:
        results = measure(
            engine, {"upstream, in place": upstream, "downstream, awaited": downstream}, args.rounds
        )
        for name, r in results.items():
            print(
                f"{name}: lower-quartile ms per k {[round(r['low_ms'][k], 2) for k in KS]}, "
                f"slope {r['slope_ms']:.2f} ms per pull, {r['bytes_per_pull']:.0f} bytes per pull",
                flush=True,
            )

    fails = []
    rows = []
    for name, r in results.items():
        ratio = r["bytes_per_pull"] / used
        ok_t = r["slope_ms"] <= PULL_TARGET_MS
        ok_b = ratio <= BYTES_TARGET
        if not ok_t:
            fails.append(f"{name}: {r['slope_ms']:.2f} ms per pull, target <= {PULL_TARGET_MS} ms")
        if not ok_b:
            fails.append(f"{name}: {ratio:.1f}x the bytes used pulled, target <= {BYTES_TARGET}x")
        rows.append(
            [
                name,
                " / ".join(f"{r['low_ms'][k]:.1f}" for k in KS),
                " / ".join(f"{d:.2f}" for d in r["increments"]),
                f"{r['slope_ms']:.2f}" + ("" if ok_t else " **FAIL**"),
                f"{r['median_slope_ms']:.2f}",
                f"{r['wire_bytes_per_pull']:.0f}",
                f"{r['bytes_per_pull']:.0f}",
                f"{used}",
                f"{ratio:.1f}x" + ("" if ok_b else " **FAIL**"),
            ]
        )
    table = bench_common.md_table(
        [
            "pull",
            "trace ms (lower quartile), k = 0 / 1 / 2 / 3",
            "increments ms",
            "slope ms per pull",
            "slope of the medians",
            "wire bytes per pull",
            "value bytes per pull",
            "bytes used",
            "value bytes / used",
        ],
        rows,
    )
    floor_table = bench_common.md_table(
        ["size", "gloo round trip ms"], [[f"{n} B", f"{t * 1e3:.3f}"] for n, t in floor.items()]
    )
    date = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    text = "\n\n".join(
        [
            SECTION,
            f"Command: `{bench_common.command_line(__file__)}` ({date}; {perf() - t_start:.0f} s); "
            f"{args.rounds} rounds. The workloads and targets are in the script's docstring.",
            bench_common.machine_lines(info),
            table,
            "**The floor** (two fresh processes, gloo, a send and a receive of each size, median of 200)",
            floor_table,
            bench_common.verdict(fails, "All targets met."),
        ]
    )
    print(text, flush=True)
    for f in fails:
        print(f"FAIL: {f}", file=sys.stderr)
    if args.write:
        bench_common.write_section(SECTION, text + "\n")
        print(f"wrote the section to {bench_common.DOC.relative_to(bench_common.ROOT)}")
    return 1 if fails else 0


if __name__ == "__main__":
    sys.exit(main())
