"""Cost of asyncpp's torch thread-local-state swap (csrc/tls_swap.cpp), measured in one run.

Every switch between an intervention block and the model's forward goes through the swap: ``enter``
when a block is resumed, ``leave`` when it parks or ends (a *switch* is one of the two). When the
thread's state fingerprint equals the block's, nothing is copied (the fast path); otherwise a full
``at::ThreadLocalState`` capture/restore runs (the slow path, counted in ``state.slow_entries``).

What is measured:

1. raw cost per switch, in a tight Python loop of ``enter(s); leave(s)`` on one ``BlockState``:
   the fast path; the slow path (the state made with grad enabled, the loop run under
   ``torch.no_grad()``); and a block that changes its state at every resume (``enter``, a grad-mode
   toggle, ``leave``: a capture at every leave and a slow entry at every enter). The same loop with
   ``id()`` (a C builtin with the same calling convention) in place of ``enter``/``leave`` gives the
   Python call overhead, which the native controllers do not pay (they call the swap from C);
   the net figure is the loop minus that baseline.
2. time inside the swap per switch in those traces (``native.timing``: the extension sums the time
   spent in enter, leave, fork and free on the model's thread), and
3. added cost per switch over realistic traces: the embedded tiny Llama (forward traces and
   ``generate`` with 8 new tokens) and a 32-block MLP (forward traces), with blocks that read every
   layer's output (every step's, in ``generate``), timed with the swap on and off
   (``engine._switch`` = the native module vs None, on the same engine; the native controllers stay
   on in both) in interleaved rounds. Each trace kind has three blocks:

   * *reads only*: the block's state equals the forward's, so every switch takes the fast path;
   * *grad mode held*: the block holds the opposite grad mode across its awaits (``torch.no_grad()``
     in a forward trace run with ``grad=True``; ``torch.enable_grad()`` in ``generate``, whose
     forward runs under ``no_grad`` already), so every resume after the first is a slow entry;
   * *autocast held*: the block holds ``torch.autocast("cpu", dtype=torch.bfloat16)`` across its
     awaits (slow path too).

   Without the swap a held context would leak into the model and change what the forward computes
   (grad mode, bf16 kernels), so the swap-off run of a *held* block enters and leaves the same
   context once before its first await instead: both runs then do the same model work and the
   same context entries, and differ only by the swap.

   Switches per trace are counted, not assumed: a probe run of each *held* block (untimed) reads
   its ``BlockState.slow_entries``; every enter after the first is slow there, so enters =
   slow_entries + 1 and switches = 2 x enters. The *reads only* block makes the same awaits, so it
   has the same count. The resumes the block's own code sees (start, one per await, one per step,
   the end of the step loop) are shown next to it: one enter per resume (a trap the native fast
   path hands to the Python kernel is handled with the block's state still entered).

   Added us per switch = (trace with swap - trace without) / switches, the difference taken round
   by round (median of each round's calls) and its median over the rounds reported, with a
   bootstrap 95% interval. It includes the swap's per-run costs (one capture of the run's start
   state, one ``fork`` per block).

Usage::

    .venv/bin/python benchmarks/tls_switch.py            # print the tables
    .venv/bin/python benchmarks/tls_switch.py --write    # and update docs/performance.md
    .venv/bin/python benchmarks/tls_switch.py --quick    # a short run to try the script
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import gc
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from statistics import median
from typing import Any

import bench_common
import torch
from torch import nn

import asyncpp

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "performance.md"
SECTION = "## Thread-local-state swap (benchmarks/tls_switch.py)"

PER_SWITCH_TARGET_US = 1.0
REFERENCE = "reference system: 4.6 us capture + 2.9 us restore"
MLP_BLOCKS = 32
MLP_WIDTH = 16
MLP_BATCH = 4
PROMPT = "Hello world"
NEW_TOKENS = 8

perf = time.perf_counter_ns


# ------------------------------------------------------------------------------------------------
# small helpers


def md_table(header: list[str], rows: list[list[str]]) -> str:
    return bench_common.md_table(header, rows)


def verdict(ok: bool | None) -> str:
    if ok is None:
        return "info"
    return "pass" if ok else "**FAIL**"


def median_ci(values: list[float]) -> tuple[float, float]:
    """Distribution-free 95% interval of the median: the order statistics n/2 -+ 1.96 sqrt(n)/2."""
    s = sorted(values)
    n = len(s)
    half = 1.96 * n**0.5 / 2
    return s[max(0, int(n / 2 - half))], s[min(n - 1, int(n / 2 + half))]


def verdict_ci(lo: float, hi: float, target: float) -> str:
    """pass when the whole interval is within the target, FAIL when none of it is."""
    if hi <= target:
        return "pass"
    if lo > target:
        return "**FAIL**"
    return "inconclusive (noise)"


def pct(samples: list[float], q: float) -> float:
    s = sorted(samples)
    return s[min(len(s) - 1, int(q * len(s)))]


def command_line() -> str:
    return bench_common.command_line(__file__)


# ------------------------------------------------------------------------------------------------
# 1. raw switch cost


@dataclass
class Loop:
    name: str
    run: Callable[[int], int]  # run(n) -> elapsed ns of n iterations
    base: Callable[[int], int]  # the same loop with id() for enter/leave
    check: Callable[[], str]  # which path the loop took (counters)
    ns: list[float] = field(default_factory=list)  # per switch, per round
    base_ns: list[float] = field(default_factory=list)


def raw_loops(native: Any) -> list[Loop]:
    enter, leave = native.enter, native.leave
    set_grad = torch._C._set_grad_enabled

    def pair_loop(f_in, f_out, s, ctx=contextlib.nullcontext):
        def run(n: int) -> int:
            with ctx():
                t0 = perf()
                for _ in range(n):
                    f_in(s)
                    f_out(s)
                return perf() - t0

        return run

    def toggle_loop(f_in, f_out, s):
        def run(n: int) -> int:
            with torch.enable_grad():  # the id() baseline toggles the thread's own grad mode
                g = True
                t0 = perf()
                for _ in range(n):
                    f_in(s)
                    g = not g
                    set_grad(g)
                    f_out(s)
                return perf() - t0

        return run

    with torch.enable_grad():
        fast = native.BlockState()
        slow = native.BlockState()  # made with grad enabled, entered under no_grad
        changing = native.BlockState()

    def counters(s, n_runs) -> Callable[[], str]:
        return lambda: f"slow entries {s.slow_entries}, captures {s.captures} over {n_runs()} enters"

    runs = {"fast": 0, "slow": 0, "changing": 0}

    def counted(key, fn):
        def run(n: int) -> int:
            runs[key] += n
            return fn(n)

        return run

    grad_on = torch.enable_grad
    return [
        Loop(
            "fast path: enter + leave, thread state = block state",
            counted("fast", pair_loop(enter, leave, fast, grad_on)),
            pair_loop(id, id, fast, grad_on),
            counters(fast, lambda: runs["fast"]),
        ),
        Loop(
            "slow path: state made with grad on, entered under `no_grad` (restore at leave)",
            counted("slow", pair_loop(enter, leave, slow, torch.no_grad)),
            pair_loop(id, id, slow, torch.no_grad),
            counters(slow, lambda: runs["slow"]),
        ),
        Loop(
            "block changes its state at every resume: enter, grad toggle, leave (a capture at every leave)",
            counted("changing", toggle_loop(enter, leave, changing)),
            toggle_loop(id, id, changing),
            counters(changing, lambda: runs["changing"]),
        ),
    ]


def measure_raw(loops: list[Loop], rounds: int, n: int) -> None:
    for lp in loops:  # warm up
        lp.run(n // 4)
        lp.base(n // 4)
    rng = random.Random(1)
    for _ in range(rounds):
        order = list(loops)
        rng.shuffle(order)
        for lp in order:
            before = lp.base(n)
            lp.ns.append(lp.run(n) / (2 * n))
            lp.base_ns.append((before + lp.base(n)) / (4 * n))  # the baseline before and after


@dataclass
class Cold:
    """enter and leave timed one by one right after a tiny Llama forward (caches cold)."""

    enter: dict[str, list[int]] = field(default_factory=dict)  # ns per call, by path
    leave: dict[str, list[int]] = field(default_factory=dict)

    def net(self, path: str) -> tuple[float, float]:
        """(enter, leave) in ns, minus the same timing of an id() call."""
        return (
            median(self.enter[path]) - median(self.enter["id()"]),
            median(self.leave[path]) - median(self.leave["id()"]),
        )


def measure_cold(native: Any, llama: nn.Module, tok: Any, reps: int) -> Cold:
    """After each forward of the tiny Llama, time one enter and one leave (fast path, slow path,
    or id() for the timer and call overhead, in rotation): the swap as a trace meets it, its code
    and data evicted by the model's work in between."""
    ids = tok(PROMPT, return_tensors="pt")["input_ids"]
    with torch.no_grad():
        fast = native.BlockState()
    with torch.enable_grad():
        slow = native.BlockState()
    kinds = [("fast path", native.enter, native.leave, fast), ("slow path", native.enter, native.leave, slow)]
    kinds.append(("id()", id, id, fast))
    out = Cold({k[0]: [] for k in kinds}, {k[0]: [] for k in kinds})
    with torch.no_grad():
        for _ in range(3):
            llama(ids)
        for i in range(reps * len(kinds)):
            name, f_in, f_out, s = kinds[i % len(kinds)]
            llama(ids)
            t0 = perf()
            f_in(s)
            t1 = perf()
            f_out(s)
            t2 = perf()
            out.enter[name].append(t1 - t0)
            out.leave[name].append(t2 - t1)
    return out


