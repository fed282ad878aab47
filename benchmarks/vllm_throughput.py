"""Decode throughput and time to first token of asyncpp traces on a real vLLM engine, in one run.

One ``asyncpp.VllmEngine`` (the embedded tiny 4-layer Llama, float32, asyncpp's defaults: eager
mode, prefix caching and chunked prefill off) serves every variant, on the same prompts:

* **(a) plain**: plain vLLM requests, no blocks: ``AsyncLLM.generate`` on the engine's own
  ``AsyncLLM`` (greedy, ``ignore_eos``), submitted to the engine's event loop. asyncpp's worker
  keeps its controllers installed for good, so this baseline already runs with idle controllers:
  the ratios below are the cost of *running blocks*, not of the asyncpp worker itself;
* **(b) reads**: one ``asyncpp.generate`` trace per request whose block reads every decoder
  layer's output at every generated step
  (``async for step in m.steps(): for layer in m.model.layers: await layer.output``);
* **(c) empty**: the same traces with a block that awaits nothing (``return None``): what is left is
  the per-request cost (the block pickled into the request, started in the worker, its outcome
  sent back with the request's end, the engine step after its last output).

Throughput: a batch of B concurrent requests (prompts of mixed lengths, 8-64 tokens, spread evenly;
``max_new_tokens`` 64) is submitted at once from the caller's event loop, and timed from the
submission to the last result: generated tokens / wall seconds. Every variant runs once per round
for every B, in rotated order (each variant first in a third of the rounds), after a warm-up
round. Ratios (b)/(a) and (c)/(a) are taken round by round (variants of a round run within a few
seconds, so load that comes and goes hits them alike); the median over rounds is reported with a
distribution-free 95% interval, and a verdict is *inconclusive* when that interval straddles the
target.

Time to first token: for (a) the time from submission to the first streamed output. A trace's
first token is not streamed (its result arrives with the request's end), so for traces TTFT
is the wall time of a ``max_new_tokens=1`` trace, set against the wall time of a ``max_tokens=1``
plain request (both measured from the caller's loop). Measured for single requests (B = 1, the
engine otherwise idle) and for every request of a batch of B submitted at once (median over the
batch's requests).

The end of a trace: the wait from its requests' last outputs to their outcomes (the workers send
each request's end, with its block's outcome, the engine step after its last output) is timed
around the engine's ``settle``, in this process; an ``asyncpp_collect`` RPC of no ids on the idle
engine gives, for comparison, the round trip through the engine core to the worker that a
trace would cost if it asked the workers for its outcomes.

Worker CPU (unless ``--no-worker-timing``): a timer sent into the worker with
``collective_rpc`` (a callable, which vLLM accepts only with ``VLLM_ALLOW_INSECURE_SERIALIZATION=1``,
set for the whole run) records the worker thread's CPU time (``time.thread_time``) of every engine
step (``execute_model`` + ``sample_tokens``) and every ``asyncpp_collect``, per timed batch. CPU
time does not count what other processes take from the worker, so these figures hold up on a busy
machine better than wall times do; they show the blocks' cost where it is paid.

``--profile`` splits the worker's cost of a reading block (B = the largest size): the step loop
alone (a block that iterates ``m.steps()`` and awaits nothing else), the reads, and the reads with
asyncpp's row narrowing (``asyncpp.kernel.batching.narrow``) swapped for the identity in the worker
(fine for a block that ignores what it reads). It reaches into asyncpp's internals and may need
updating when they change.

Every trace's generated tokens are checked against the plain requests' tokens of the same round
(greedy): a difference aborts the run.

Usage::

    .venv/bin/python benchmarks/vllm_throughput.py                      # print the tables
    .venv/bin/python benchmarks/vllm_throughput.py --write --profile    # update docs/performance.md
    .venv/bin/python benchmarks/vllm_throughput.py --quick              # a short run to try it
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import gc
import math
import os
import platform
import random
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from statistics import median
from typing import Any

import bench_common

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "performance.md"
SECTION = "## vLLM decode throughput (benchmarks/vllm_throughput.py)"

RATIO_TARGET = 0.9  # (b)/(a): traces that read every layer at every step vs plain requests
PROMPT_MIN, PROMPT_MAX = 8, 64
MIN_ROUNDS = 6  # throughput rounds run even past --budget

perf = time.perf_counter

TEXT = bench_common.PROMPT_TEXT  # prompts are cut from it


# ------------------------------------------------------------------------------------------------
# the blocks (pickled by value into every request: they are defined in __main__)


async def read_every_layer(m):
    async for _step in m.steps():
        for layer in m.model.layers:
            await layer.output  # a vLLM decoder layer's output: (mlp_out, residual)


async def no_awaits(m):
    return None


async def steps_only(m):  # --profile: the step loop alone
    async for _step in m.steps():
        pass


VARIANTS = ("plain", "reads", "empty")
LABEL = {
    "plain": "(a) plain vLLM requests",
    "reads": "(b) traces, block reads every layer every step",
    "empty": "(c) traces, block awaits nothing",
}
BLOCKS = {"reads": read_every_layer, "empty": no_awaits}


# ------------------------------------------------------------------------------------------------
# prompts


def make_prompts(tokenizer: Any, count: int, seed: int) -> list[list[int]]:
    """``count`` prompts of token ids, lengths spread evenly over 8..64, in shuffled order."""
    ids = list(tokenizer(TEXT, add_special_tokens=False)["input_ids"])
    while len(ids) < 4 * PROMPT_MAX:
        ids += ids
    rng = random.Random(seed + count)
    if count == 1:
        lengths = [(PROMPT_MIN + PROMPT_MAX) // 2]
    else:
        lengths = [PROMPT_MIN + round(i * (PROMPT_MAX - PROMPT_MIN) / (count - 1)) for i in range(count)]
    rng.shuffle(lengths)
    prompts = []
    for n in lengths:
        start = rng.randrange(0, len(ids) - n)
        prompts.append(ids[start : start + n])
    return prompts


# ------------------------------------------------------------------------------------------------
# the worker-side timer: sent to the worker with collective_rpc (a callable, pickled by value), it
# wraps the worker wrapper's execute_model / sample_tokens / asyncpp_collect and records the worker
# thread's CPU time of each (time.thread_time: CPU that other processes take does not count)


def _worker_install(worker: Any) -> None:
    import time

    log: dict = {"on": False, "steps": [], "collects": []}
    execute, sample, collect = worker.execute_model, worker.sample_tokens, worker.asyncpp_collect

    def execute_model(so, *args, **kwargs):
        c = time.thread_time()
        try:
            return execute(so, *args, **kwargs)
        finally:
            if log["on"]:
                reqs = len(so.num_scheduled_tokens)
                log["steps"].append([time.thread_time() - c, so.total_num_scheduled_tokens, reqs])

    def sample_tokens(*args, **kwargs):
        c = time.thread_time()
        try:
            return sample(*args, **kwargs)
        finally:
            if log["on"] and log["steps"]:
                log["steps"][-1][0] += time.thread_time() - c

    def asyncpp_collect(ids):
        c = time.thread_time()
        try:
            return collect(ids)
        finally:
            if log["on"]:
                log["collects"].append([time.thread_time() - c, len(ids)])

    worker.execute_model, worker.sample_tokens, worker.asyncpp_collect = (
        execute_model,
        sample_tokens,
        asyncpp_collect,
    )
    worker._asyncpp_bench = log


def _worker_take(worker: Any, on: bool) -> tuple[list, list]:
    """The records so far (and clear them); record from now on if ``on``."""
    log = worker._asyncpp_bench
    out = (log["steps"], log["collects"])
    log["steps"], log["collects"], log["on"] = [], [], on
    return out


def _worker_remove(worker: Any) -> None:
    for name in ("execute_model", "sample_tokens", "asyncpp_collect", "_asyncpp_bench"):
        worker.__dict__.pop(name, None)


def _worker_set_narrow(worker: Any, identity: bool) -> bool:
    """--profile: swap asyncpp's row narrowing in the worker for the identity (or put it back).

    Only for blocks that do not look at what they read: they then see the whole batch's values."""
    from asyncpp.kernel import batching

    real = batching.__dict__.setdefault("_bench_real_narrow", batching.narrow)
    batching.narrow = (lambda value, rows, batch: value) if identity else real
    return True


