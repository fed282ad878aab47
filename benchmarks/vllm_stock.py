"""asyncpp's cost against a *stock* vLLM engine (vLLM's own worker), side by side in one run (issue 14).

Engines, all on the same model folder, float32, prefix caching off, a 1 GiB KV cache
(``kv_cache_memory_bytes``), with ``VLLM_CPU_OMP_THREADS_BIND=auto`` (vLLM's default, which
``asyncpp.VllmEngine`` keeps for one-worker engines: the worker's OpenMP threads are pinned to the
cores left after one is reserved for the engine core and this process; here one each. ``--omp-bind
nobind`` leaves them unpinned, sharing every core: on 2 cores other work then stalls them), ``HF_HUB_OFFLINE=1``, ``TOKENIZERS_PARALLELISM=false`` and
``VLLM_LOGGING_LEVEL=ERROR`` (unless set) in the environment of the whole run, so every engine's
processes inherit the same:

* **stock**: ``vllm.v1.engine.async_llm.AsyncLLM`` with vLLM's own worker (no ``worker_cls``), on an
  event loop in a thread of its own (as ``asyncpp.VllmEngine`` runs its ``AsyncLLM``), in two
  settings: *stock defaults* (vLLM's own scheduler defaults apart from the above) and *asyncpp
  settings* (the scheduler options ``asyncpp.VllmEngine.__init__`` forces:
  ``enable_chunked_prefill=False``, ``long_prefill_token_threshold=0``, ``max_model_len=512``,
  ``max_num_batched_tokens=max(max_model_len, ...)`` = 512; checked against each asyncpp engine's
  ``options`` when it starts); each eager (``enforce_eager=True``) and compiled
  (``enforce_eager=False``: dynamo + inductor on CPU). Stock engines run plain requests only.
* **asyncpp**: ``asyncpp.VllmEngine(model, dtype="float32", mode="eager")`` and ``mode="compiled"``
  (vLLM's compiled model with asyncpp's taps: its default tap set).

Workloads on asyncpp engines: (a) **plain** requests without a block (``AsyncLLM.generate`` on the
engine's own ``AsyncLLM``, ``engine.async_llm``, submitted to its loop, ``engine.loop``, exactly as
on the stock engines); (b) **empty**: one ``asyncpp.generate`` trace per request whose block awaits
nothing; (c) **reads**: a block awaiting every decoder layer's output at every step
(``async for step in m.steps(): for layer in m.model.layers: await layer.output``); (d) **steer**: a
steering write at one layer at every step (``h, r = await m.model.layers[1].output; h[-1] += 0.01``).
Plain requests use the request options asyncpp gives a trace's request (greedy, ``ignore_eos``,
``output_kind=FINAL_ONLY``, ``skip_clone=True``), so a workload's cost against a stock plain
request is the block's and asyncpp's, not a difference of request options.

Requests: a batch of B requests (B = 1, 16, 32) submitted at once from the caller's event loop;
prompts of random token ids (byte tokens of the tiny tokenizer), lengths spread evenly over 8-64 and
shuffled, new ones every round (seeded per round and B: every engine gets the same prompts in the
same round); greedy, ``ignore_eos``, 64 new tokens each. Models: the embedded tiny model
(``asyncpp.models.tiny_model_dir()``: 4 layers, hidden 128) and ``small``, built here with
``tiny_model_dir(config)`` (8 layers, hidden 512, intermediate 1376, 8 heads of head size 64, the
tiny tokenizer's vocabulary).

Metrics, per batch: wall tokens/s (generated tokens / seconds from submission to the last result);
and, the steady measure on this machine, generated tokens per CPU second of *all* the engine's
processes (this process, with the caller's and the engine's event loops, plus its live descendants:
vLLM's EngineCore and worker(s), found with ``psutil``) and of the worker process(es) alone. CPU
time is read from each process's CPU clock (``clock_getcpuclockid`` + ``clock_gettime``: every
thread, in nanoseconds), not from ``/proc/<pid>/stat``, whose 10 ms ticks are too coarse for batches
of a few hundred milliseconds (3 processes, a few percent of a batch). The process set is taken once after each engine has started (processes made since it began
starting; vLLM's processes live as long as the engine). Worker pids: an asyncpp engine reports them
(``engine.worker_stats()``, ``pid`` per rank); for a stock engine they are this process's
descendants whose process title (``/proc/<pid>/cmdline``, as ``psutil`` reads it) or name starts with
``VLLM::Worker`` (vLLM's multiprocessing executor names its workers so with ``setproctitle``); its
engine core is the one titled ``VLLM::EngineCore``. For asyncpp engines both ways are used and
must agree (reported). The figures are medians over rounds. The machine's CPU (``/proc/stat``)
during each batch is read too: what other work took ("other work", in cores) is reported beside the
ratios, since on 2 cores (with ``nobind`` most of all) a core taken by other work stalls the worker's OpenMP
threads and inflates its CPU per token many times over.

Inside the workers' steps, the measure that holds still best here: every engine's workers (stock's
and asyncpp's alike) get ``benchmarks/step_clock.py`` mixed in (``worker_extension_cls``), which
times each ``execute_model`` and ``sample_tokens`` call with the worker process's CPU clock; this
folder goes on ``PYTHONPATH`` for the engines' processes. vLLM's processes poll their queues between
steps, so whole-process CPU follows wall time; the CPU inside the steps is the work a step does
(the model, vLLM's runner, and on asyncpp every block served). Per batch: the median CPU of the steps
that decode the whole batch (exactly B scheduled tokens: steps of the same work, whatever the
prompts), and all steps' CPU per generated token (prefill steps, where blocks start, and the last,
where they end, included). An engine's figure is the lowest over rounds: on this machine the noise
only adds (whole batches run up to 1.6x slower at times, every step alike, then fast again).

Ratios are asyncpp / stock in tokens per CPU second (higher is better), same model, B, settings
(asyncpp's) and mode, for each workload; and asyncpp's best mode against stock's best (the better
engine of each side by tokens per CPU second, stock's over both settings). The range next to a ratio
is [min asyncpp / max stock, max asyncpp / min stock] over rounds; a verdict is *pass* when the
median ratio meets the target, **FAIL** when even the range's top misses it, *inconclusive*
otherwise.

Run order: only one engine is alive at a time (2 cores and 24 GiB do not hold several engines
comfortably, and two engines polling their queues would take cores from each other): for each model,
an engine is started, runs a warm-up round (every workload and B, untimed) and R rounds (default 3;
each round runs every B, the workloads in rotated order), and is closed before the next starts. The
engines of one mode run next to each other (stock with asyncpp settings, asyncpp, stock defaults).
So ratios are taken across engine lifetimes, minutes apart, not round by round: load that comes and
goes on the machine may hit one engine and not the other, which medians of CPU seconds (not wall
time) blunt. Worse, a whole engine lifetime is sometimes slow here: the same stock engine gave
4213 and 2467 tokens per CPU second (worker 0.12 and 0.19 ms per token) in two starts minutes
apart on an idle machine, each steady over its rounds. So ``--passes P`` goes over the engine list
P times (new engines, new prompts), and an engine's figure is the median over rounds of its best
lifetime, the range of a ratio then spanning its lifetimes. Batches follow each other without a pause: the busy-polling of vLLM's processes
after a batch's last message (about 1 s, vLLM's ``SpinCondition``) overlaps the next batch's start.

``--together`` takes the other way round: the engines of one mode (those of ``--engines``) are alive
at once, and every round runs each engine's workloads interleaved (the order rotated every round),
with ``--pause`` seconds (default 1.5) of rest before each batch, so that the engine that ran last
has stopped polling before the next batch is timed. A ratio is then the median of the
round-by-round ratios of the two engines (each round's batches run within a minute of each other),
and its range their [min, max]: load that comes and goes, and the drift of the machine, hit both
engines alike. The report goes to a section of its own in docs/performance.md.

Correctness on the way: the greedy tokens of asyncpp's plain requests and empty-block traces (and,
for information, reading traces) must equal a stock engine's for the same prompts (stock with
asyncpp settings in the same mode, else stock defaults in that mode); a difference is reported
(and the script exits with status 1), it does not abort the run. Compiled against eager tokens of the
same side and settings are compared too: a difference is a warning only (compilation may reorder
float32 arithmetic).

Engine start: wall seconds from creating the engine to its being ready. Compile time: a compiled
engine's start less its eager twin's (the same kind and settings on the same model); vLLM's own
``compilation_config.compilation_time`` stays 0 on CPU (it counts only the ``VLLM_COMPILE`` mode, and
vLLM's CPU platform runs ``DYNAMO_TRACE_ONCE``). For asyncpp engines also ``engine.compile_seconds``
(vLLM's warm-up forward, which compiles). A first compiled start on a cold compile cache takes
minutes; later ones reuse vLLM's cache.

Usage::

    .venv/bin/python benchmarks/vllm_stock.py                    # every engine, both models, B=1,16,32
    .venv/bin/python benchmarks/vllm_stock.py --write            # and update docs/performance.md
    .venv/bin/python benchmarks/vllm_stock.py --quick            # a smoke run: tiny, B=16, 1 round
    .venv/bin/python benchmarks/vllm_stock.py --models tiny --engines stock-asyncpp-eager,asyncpp-eager
    # the recorded run of the step table: engines of a mode alive together, batches back to back
    .venv/bin/python benchmarks/vllm_stock.py --models tiny,small --together --pause 0 --rounds 8 \
        --engines stock-asyncpp-eager,asyncpp-eager,stock-asyncpp-compiled,asyncpp-compiled --write
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ctypes
import datetime
import gc
import os
import random
import sys
import threading
import time
import traceback
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from statistics import median
from typing import Any

import bench_common

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "performance.md"
SECTION = "## vLLM against stock vLLM (benchmarks/vllm_stock.py, issue 14)"
SECTION_TOGETHER = (
    "## vLLM against stock vLLM, engines alive together (benchmarks/vllm_stock.py --together, issue 14)"
)

PROMPT_MIN, PROMPT_MAX = 8, 64
PROMPT_VOCAB = 256  # the byte tokens of the tiny tokenizer (its specials are 256-258)
KV_CACHE_BYTES = 2**30
STEP_CLOCK = "step_clock.StepClock"  # benchmarks/step_clock.py, on every engine's workers
MAX_MODEL_LEN = 512

# the environment every engine of the run gets (its processes inherit it)
ENV_FORCED = {"VLLM_CPU_OMP_THREADS_BIND": "auto", "HF_HUB_OFFLINE": "1"}
ENV_DEFAULTS = {"TOKENIZERS_PARALLELISM": "false", "VLLM_LOGGING_LEVEL": "ERROR"}

# the scheduler options asyncpp.VllmEngine.__init__ forces (asyncpp/engines/vllm/engine.py)
ASYNCPP_SETTINGS: dict[str, Any] = {
    "enable_chunked_prefill": False,
    "long_prefill_token_threshold": 0,
    "max_model_len": MAX_MODEL_LEN,
    "max_num_batched_tokens": MAX_MODEL_LEN,  # max(max_model_len, the caller's or 0)
}

SMALL_CONFIG: dict[str, Any] = {
    "hidden_size": 512,
    "intermediate_size": 1376,
    "num_hidden_layers": 8,
    "num_attention_heads": 8,  # head size 64 (CPU attention: 32, 64, 80, ...)
    "num_key_value_heads": 8,
}
MODELS: dict[str, dict[str, Any] | None] = {"tiny": None, "small": SMALL_CONFIG}
MODEL_LABEL = {
    "tiny": "tiny (4 layers, hidden 128, the embedded model)",
    "small": "small (8 layers, hidden 512, intermediate 1376, 8 heads)",
}

perf = time.perf_counter


# ------------------------------------------------------------------------------------------------
# the blocks (pickled by value into every request: they are defined in __main__)


async def no_awaits(m: Any) -> None:
    return None


async def read_every_layer(m: Any) -> None:
    async for _step in m.steps():
        for layer in m.model.layers:
            await layer.output  # a vLLM decoder layer's output: (mlp_out, residual)


async def steer_one_layer(m: Any) -> None:
    async for _step in m.steps():
        h, _r = await m.model.layers[1].output
        h[-1] += 0.01


WORKLOADS = ("plain", "empty", "reads", "steer")
BLOCKS: dict[str, Callable[[Any], Any]] = {
    "empty": no_awaits,
    "reads": read_every_layer,
    "steer": steer_one_layer,
}
LABEL = {
    "plain": "(a) requests without a block",
    "empty": "(b) block awaits nothing",
    "reads": "(c) block reads every layer every step",
    "steer": "(d) steering write at one layer every step",
}
TARGET = {"plain": 0.99, "empty": 0.97, "reads": 0.90, "steer": 0.93}
BEST_TARGET = {"plain": 0.97, "empty": 0.97}  # asyncpp's best mode against stock's best mode


# ------------------------------------------------------------------------------------------------
# engines


@dataclass(frozen=True)
class EngineSpec:
    name: str
    kind: str  # "stock" | "asyncpp"
    settings: str  # "default" | "asyncpp"
    mode: str  # "eager" | "compiled"

    @property
    def workloads(self) -> tuple[str, ...]:
        return ("plain",) if self.kind == "stock" else WORKLOADS


def _spec(kind: str, settings: str, mode: str) -> EngineSpec:
    name = f"asyncpp-{mode}" if kind == "asyncpp" else f"stock-{settings}-{mode}"
    return EngineSpec(name, kind, settings, mode)


# the run order per model: the engines of one mode next to each other
ENGINE_ORDER = [
    _spec(kind, settings, mode)
    for mode in ("eager", "compiled")
    for kind, settings in (("stock", "asyncpp"), ("asyncpp", "asyncpp"), ("stock", "default"))
]
ENGINES = {s.name: s for s in ENGINE_ORDER}
QUICK_ENGINES = ["stock-asyncpp-eager", "asyncpp-eager", "stock-asyncpp-compiled", "asyncpp-compiled"]


class StockEngine:
    """A stock ``AsyncLLM`` (vLLM's own worker) on an event loop in a thread of its own."""

    def __init__(self, options: dict[str, Any]):
        self.options = options
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="stock-vllm", daemon=True)
        self._thread.start()
        try:
            self.async_llm = asyncio.run_coroutine_threadsafe(self._start(), self.loop).result()
        except BaseException:
            self._stop_loop()
            raise

    async def _start(self) -> Any:
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        return AsyncLLM.from_engine_args(AsyncEngineArgs(**self.options))

    def close(self) -> None:
        async def shutdown() -> None:
            self.async_llm.shutdown(timeout=60)

        try:
            asyncio.run_coroutine_threadsafe(shutdown(), self.loop).result()
        finally:
            self.async_llm = None
            gc.collect()
            self._stop_loop()

    def _stop_loop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(30)
        self.loop.close()