# ------------------------------------------------------------------------------------------------
# 2. realistic traces


def build_mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        *[nn.Sequential(nn.Linear(MLP_WIDTH, MLP_WIDTH), nn.ReLU()) for _ in range(MLP_BLOCKS)]
    )


# The blocks: `hold` is a context factory or None; `across` says whether the context is held across
# the awaits (swap on) or entered and left once before them (swap off: same work, nothing leaks).
# `probe`, in untimed probe runs only, collects the block's BlockState and the resumes it sees.


def _probe_start(probe: dict | None) -> None:
    if probe is not None:
        from asyncpp.kernel.interleaver import active_interleaver

        probe["state"] = active_interleaver().current.state
        probe["resumes"] = 1


def _seen(probe: dict | None) -> None:
    if probe is not None:
        probe["resumes"] += 1


def _held(hold: Callable | None, across: bool) -> Any:
    """The context a block holds across its awaits; without ``across`` (the swap-off run of a held
    block) the context is entered and left once here instead, and nothing is held."""
    if hold is None:
        return contextlib.nullcontext()
    if across:
        return hold()
    with hold():
        pass
    return contextlib.nullcontext()


async def mlp_block(m, hold=None, across=True, probe=None):
    _probe_start(probe)
    ctx = _held(hold, across)
    with ctx:
        for i in range(MLP_BLOCKS):
            await m[i].output
            _seen(probe)