@dataclass
class WorkerBatch:
    """Worker thread CPU seconds of one batch."""

    steps: list[list]  # [cpu s, scheduled tokens, requests] per engine step (forward + sampling)
    collects: list[list]  # [cpu s, ids] per asyncpp_collect

    def total(self) -> float:
        return sum(s[0] for s in self.steps) + sum(c[0] for c in self.collects)

    def full_decode(self, b: int) -> list[float]:
        """CPU of the steps that decode one token for each of the batch's B requests."""
        return [s[0] for s in self.steps if s[2] == b and s[1] == b]


# ------------------------------------------------------------------------------------------------
# one batch of requests, timed from the caller's event loop


@dataclass
class Batch:
    wall: float  # s, submission of the batch to its last result
    ends: list[float]  # s after submission, when each request's result arrived
    firsts: list[float]  # s after submission, each request's first streamed output (plain only)
    tokens: list[list[int]]


class Runner:
    """Runs plain requests and traces on one engine, from the caller's event loop."""

    def __init__(self, engine: Any):
        import vllm
        from vllm.inputs import tokens_input

        self.engine = engine
        self.llm = engine._llm
        self._params = vllm.SamplingParams
        self._tokens_input = tokens_input
        self.ends: list[float] = []  # s, every trace's wait for its outcomes while recording
        self.recording = False

    # the end of each trace, timed in this process (the engine awaits settle on its loop)

    def install_end_timer(self) -> None:
        engine, orig = self.engine, self.engine.settle

        async def timed(streams):
            t0 = perf()
            try:
                return await orig(streams)
            finally:
                if self.recording:
                    self.ends.append(perf() - t0)

        engine.settle = timed

    def remove_end_timer(self) -> None:
        with contextlib.suppress(AttributeError):
            del self.engine.settle

    async def bare_collect_rpc(self) -> float:
        """One ``asyncpp_collect`` of no ids: the round trip through engine core and worker."""

        async def rpc() -> float:
            t0 = perf()
            await self.llm.collective_rpc("asyncpp_collect", args=([],))
            return perf() - t0

        return await self._on_engine(rpc())

    async def worker_rpc(self, fn: Any, *args: Any) -> Any:
        """Run ``fn(worker, *args)`` in the (first) worker; its result."""

        async def rpc() -> Any:
            return (await self.llm.collective_rpc(fn, args=args))[0]

        return await self._on_engine(rpc())

    async def _on_engine(self, coro: Any) -> Any:
        return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(coro, self.engine._loop))

    # (a) plain requests, each submitted to the engine's loop and awaited from the caller's loop
    # (as a trace is), so that both are timed from submission to the result in the caller's loop

    async def plain(self, prompts: list[list[int]], max_tokens: int) -> Batch:
        llm, params, tokens_input, loop = self.llm, self._params, self._tokens_input, self.engine._loop

        async def one(ids: list[int], t0: float) -> tuple[float, list[int]]:
            sp = params(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
            first = final = None
            async for out in llm.generate(tokens_input(ids), sp, request_id=f"bench-{uuid.uuid4().hex}"):
                if first is None:
                    first = perf() - t0
                final = out
            return first, list(final.outputs[0].token_ids)

        async def caller(ids: list[int], t0: float) -> tuple[float, float, list[int]]:
            first, tokens = await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(one(ids, t0), loop))
            return first, perf() - t0, tokens

        t0 = perf()
        results = await asyncio.gather(*(caller(p, t0) for p in prompts))
        wall = perf() - t0
        return Batch(wall, [r[1] for r in results], [r[0] for r in results], [r[2] for r in results])

    # (b), (c) traces: one trace (one invoke, one request) per prompt

    async def traces(self, prompts: list[list[int]], block: Any, max_new_tokens: int) -> Batch:
        import asyncpp

        engine = self.engine

        async def one(ids: list[int], t0: float) -> tuple[float, list[int]]:
            async with asyncpp.generate(engine, max_new_tokens=max_new_tokens, ignore_eos=True) as t:
                h = t.invoke(ids, block)
            return perf() - t0, h.tokens[0].tolist()

        t0 = perf()
        results = await asyncio.gather(*(one(p, t0) for p in prompts))
        wall = perf() - t0
        return Batch(wall, [r[0] for r in results], [], [r[1] for r in results])

    async def run(self, variant: str, prompts: list[list[int]], n: int) -> Batch:
        if variant == "plain":
            return await self.plain(prompts, n)
        return await self.traces(prompts, BLOCKS[variant], n)


