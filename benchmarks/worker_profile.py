"""Where an asyncpp worker's step goes: vLLM and torch, asyncpp's own machinery, the block's own
code (issue 14).

The throughput benchmark (``vllm_stock.py``) says how much a workload costs over stock vLLM; this one
says whose cost it is. One asyncpp engine (the embedded tiny model, float32, as ``vllm_stock.py``
makes it) runs the workloads of ``vllm_stock.py`` in turn, with its blocks, prompts and requests
(batches of B requests, B = 32 by default, 64 new tokens each: plain requests on the engine's own
``AsyncLLM``, or one ``asyncpp.generate`` trace per request), back to back for ``--seconds`` each
while `py-spy <https://github.com/benfred/py-spy>`_ samples the worker process (``--native``,
200 Hz by default).

Each sample taken inside the worker's step calls (``execute_model``, ``sample_tokens``) is given to
the deepest owner on its stack, read from the leaf up:

* **block code**: a frame of the block's own function (``vllm_stock.py``'s blocks: what the user
  wrote, and the torch calls it makes);
* **asyncpp**: a frame of the ``asyncpp`` package (Python) or of its native extension
  (``asyncpp_native_*.so``): serving, the step loop, narrowing rows, switching torch's
  thread-local state, starting and ending blocks;
* **vLLM and torch**: a frame of ``vllm`` or ``torch`` Python code: the model, vLLM's runner and
  sampler.

Native frames of other libraries (torch's C++, CPython) take the owner of the Python frame that
called them: ``h[-1] += 0.01`` in a block is block code, a matmul in the model vLLM's. The shares are
of the samples inside the step calls (a step's CPU, as ``step_clock.py`` measures it), with a
binomial 95 % interval. What a workload costs over plain requests is in ``vllm_stock.py``; the block
code's share here is what any runtime that runs the user's Python per request would pay on top of
stock, the asyncpp share what asyncpp itself adds.

Needs ``py-spy`` (``pip install py-spy``) and the permission to read another process's memory
(``ptrace``; root, or ``kernel.yama.ptrace_scope`` 0).
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import bench_common
from vllm_stock import BLOCKS, ENV_DEFAULTS, ENV_FORCED, LABEL, make_prompts, run_batch

SECTION = "## Where a worker's step goes (benchmarks/worker_profile.py, issue 14)"
OWNERS = ("vLLM and torch", "asyncpp", "block code")
STEP_CALLS = ("AsyncppWorker.execute_model ", "AsyncppWorker.sample_tokens ")
BLOCK_FILE = Path(sys.modules[BLOCKS["reads"].__module__].__file__).name


def owner(frame: str, block_names: set[str]) -> str | None:
    """Who a py-spy frame (``name (file:line)`` or ``symbol (library.so)``) belongs to, or None for
    a frame that takes its caller's owner."""
    name, _, where = frame.rpartition(" (")
    if name in block_names and where.split(":")[0].endswith(BLOCK_FILE):
        return "block code"
    if where.startswith("asyncpp_native_") or where.startswith("asyncpp/") or "/asyncpp/" in where:
        return "asyncpp"
    if where.startswith(("vllm/", "torch/")) or "/vllm/" in where or "/torch/" in where:
        return "vLLM and torch"
    return None


def classify(raw: Path, block_names: set[str]) -> tuple[int, Counter, Counter]:
    """From py-spy's raw output: the samples inside step calls, per owner, and asyncpp's samples
    per innermost asyncpp frame."""
    steps, owners, inner = 0, Counter(), Counter()
    for line in raw.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not count.isdigit():
            continue
        frames = stack.split(";")
        if not any(f.startswith(STEP_CALLS) for f in frames):
            continue
        n = int(count)
        steps += n
        who, where = "vLLM and torch", ""
        for f in reversed(frames):
            got = owner(f, block_names)
            if got is not None:
                who, where = got, f
                break
        owners[who] += n
        if who == "asyncpp":
            name, _, loc = where.rpartition(" (")
            inner[f"{name} ({loc.split(':')[0].rstrip(')').rsplit('/', 1)[-1]})"] += n
    return steps, owners, inner


def share(k: int, n: int) -> str:
    """k of n as a percentage with a binomial 95 % interval (normal approximation)."""
    if n == 0:
        return "-"
    p = k / n
    half = 1.96 * math.sqrt(p * (1 - p) / n)
    return f"{100 * p:.1f} % [{100 * max(p - half, 0):.1f}, {100 * min(p + half, 1):.1f}]"