async def empty_block(m, hold=None, across=True, probe=None):
    _probe_start(probe)


async def llama_block(m, hold=None, across=True, probe=None):
    _probe_start(probe)
    ctx = _held(hold, across)
    with ctx:
        for layer in m.model.layers:
            await layer.output
            _seen(probe)


async def llama_gen_block(m, hold=None, across=True, probe=None):
    _probe_start(probe)
    ctx = _held(hold, across)
    with ctx:
        async for _step in m.steps():
            _seen(probe)
            for layer in m.model.layers:
                await layer.output
                _seen(probe)
    _seen(probe)  # the step loop ended: resumed once more


def autocast_bf16():
    return torch.autocast("cpu", dtype=torch.bfloat16)


@dataclass
class Scenario:
    trace: str  # trace kind, e.g. "tiny Llama, forward"
    variant: str  # "reads only", "grad mode held", "autocast held"
    engine: asyncpp.LocalEngine
    make: Callable[[], Any]  # a new asyncpp.Trace
    inp: Any
    block: Callable
    hold: Callable | None
    inner: int
    switches: int = 0
    resumes: int = 0  # as the block's code sees them
    slow_entries: int = 0
    same_output: bool | None = None
    on: list[float] = field(default_factory=list)  # us, every call
    off: list[float] = field(default_factory=list)
    diffs: list[float] = field(default_factory=list)  # us, on - off of each adjacent pair of calls
    realistic: bool = True  # counted in the pooled figure
    control: bool = False  # an A/A control: both runs of each pair with the swap off
    situ: tuple[int, int, int] = (0, 0, 0)  # in-trace swap time: ns, switches, ns of per-block work

    @property
    def name(self) -> str:
        return f"{self.trace}, {self.variant}"

    def run(self, swap: Any, probe: dict | None = None) -> asyncpp.Invoke:
        if self.control:
            swap = None
        self.engine._switch = swap
        with self.make() as t:
            h = t.invoke(self.inp, self.block, self.hold, swap is not None, probe)
        return h