class TokenMismatch(RuntimeError):
    pass


def check_tokens(what: str, got: list[list[int]], want: list[list[int]], prompts: list[list[int]]) -> None:
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        if g != w:
            k = next((j for j, (x, y) in enumerate(zip(g, w, strict=False)) if x != y), min(len(g), len(w)))
            raise TokenMismatch(
                f"{what}: request {i} (prompt of {len(prompts[i])} tokens) generated other tokens than "
                f"the plain vLLM request: first difference at token {k} ({g[k : k + 4]} vs {w[k : k + 4]}, "
                f"{len(g)} vs {len(w)} tokens)"
            )


# ------------------------------------------------------------------------------------------------
# statistics


def median_ci(values: list[float], level: float = 0.95) -> tuple[float, float]:
    """Distribution-free interval for the median (order statistics, binomial ranks)."""
    s = sorted(values)
    n = len(s)
    if n < 6:
        return s[0], s[-1]
    alpha = (1 - level) / 2
    cum, k = 0.0, 0
    for i in range(n + 1):
        p = math.comb(n, i) / 2**n
        if cum + p > alpha:
            k = i
            break
        cum += p
    k = max(k, 1)
    return s[k - 1], s[n - k]


def pct(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))]


@dataclass
class Results:
    sizes: list[int]
    new_tokens: int
    rounds: int
    walls: dict[tuple[str, int], list[float]] = field(default_factory=dict)  # (variant, B) -> s
    plain_firsts: dict[int, list[float]] = field(default_factory=dict)  # B -> s, every request
    ttft: dict[tuple[str, int], list[float]] = field(default_factory=dict)  # (variant, B) -> s
    ttft_first: dict[int, list[float]] = field(default_factory=dict)  # B -> plain first output, s
    ends: dict[str, list[float]] = field(default_factory=dict)  # phase -> s per trace
    bare_rpc: list[float] = field(default_factory=list)
    seconds: dict[str, float] = field(default_factory=dict)
    plain_stable: bool = True
    load: dict[str, str] = field(default_factory=dict)
    # (variant, B, tokens per request) -> the worker CPU of each timed batch
    worker: dict[tuple[str, int, int], list[WorkerBatch]] = field(default_factory=dict)
    profile: dict[str, list[list[float]]] = field(default_factory=dict)  # --profile: per round, s
    profile_batch: int = 0

    def tps(self, variant: str, b: int) -> list[float]:
        return [b * self.new_tokens / w for w in self.walls[(variant, b)]]

    def ratios(self, variant: str, b: int) -> list[float]:
        return [p / v for v, p in zip(self.walls[(variant, b)], self.walls[("plain", b)], strict=True)]