def stock_options(model: Path, spec: EngineSpec, extension: str = STEP_CLOCK) -> dict[str, Any]:
    options: dict[str, Any] = {
        "model": str(model),
        "dtype": "float32",
        "enforce_eager": spec.mode == "eager",
        "enable_prefix_caching": False,
        "kv_cache_memory_bytes": KV_CACHE_BYTES,
        "use_tqdm_on_load": False,  # as asyncpp's quiet engines
        "worker_extension_cls": extension,
    }
    if spec.settings == "asyncpp":
        options.update(ASYNCPP_SETTINGS)
    return options


def _title(p: Any) -> str:
    """A process's title (what setproctitle wrote over its command line), else its name."""
    import psutil

    with contextlib.suppress(psutil.Error):
        cmd = p.cmdline()
        if cmd:
            return " ".join(cmd)
    with contextlib.suppress(psutil.Error):
        return p.name()
    return ""


def _cpu_clock(pid: int) -> int | None:
    """The CPU-time clock of process ``pid`` (``clock_getcpuclockid``), None where there is none."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        clock = ctypes.c_int()
        if libc.clock_getcpuclockid(int(pid), ctypes.byref(clock)) != 0:
            return None
        time.clock_gettime(clock.value)
    except (OSError, AttributeError):
        return None
    return clock.value


class Processes:
    """The engine's processes: this one and its live descendants made since the engine began to
    start (the caller, vLLM's EngineCore, the workers, multiprocessing's resource tracker)."""

    def __init__(self, since: float, worker_pids: list[int] | None = None):
        import psutil

        self.me = psutil.Process()
        kids = []
        for p in self.me.children(recursive=True):
            with contextlib.suppress(psutil.Error):
                if p.create_time() >= since - 1.0:
                    kids.append(p)
        titles = {p.pid: _title(p) for p in kids}
        self.titled_workers = sorted(pid for pid, t in titles.items() if t.startswith("VLLM::Worker"))
        self.core = [p for p in kids if titles[p.pid].startswith("VLLM::EngineCore")]
        self.reported_workers = sorted(worker_pids) if worker_pids is not None else None
        pids = self.reported_workers if self.reported_workers is not None else self.titled_workers
        self.workers = [p for p in kids if p.pid in pids]
        self.kids = kids
        self._last: dict[int, float] = {}
        # each process's CPU clock (all its threads, in ns): /proc/<pid>/stat counts 10 ms ticks,
        # too coarse for batches of a few hundred ms
        self._clocks = {p.pid: _cpu_clock(p.pid) for p in kids}
        self._clocks[self.me.pid] = time.CLOCK_PROCESS_CPUTIME_ID

    def how_found(self) -> str:
        titled = ", ".join(map(str, self.titled_workers)) or "none"
        if self.reported_workers is None:
            return f"{titled} (process title `VLLM::Worker*`)"
        reported = ", ".join(map(str, self.reported_workers)) or "none"
        agree = "agree" if self.reported_workers == self.titled_workers else "**DISAGREE**"
        return f"{reported} (`worker_stats()`; titles: {titled}, {agree})"

    def _cpu(self, p: Any) -> float:
        import psutil

        clock = self._clocks.get(p.pid)
        try:
            if clock is not None:
                value = time.clock_gettime(clock)
            else:
                t = p.cpu_times()
                value = t.user + t.system
        except (OSError, psutil.Error):  # it has exited: its last reading
            return self._last.get(p.pid, 0.0)
        self._last[p.pid] = value
        return value

    def sample(self) -> tuple[float, float, float, float]:
        """CPU seconds so far: (all, this process, engine core, workers)."""
        mine = self._cpu(self.me)
        kids = {p.pid: self._cpu(p) for p in self.kids}
        core = sum(kids[p.pid] for p in self.core)
        workers = sum(kids[p.pid] for p in self.workers)
        return mine + sum(kids.values()), mine, core, workers


@dataclass
class Live:
    """A started engine of either kind, as the runner sees it."""

    spec: EngineSpec
    engine: Any  # asyncpp.VllmEngine or StockEngine
    llm: Any
    loop: asyncio.AbstractEventLoop
    procs: Processes
    start_seconds: float
    asyncpp_compile_seconds: float | None
    scheduler: dict[str, Any]
    notes: list[str] = field(default_factory=list)
    run: EngineRun | None = None  # where the runner records it


def _scheduler(llm: Any) -> dict[str, Any]:
    cfg = getattr(llm, "vllm_config", None)
    sched = getattr(cfg, "scheduler_config", None)
    model = getattr(cfg, "model_config", None)
    out = {}
    for key in (
        "enable_chunked_prefill",
        "max_num_batched_tokens",
        "max_num_seqs",
        "long_prefill_token_threshold",
    ):
        out[key] = getattr(sched, key, "?")
    out["max_model_len"] = getattr(model, "max_model_len", "?")
    return out


def start_engine(spec: EngineSpec, model: Path, extension: str = STEP_CLOCK) -> Live:
    """Start the engine ``spec`` on ``model``, its workers extended with ``extension`` (a
    subclass of the step clock, from this folder)."""
    since = time.time()
    t0 = perf()
    notes: list[str] = []
    if spec.kind == "stock":
        engine = StockEngine(stock_options(model, spec, extension))
        start = perf() - t0
        llm, loop = engine.async_llm, engine.loop
        procs = Processes(since)
        asyncpp_compile = None
    else:
        import asyncpp

        engine = asyncpp.VllmEngine(model, dtype="float32", mode=spec.mode, worker_extension_cls=extension)
        start = perf() - t0
        llm, loop = engine.async_llm, engine.loop
        try:
            pids = [int(s["pid"]) for s in engine.worker_stats()]
        except Exception as err:  # fall back on the process titles
            notes.append(f"worker_stats() gave no pids ({type(err).__name__}: {err})")
            pids = None
        procs = Processes(since, pids)
        asyncpp_compile = float(getattr(engine, "compile_seconds", 0.0))
        want = {**ASYNCPP_SETTINGS, "enable_prefix_caching": False, "kv_cache_memory_bytes": KV_CACHE_BYTES}
        for key, value in want.items():
            if engine.options.get(key) != value:
                notes.append(
                    f"asyncpp's engine has {key}={engine.options.get(key)!r}, the stock engines {value!r}"
                )
    if not procs.workers:
        notes.append("no worker process found: worker CPU figures are 0")
    return Live(
        spec,
        engine,
        llm,
        loop,
        procs,
        start,
        asyncpp_compile,
        _scheduler(llm),
        notes,
    )


def close_engine(live: Live) -> None:
    live.engine.close()
    gc.collect()


# ------------------------------------------------------------------------------------------------
# prompts and batches


def make_prompts(count: int, seed: int, round_id: int) -> list[list[int]]:
    """``count`` prompts of random byte-token ids, lengths spread evenly over 8..64, shuffled; the
    same for the same (seed, round, count), different for every round."""
    rng = random.Random(f"vllm_stock/{seed}/{round_id}/{count}")
    if count == 1:
        lengths = [(PROMPT_MIN + PROMPT_MAX) // 2]
    else:
        lengths = [PROMPT_MIN + round(i * (PROMPT_MAX - PROMPT_MIN) / (count - 1)) for i in range(count)]
    rng.shuffle(lengths)
    return [[rng.randrange(PROMPT_VOCAB) for _ in range(n)] for n in lengths]


@dataclass
class Sample:
    """One timed batch."""

    wall: float  # s, submission to the last result
    tokens: int  # generated
    cpu_all: float  # s, every process of the engine
    cpu_caller: float  # s, this process
    cpu_core: float  # s, the engine core
    cpu_worker: float  # s, the worker(s)
    cpu_machine: float  # s, every process of the machine (/proc/stat)
    cpu_step: float = 0.0  # s, the workers' CPU inside their step calls (step_clock.py)
    decode_steps: list[float] = field(default_factory=list)  # s, CPU of each step decoding the whole batch
    life: int = 0  # the pass (engine lifetime) it was measured in


async def plain_batch(live: Live, prompts: list[list[int]], n: int) -> list[list[int]]:
    """Plain requests on the engine's own ``AsyncLLM``, each submitted to the engine's loop and
    awaited from the caller's (as a trace is)."""
    from vllm import SamplingParams
    from vllm.inputs import tokens_input
    from vllm.sampling_params import RequestOutputKind

    llm, loop = live.llm, live.loop

    async def one(ids: list[int]) -> list[int]:
        sp = SamplingParams(
            max_tokens=n,
            temperature=0.0,
            ignore_eos=True,
            output_kind=RequestOutputKind.FINAL_ONLY,
            skip_clone=True,
        )
        final = None
        async for out in llm.generate(tokens_input(ids), sp, request_id=f"bench-{uuid.uuid4().hex}"):
            final = out
        return list(final.outputs[0].token_ids)

    async def caller(ids: list[int]) -> list[int]:
        return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(one(ids), loop))

    return list(await asyncio.gather(*(caller(p) for p in prompts)))