def scenarios(inner_scale: float, llama: nn.Module, tok: Any) -> list[Scenario]:
    mlp = build_mlp().eval()
    mlp_engine = asyncpp.LocalEngine(mlp)
    x = torch.randn(MLP_BATCH, MLP_WIDTH, generator=torch.Generator().manual_seed(0))
    llama_engine = asyncpp.LocalEngine(llama, tok)

    def k(n: int) -> int:
        return max(1, round(n * inner_scale))

    out = []
    kinds = [
        ("32-block MLP, forward", mlp_engine, mlp_block, x, False, k(10)),
        ("tiny Llama, forward", llama_engine, llama_block, PROMPT, False, k(12)),
        (f"tiny Llama, generate({NEW_TOKENS})", llama_engine, llama_gen_block, PROMPT, True, k(2)),
    ]
    for trace, engine, block, inp, gen, inner in kinds:
        if gen:
            held_grad = ("grad mode held (`enable_grad`)", torch.enable_grad, False)
        else:
            held_grad = ("grad mode held (`no_grad`, forward with grad=True)", torch.no_grad, True)
        for variant, hold, grad in [
            ("reads only", None, False),
            held_grad,
            ("autocast held (cpu, bf16)", autocast_bf16, False),
        ]:
            if gen:

                def make(engine=engine, grad=grad):
                    return asyncpp.generate(engine, max_new_tokens=NEW_TOKENS, grad=grad)
            else:

                def make(engine=engine, grad=grad):
                    return asyncpp.trace(engine, grad=grad)

            out.append(Scenario(trace, variant, engine, make, inp, block, hold, inner))
        reads = out[-3]
        control = Scenario(
            trace,
            "A/A control (reads only, swap off in both runs)",
            engine,
            reads.make,
            inp,
            block,
            None,
            inner,
        )
        control.realistic, control.control = False, True
        out.append(control)
        if not gen:  # the per-trace fixed cost: a block that never parks
            empty = Scenario(trace, "block without awaits", engine, reads.make, inp, empty_block, None, inner)
            empty.realistic = False
            out.append(empty)
    return out


def _outputs(sc: Scenario, h: asyncpp.Invoke) -> torch.Tensor:
    if sc.trace.startswith("tiny Llama, generate"):
        return h.tokens
    o = h.output
    return getattr(o, "logits", o)