# ------------------------------------------------------------------------------------------------
# the run


async def measure(engine: Any, args: argparse.Namespace) -> Results:
    n = args.new_tokens
    res = Results(sizes=args.sizes, new_tokens=n, rounds=args.rounds)
    prompts = {b: make_prompts(engine.tokenizer, b, args.seed) for b in args.sizes}
    single = make_prompts(engine.tokenizer, 1, args.seed)[0]
    singles = [single[i:] + single[:i] for i in range(args.ttft_rounds)]  # B=1: rotations of one prompt
    r = Runner(engine)
    r.install_end_timer()
    workers = args.worker_timing

    async def run(v: str, ps: list[list[int]], tokens: int) -> Batch:
        """One timed batch; with the worker timer, its worker CPU is recorded too (untimed RPCs)."""
        if workers:
            await r.worker_rpc(_worker_take, True)
        batch = await r.run(v, ps, tokens)
        if workers:
            steps, collects = await r.worker_rpc(_worker_take, False)
            res.worker.setdefault((v, len(ps), tokens), []).append(WorkerBatch(steps, collects))
        return batch

    try:
        if workers:
            await r.worker_rpc(_worker_install)
        # bare RPC round trip on the idle engine
        for _ in range(5):
            await r.bare_collect_rpc()
        res.bare_rpc = [await r.bare_collect_rpc() for _ in range(args.ttft_rounds)]

        # warm-up (and a first token check): every variant, every size, untimed
        t0 = perf()
        for b in args.sizes:
            want = (await r.run("plain", prompts[b], n)).tokens
            for v in ("reads", "empty"):
                check_tokens(f"warm-up, {v}, B={b}", (await r.run(v, prompts[b], n)).tokens, want, prompts[b])
        for v in VARIANTS:
            await r.run(v, singles[:1], 1)
        res.seconds["warm-up"] = perf() - t0

        # throughput rounds
        t0 = perf()
        reference = {}
        r.recording = True
        for rnd in range(args.rounds):
            if rnd >= MIN_ROUNDS and perf() - t0 > args.budget:
                break  # a busy machine: fewer rounds rather than a run of many minutes
            res.rounds = rnd + 1
            order = VARIANTS[rnd % 3 :] + VARIANTS[: rnd % 3]
            gc.collect()
            for b in args.sizes:
                got = {}
                for v in order:
                    batch = await run(v, prompts[b], n)
                    res.walls.setdefault((v, b), []).append(batch.wall)
                    got[v] = batch
                plain = got["plain"]
                res.plain_firsts.setdefault(b, []).extend(plain.firsts)
                for v in ("reads", "empty"):
                    check_tokens(f"round {rnd}, {v}, B={b}", got[v].tokens, plain.tokens, prompts[b])
                if reference.setdefault(b, plain.tokens) != plain.tokens:
                    res.plain_stable = False
        r.recording = False
        res.ends["throughput"] = r.ends[:]
        res.seconds["throughput"] = perf() - t0

        # TTFT: single requests (B = 1, the engine otherwise idle), then every request of a batch
        t0 = perf()
        for rnd in range(args.ttft_rounds):
            p = [singles[rnd]]
            order = VARIANTS[rnd % 3 :] + VARIANTS[: rnd % 3]
            got = {}
            for v in order:
                r.ends.clear()
                r.recording = v != "plain"
                batch = await run(v, p, 1)
                r.recording = False
                res.ttft.setdefault((v, 1), []).append(batch.ends[0])
                res.ends.setdefault("single", []).extend(r.ends)
                got[v] = batch
            res.ttft_first.setdefault(1, []).append(got["plain"].firsts[0])
            for v in ("reads", "empty"):
                check_tokens(f"TTFT round {rnd}, {v}, B=1", got[v].tokens, got["plain"].tokens, p)
        for rnd in range(args.batch_ttft_rounds):
            order = VARIANTS[rnd % 3 :] + VARIANTS[: rnd % 3]
            for b in args.sizes:
                got = {}
                for v in order:
                    batch = await run(v, prompts[b], 1)
                    res.ttft.setdefault((v, b), []).append(median(batch.ends))
                    got[v] = batch
                res.ttft_first.setdefault(b, []).append(median(got["plain"].firsts))
                for v in ("reads", "empty"):
                    check_tokens(
                        f"batch TTFT round {rnd}, {v}, B={b}", got[v].tokens, got["plain"].tokens, prompts[b]
                    )
        res.seconds["ttft"] = perf() - t0
        if args.profile and workers:
            t0 = perf()
            await profile(r, res, prompts[max(args.sizes)], n, args.profile_rounds)
            res.seconds["profile"] = perf() - t0
    finally:
        r.remove_end_timer()
        if workers:
            with contextlib.suppress(Exception):
                await r.worker_rpc(_worker_set_narrow, False)
            with contextlib.suppress(Exception):
                await r.worker_rpc(_worker_remove)
    return res


PROFILE_VARIANTS = {
    "plain": "(a) plain vLLM requests",
    "steps": "traces, block iterates the steps and awaits nothing else",
    "reads": "(b) traces, block reads every layer every step",
    "reads, no narrowing": "(b) with `batching.narrow` swapped for the identity in the worker",
}