def profile(engine: Any, pid: int, workload: str, args: argparse.Namespace, out: Path) -> float:
    """Run ``workload`` in batches while py-spy samples the worker; the tokens generated per second."""
    live = SimpleNamespace(engine=engine, llm=engine.async_llm, loop=engine.loop)
    rounds = itertools.count()

    async def batch() -> int:
        ps = make_prompts(args.batch, 0, next(rounds))
        return sum(len(t) for t in await run_batch(live, workload, ps, args.max_new_tokens))

    with asyncio.Runner() as runner:
        runner.run(batch())  # warm-up
        spy = subprocess.Popen(
            [args.py_spy, "record", "--native", "-r", str(args.rate), "-d", str(args.seconds), "-f", "raw"]
            + ["-o", str(out), "-p", str(pid)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        tokens, t0 = 0, time.perf_counter()
        while spy.poll() is None:
            tokens += runner.run(batch())
        wall = time.perf_counter() - t0
    if spy.returncode != 0 or not out.exists():
        raise SystemExit(f"py-spy failed on the worker (pid {pid}): {spy.stderr.read().strip()}")
    return tokens / wall


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mode", default="compiled", choices=["compiled", "eager"])
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--seconds", type=int, default=30, help="py-spy's recording per workload")
    ap.add_argument("--rate", type=int, default=200, help="py-spy's samples per second")
    ap.add_argument("--workloads", default="plain,empty,reads,steer")
    ap.add_argument("--top", type=int, default=8, help="asyncpp frames listed per workload")
    ap.add_argument("--raw", type=Path, help="keep py-spy's raw stacks in this folder (<workload>.txt)")
    ap.add_argument(
        "--write", action="store_true", help=f"replace the section {SECTION!r} of docs/performance.md"
    )
    args = ap.parse_args()
    args.py_spy = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    if not Path(args.py_spy).exists():
        raise SystemExit("this benchmark needs py-spy: pip install py-spy")
    workloads = args.workloads.split(",")
    unknown = [w for w in workloads if w not in LABEL]
    if unknown:
        raise SystemExit(f"unknown workloads {unknown}; choose from {list(LABEL)}")
    os.environ.update(ENV_FORCED)  # as vllm_stock.py runs its engines
    for k, v in ENV_DEFAULTS.items():
        os.environ.setdefault(k, v)

    import asyncpp

    info = bench_common.machine_info()
    started = time.time()
    t0 = time.perf_counter()
    engine = asyncpp.VllmEngine(dtype="float32", mode=args.mode)
    start_s = time.perf_counter() - t0
    block_names = {b.__name__ for b in BLOCKS.values()}
    rows, detail = [], []
    try:
        pid = int(engine.worker_stats()[0]["pid"])
        with tempfile.TemporaryDirectory() as tmp:
            folder = args.raw or Path(tmp)
            folder.mkdir(parents=True, exist_ok=True)
            for w in workloads:
                tok_s = profile(engine, pid, w, args, folder / f"{w}.txt")
                n, owners, inner = classify(folder / f"{w}.txt", block_names)
                cells = [share(owners[o], n) for o in OWNERS]
                rows.append([LABEL[w], str(n), *cells, f"{tok_s:.0f}"])
                print(
                    f"{LABEL[w]}: {n} samples in steps; "
                    + ", ".join(f"{o} {c}" for o, c in zip(OWNERS, cells))
                )
                for frame, k in inner.most_common(args.top):
                    detail.append([LABEL[w], frame, f"{100 * k / n:.2f} %"])
                    print(f"    asyncpp {100 * k / n:5.2f} %  {frame}")
    finally:
        engine.close()

    command = bench_common.command_line(__file__)
    when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(started))
    text = "\n\n".join(
        [
            SECTION,
            f"Command: `{command}` ({when}; engine start {start_s:.0f} s). What is measured, and why, is "
            f"in the script's docstring: shares of the worker's samples inside its step calls, "
            f"asyncpp {args.mode} engine, tiny model, B = {args.batch}, {args.seconds} s of "
            f"py-spy at {args.rate} Hz per workload, 95 % intervals.",
            bench_common.machine_lines(info),
            bench_common.md_table(
                ["workload", "samples in steps", *OWNERS, "wall tok/s (info)"],
                rows,
            ),
            "asyncpp's samples by their innermost asyncpp frame (of all the step samples):",
            bench_common.md_table(["workload", "frame", "share of the step"], detail),
        ]
    )
    print("\n" + text)
    if args.write:
        bench_common.write_section(SECTION, text)
        print(f"\nwritten to {bench_common.DOC}")


if __name__ == "__main__":
    main()