async def trace_batch(live: Live, prompts: list[list[int]], block: Any, n: int) -> list[list[int]]:
    """One ``asyncpp.generate`` trace (one invoke, one request) per prompt."""
    import asyncpp

    engine = live.engine

    async def one(ids: list[int]) -> list[int]:
        async with asyncpp.generate(engine, max_new_tokens=n, ignore_eos=True) as t:
            h = t.invoke(ids, block)
        return h.tokens[0].tolist()

    return list(await asyncio.gather(*(one(p) for p in prompts)))


async def run_batch(live: Live, workload: str, prompts: list[list[int]], n: int) -> list[list[int]]:
    if workload == "plain":
        return await plain_batch(live, prompts, n)
    return await trace_batch(live, prompts, BLOCKS[workload], n)


# ------------------------------------------------------------------------------------------------
# results


Key = tuple[str, str, str, int]  # (model, engine, workload, B)


@dataclass
class EngineRun:
    model: str
    spec: EngineSpec
    start_seconds: float | None = None
    asyncpp_compile_seconds: float | None = None
    scheduler: dict[str, Any] = field(default_factory=dict)
    workers: str = ""
    notes: list[str] = field(default_factory=list)
    error: str = ""
    seconds: float = 0.0  # warm-up + rounds


@dataclass
class Results:
    args: argparse.Namespace
    samples: dict[Key, list[Sample]] = field(default_factory=dict)
    # (model, engine, workload, round, B) -> tokens of every request; round -1 is the warm-up
    tokens: dict[tuple[str, str, str, int, int], list[list[int]]] = field(default_factory=dict)
    runs: list[EngineRun] = field(default_factory=list)
    load: dict[str, str] = field(default_factory=dict)
    seconds: float = 0.0

    def has(self, key: Key) -> bool:
        return bool(self.samples.get(key))

    def per_round(self, key: Key, what: str) -> list[float]:
        out = []
        for s in self.samples[key]:
            if what == "wall":
                out.append(s.tokens / s.wall)
            elif what == "all":
                out.append(s.tokens / s.cpu_all if s.cpu_all > 0 else float("nan"))
            else:
                out.append(s.tokens / s.cpu_worker if s.cpu_worker > 0 else float("nan"))
        return out

    def lifetimes(self, key: Key, what: str) -> list[float]:
        """The median over rounds of each engine lifetime (pass) that measured ``key``."""
        values, lives = self.per_round(key, what), [s.life for s in self.samples[key]]
        return [
            median(v for v, life in zip(values, lives, strict=True) if life == x) for x in sorted(set(lives))
        ]

    def med(self, key: Key, what: str) -> float:
        """The figure of ``key``: the median over rounds of its best engine lifetime (an engine
        lifetime on this machine is sometimes slow as a whole, by up to 2x: see the docstring)."""
        return max(self.lifetimes(key, what))

    def step_cpu(self, key: Key, what: str) -> float:
        """Worker CPU seconds inside its steps (step_clock.py), the lowest over rounds (noise on
        this machine only adds: whole batches run up to 1.6x slower at times): ``decode``, the
        median step decoding the whole batch; ``token``, all steps of a batch per generated token."""
        if what == "decode":
            values = [median(s.decode_steps) for s in self.samples[key] if s.decode_steps]
        else:
            values = [s.cpu_step / s.tokens for s in self.samples[key] if s.tokens and s.cpu_step > 0]
        return min(values) if values else float("nan")

    def other_cores(self, key: Key) -> float:
        """Cores other work took during these batches (the machine's CPU less the engine's)."""
        ss = self.samples[key]
        return max(0.0, sum(s.cpu_machine - s.cpu_all for s in ss)) / sum(s.wall for s in ss)