async def profile(r: Runner, res: Results, prompts: list[list[int]], n: int, rounds: int) -> None:
    """Worker CPU per decode step of the whole batch, for the block's parts: the step loop alone,
    and the reads with and without asyncpp's row narrowing (rotated order, untimed walls)."""
    b = len(prompts)
    names = list(PROFILE_VARIANTS)

    async def once(v: str) -> list[float]:
        await r.worker_rpc(_worker_set_narrow, v == "reads, no narrowing")
        await r.worker_rpc(_worker_take, True)
        if v == "plain":
            await r.plain(prompts, n)
        else:
            await r.traces(prompts, steps_only if v == "steps" else read_every_layer, n)
        steps, _ = await r.worker_rpc(_worker_take, False)
        return WorkerBatch(steps, []).full_decode(b)

    try:
        for v in names:  # warm-up
            await once(v)
        for rnd in range(rounds):
            for v in names[rnd % len(names) :] + names[: rnd % len(names)]:
                res.profile.setdefault(v, []).append(await once(v))
    finally:
        await r.worker_rpc(_worker_set_narrow, False)
    res.profile_batch = b


# ------------------------------------------------------------------------------------------------
# machine info, CPU accounting


def _machine_busy_seconds() -> float:
    """CPU seconds all processes of the machine have used since boot (/proc/stat)."""
    fields = Path("/proc/stat").read_text().splitlines()[0].split()[1:]
    vals = [int(x) for x in fields]
    busy = sum(vals) - vals[3] - (vals[4] if len(vals) > 4 else 0)  # minus idle and iowait
    return busy / os.sysconf("SC_CLK_TCK")


@dataclass
class CpuMeter:
    t0: float = 0.0
    mine0: float = 0.0
    all0: float = 0.0

    def start(self) -> None:
        self.t0, self.mine0, self.all0 = perf(), bench_common.tree_cpu_seconds(), _machine_busy_seconds()

    def stop(self) -> tuple[float, float, float]:
        """(wall s, cores used by this benchmark's processes, cores used by everything else)."""
        wall = perf() - self.t0
        mine = (bench_common.tree_cpu_seconds() - self.mine0) / wall
        every = (_machine_busy_seconds() - self.all0) / wall
        return wall, mine, max(0.0, every - mine)


def machine_info() -> dict[str, str]:
    import torch
    import vllm

    import asyncpp

    cpu = bench_common.cpu_model()
    usable = bench_common.usable_cores()
    rev = bench_common.git_rev()
    where = Path(asyncpp.__file__).resolve().parent
    version = f"{asyncpp.__version__}, {rev}" if where.is_relative_to(ROOT) and rev else str(where)
    return {
        "cpu": cpu,
        "cores": f"{os.cpu_count()} logical, {usable} usable",
        "torch": torch.__version__,
        "vllm": vllm.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "asyncpp": version,
    }


def command_line() -> str:
    return bench_common.command_line(__file__)


# ------------------------------------------------------------------------------------------------
# the report


def verdict(value: float, lo: float, hi: float, target: float) -> str:
    if lo >= target:
        return "pass"
    if hi < target:
        return "**FAIL**"
    return f"inconclusive (noise; median {'>=' if value >= target else '<'} target)"


def md_table(header: list[str], rows: list[list[str]]) -> str:
    return bench_common.md_table(header, rows)


def ms(s: float) -> str:
    return f"{s * 1000:.1f} ms"


def _per_round(a: list[float], b: list[float], fn) -> float:
    return median(fn(x, y) for x, y in zip(a, b, strict=True))


