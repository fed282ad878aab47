"""Two nodes against one: the pipeline-parallel workloads on PP=2 split over two node processes
(vLLM's multiprocessing executor with ``nnodes=2``: the head, this process, holds stage 0; a
headless ``asyncpp serve --headless`` process, started here, holds stage 1) against PP=2 on one
node, the same model and blocks.

Both engines are ``asyncpp.VllmEngine(dtype="float32", mode="eager", pipeline_parallel_size=2)``
on the embedded tiny Llama, started one at a time (each closed before the next starts), and run
``benchmarks/pp_parity.py``'s workloads on the same prompts: per workload, the **wall time** of
the two-node engine over the one-node one (medians of ``--repeats`` timed runs each, after an
untimed warm-up run), the **bytes pulled** across stages per run (the change of the workers'
``pull_bytes``), and the agreement of the results (top-1 agreement and the largest total variation
of the two-node engine's cells against the one-node engine's: targets 1.00 and 0.000). Both nodes
are on this host and talk over 127.0.0.1, so the time ratio is what the multi-node path itself
costs (TCP instead of shared memory between the stages, vLLM's queues over ZMQ), not a network.

Usage::

    python benchmarks/multinode.py [--prompts N] [--repeats N] [--write]

``--write`` records the table in docs/performance.md ("Two nodes against one").
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import time
from statistics import median
from typing import Any

import bench_common
from pp_parity import CELLS, QUICK_PROMPTS, TOP1_TARGET, TV_TARGET, WORKLOADS, compare, make_ctx, measure

ROOT = bench_common.ROOT
DOC = bench_common.DOC
SECTION = "## Two nodes against one"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(two_nodes: bool) -> tuple[Any, subprocess.Popen | None]:
    import asyncpp

    options: dict[str, Any] = {"dtype": "float32", "mode": "eager", "pipeline_parallel_size": 2}
    node = None
    if two_nodes:
        port = free_port()
        node = subprocess.Popen(
            [
                sys.executable, "-m", "asyncpp.serve", "--headless", "--nnodes", "2", "--node-rank", "1",
                "--master-addr", "127.0.0.1", "--master-port", str(port), "--mode", "eager",
                "--pipeline-parallel-size", "2", "--dtype", "float32",
            ],
            start_new_session=True,
        )  # fmt: skip
        options.update(nnodes=2, node_rank=0, master_addr="127.0.0.1", master_port=port, node_timeout=240)
    try:
        return asyncpp.VllmEngine(**options), node
    except BaseException:
        stop(node)
        raise


def stop(node: subprocess.Popen | None) -> None:
    if node is None:
        return
    try:
        node.wait(60)  # it ends by itself once the head's engine has closed
    except subprocess.TimeoutExpired:
        os.killpg(node.pid, signal.SIGKILL)
        node.wait(10)


def run(two_nodes: bool, ctx: Any, repeats: int) -> dict[str, Any]:
    engine, node = start(two_nodes)
    try:
        out = {name: measure(engine, fn, ctx, repeats) for name, fn in WORKLOADS.items()}
    finally:
        engine.close()
        stop(node)
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--prompts", type=int, default=QUICK_PROMPTS, help="prompts per workload")
    p.add_argument("--repeats", type=int, default=5, help="timed runs per workload and engine")
    p.add_argument("--write", action="store_true", help="record the table in docs/performance.md")
    args = p.parse_args()
    info = bench_common.machine_info()
    ctx = make_ctx(args.prompts)
    t0 = time.perf_counter()
    one = run(False, ctx, args.repeats)
    two = run(True, ctx, args.repeats)
    rows, fails = [], []
    for name in WORKLOADS:
        a, b = one[name], two[name]
        c = compare(a.out, b.out)
        t_a, t_b = median(a.times), median(b.times)
        bytes_a, bytes_b = median(a.pulled[1:] or a.pulled), median(b.pulled[1:] or b.pulled)
        rows.append(
            [
                f"{name} ({CELLS[name]})",
                f"{t_b / t_a:.2f}x ({t_b * 1000:.0f} / {t_a * 1000:.0f} ms)",
                f"{bytes_b:,.0f} / {bytes_a:,.0f}",
                f"{c.top1:.2f}",
                f"{c.max_tv:.3f}",
            ]
        )
        if c.top1 < TOP1_TARGET or c.max_tv > TV_TARGET:
            fails.append(f"{name}: top-1 {c.top1:.2f}, total variation {c.max_tv:.4f}")
        if c.tokens_equal is False:
            fails.append(f"{name}: the tokens differ")
    table = bench_common.md_table(
        [
            "workload (cells)",
            "wall time, two nodes / one node (medians)",
            "bytes pulled per run, two nodes / one node",
            "top-1 agreement",
            "max total variation",
        ],
        rows,
    )
    text = f"""{SECTION}

PP=2 over two node processes on one host (vLLM's multiprocessing executor, `nnodes=2`: this process
holds stage 0, a headless `asyncpp serve --headless` process stage 1, over 127.0.0.1) against PP=2
on one node: `benchmarks/pp_parity.py`'s workloads, {args.prompts} prompts each, eager engines on
the embedded tiny Llama at float32, the median of {args.repeats} timed runs per workload after a
warm-up run, the engines started one at a time. Targets for the results: top-1 agreement
{TOP1_TARGET:.2f}, total variation 0.000; the times are information (what the multi-node path costs
on one host: TCP between the stages instead of shared memory; no network).

{table}

Command: `{bench_common.command_line(__file__)}` ({time.perf_counter() - t0:.0f} s in all)

{bench_common.machine_lines(info)}

{bench_common.verdict(fails)}
"""
    return bench_common.finish(SECTION, text, fails, args.write, DOC)


if __name__ == "__main__":
    sys.exit(main())