async def step_log(live: Live, batch: int) -> tuple[float, list[float]]:
    """Since the last call (step_clock.py): the workers' CPU seconds inside their steps, and the CPU
    seconds of each of the first worker's steps that decoded exactly ``batch`` tokens (one per
    request of the whole batch: steps of the same work)."""
    rpc = asyncio.run_coroutine_threadsafe(live.llm.collective_rpc("bench_step_log"), live.loop)
    logs = await asyncio.wrap_future(rpc)
    total = sum(ns for log in logs for _, ns in log) / 1e9
    return total, [ns / 1e9 for tokens, ns in logs[0] if tokens == batch]


def _machine_busy_seconds() -> float:
    """CPU seconds every process of the machine has used since boot (/proc/stat)."""
    vals = [int(x) for x in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    busy = sum(vals) - vals[3] - (vals[4] if len(vals) > 4 else 0)  # less idle and iowait
    return busy / os.sysconf("SC_CLK_TCK")


async def measure(lives: list[Live], model: str, res: Results, pass_index: int, pause: float = 0.0) -> None:
    """A warm-up round, then the timed rounds on the engines given (alive together: their batches
    interleaved, each engine's workloads and the engines in an order rotated every round), with
    ``pause`` seconds before each batch."""
    args = res.args
    n = args.max_new_tokens
    jobs = [(live, w) for live in lives for w in live.spec.workloads]

    async def timed(live: Live, workload: str, prompts: list[list[int]]) -> tuple[Sample, list[list[int]]]:
        if pause:
            await asyncio.sleep(pause)
        await step_log(live, 0)  # installs the clock on first use, and empties the log
        m0, c0 = _machine_busy_seconds(), live.procs.sample()
        t0 = perf()
        tokens = await run_batch(live, workload, prompts, n)
        wall = perf() - t0
        c1, m1 = live.procs.sample(), _machine_busy_seconds()
        in_steps, decode = await step_log(live, len(prompts))
        d = [b - a for a, b in zip(c0, c1, strict=True)]
        generated = sum(len(t) for t in tokens)
        sample = Sample(wall, generated, d[0], d[1], d[2], d[3], m1 - m0, in_steps, decode, pass_index)
        return sample, tokens

    # warm-up: every workload and B, untimed (round -1: the same prompts on every engine)
    for b in args.batches:
        prompts = make_prompts(b, args.seed, -1)
        for live, w in jobs:
            res.tokens[(model, live.spec.name, w, -1, b)] = await run_batch(live, w, prompts, n)
    for rnd in range(args.rounds):
        round_id = pass_index * args.rounds + rnd
        k = round_id % len(jobs)
        order = jobs[k:] + jobs[:k]
        gc.collect()
        for b in args.batches:
            prompts = make_prompts(b, args.seed, round_id)
            for live, w in order:
                sample, tokens = await timed(live, w, prompts)
                res.samples.setdefault((model, live.spec.name, w, b), []).append(sample)
                res.tokens[(model, live.spec.name, w, round_id, b)] = tokens
        for b in args.batches:
            last = {
                f"{live.spec.name} {w}": res.samples[(model, live.spec.name, w, b)][-1] for live, w in jobs
            }
            figures = ", ".join(
                f"{name} {s.tokens / max(s.cpu_all, 1e-9):.0f} / {s.tokens / max(s.cpu_step, 1e-9):.0f}"
                f" / {median(s.decode_steps) * 1e6 if s.decode_steps else 0:.0f} us"
                for name, s in last.items()
            )
            print(
                f"  round {rnd + 1}/{args.rounds}, B={b}: tok/CPU-s all / in steps / decode step: {figures}",
                flush=True,
            )


def _start(res: Results, model: str, spec: EngineSpec, model_dir: Path, what: str) -> Live | None:
    """Start one engine and record it (None, with the error recorded, where it did not start)."""
    run = EngineRun(model, spec)
    res.runs.append(run)
    print(f"starting {what}...", flush=True)
    try:
        live = start_engine(spec, model_dir)
    except Exception as err:
        run.error = f"start failed: {type(err).__name__}: {err}"
        print(f"  {run.error}", file=sys.stderr, flush=True)
        traceback.print_exc()
        return None
    run.start_seconds = live.start_seconds
    run.asyncpp_compile_seconds = live.asyncpp_compile_seconds
    run.scheduler = live.scheduler
    run.workers = live.procs.how_found()
    run.notes = live.notes
    for note in live.notes:
        print(f"  note: {note}", flush=True)
    print(
        f"  ready in {live.start_seconds:.1f} s; workers {run.workers}; "
        f"engine core {[p.pid for p in live.procs.core]}",
        flush=True,
    )
    live.run = run
    return live


def _engines_cpu(lives: list[Live]) -> float:
    """CPU seconds so far of the engines' processes, this one (which holds them all) counted once."""
    samples = [live.procs.sample() for live in lives]
    return sum(x[0] for x in samples) - sum(x[1] for x in samples[1:])


def run_all(res: Results, model_dirs: dict[str, Path]) -> None:
    """Every engine in turn, one alive at a time (with ``--together``: the engines of one mode
    alive at once, their batches interleaved); the machine's CPU use during the measurements."""
    args = res.args
    window = mine = every = 0.0
    specs = [ENGINES[e] for e in args.engines]
    if args.together:
        groups = [[sp for sp in specs if sp.mode == mode] for mode in ("eager", "compiled")]
        groups = [g for g in groups if g]
    else:
        groups = [[sp] for sp in specs]
    with asyncio.Runner() as runner:
        for pass_index in range(args.passes):
            for model in args.models:
                for group in groups:
                    lives: list[Live] = []
                    try:
                        for spec in group:
                            what = f"{spec.name} on {model}" + (
                                f" (pass {pass_index + 1})" if args.passes > 1 else ""
                            )
                            live = _start(res, model, spec, model_dirs[model], what)
                            if live is not None:
                                lives.append(live)
                        if not lives:
                            continue
                        t0, m0, c0 = perf(), _machine_busy_seconds(), _engines_cpu(lives)
                        try:
                            runner.run(measure(lives, model, res, pass_index, args.pause))
                        except Exception as err:
                            for live in lives:
                                live.run.error = f"run failed: {type(err).__name__}: {err}"
                            print(f"  run failed: {type(err).__name__}: {err}", file=sys.stderr, flush=True)
                            traceback.print_exc()
                        finally:
                            seconds = perf() - t0
                            for live in lives:
                                live.run.seconds = seconds
                            window += seconds
                            mine += _engines_cpu(lives) - c0
                            every += _machine_busy_seconds() - m0
                    finally:
                        for live in lives:
                            close_engine(live)
    if window > 0:
        cores = bench_common.usable_cores()
        res.load["CPU use during the measurements"] = (
            f"the engines' processes {mine / window:.2f} cores, everything else "
            f"{max(0.0, every - mine) / window:.2f} cores, of {cores} ({window:.0f} s, engine starts not counted)"
        )


# ------------------------------------------------------------------------------------------------
# the report


def verdict(value: float, hi: float, target: float) -> str:
    if value >= target:
        return "pass"
    if hi < target:
        return "**FAIL**"
    return "inconclusive (median below, range reaches it)"


def ratio_range(res: Results, a: Key, s: Key, what: str) -> tuple[float, float, float]:
    """The ratio of a over s, and its range. Engines alive together (``--together``): the median
    of the round-by-round ratios (each round's batches of both ran minutes apart at most) and their
    range. Else: the best lifetimes' ratio, its range over lifetimes with several passes, else over
    rounds."""
    if res.args.together:
        ra, rs = res.per_round(a, what), res.per_round(s, what)
        if len(ra) == len(rs):
            pairs = [x / y for x, y in zip(ra, rs, strict=True)]
            return median(pairs), min(pairs), max(pairs)
    la, ls = res.lifetimes(a, what), res.lifetimes(s, what)
    if len(la) > 1 and len(ls) > 1:
        return max(la) / max(ls), min(la) / max(ls), max(la) / min(ls)
    ra, rs = res.per_round(a, what), res.per_round(s, what)
    return median(ra) / median(rs), min(ra) / max(rs), max(ra) / min(rs)


def fmt_ratio(t: tuple[float, float, float]) -> str:
    return f"{t[0]:.3f} [{t[1]:.3f}, {t[2]:.3f}]"


def stock_reference(res: Results, model: str, mode: str) -> str | None:
    """The stock engine asyncpp's engine of ``mode`` is compared with: asyncpp's settings, else
    the stock defaults, in the same mode."""
    for name in (f"stock-asyncpp-{mode}", f"stock-default-{mode}"):
        if any(k[0] == model and k[1] == name for k in res.samples):
            return name
    return None


def _pairs(res: Results) -> Iterator[tuple[str, int, str, str, Key, Key]]:
    """(model, B, mode, workload, asyncpp's key, stock's key) of every workload measured on both an
    asyncpp engine and the stock engine with asyncpp's settings in the same mode."""
    for model in res.args.models:
        for b in res.args.batches:
            for mode in ("eager", "compiled"):
                s_key = (model, f"stock-asyncpp-{mode}", "plain", b)
                if not res.has(s_key):
                    continue
                for w in WORKLOADS:
                    a_key = (model, f"asyncpp-{mode}", w, b)
                    if res.has(a_key):
                        yield model, b, mode, w, a_key, s_key


def ratio_table(res: Results) -> str:
    rows = []
    for model, b, mode, w, a_key, s_key in _pairs(res):
        r_all = ratio_range(res, a_key, s_key, "all")
        r_worker = ratio_range(res, a_key, s_key, "worker")
        r_wall = res.med(a_key, "wall") / res.med(s_key, "wall")
        rows.append(
            [
                f"{model}, B={b}, {mode}",
                LABEL[w],
                f"{res.med(a_key, 'all'):.0f} / {res.med(s_key, 'all'):.0f}",
                fmt_ratio(r_all),
                f"{r_worker[0]:.3f}",
                f"{r_wall:.3f}",
                f"{res.other_cores(a_key):.2f} / {res.other_cores(s_key):.2f}",
                f">= {TARGET[w]}",
                verdict(r_all[0], r_all[2], TARGET[w]),
            ]
        )
    return bench_common.md_table(
        [
            "model, B, mode",
            "asyncpp workload",
            "tok/CPU-s, asyncpp / stock",
            "ratio, all processes [range]",
            "ratio, worker",
            "ratio, wall tok/s (info)",
            "other work, cores: asyncpp / stock",
            "target",
            "verdict",
        ],
        rows,
    )


def _step_verdict(decode: float, steps: float, target: float) -> str:
    met = (decode >= target) + (steps >= target)
    return ("**miss**", "mixed (one of the two meets it)", "pass")[met]


def step_table(res: Results) -> str:
    """asyncpp against stock inside the workers' steps (step_clock.py), lowest over rounds."""
    rows = []
    for model, b, mode, w, a_key, s_key in _pairs(res):
        da, ds = res.step_cpu(a_key, "decode"), res.step_cpu(s_key, "decode")
        ta, ts = res.step_cpu(a_key, "token"), res.step_cpu(s_key, "token")
        rows.append(
            [
                f"{model}, B={b}, {mode}",
                LABEL[w],
                f"{da * 1e6:.0f} / {ds * 1e6:.0f}",
                f"{ds / da:.3f}",
                f"{ta * 1e6:.1f} / {ts * 1e6:.1f}",
                f"{ts / ta:.3f}",
                f">= {TARGET[w]}",
                _step_verdict(ds / da, ts / ta, TARGET[w]),
            ]
        )
    return bench_common.md_table(
        [
            "model, B, mode",
            "asyncpp workload",
            "decode step, us: asyncpp / stock",
            "ratio, decode steps",
            "all steps, us per token: asyncpp / stock",
            "ratio, all steps",
            "target",
            "verdict (both ratios)",
        ],
        rows,
    )


def own_cost_table(res: Results) -> str:
    """asyncpp's own cost, the steady way: each block workload against plain requests on the same
    asyncpp engine, round by round (the workloads of a round run back to back, minutes closer
    than two engine lifetimes), so a slow lifetime cancels out."""
    rows = []
    for model in res.args.models:
        for b in res.args.batches:
            for mode in ("eager", "compiled"):
                name = f"asyncpp-{mode}"
                plain = res.samples.get((model, name, "plain", b))
                if not plain:
                    continue
                for w in WORKLOADS[1:]:
                    ours = res.samples.get((model, name, w, b))
                    if not ours or len(ours) != len(plain):
                        continue
                    paired = [
                        (o.tokens / max(o.cpu_all, 1e-9)) / (p.tokens / max(p.cpu_all, 1e-9))
                        for o, p in zip(ours, plain, strict=True)
                    ]
                    r = (median(paired), min(paired), max(paired))
                    rows.append(
                        [
                            f"{model}, B={b}, {mode}",
                            LABEL[w],
                            fmt_ratio(r),
                            str(len(paired)),
                            f">= {TARGET[w]}",
                            verdict(r[0], r[2], TARGET[w]),
                        ]
                    )
    if not rows:
        return ""
    return bench_common.md_table(
        [
            "model, B, mode",
            "asyncpp workload",
            "tok/CPU-s, workload / plain requests, same engine, same round: median [range]",
            "rounds",
            "target (vs stock)",
            "verdict",
        ],
        rows,
    )


def defaults_table(res: Results) -> str:
    """asyncpp against stock vLLM with its own scheduler defaults (info: what asyncpp's forced
    scheduler settings cost or save, together with asyncpp's own cost)."""
    rows = []
    for model in res.args.models:
        for b in res.args.batches:
            for mode in ("eager", "compiled"):
                s_key = (model, f"stock-default-{mode}", "plain", b)
                if not res.has(s_key):
                    continue
                cells = []
                for w in WORKLOADS:
                    a_key = (model, f"asyncpp-{mode}", w, b)
                    cells.append(f"{ratio_range(res, a_key, s_key, 'all')[0]:.3f}" if res.has(a_key) else "-")
                same = (model, f"stock-asyncpp-{mode}", "plain", b)
                settings = f"{ratio_range(res, same, s_key, 'all')[0]:.3f}" if res.has(same) else "-"
                rows.append([f"{model}, B={b}, {mode}", f"{res.med(s_key, 'all'):.0f}", settings, *cells])
    if not rows:
        return ""
    return bench_common.md_table(
        [
            "model, B, mode",
            "stock defaults tok/CPU-s",
            "stock, asyncpp settings / defaults",
            *[f"asyncpp {LABEL[w][:3]} / stock defaults" for w in WORKLOADS],
        ],
        rows,
    )


def best_table(res: Results) -> str:
    rows = []
    stock_names = [s.name for s in ENGINE_ORDER if s.kind == "stock"]
    asyncpp_names = [s.name for s in ENGINE_ORDER if s.kind == "asyncpp"]
    for model in res.args.models:
        for b in res.args.batches:
            stock = [
                (res.med((model, e, "plain", b), "all"), e)
                for e in stock_names
                if res.has((model, e, "plain", b))
            ]
            if not stock:
                continue
            s_val, s_name = max(stock)
            s_key = (model, s_name, "plain", b)
            for w in WORKLOADS:
                ours = [
                    (res.med((model, e, w, b), "all"), e) for e in asyncpp_names if res.has((model, e, w, b))
                ]
                if not ours:
                    continue
                a_val, a_name = max(ours)
                r = ratio_range(res, (model, a_name, w, b), s_key, "all")
                target = BEST_TARGET.get(w)
                rows.append(
                    [
                        f"{model}, B={b}",
                        LABEL[w],
                        f"{a_name} {a_val:.0f}",
                        f"{s_name} {s_val:.0f}",
                        fmt_ratio(r),
                        f">= {target}" if target else "-",
                        verdict(r[0], r[2], target) if target else "info",
                    ]
                )
    return bench_common.md_table(
        [
            "model, B",
            "asyncpp workload",
            "asyncpp's best, tok/CPU-s",
            "stock's best, tok/CPU-s",
            "ratio [range]",
            "target",
            "verdict",
        ],
        rows,
    )


def engines_table(res: Results) -> str:
    rows = []
    # the median start of each (model, eager engine): a compiled engine's start less its eager twin's
    starts: dict[tuple[str, str], list[float]] = {}
    for run in res.runs:
        if run.start_seconds is not None:
            starts.setdefault((run.model, run.spec.name), []).append(run.start_seconds)
    for run in res.runs:
        s = run.scheduler
        sched = (
            f"chunked prefill {s.get('enable_chunked_prefill')}, max_num_batched_tokens "
            f"{s.get('max_num_batched_tokens')}, max_num_seqs {s.get('max_num_seqs')}, "
            f"long_prefill_token_threshold {s.get('long_prefill_token_threshold')}, max_model_len "
            f"{s.get('max_model_len')}"
            if s
            else "-"
        )
        twin = starts.get((run.model, run.spec.name.replace("-compiled", "-eager")))
        vc = "-"
        if run.spec.mode == "compiled" and twin and run.start_seconds is not None:
            vc = f"{run.start_seconds - median(twin):+.1f}"
        ac = "-" if run.asyncpp_compile_seconds is None else f"{run.asyncpp_compile_seconds:.1f}"
        status = run.error or ("; ".join(run.notes) if run.notes else "ok")
        rows.append(
            [
                run.model,
                run.spec.name,
                "-" if run.start_seconds is None else f"{run.start_seconds:.1f}",
                vc,
                ac,
                sched,
                run.workers or "-",
                f"{run.seconds:.0f}",
                status,
            ]
        )
    return bench_common.md_table(
        [
            "model",
            "engine",
            "start s (creation to ready)",
            "compile s (start less the eager twin's)",
            "asyncpp compile s",
            "scheduler",
            "worker pid(s), how found",
            "measured s",
            "status",
        ],
        rows,
    )


def details_table(res: Results) -> str:
    rows = []
    for model in res.args.models:
        for spec in ENGINE_ORDER:
            for w in spec.workloads:
                for b in res.args.batches:
                    key = (model, spec.name, w, b)
                    if not res.has(key):
                        continue
                    ss = res.samples[key]
                    tot = sum(s.tokens for s in ss)
                    split = " / ".join(
                        f"{sum(getattr(s, f) for s in ss) / tot * 1e3:.2f}"
                        for f in ("cpu_caller", "cpu_core", "cpu_worker")
                    )
                    walls = res.per_round(key, "wall")
                    rows.append(
                        [
                            f"{model}, {spec.name}",
                            LABEL[w],
                            str(b),
                            f"{median(walls):.0f} [{min(walls):.0f}, {max(walls):.0f}]",
                            f"{res.med(key, 'all'):.0f}",
                            f"{res.med(key, 'worker'):.0f}",
                            split,
                            f"{res.other_cores(key):.2f}",
                            str(len(ss)),
                        ]
                    )
    return bench_common.md_table(
        [
            "model, engine",
            "workload",
            "B",
            "wall tok/s [range]",
            "tok/CPU-s, all",
            "tok/CPU-s, worker",
            "CPU ms per token: caller / engine core / worker",
            "other work, cores",
            "rounds",
        ],
        rows,
    )


def _compare(
    res: Results, model: str, a: tuple[str, str], b: tuple[str, str]
) -> tuple[int, int, list[str]] | None:
    """Requests compared, requests equal, and where the first differences are, between engine
    a's workload and engine b's workload over every round and B both ran."""
    rounds = sorted(
        {(k[3], k[4]) for k in res.tokens if k[0] == model and (k[1], k[2]) == a}
        & {(k[3], k[4]) for k in res.tokens if k[0] == model and (k[1], k[2]) == b}
    )
    if not rounds:
        return None
    total = equal = 0
    where = []
    for rnd, bs in rounds:
        ta = res.tokens[(model, *a, rnd, bs)]
        tb = res.tokens[(model, *b, rnd, bs)]
        for i, (x, y) in enumerate(zip(ta, tb, strict=True)):
            total += 1
            if x == y:
                equal += 1
            elif len(where) < 3:
                j = next(
                    (j for j, (p, q) in enumerate(zip(x, y, strict=False)) if p != q), min(len(x), len(y))
                )
                where.append(f"{'warm-up' if rnd < 0 else f'round {rnd}'}, B={bs}, request {i}: token {j}")
    return total, equal, where


@dataclass
class Check:
    model: str
    what: str
    against: str
    required: bool  # a difference fails the run (else a warning)
    total: int
    equal: int
    where: list[str]

    @property
    def ok(self) -> bool:
        return self.total == self.equal


def correctness(res: Results) -> list[Check]:
    checks = []
    for model in res.args.models:
        for mode in ("eager", "compiled"):
            ref = stock_reference(res, model, mode)
            if ref is None:
                continue
            for w in ("plain", "empty", "reads"):
                got = _compare(res, model, (f"asyncpp-{mode}", w), (ref, "plain"))
                if got:
                    checks.append(
                        Check(model, f"asyncpp-{mode} {LABEL[w]}", f"{ref} plain", w != "reads", *got)
                    )
            other = f"stock-default-{mode}"
            if ref != other:
                got = _compare(res, model, (ref, "plain"), (other, "plain"))
                if got:
                    checks.append(Check(model, f"{ref} plain", f"{other} plain", False, *got))
        for a, b in (
            ("stock-asyncpp-compiled", "stock-asyncpp-eager"),
            ("stock-default-compiled", "stock-default-eager"),
            ("asyncpp-compiled", "asyncpp-eager"),
        ):
            got = _compare(res, model, (a, "plain"), (b, "plain"))
            if got:
                checks.append(Check(model, f"{a} plain", f"{b} plain (compiled vs eager)", False, *got))
    return checks


def checks_table(checks: list[Check]) -> str:
    rows = []
    for c in checks:
        state = "equal" if c.ok else ("**MISMATCH**" if c.required else "differ (warning)")
        rows.append(
            [
                c.model,
                c.what,
                c.against,
                f"{c.equal} of {c.total}",
                state + (f": {'; '.join(c.where)}" if c.where else ""),
            ]
        )
    return bench_common.md_table(["model", "greedy tokens of", "against", "requests equal", "result"], rows)


def render(res: Results, info: dict[str, str], checks: list[Check]) -> str:
    args = res.args
    date = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    machine = "\n".join(f"- {k}: {v}" for k, v in {**info, **res.load}.items())
    models = "; ".join(MODEL_LABEL[m] for m in args.models)
    env = ", ".join(f"`{k}={os.environ.get(k, '')}`" for k in (*ENV_FORCED, *ENV_DEFAULTS))
    defaults = defaults_table(res)
    rounds = f"{args.rounds} round{'s' if args.rounds > 1 else ''} per engine" + (
        f" in each of {args.passes} passes" if args.passes > 1 else ""
    )
    defaults_text = (
        f"\nasyncpp against stock vLLM with vLLM's own scheduler defaults (info: asyncpp's forced "
        f"scheduler settings and asyncpp's own cost together), tokens per CPU second of all processes:\n\n"
        f"{defaults}\n"
        if defaults
        else ""
    )
    if args.together:
        order_text = (
            "The engines of one mode are alive together and their batches interleave, the order "
            f"rotated every round, with {args.pause:g} s of rest before each batch (vLLM's processes "
            "poll for about 1 s after a batch); a ratio is the median of the round-by-round ratios, "
            "its range their [min, max]: each round's batches of both engines run within a minute, "
            "so load that comes and goes hits both alike. The engines' figures are medians over "
            "rounds of their best lifetime (with several passes)."
        )
    else:
        order_text = (
            "Only one engine is alive at a time (2 cores, 24 GiB), so a ratio is taken across engine "
            "lifetimes, minutes apart, not round by round; and a whole lifetime is sometimes slow on "
            "this machine (the same stock engine: 4213 and 2467 tokens per CPU second in two starts "
            "on an idle machine, each steady over its rounds). With several passes (engine "
            "lifetimes) an engine's figure is the median of its best lifetime, and a ratio's range "
            "[min/max, max/min] spans the lifetimes; with one, the rounds. (`--together` keeps the "
            "engines of a mode alive at once and pairs their rounds: its own section.)"
        )
    return f"""{SECTION_TOGETHER if args.together else SECTION}

asyncpp's engines against stock vLLM engines (vLLM's own worker, `AsyncLLM`) on the same model,
requests and mode. Engines: stock with asyncpp's scheduler settings (chunked prefill off,
`long_prefill_token_threshold` 0, `max_model_len` and `max_num_batched_tokens` 512) and with vLLM's
defaults, eager and compiled; `asyncpp.VllmEngine(dtype="float32", mode="eager"|"compiled")`. All:
float32, prefix caching off, a 1 GiB KV cache; environment {env}. Models: {models}.
Workloads on asyncpp's engines: (a) plain requests on its own `AsyncLLM`, (b) one `asyncpp.generate`
trace per request, block awaits nothing, (c) block awaits every decoder layer's output every step,
(d) block adds 0.01 to layer 1's output at the last position every step; stock engines run plain
requests. Plain requests get the options asyncpp gives a trace's request (greedy, `ignore_eos`,
`FINAL_ONLY` output, `skip_clone`). Batches of B requests submitted at once, random byte-token
prompts of 8-64 tokens (spread evenly), new every round, {args.max_new_tokens} new tokens each.

The steady measure is generated tokens per CPU second of all the engine's processes (this process
and its live descendants, EngineCore and worker: each one's CPU clock, `clock_getcpuclockid`); the
worker's alone beside it
(asyncpp: pids from `engine.worker_stats()`, checked against the process titles; stock: the
descendants titled `VLLM::Worker`). Ratios asyncpp / stock, higher is better; medians over
{rounds} after a warm-up round. {order_text} Verdict: pass when the median meets the target, FAIL when the range's top misses
it. "Other work" is the CPU the machine's other processes took during an engine's batches (all CPU
in `/proc/stat` less the engine's processes'), in cores: with `nobind` the worker runs one OpenMP
thread per core, and a core taken by other work stalls its parallel regions (threads wait for the
one that lost its core): in smoke runs beside other work, some batches cost 20x the CPU per token.
Figures taken beside other work are not comparable.

Command: `{bench_common.command_line(__file__)}` ({date}; {res.seconds:.0f} s)

{machine}

Engines (start: wall seconds from creation to ready; compile: a compiled engine's start less the
start of the same engine in eager mode; asyncpp compile: `engine.compile_seconds`, vLLM's warm-up
forward, which compiles; vLLM's own `compilation_time` counts only its `VLLM_COMPILE` mode, and on
CPU it runs `DYNAMO_TRACE_ONCE`):

{engines_table(res)}

asyncpp against stock vLLM with the same settings (asyncpp's) and mode:

{ratio_table(res)}

Inside the workers' steps: the CPU time the worker process spends in its step calls
(`execute_model` and `sample_tokens`, timed by `benchmarks/step_clock.py`, mixed into stock's
worker and asyncpp's alike with `worker_extension_cls`), which leaves out the polling of vLLM's
processes between steps. "Decode step": the median CPU of a batch's steps that decode the whole
batch (B tokens, one per request: steps of the same work); "all steps": every step of a batch, per
generated token (also the prefill steps, where blocks start, and the last, where they end). Each is
the lowest over rounds: the noise on this machine only adds (whole batches at times run up to 1.6x
slower, every step alike). Ratios stock / asyncpp (higher is better, as above):

{step_table(res)}

asyncpp's own cost, measured steadily: each block workload against plain requests on the same
asyncpp engine in the same round (a whole engine lifetime can be slow on this machine; the
workloads of one round run back to back, so that cancels out). Plain requests on asyncpp's engine
are compared with stock above; the targets are the ones against stock:

{own_cost_table(res)}

asyncpp's best mode against stock's best mode (the better engine of each side by tokens per CPU
second; stock's over both settings and modes):

{best_table(res)}
{defaults_text}
Greedy tokens (asyncpp's plain requests and empty-block traces must equal stock's; reading traces
should; compiled against eager is a warning only):

{checks_table(checks)}

<details><summary>Every engine, workload and B</summary>

{details_table(res)}

</details>
"""


# ------------------------------------------------------------------------------------------------


def _list(text: str, known: list[str] | None, what: str, ap: argparse.ArgumentParser) -> list[str]:
    items = [x.strip() for x in text.split(",") if x.strip()]
    if known is not None:
        if items == ["all"]:
            return list(known)
        bad = [x for x in items if x not in known]
        if bad:
            ap.error(f"unknown {what}: {', '.join(bad)} (known: {', '.join(known)})")
    return items


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--engines",
        default=None,
        help=f"engines, comma-separated, or 'all' (default: all: {', '.join(ENGINES)})",
    )
    ap.add_argument("--models", default="tiny,small", help="models: tiny, small (default both)")
    ap.add_argument("--batches", default="1,16,32", help="batch sizes B, comma-separated (default 1,16,32)")
    ap.add_argument("--rounds", type=int, default=3, help="timed rounds per engine (default 3)")
    ap.add_argument(
        "--passes", type=int, default=1, help="times over the engine list, new engines each (default 1)"
    )
    ap.add_argument(
        "--max-new-tokens", type=int, default=64, help="tokens generated per request (default 64)"
    )
    ap.add_argument("--seed", type=int, default=0, help="prompt seed (default 0)")
    ap.add_argument(
        "--omp-bind",
        default=ENV_FORCED["VLLM_CPU_OMP_THREADS_BIND"],
        help="VLLM_CPU_OMP_THREADS_BIND for every engine (default auto, vLLM's own and asyncpp's for one worker)",
    )
    ap.add_argument(
        "--quick",
        action="store_true",
        help=f"a smoke run: tiny model, B=16, 1 round, engines {', '.join(QUICK_ENGINES)} (unless given)",
    )
    ap.add_argument(
        "--together",
        action="store_true",
        help="the engines of one mode alive at once, their batches interleaved round by round, and "
        "ratios taken round by round (default: one engine at a time)",
    )
    ap.add_argument(
        "--pause",
        type=float,
        default=None,
        help="seconds of rest before each batch (default 1.5 with --together, so the engine that ran "
        "last has stopped polling; else 0)",
    )
    ap.add_argument("--write", action="store_true", help="update the section in docs/performance.md")
    args = ap.parse_args()
    if args.pause is None:
        args.pause = 1.5 if args.together else 0.0
    if args.quick:
        args.models, args.batches, args.rounds, args.passes = "tiny", "16", 1, 1
        args.engines = args.engines or ",".join(QUICK_ENGINES)
    args.engines = _list(args.engines or "all", list(ENGINES), "engine", ap)
    args.engines = [s.name for s in ENGINE_ORDER if s.name in args.engines]  # the run order
    args.models = _list(args.models, list(MODELS), "model", ap)
    try:
        args.batches = [int(x) for x in _list(args.batches, None, "B", ap)]
    except ValueError:
        ap.error("--batches takes integers")
    if not args.engines or not args.models or not args.batches or min(args.batches) < 1:
        ap.error("engines, models and batch sizes must be given (positive)")
    if args.rounds < 1 or args.passes < 1 or args.max_new_tokens < 1:
        ap.error("--rounds, --passes and --max-new-tokens must be positive")
    if PROMPT_MAX + args.max_new_tokens > MAX_MODEL_LEN:
        ap.error(f"--max-new-tokens must leave room in max_model_len {MAX_MODEL_LEN}")
    return args