def report(res: Results) -> tuple[str, str]:
    n = res.new_tokens
    rows = []
    # throughput
    for b in res.sizes:
        a = median(res.tps("plain", b))
        rows.append(
            [f"B={b}: (a) plain vLLM requests, tokens/s (median of rounds)", f"{a:.0f} tok/s", "-", "info"]
        )
        for v, target in (("reads", RATIO_TARGET), ("empty", None)):
            rs = res.ratios(v, b)
            m, (lo, hi) = median(rs), median_ci(rs)
            what = (
                "(b)/(a), block reads every layer every step"
                if v == "reads"
                else "(c)/(a), block awaits nothing"
            )
            rows.append(
                [
                    f"B={b}: {what}",
                    f"{m:.3f}x [{lo:.3f}, {hi:.3f}] ({median(res.tps(v, b)):.0f} tok/s)",
                    f">= {target}x" if target else "-",
                    verdict(m, lo, hi, target) if target else "info",
                ]
            )
        w = res.walls
        fixed = _per_round(w[("empty", b)], w[("plain", b)], lambda e, p, b=b: (e - p) / b)
        reads = _per_round(w[("reads", b)], w[("empty", b)], lambda x, e, b=b: (x - e) / (b * n * 4))
        rows.append(
            [
                f"B={b}: added batch wall time per request, ((c) - (a)) / B, and per layer read, "
                f"((b) - (c)) / (B x {n} steps x 4 layers)",
                f"{fixed * 1e3:+.2f} ms/request, {reads * 1e6:+.1f} us/read",
                "-",
                "info",
            ]
        )
    # the worker's own CPU time
    if res.worker:
        for b in res.sizes:
            wb = {v: res.worker[(v, b, n)] for v in VARIANTS}
            dec = {v: median(x for batch in wb[v] for x in batch.full_decode(b)) for v in VARIANTS}
            per_read = (dec["reads"] - dec["plain"]) / (b * 4)
            rows.append(
                [
                    f"B={b}, worker CPU per decode step of the whole batch (forward + sampling): (a) / (b) / (c)",
                    f"{ms(dec['plain'])} / {ms(dec['reads'])} ((a)/(b) = {dec['plain'] / dec['reads']:.3f}x) / "
                    f"{ms(dec['empty'])}",
                    "-",
                    "info",
                ]
            )
            rows.append(
                [
                    f"B={b}, worker CPU per layer read (with its share of the step resume), ((b) - (a)) / (B x 4)",
                    f"{per_read * 1e6:.1f} us/read",
                    "-",
                    "info",
                ]
            )
            tot = {v: median(batch.total() for batch in wb[v]) for v in VARIANTS}
            share = tot["plain"] / median(res.walls[("plain", b)])
            rows.append(
                [
                    f"B={b}, worker CPU per batch (all steps): (a) / (b) / (c); ((c) - (a)) / B per request",
                    f"{tot['plain'] * 1e3:.0f} / {tot['reads'] * 1e3:.0f} / {tot['empty'] * 1e3:.0f} ms; "
                    f"{(tot['empty'] - tot['plain']) / b * 1e3:+.2f} ms/request ((a): worker busy {share:.0%} of "
                    f"the batch wall)",
                    "-",
                    "info",
                ]
            )
        if ("plain", 1, 1) in res.worker:
            one = {v: median(batch.total() for batch in res.worker[(v, 1, 1)]) for v in VARIANTS}
            rows.append(
                [
                    "B=1, worker CPU of a 1-token request (all steps): (a) / (b) / (c)",
                    f"{ms(one['plain'])} / {ms(one['reads'])} ({(one['reads'] - one['plain']) * 1e3:+.2f} ms) / "
                    f"{ms(one['empty'])} ({(one['empty'] - one['plain']) * 1e3:+.2f} ms)",
                    "-",
                    "info",
                ]
            )
    # TTFT
    for b in [1, *res.sizes]:
        first = median(res.ttft_first[b])
        p1 = median(res.ttft[("plain", b)])
        tr = median(res.ttft[("reads", b)])
        te = median(res.ttft[("empty", b)])
        where = (
            "one request, engine otherwise idle"
            if b == 1
            else f"{b} requests submitted at once, median request"
        )
        rows.append(
            [
                f"TTFT, B={b} ({where}): (a) first streamed output of a plain request",
                ms(first),
                "-",
                "info",
            ]
        )
        rows.append(
            [
                f"TTFT, B={b}, as the wall time of a 1-token request: (a) plain `max_tokens=1` / "
                f"(b) trace `max_new_tokens=1` reading every layer / (c) trace, block awaits nothing",
                f"{ms(p1)} / {ms(tr)} ({tr / p1:.2f}x, {(tr - p1) * 1e3:+.1f} ms) / {ms(te)} "
                f"({te / p1:.2f}x, {(te - p1) * 1e3:+.1f} ms)",
                "-",
                "info",
            ]
        )
    # the end of a trace
    rows.append(
        [
            "end: a bare `asyncpp_collect` RPC (no ids, idle engine), round trip (what asking the "
            "workers for the outcomes would cost)",
            ms(median(res.bare_rpc)),
            "-",
            "info",
        ]
    )
    single = res.ends.get("single", [])
    if single:
        rows.append(
            [
                "end: per trace of one 1-token request (idle engine), from its last output to its outcome",
                ms(median(single)),
                "-",
                "info",
            ]
        )
    thr = res.ends.get("throughput", [])
    if thr:
        rows.append(
            [
                f"end: per trace in the B={'/'.join(map(str, res.sizes))} batches, median (p90), from the "
                f"last output to the outcomes",
                f"{ms(median(thr))} ({ms(pct(thr, 0.9))})",
                "-",
                "info",
            ]
        )
    if res.worker:
        cs = [
            c[0] for k, lst in res.worker.items() if k[0] != "plain" for batch in lst for c in batch.collects
        ]
        if cs:
            rows.append(
                [
                    "collect: worker CPU per `asyncpp_collect` call (requests given up), median",
                    f"{median(cs) * 1e6:.0f} us",
                    "-",
                    "info",
                ]
            )
    main = md_table(["measure", "value", "target", "verdict"], rows)

    detail = []
    for b in res.sizes:
        for v in VARIANTS:
            t = res.tps(v, b)
            w = res.walls[(v, b)]
            extra = ""
            if res.worker:
                batches = res.worker[(v, b, n)]
                steps = median(len(x.steps) for x in batches)
                extra = f"{median(x.total() for x in batches) * 1e3:.0f} ms, {steps:.0f} steps"
            detail.append(
                [
                    f"B={b}, {LABEL[v]}",
                    f"{median(t):.0f}",
                    f"{pct(t, 0.1):.0f}",
                    f"{pct(t, 0.9):.0f}",
                    f"{median(w) * 1e3:.0f}",
                    extra or "-",
                    str(len(w)),
                ]
            )
    details = md_table(
        ["batch, variant", "median tok/s", "p10", "p90", "median wall ms", "worker CPU per batch", "rounds"],
        detail,
    )
    spread = []
    for b in res.sizes:
        for v in ("reads", "empty"):
            ratios = " ".join(f"{x:.2f}" for x in sorted(res.ratios(v, b)))
            spread.append([f"B={b}, {LABEL[v][:3]}/(a)", ratios])
    details += "\n\n" + md_table(["ratio", "every round's value, sorted"], spread)
    ttft_rows = []
    for b in [1, *res.sizes]:
        f = res.ttft_first[b]
        ttft_rows.append([f"B={b}, (a) first streamed output", ms(median(f)), ms(pct(f, 0.9)), str(len(f))])
        for v in VARIANTS:
            vals = res.ttft[(v, b)]
            kind = "`max_tokens=1` request" if v == "plain" else "`max_new_tokens=1` trace"
            ttft_rows.append(
                [f"B={b}, {LABEL[v]}: wall of a {kind}", ms(median(vals)), ms(pct(vals, 0.9)), str(len(vals))]
            )
    for b in res.sizes:
        f = res.plain_firsts[b]
        ttft_rows.append(
            [
                f"B={b}, (a) first streamed output in the throughput batches ({n} tokens)",
                ms(median(f)),
                ms(pct(f, 0.9)),
                str(len(f)),
            ]
        )
    details += "\n\n" + md_table(["TTFT", "median", "p90", "samples"], ttft_rows)
    return main, profile_table(res), details