def probe_counts(scs: list[Scenario], native: Any) -> list[str]:
    """Count switches per trace (see the module docstring); check on/off give the same output."""
    problems = []
    by_trace: dict[str, int] = {}
    for sc in scs:
        probe: dict = {}
        h_on = sc.run(native, probe)
        h_off = sc.run(None)
        h_on.result  # noqa: B018  (re-raises the block's error, if any)
        h_off.result  # noqa: B018
        sc.same_output = bool(torch.equal(_outputs(sc, h_on), _outputs(sc, h_off)))
        sc.resumes = probe["resumes"]
        if sc.control:  # no swap, no state: the control has the reads-only block's switches
            continue
        sc.slow_entries = probe["state"].slow_entries
        if sc.hold is not None:
            enters = sc.slow_entries + 1
            if by_trace.setdefault(sc.trace, enters) != enters:
                problems.append(
                    f"{sc.name}: {enters} enters, another held block of this trace had {by_trace[sc.trace]}"
                )
        elif sc.slow_entries:
            problems.append(f"{sc.name}: {sc.slow_entries} slow entries where none were expected")
        if not sc.same_output:
            problems.append(f"{sc.name}: the output differs between swap on and off")
    for sc in scs:
        sc.switches = 2 * (by_trace[sc.trace] if sc.realistic or sc.control else sc.resumes)
    return problems