def _import_vllm() -> None:
    """Import vLLM in a frame of its own that ends at once (vLLM keeps its importer's frame
    alive, and an engine made there would outlive its close)."""
    import vllm.engine.arg_utils  # noqa: F401
    import vllm.v1.engine.async_llm  # noqa: F401


def main() -> int:
    args = parse_args()
    os.environ.update({**ENV_FORCED, "VLLM_CPU_OMP_THREADS_BIND": args.omp_bind})
    for k, v in ENV_DEFAULTS.items():
        os.environ.setdefault(k, v)
    # the engines' processes import the step clock (STEP_CLOCK) from this folder
    here = str(Path(__file__).resolve().parent)
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (here, os.environ.get("PYTHONPATH")) if p)
    _import_vllm()
    import vllm

    from asyncpp.models import tiny_model_dir

    model_dirs = {m: tiny_model_dir(MODELS[m]) for m in args.models}
    info = bench_common.machine_info(extra={"vllm": vllm.__version__})
    res = Results(args)
    t0 = perf()
    run_all(res, model_dirs)
    res.seconds = perf() - t0
    checks = correctness(res)
    for c in checks:
        if not c.ok:
            kind = "error" if c.required else "warning"
            print(
                f"{kind}: {c.model}: {c.what} differ from {c.against} in {c.total - c.equal} of "
                f"{c.total} requests ({'; '.join(c.where)})",
                file=sys.stderr,
            )
    text = render(res, info, checks)
    print(text)
    if args.write:
        bench_common.write_section(SECTION_TOGETHER if args.together else SECTION, text, DOC)
        print(f"wrote the section to {DOC.relative_to(ROOT)}")
    failed = any(r.error for r in res.runs) or any(c.required and not c.ok for c in checks)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