def profile_table(res: Results) -> str:
    """Per variant: the median decode step; differences taken round by round (each round's
    medians), their median over the rounds with the rounds' range."""
    if not res.profile:
        return ""
    b = res.profile_batch
    per_round = {v: [median(x) for x in rounds] for v, rounds in res.profile.items()}

    def diff(x: str, y: str, scale: float) -> tuple[float, float, float]:
        d = [(p - q) / scale for p, q in zip(per_round[x], per_round[y], strict=True)]
        return median(d), min(d), max(d)

    def us(t: tuple[float, float, float]) -> str:
        return f"{t[0] * 1e6:+.1f} us [{t[1] * 1e6:+.1f}, {t[2] * 1e6:+.1f}]"

    rows = []
    for v, label in PROFILE_VARIANTS.items():
        steps = [x for rounds in res.profile[v] for x in rounds]
        added = "-" if v == "plain" else us(diff(v, "plain", b))
        rows.append([label, ms(median(steps)), added, str(len(steps))])
    table = md_table(
        [f"B={b}: worker CPU per decode step", "median", "added per block [range over rounds]", "steps"], rows
    )
    return (
        f"{table}\n\nPer block and step: the step loop {us(diff('steps', 'plain', b))}; per layer read "
        f"{us(diff('reads', 'steps', b * 4))}, of which row narrowing (`batching.narrow` of the layer's "
        f"`(mlp_out, residual)` to the request's row) {us(diff('reads', 'reads, no narrowing', b * 4))}."
    )


def render(
    res: Results, main: str, prof: str, details: str, info: dict[str, str], args: argparse.Namespace
) -> str:
    date = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    machine = "\n".join(f"- {k}: {v}" for k, v in {**info, **res.load}.items())
    secs = ", ".join(f"{k} {v:.0f} s" for k, v in res.seconds.items())
    worker = ""
    if res.worker:
        worker = (
            "\n\nWorker CPU: a timer sent to the worker with `collective_rpc` (hence\n"
            "`VLLM_ALLOW_INSECURE_SERIALIZATION=1` for this run) records the worker thread's CPU time\n"
            "(`time.thread_time`, so CPU taken by other processes does not count) of every engine step\n"
            "(`execute_model` + `sample_tokens`) and of every `asyncpp_collect` (none unless a\n"
            "request is given up), per timed batch."
        )
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 0
        if cores < 4:
            worker += (
                f"\nWith {cores} cores for vLLM's three busy processes (the caller's, EngineCore, the\n"
                "worker, which poll their queues), a batch's wall time swings between rounds (every\n"
                "round's ratio is in the details): the worker CPU rows are the steadier measure of what\n"
                "the blocks cost, and where they cost it."
            )
    rounds = f"{res.rounds} rounds"
    if res.rounds < args.rounds:
        rounds += f" (of {args.rounds}: the time budget of {args.budget:.0f} s ran out)"
    prof_text = ""
    if prof:
        prof_text = (
            f"\nWhere a reading block's worker time goes (`--profile`, {args.profile_rounds} rotated rounds of "
            f"B={res.profile_batch}; the worker CPU of the decode steps of the whole batch, each variant "
            f"against (a); the last row swaps asyncpp's row narrowing for the identity in the worker, "
            f"which only a block that ignores what it reads tolerates):\n\n{prof}\n"
        )
    stable = (
        ""
        if res.plain_stable
        else " (plain requests themselves generated different tokens in different rounds)"
    )
    return f"""{SECTION}

One `asyncpp.VllmEngine(dtype="float32")` (the embedded tiny 4-layer Llama; eager mode, prefix
caching and chunked prefill off) serves every variant on the same prompts (mixed lengths,
{PROMPT_MIN}-{PROMPT_MAX} tokens, spread evenly), greedy with `ignore_eos`, {res.new_tokens} new tokens
per request: (a) plain vLLM requests on the engine's `AsyncLLM` (asyncpp's controllers stay
installed in the worker, idle: the baseline is the asyncpp worker without blocks), (b) one
`asyncpp.generate` trace per request whose block awaits every decoder layer's output at every step,
(c) the same traces with a block that awaits nothing. Every trace's tokens equal the plain
requests' tokens of its round (checked; the run aborts otherwise){stable}.

Throughput: a batch of B requests is submitted at once from the caller's event loop and timed to
its last result (generated tokens / wall seconds). Variants alternate in rotated order in each of
{rounds} after a warm-up; ratios are taken round by round, median over rounds
with a distribution-free 95% interval (a verdict is *inconclusive* when it straddles the target).
TTFT: (a) the first streamed output; a trace's first token is not streamed, so traces are timed as
the wall time of a `max_new_tokens=1` trace against a `max_tokens=1` plain request. End: each
trace's wait from its requests' last outputs to their outcomes (which the workers send with each
request's end, the engine step after its last output), timed around the engine's `settle` in the
caller's process.{worker}

Command: `{command_line()}` ({date}; {secs})

{machine}

{main}
{prof_text}
<details><summary>All variants</summary>

{details}

</details>
"""