def measure_in_situ(scs: list[Scenario], native: Any, reps: int, problems: list[str]) -> None:
    """The swap's own time inside real traces: the native module sums the time spent in enter,
    leave, fork and free on this thread (steady_clock around each call, cold caches and all)."""
    for sc in scs:
        if sc.control:
            continue
        native.timing(True)
        for _ in range(reps):
            sc.run(native)
        ns, switches, per_block = native.timing(False)
        sc.situ = (ns // reps, switches // reps, per_block // reps)
        if switches != reps * sc.switches:
            problems.append(f"{sc.name}: timed {switches / reps:g} switches per trace, counted {sc.switches}")


CLOCKS = {
    # CPU time of the calling thread (the sync trace runs on it): time the thread was switched out
    # for other work on this 2-core machine is not counted, which is most of the on/off noise
    "thread": time.thread_time_ns,
    "wall": time.perf_counter_ns,
}


def measure_traces(scs: list[Scenario], native: Any, rounds: int, warmup: int, clock: str) -> None:
    now = CLOCKS[clock]
    for sc in scs:  # warm up: at least `warmup` calls each way, or a quarter second
        end = time.perf_counter() + 0.25
        for i in range(1_000_000):
            if i >= warmup and time.perf_counter() > end:
                break
            sc.run(native)
            sc.run(None)
    gc.collect()
    gc.freeze()
    rng = random.Random(2)
    order = list(scs)
    try:
        for r in range(rounds):
            rng.shuffle(order)
            gc.collect()
            gc.disable()
            for sc in order:
                for i in range(sc.inner):
                    first_on = (r + i) % 2 == 0
                    t = {}
                    for swap in (native, None) if first_on else (None, native):
                        t0 = now()
                        sc.run(swap)
                        t[swap is not None] = (now() - t0) / 1000.0
                    sc.on.append(t[True])
                    sc.off.append(t[False])
                    sc.diffs.append(t[True] - t[False])
            gc.enable()
    finally:
        gc.enable()
        gc.unfreeze()


# ------------------------------------------------------------------------------------------------
# report


def report(loops: list[Loop], cold: Cold, scs: list[Scenario]) -> tuple[str, str, str]:
    main_rows = []
    raw_rows = []
    for i, lp in enumerate(loops):
        gross = median(lp.ns)
        net = median(a - b for a, b in zip(lp.ns, lp.base_ns, strict=True))
        if i == 0:
            target, ok = f"<= {PER_SWITCH_TARGET_US * 1000:.0f} ns", net <= PER_SWITCH_TARGET_US * 1000
        else:
            target, ok = f"- ({REFERENCE})", None
        main_rows.append(
            [
                f"raw, {lp.name}",
                f"{net:.0f} ns/switch ({gross:.0f} with the Python call)",
                target,
                verdict(ok),
            ]
        )
        raw_rows.append([lp.name, f"{gross:.1f}", f"{median(lp.base_ns):.1f}", f"{net:.1f}", lp.check()])
    for path in ("fast path", "slow path"):
        e, lv = cold.net(path)
        main_rows.append(
            [
                f"raw, cold: {path}, timed one call at a time after a tiny Llama forward",
                f"{(e + lv) / 2:.0f} ns/switch (enter {e:.0f}, leave {lv:.0f})",
                "-",
                "info",
            ]
        )

    trace_rows = []
    pooled_d = pooled_sw = pooled_lo = pooled_hi = 0.0
    situ_ns = situ_sw = 0
    added: dict[str, float] = {}
    for sc in (sc for sc in scs if sc.realistic):
        ns, switches, per_block = sc.situ
        situ_ns += ns
        situ_sw += switches
        per = ns / switches / 1000
        main_rows.append(
            [
                f"{sc.name}: time inside the swap per switch, in the trace",
                f"{per:.3f} us/switch; {switches} switches, {ns / 1000:.1f} us per trace "
                f"(of which fork and free of the block's state {per_block / 1000:.1f} us)",
                f"<= {PER_SWITCH_TARGET_US:g} us",
                verdict(per <= PER_SWITCH_TARGET_US),
            ]
        )
    main_rows.append(
        [
            "all realistic traces, pooled: time inside the swap / switches",
            f"{situ_ns / situ_sw / 1000:.3f} us/switch",
            f"<= {PER_SWITCH_TARGET_US:g} us",
            verdict(situ_ns / situ_sw / 1000 <= PER_SWITCH_TARGET_US),
        ]
    )
    for sc in scs:
        d = median(sc.diffs)
        lo, hi = median_ci(sc.diffs)
        added[sc.name] = d
        off = median(sc.off)
        per, per_lo, per_hi = d / sc.switches, lo / sc.switches, hi / sc.switches
        if sc.control:
            main_rows.append(
                [
                    f"{sc.trace}, A/A control: the same pairs, swap off in both runs",
                    f"{per:.3f} us/switch [{per_lo:.3f}, {per_hi:.3f}]; trace {d:+.1f} us",
                    "~0",
                    "info (the on/off method's bias on this machine)",
                ]
            )
        if sc.realistic:
            pooled_d += d
            pooled_lo += lo
            pooled_hi += hi
            pooled_sw += sc.switches
            main_rows.append(
                [
                    f"{sc.name}: added per switch",
                    f"{per:.3f} us/switch [{per_lo:.3f}, {per_hi:.3f}]; {sc.switches} switches, "
                    f"trace {d:+.1f} us ({100 * d / off:+.2f}% of {off:.0f} us)",
                    f"<= {PER_SWITCH_TARGET_US:g} us",
                    verdict_ci(per_lo, per_hi, PER_SWITCH_TARGET_US),
                ]
            )
        trace_rows.append(
            [
                sc.name,
                f"{off:.1f} ({pct(sc.off, 0.1):.0f}-{pct(sc.off, 0.9):.0f})",
                f"{median(sc.on):.1f} ({pct(sc.on, 0.1):.0f}-{pct(sc.on, 0.9):.0f})",
                f"{d:+.2f} [{lo:+.2f}, {hi:+.2f}]",
                f"{100 * d / off:+.3f}%",
                f"{sc.switches} ({sc.resumes})",
                str(sc.slow_entries),
                f"{per:.3f}",
                str(len(sc.diffs)),
                "yes" if sc.same_output else "**no**",
            ]
        )
    main_rows.append(
        [
            "all realistic traces above, pooled (on - off): sum of added us / sum of switches",
            f"{pooled_d / pooled_sw:.3f} us/switch [{pooled_lo / pooled_sw:.3f}, {pooled_hi / pooled_sw:.3f}]",
            f"<= {PER_SWITCH_TARGET_US:g} us",
            verdict_ci(pooled_lo / pooled_sw, pooled_hi / pooled_sw, PER_SWITCH_TARGET_US),
        ]
    )
    for empty in (sc for sc in scs if not sc.realistic and not sc.control):
        reads = next(sc for sc in scs if sc.trace == empty.trace and sc.hold is None and sc.realistic)
        fixed = added[empty.name]
        lo, hi = median_ci(empty.diffs)
        n = reads.switches - empty.switches
        marginal = (added[reads.name] - fixed) / n
        main_rows.append(
            [
                f"{empty.trace}: fixed cost per trace (a block without awaits, {empty.switches} switches)",
                f"{fixed:+.2f} us [{lo:+.2f}, {hi:+.2f}]",
                "-",
                "info",
            ]
        )
        main_rows.append(
            [
                f"{reads.trace}: marginal cost of a fast-path switch ((reads only - no awaits) / {n})",
                f"{1000 * marginal:.0f} ns/switch",
                "-",
                "info",
            ]
        )
    main = md_table(["measure", "value", "target", "verdict"], main_rows)
    raw = md_table(
        ["loop", "ns per switch", "same loop with id()", "net ns per switch", "path taken (counters)"],
        raw_rows,
    )
    traces = md_table(
        [
            "trace, block",
            "swap off: median us (p10-p90)",
            "swap on: median us (p10-p90)",
            "on - off, median of pairs, us [95% CI]",
            "overhead",
            "switches (block resumes)",
            "slow entries",
            "us/switch",
            "pairs",
            "same output",
        ],
        trace_rows,
    )
    return main, raw, traces


CLOCK_TEXT = {
    "thread": "the CPU time of the thread that runs them (`time.thread_time_ns`: time the thread spends "
    "switched out for other work on the machine is left out, and with it most of the noise; what the "
    "swap costs the thread itself, cache misses included, is all counted)",
    "wall": "wall time (`time.perf_counter_ns`)",
}


def render(main: str, raw: str, traces: str, info: dict[str, str], seconds: float, args, problems) -> str:
    date = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    machine = "\n".join(f"- {k}: {v}" for k, v in info.items())
    warn = ""
    if problems:
        warn = "\n**Checks that failed:**\n\n" + "\n".join(f"- {p}" for p in problems) + "\n"
    return f"""{SECTION}

The swap of torch's thread-local state at every switch between a block and the forward (a switch is
one `enter` or one `leave`). Raw: `enter(s); leave(s)` in a Python loop on one `BlockState`
({args.iters} pairs x {args.raw_rounds} shuffled rounds, median over rounds; *net* subtracts the same
loop calling `id()`, the Python call the native controllers do not pay). Traces (sync `with`): the
embedded tiny Llama (4 layers, prompt {PROMPT!r}; a forward trace, and `generate` with
{NEW_TOKENS} new tokens) and a 32-block `Linear(16, 16) + ReLU` MLP (input 4x16), with a block that
reads every layer's output (every step's, in `generate`). Each trace runs with the swap on and off on
the same engine (`engine._switch` = the native module / None; the native controllers stay on) as
adjacent pairs in alternating order, {args.rounds} shuffled rounds of them. Added cost = median of
the pairs' (on - off), with a distribution-free 95% interval; per switch, divided by the trace's
switches. It includes the swap's per-trace costs (one capture of the start state, one fork per
block). *Held* blocks keep a context (grad mode, autocast) across their awaits, so every resume
after the first is a slow entry; their swap-off runs enter and leave the context once before the
first await instead, so that the model computes the same thing in both runs (the outputs are
checked equal). Switches per trace are counted: the held blocks' `slow_entries` + 1 enters, x2.
A verdict is *inconclusive* when the interval straddles the target. `torch.set_num_threads(1)`.
The traces are timed with {CLOCK_TEXT[args.clock]}.

Two measures of the per-switch cost. *Time inside the swap*: the native module sums the time spent
in `enter`, `leave`, `fork` and the free of a block's state on the model's thread (a steady clock
read around each call) over {args.situ} traces of each kind: the swap's own cost in the real trace,
with the caches as cold as the forward leaves them (the clock reads included), per switch. *On -
off*: the whole traces timed with and without the swap, which also catches indirect costs (the
calls into the swap, cache lines it evicts) but on a 2-3 ms Llama trace sits within this VM's
noise; the *A/A control* runs the same pairs with the swap off in both runs and shows how far the
method strays from zero by itself.

Command: `{command_line()}` ({date}; {seconds:.0f} s)

{machine}
{warn}
{main}

<details><summary>Raw loops and all traces</summary>

{raw}

{traces}

Switch counts: each enter is followed by a leave. "block resumes" counts the resumes the block's
own code sees (start, each await, each step, the end of the step loop): one enter each. Slow
entries are those of the probe run.

</details>
"""


def write_section(text: str) -> None:
    """Replace (or append) this benchmark's section of docs/performance.md, keeping the others."""
    bench_common.write_section(SECTION, text, DOC)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--write", action="store_true", help=f"update the section in {DOC.relative_to(ROOT)}")
    ap.add_argument("--rounds", type=int, default=150, help="shuffled rounds of the traces (default 150)")
    ap.add_argument(
        "--raw-rounds", type=int, default=15, help="shuffled rounds of the raw loops (default 15)"
    )
    ap.add_argument("--cold", type=int, default=200, help="cold enter/leave timings per path (default 200)")
    ap.add_argument("--iters", type=int, default=50000, help="enter/leave pairs per raw loop (default 50000)")
    ap.add_argument(
        "--inner",
        type=float,
        default=1.0,
        help="scale the on/off pairs per trace per round (10, 12, 2; default 1)",
    )
    ap.add_argument(
        "--warmup", type=int, default=3, help="least warm-up calls per trace, each way (default 3)"
    )
    ap.add_argument("--situ", type=int, default=100, help="traces of each kind timed in situ (default 100)")
    ap.add_argument(
        "--clock",
        choices=sorted(CLOCKS),
        default="thread",
        help="how the on/off traces are timed: the thread's CPU time (default) or wall time",
    )
    ap.add_argument("--quick", action="store_true", help="a short run to try the script")
    args = ap.parse_args()
    if args.quick:
        args.rounds, args.raw_rounds, args.iters, args.cold, args.situ = 10, 3, 10000, 30, 10
    torch.set_num_threads(1)
    from asyncpp.native import load

    native = load()
    info = bench_common.machine_info()
    t0 = time.perf_counter()

    loops = raw_loops(native)
    measure_raw(loops, args.raw_rounds, args.iters)
    from asyncpp.models import load_tiny

    llama, tok = load_tiny()
    llama.eval()
    cold = measure_cold(native, llama, tok, args.cold)

    scs = scenarios(args.inner, llama, tok)
    problems = probe_counts(scs, native)
    measure_traces(scs, native, args.rounds, args.warmup, args.clock)
    measure_in_situ(scs, native, args.situ, problems)
    for eng in {id(sc.engine): sc.engine for sc in scs}.values():
        eng.close()

    main_t, raw_t, traces_t = report(loops, cold, scs)
    text = render(main_t, raw_t, traces_t, info, time.perf_counter() - t0, args, problems)
    print(text)
    if args.write:
        write_section(text)
        print(f"updated {DOC.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