def write_section(text: str) -> None:
    """Replace (or append) this benchmark's section of docs/performance.md, keeping the others."""
    bench_common.write_section(SECTION, text, DOC)


# ------------------------------------------------------------------------------------------------


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="16,32", help="batch sizes B, comma-separated (default 16,32)")
    ap.add_argument("--new-tokens", type=int, default=64, help="tokens generated per request (default 64)")
    ap.add_argument("--rounds", type=int, default=20, help="throughput rounds (default 20)")
    ap.add_argument(
        "--budget",
        type=float,
        default=110.0,
        help=f"no new throughput round after this many seconds, once {MIN_ROUNDS} are done (default 110)",
    )
    ap.add_argument("--ttft-rounds", type=int, default=24, help="single-request TTFT rounds (default 24)")
    ap.add_argument("--batch-ttft-rounds", type=int, default=8, help="batch TTFT rounds (default 8)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--no-worker-timing",
        dest="worker_timing",
        action="store_false",
        help="do not time the worker's steps (the timer needs VLLM_ALLOW_INSECURE_SERIALIZATION=1)",
    )
    ap.add_argument(
        "--profile",
        action="store_true",
        help="also split the worker's cost of a reading block: the step loop, the reads, row narrowing",
    )
    ap.add_argument("--profile-rounds", type=int, default=8, help="--profile rounds (default 8)")
    ap.add_argument("--quick", action="store_true", help="a short run (3 rounds) to try the script")
    ap.add_argument("--write", action="store_true", help="update the section in docs/performance.md")
    args = ap.parse_args()
    args.sizes = [int(x) for x in args.sizes.split(",") if x.strip()]
    if args.quick:
        args.rounds, args.ttft_rounds, args.batch_ttft_rounds, args.profile_rounds = 3, 6, 2, 2
    if args.profile and not args.worker_timing:
        ap.error("--profile needs the worker timer (drop --no-worker-timing)")
    if args.rounds < 1 or args.ttft_rounds < 1 or args.batch_ttft_rounds < 1 or not args.sizes:
        ap.error("rounds and sizes must be positive")
    return args


def main() -> int:
    args = parse_args()
    import asyncpp

    if args.worker_timing:
        # the worker timer travels as a callable in collective_rpc, which vLLM pickles only with this
        os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
    load = os.getloadavg() if hasattr(os, "getloadavg") else None
    info = machine_info()
    t0 = perf()
    engine = asyncpp.VllmEngine(dtype="float32", mode="eager")  # (the mode its figures were made in)
    startup = perf() - t0
    try:
        meter = CpuMeter()
        meter.start()
        with asyncio.Runner() as runner:
            res = runner.run(measure(engine, args))
        wall, mine, other = meter.stop()
    except TokenMismatch as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    finally:
        engine.close()
    res.seconds = {"engine start": startup, **res.seconds}
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    if load is not None:
        note = " (other work was running: expect noisier figures)" if load[0] > 0.5 else ""
        res.load["load average before the run"] = ", ".join(f"{x:.2f}" for x in load) + note
    res.load["CPU use during the measurement"] = (
        f"this benchmark's processes {mine:.2f} cores, everything else {other:.2f} cores, "
        f"of {cores} ({wall:.0f} s)"
    )
    main_table, prof, details = report(res)
    text = render(res, main_table, prof, details, info, args)
    print(text)
    if args.write:
        write_section(text)
        print(f"wrote the section to {DOC.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
