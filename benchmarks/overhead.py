"""Overhead of asyncpp's local kernel on a tiny CPU model, measured in one run.

The model is 32 small blocks (``Linear(16, 16) + ReLU`` each, 97 modules with the containers), run
on one CPU thread under ``torch.no_grad()`` (asyncpp runs blocks under ``no_grad`` by default too).
Every variant is timed with ``time.perf_counter_ns`` around one call; variants run interleaved in
shuffled rounds so that drift (frequency scaling, noisy neighbours) hits them all alike, and the
reported figures are medians over all rounds.

What is measured:

* plain forward (no asyncpp);
* idle controllers: the same forward with asyncpp's per-module controllers installed and an
  interleaver active with nothing waiting (the engine's internals, no trace around it);
* empty trace: ``with asyncpp.trace(model) as t: t.invoke(x, block)`` whose block returns at once;
  its fixed cost is its median minus the plain forward's;
* reads: a block that awaits the output of k of the 32 blocks (k = 0, 8, 16, 32) and returns them
  in a list (asyncpp detaches and clones every returned tensor); the slope of a least-squares line
  through the k medians is the marginal cost of one read-and-return. The same reads done with plain
  PyTorch forward hooks (registered per call, saving ``out.detach().clone()``, removed after the
  call) give the comparison slope;
* async entry: ``async with asyncpp.trace(model)`` under asyncio against
  ``await asyncio.to_thread(model, x)`` (both under ``no_grad``), each minus a plain forward run in
  the same event loop; the async trace minus a sync trace run in the loop is the hand-off alone;
* extra invokes: traces of 1, 2 and 4 invokes of one row each (empty blocks), each minus a plain
  forward of the same batch size; the slope over the invoke count is the cost of one more invoke.

Usage::

    .venv/bin/python benchmarks/overhead.py            # print the table
    .venv/bin/python benchmarks/overhead.py --write    # and update docs/performance.md
    .venv/bin/python benchmarks/overhead.py --profile  # and print where the time goes

``--profile`` reaches into the engine's internals (it times ``LocalEngine._execute``'s steps one by
one, and swaps pieces of the read path at run time); a step that no longer fits them says so and
the rest still runs.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import cProfile
import datetime
import gc
import os
import pstats
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
SECTION = "## Local kernel overhead (benchmarks/overhead.py)"

N_BLOCKS = 32
WIDTH = 16
BATCH = 4
READ_COUNTS = (0, 8, 16, 32)
INVOKE_COUNTS = (1, 2, 4)

# targets
IDLE_RATIO_TARGET = 1.05
READ_TARGET_US = 3.5
FIXED_TARGET_US = 60.0
INVOKE_TARGET_US = 8.0

perf = time.perf_counter_ns


# ------------------------------------------------------------------------------------------------
# the model and the blocks


def build_model() -> nn.Sequential:
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.ReLU()) for _ in range(N_BLOCKS)])
    return model.eval()


def read_indices(k: int) -> list[int]:
    """``k`` block indices spread evenly over the 32 blocks, in model order."""
    if k == 0:
        return []
    step = N_BLOCKS / k
    return sorted({int(i * step) for i in range(k)})


async def empty_block(m):
    return None


async def read_block(m, idx):
    outs = []
    for i in idx:
        outs.append(await m[i].output)
    return outs


# ------------------------------------------------------------------------------------------------
# the timing harness


@dataclass
class Variant:
    name: str
    fn: Callable[[], Any]
    ctx: Callable[[], Any] = contextlib.nullcontext  # entered around each batch of timed calls
    samples: list[int] = field(default_factory=list)  # ns, every timed call
    rounds: list[float] = field(default_factory=list)  # us, the median of each round's calls

    def med(self) -> float:
        return median(self.samples) / 1000.0

    def record(self, batch: list[int]) -> None:
        self.samples.extend(batch)
        self.rounds.append(median(batch) / 1000.0)

    def pct(self, q: float) -> float:
        s = sorted(self.samples)
        return s[min(len(s) - 1, int(q * len(s)))] / 1000.0


def run_rounds(variants: list[Variant], rounds: int, inner: int, warmup: int, seed: int = 0) -> None:
    """Time every variant ``rounds * inner`` times, interleaved in shuffled rounds."""
    for v in variants:
        with v.ctx():
            for _ in range(warmup):
                v.fn()
    rng = random.Random(seed)
    order = list(variants)
    gc.collect()
    for _ in range(rounds):
        rng.shuffle(order)
        for v in order:
            fn, batch = v.fn, []
            with v.ctx():
                for _ in range(inner):
                    t0 = perf()
                    fn()
                    batch.append(perf() - t0)
            v.record(batch)


# Differences, ratios and slopes are taken round by round (each round runs every variant within a
# fraction of a second) and then the median over rounds is reported: load that comes and goes
# between rounds cancels out instead of landing on whichever variant it happened to hit.


def diff(a: Variant, b: Variant) -> float:
    """Median over rounds of a's round median minus b's."""
    return median(x - y for x, y in zip(a.rounds, b.rounds, strict=True))


def ratio(a: Variant, b: Variant) -> float:
    return median(x / y for x, y in zip(a.rounds, b.rounds, strict=True))


def paired_slope(xs: list[float], ys: list[Variant], base: list[Variant] | None = None) -> float:
    """Median over rounds of the slope of ys (minus base, if given) over xs."""
    out = []
    for r in range(len(ys[0].rounds)):
        vals = [v.rounds[r] - (base[i].rounds[r] if base else 0.0) for i, v in enumerate(ys)]
        out.append(bench_common.slope(xs, vals))
    return median(out)


# ------------------------------------------------------------------------------------------------
# the variants


def plain_fn(model: nn.Module, x: torch.Tensor) -> Callable[[], Any]:
    return lambda: model(x)


@contextlib.contextmanager
def idle_controllers(model: nn.Module, batch: int):
    """The engine's controllers installed and an interleaver active with nothing waiting."""
    from asyncpp.kernel.interleaver import Interleaver

    engine = asyncpp.LocalEngine.for_model(model)
    kernel = Interleaver(engine.paths, batch)
    engine._controllers.install(kernel)
    try:
        with kernel.active(), torch.no_grad():
            yield
    finally:
        engine._controllers.remove()


def trace_fn(model: nn.Module, x: torch.Tensor, block, *args) -> Callable[[], Any]:
    def run():
        with asyncpp.trace(model) as t:
            h = t.invoke(x, block, *args)
        return h.result

    return run


def hooks_fn(model: nn.Module, x: torch.Tensor, idx: list[int]) -> Callable[[], Any]:
    """The same reads with plain forward hooks: registered for the call, cloned out, removed."""
    targets = [model[i] for i in idx]

    def run():
        saved = []

        def hook(mod, args, out):
            saved.append(out.detach().clone())

        handles = [t.register_forward_hook(hook) for t in targets]
        try:
            model(x)
        finally:
            for h in handles:
                h.remove()
        return saved

    return run


def invokes_fn(model: nn.Module, rows: list[torch.Tensor]) -> Callable[[], Any]:
    def run():
        with asyncpp.trace(model) as t:
            for r in rows:
                t.invoke(r, empty_block)

    return run


def check_variants(model: nn.Module, x: torch.Tensor) -> None:
    """The variants compute what they claim: asyncpp's reads and the hooks' reads return the same
    tensors (both copies), and the forward with idle controllers returns the plain forward's output."""
    with torch.no_grad():
        want = model(x)
    with idle_controllers(model, BATCH):
        assert torch.equal(model(x), want)
    idx = read_indices(8)
    got = trace_fn(model, x, read_block, idx)()
    ref = hooks_fn(model, x, idx)()
    with torch.no_grad():
        direct = []
        h = x
        for i, b in enumerate(model):
            h = b(h)
            if i in idx:
                direct.append(h)
    assert len(got) == len(ref) == len(direct) == len(idx)
    for a, b, c in zip(got, ref, direct, strict=True):
        assert torch.equal(a, b) and torch.equal(a, c)
        assert a.data_ptr() != c.data_ptr() and b.data_ptr() != c.data_ptr()
        assert not a.requires_grad and not b.requires_grad


# ------------------------------------------------------------------------------------------------
# async entry


async def async_rounds(
    model: nn.Module, x: torch.Tensor, rounds: int, inner: int, warmup: int
) -> dict[str, Variant]:
    def forward_no_grad():
        with torch.no_grad():
            return model(x)

    async def plain():
        with torch.no_grad():
            model(x)

    async def sync_trace():
        with asyncpp.trace(model) as t:
            t.invoke(x, empty_block)

    async def async_trace():
        async with asyncpp.trace(model) as t:
            t.invoke(x, empty_block)

    async def to_thread():
        await asyncio.to_thread(forward_no_grad)

    variants = {
        "plain forward (in the loop)": plain,
        "sync trace (in the loop)": sync_trace,
        "async trace": async_trace,
        "asyncio.to_thread(model, x)": to_thread,
    }
    out = {name: Variant(name, fn) for name, fn in variants.items()}
    for v in out.values():
        for _ in range(warmup):
            await v.fn()
    rng = random.Random(1)
    order = list(out.values())
    gc.collect()
    for _ in range(rounds):
        rng.shuffle(order)
        for v in order:
            fn, batch = v.fn, []
            for _ in range(inner):
                t0 = perf()
                await fn()
                batch.append(perf() - t0)
            v.record(batch)
    return out


# ------------------------------------------------------------------------------------------------
# machine info and the report


def machine_info() -> dict[str, str]:
    return bench_common.machine_info(
        "expect noisier figures, thread hand-offs most of all", {"torch TLS swap": tls_state()}
    )


def tls_state() -> str:
    try:
        from asyncpp.native import tls
    except ImportError:
        return "n/a (this asyncpp has none)"
    on = tls.enabled()
    return f"{'on' if on else 'off'} (ASYNCPP_NATIVE={os.environ.get('ASYNCPP_NATIVE', 'unset')})"


def command_line() -> str:
    return bench_common.command_line(__file__)


def verdict(ok: bool | None) -> str:
    if ok is None:
        return "info"
    return "pass" if ok else "**FAIL**"


def md_table(header: list[str], rows: list[list[str]]) -> str:
    return bench_common.md_table(header, rows)


# ------------------------------------------------------------------------------------------------
# the benchmark


def measure(args) -> dict[str, Any]:
    model = build_model()
    xs = {
        b: torch.randn(b, WIDTH, generator=torch.Generator().manual_seed(b)) for b in {BATCH, *INVOKE_COUNTS}
    }
    x = xs[BATCH]
    check_variants(model, x)

    nograd = torch.no_grad
    plain = {b: Variant(f"plain forward, batch {b}", plain_fn(model, xs[b]), nograd) for b in xs}
    idle = Variant(
        "forward with idle controllers", plain_fn(model, x), lambda: idle_controllers(model, BATCH)
    )
    empty = Variant("empty trace (block returns None)", trace_fn(model, x, empty_block))
    reads = {
        k: Variant(f"trace, block reads {k} outputs", trace_fn(model, x, read_block, read_indices(k)))
        for k in READ_COUNTS
    }
    hooks = {
        k: Variant(f"forward hooks, {k} reads", hooks_fn(model, x, read_indices(k)), nograd)
        for k in READ_COUNTS
    }
    invokes = {
        n: Variant(f"trace, {n} invoke(s) x 1 row", invokes_fn(model, [xs[n][i : i + 1] for i in range(n)]))
        for n in INVOKE_COUNTS
    }
    variants = [*plain.values(), idle, empty, *reads.values(), *hooks.values(), *invokes.values()]
    t0 = time.monotonic()
    run_rounds(variants, args.rounds, args.inner, args.warmup)
    sync_s = time.monotonic() - t0

    t0 = time.monotonic()
    avariants = asyncio.run(async_rounds(model, x, args.rounds, args.inner, args.warmup))
    async_s = time.monotonic() - t0
    asyncpp.LocalEngine.for_model(model).close()

    return {
        "plain": plain,
        "idle": idle,
        "empty": empty,
        "reads": reads,
        "hooks": hooks,
        "invokes": invokes,
        "async": avariants,
        "seconds": (sync_s, async_s),
    }


def report(r: dict[str, Any], args) -> tuple[str, str]:
    P = r["plain"][BATCH]
    plain = P.med()
    idle_x, idle_d = ratio(r["idle"], P), diff(r["idle"], P)
    empty_x, fixed = ratio(r["empty"], P), diff(r["empty"], P)
    ks = list(READ_COUNTS)
    read_slope = paired_slope(ks, [r["reads"][k] for k in ks])
    hook_slope = paired_slope(ks, [r["hooks"][k] for k in ks])
    ns = list(INVOKE_COUNTS)
    inv_fixed = [diff(r["invokes"][n], r["plain"][n]) for n in ns]
    inv_slope = paired_slope(ns, [r["invokes"][n] for n in ns], [r["plain"][n] for n in ns])
    a = r["async"]
    a_plain = a["plain forward (in the loop)"]
    a_trace = diff(a["async trace"], a_plain)
    a_bridge = diff(a["async trace"], a["sync trace (in the loop)"])
    a_thread = diff(a["asyncio.to_thread(model, x)"], a_plain)

    rows = [
        ["plain forward (batch 4), median", f"{plain:.1f} us", "-", verdict(None)],
        [
            "idle controllers: forward with controllers installed / plain",
            f"{idle_x:.3f}x ({idle_d:+.1f} us)",
            f"<= {IDLE_RATIO_TARGET:.2f}x",
            verdict(idle_x <= IDLE_RATIO_TARGET),
        ],
        [
            "idle trace: empty sync trace / plain",
            f"{empty_x:.3f}x",
            "- (fixed cost below)",
            verdict(None),
        ],
        [
            "fixed cost of an empty sync trace (trace - plain)",
            f"{fixed:.1f} us",
            f"<= {FIXED_TARGET_US:.0f} us",
            verdict(fixed <= FIXED_TARGET_US),
        ],
        [
            "marginal cost per read-and-return (slope, k = 0..32)",
            f"{read_slope:.2f} us/read",
            f"<= {READ_TARGET_US} us",
            verdict(read_slope <= READ_TARGET_US),
        ],
        [
            "same reads with forward hooks (register, detach+clone, remove)",
            f"{hook_slope:.2f} us/read",
            "-",
            verdict(None),
        ],
        [
            "async entry: `async with` empty trace - plain forward (sync fixed cost + hand-off)",
            f"{a_trace:.1f} us",
            "- (the target is on the hand-off, next row)",
            verdict(None),
        ],
        [
            "async hand-off alone: `async with` trace - sync `with` trace",
            f"{a_bridge:.1f} us",
            f"<= to_thread ({a_thread:.1f} us)",
            verdict(a_bridge <= a_thread),
        ],
        ["`asyncio.to_thread(model, x)` - plain forward", f"{a_thread:.1f} us", "-", verdict(None)],
        [
            "extra invoke (slope over 1, 2, 4 invokes of 1 row, vs plain of same batch)",
            f"{inv_slope:.2f} us/invoke (1->2: {inv_fixed[1] - inv_fixed[0]:.1f}, "
            f"2->4: {(inv_fixed[2] - inv_fixed[1]) / 2:.1f} each)",
            f"<= {INVOKE_TARGET_US:.0f} us",
            verdict(inv_slope <= INVOKE_TARGET_US),
        ],
    ]
    main = md_table(["measure", "value", "target", "verdict"], rows)

    detail_rows = []

    def add(v: Variant, extra: str = "") -> None:
        detail_rows.append(
            [v.name, f"{v.med():.1f}", f"{v.pct(0.1):.1f}", f"{v.pct(0.9):.1f}", str(len(v.samples)), extra]
        )

    for b in sorted(r["plain"]):
        add(r["plain"][b])
    for v in [r["idle"], r["empty"], *r["reads"].values(), *r["hooks"].values()]:
        add(v, f"{diff(v, P):+.1f} vs plain")
    for n, f in zip(ns, inv_fixed, strict=True):
        add(r["invokes"][n], f"{f:+.1f} vs plain batch {n}")
    for v in a.values():
        add(v, "" if v is a_plain else f"{diff(v, a_plain):+.1f} vs plain in the loop")
    details = md_table(["variant", "median us", "p10", "p90", "samples", "note"], detail_rows)
    return main, details


def render(main: str, details: str, info: dict[str, str], seconds: tuple[float, float], args) -> str:
    date = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    machine = "\n".join(f"- {k}: {v}" for k, v in info.items())
    return f"""{SECTION}

Model: {N_BLOCKS} blocks of `Linear({WIDTH}, {WIDTH}) + ReLU` in an `nn.Sequential` ({N_BLOCKS * 3 + 1} modules),
input {BATCH}x{WIDTH}, `torch.set_num_threads(1)`, `torch.no_grad()` everywhere. Every variant runs
{args.inner} timed calls in each of {args.rounds} shuffled rounds. Times are medians over all calls
(p10/p90 in the details); differences, ratios and least-squares slopes (us per read, per invoke) are
computed round by round from each round's medians, and their median over the rounds is reported.
asyncpp returns `detach().clone()` copies of what a block returns; the hook comparison clones too
and registers/removes its hooks on every call, as a trace installs and removes its controllers.

Command: `{command_line()}` ({date}; {seconds[0]:.0f} s sync + {seconds[1]:.0f} s async)

{machine}

{main}

<details><summary>All variants</summary>

{details}

</details>
"""


def write_section(text: str) -> None:
    """Replace (or append) this benchmark's section of docs/performance.md, keeping the others."""
    bench_common.write_section(SECTION, text, DOC)


# ------------------------------------------------------------------------------------------------
# --profile: where the time goes (reaches into the engine's internals; may need updating when
# they change, which is why it is optional)


def timeit_us(fn: Callable[[], Any], reps: int = 20000, batch: int = 100) -> float:
    """Median us per call of a cheap ``fn``, timed in batches."""
    for _ in range(500):
        fn()
    s = []
    for _ in range(max(1, reps // batch)):
        t0 = perf()
        for _ in range(batch):
            fn()
        s.append((perf() - t0) / batch)
    return median(s) / 1000


def profile_empty_trace(model: nn.Module, x: torch.Tensor, n: int) -> None:
    """Time the pieces of real empty sync traces: the engine's steps are wrapped with timers in
    place (instance attributes and the engine module's Interleaver name, restored after), so this
    follows whatever LocalEngine._execute does; the rest of a run is reported as one remainder."""
    from asyncpp.engines.local import engine as engine_mod

    engine = asyncpp.LocalEngine.for_model(model)
    cur: dict[str, int] = {}
    calls = [0]

    def timed(name: str, fn: Callable) -> Callable:
        def wrapper(*args, **kwargs):
            calls[0] += 1
            t0 = perf()
            try:
                return fn(*args, **kwargs)
            finally:
                cur[name] = cur.get(name, 0) + perf() - t0

        return wrapper

    real_interleaver = engine_mod.Interleaver

    def interleaver(*args, **kwargs):
        t0 = perf()
        kernel = real_interleaver(*args, **kwargs)
        cur["Interleaver(...)"] = perf() - t0
        for name in ("start", "serve", "finish"):
            if hasattr(kernel, name):
                setattr(kernel, name, timed(f"kernel.{name}", getattr(kernel, name)))
        return kernel

    real_prepare = engine._prepare

    def prepare(spec):
        t0 = perf()
        call, *rest = real_prepare(spec)
        cur["engine._prepare"] = perf() - t0
        return (timed("forward (with the controllers)", call), *rest)

    class Switch:  # times the TLS extension's calls (they happen inside kernel.start and reads)
        def __init__(self, real):
            self.BlockState = timed("TLS BlockState()", real.BlockState)
            self.enter = timed("TLS enter + leave", real.enter)
            self.leave = timed("TLS enter + leave", real.leave)

    bare, bare_plain = [], []
    full, fwd = trace_fn(model, x, empty_block), plain_fn(model, x)
    for i in range(n + 300):
        t0 = perf()
        full()
        t1 = perf()
        with torch.no_grad():
            fwd()
        t2 = perf()
        if i >= 300:
            bare.append(t1 - t0)
            bare_plain.append(t2 - t1)
    uninstrumented = (median(bare) - median(bare_plain)) / 1000

    ctl = engine._controllers
    restore: list[Callable[[], None]] = []
    switch = getattr(engine, "switch", None)
    try:
        engine_mod.Interleaver = interleaver
        restore.append(lambda: setattr(engine_mod, "Interleaver", real_interleaver))
        engine._prepare = prepare
        restore.append(lambda: engine.__dict__.pop("_prepare", None))
        for name in ("install", "remove"):
            setattr(ctl, name, timed(f"Controllers.{name}", getattr(ctl, name)))
            restore.append(lambda name=name: ctl.__dict__.pop(name, None))
        if switch is not None and hasattr(engine, "_switch"):
            engine._switch = Switch(switch)
            restore.append(lambda: setattr(engine, "_switch", switch))

        def once() -> None:
            cur.clear()
            calls[0] = 0
            t0 = perf()
            t = asyncpp.trace(model)
            t1 = perf()
            t.invoke(x, empty_block)
            t2 = perf()
            t.__enter__()
            t.__exit__(None, None, None)
            t3 = perf()
            cur["asyncpp.trace(model)"] = t1 - t0
            cur["t.invoke(x, block)"] = t2 - t1
            cur["total"] = t3 - t0
            cur["timed calls"] = calls[0]

        samples: dict[str, list[int]] = {}
        plain_s: list[int] = []
        for _ in range(300):
            once()
        for _ in range(n):
            once()
            for k, v in cur.items():
                samples.setdefault(k, []).append(v)
            with torch.no_grad():
                t0 = perf()
                fwd()
                plain_s.append(perf() - t0)
    finally:
        for undo in reversed(restore):
            undo()

    pm = median(plain_s) / 1000
    inner = {"TLS BlockState()", "TLS enter + leave", "timed calls"}
    order = [
        "asyncpp.trace(model)",
        "t.invoke(x, block)",
        "engine._prepare",
        "Interleaver(...)",
        "Controllers.install",
        "kernel.start",
        "TLS BlockState()",
        "TLS enter + leave",
        "kernel.serve",
        "forward (with the controllers)",
        "kernel.finish",
        "Controllers.remove",
    ]
    rows = []
    acc = 0.0
    rest = []
    for i in range(n):
        r = samples["total"][i] - sum(samples[k][i] for k in samples if k != "total" and k not in inner)
        rest.append(r)
    for name in order:
        if name not in samples:
            continue
        m = median(samples[name]) / 1000
        if name.startswith("forward"):
            rows.append([name, f"{m - pm:+.1f}", f"{m:.1f} in all; plain forward {pm:.1f}"])
            acc += m - pm
        elif name in inner:
            rows.append([f"  {name}", f"({m:.1f})", "inside the rows around it, not added"])
        else:
            rows.append([name, f"{m:.1f}", ""])
            acc += m
    ncalls = median(samples["timed calls"])
    other = median(rest) / 1000
    acc += other
    rows.append(
        [
            "the rest: lock, contexts, outcome, settle, timers",
            f"{other:.1f}",
            f"total - the pieces; holds most of the cost of the {ncalls:.0f} timed calls",
        ]
    )
    rows.append(["**sum of the rows** (trace - plain, timed)", f"{acc:.1f}", ""])
    rows.append(
        [
            "**trace - plain without the timers**",
            f"{uninstrumented:.1f}",
            f"so the timers add ~{acc - uninstrumented:.0f} us in all",
        ]
    )
    print("\n### Profile: the pieces of an empty sync trace (median us, timed in place)\n")
    print(md_table(["piece", "us", "note"], rows))


@contextlib.contextmanager
def installed(model: nn.Module, make: Callable[[int, Callable], Callable]):
    """Install ``make(index, forward)`` as every module's instance ``forward`` (restored after)."""
    mods = list(model.modules())
    for i, m in enumerate(mods):
        m.__dict__["forward"] = make(i, m.forward)
    try:
        with torch.no_grad():
            yield
    finally:
        for m in mods:
            m.__dict__.pop("forward", None)


def profile_idle(model: nn.Module, x: torch.Tensor, rounds: int, inner: int) -> None:
    """The idle controllers against the cheapest wrappers that could replace them."""
    counts = [0] * 200

    def py_passthrough(i, f):
        def w(*args, **kwargs):
            return f(*args, **kwargs)

        return w

    def py_counting(i, f):
        def w(*args, **kwargs):
            out = f(*args, **kwargs)
            counts[i] += 1
            return out

        return w

    def c_passthrough(i, f):
        import functools

        return functools.partial(f)

    fwd = plain_fn(model, x)
    variants = [
        Variant("plain forward", fwd, torch.no_grad),
        Variant("asyncpp controllers, idle", fwd, lambda: idle_controllers(model, BATCH)),
        Variant("Python pass-through wrapper `f(*a, **k)`", fwd, lambda: installed(model, py_passthrough)),
        Variant("Python wrapper + visit counter", fwd, lambda: installed(model, py_counting)),
        Variant("C pass-through (functools.partial)", fwd, lambda: installed(model, c_passthrough)),
    ]
    run_rounds(variants, rounds, inner, 100, seed=2)
    base = variants[0]
    n_mod = len(list(model.modules()))
    rows = [
        [v.name, f"{v.med():.1f}", f"{ratio(v, base):.3f}x", f"{diff(v, base) / n_mod * 1000:.0f}"]
        for v in variants
    ]
    print(f"\n### Profile: idle controllers against bare wrappers ({n_mod} module calls per forward)\n")
    print(md_table(["forward with", "median us", "vs plain", "ns per module call"], rows))


def _cprofile_delta(fa: Callable, fb: Callable, n: int, per: int, slope_us: float | None, title: str) -> None:
    """cProfile ``n`` calls of ``fa`` and of ``fb``; print own time of (a - b) per unit."""

    def prof(fn) -> dict:
        p = cProfile.Profile()
        p.enable()
        for _ in range(n):
            fn()
        p.disable()
        return pstats.Stats(p).stats  # type: ignore[attr-defined]

    for _ in range(200):
        fa()
        fb()
    sa, sb = prof(fa), prof(fb)
    deltas: dict[str, tuple[float, float]] = {}
    for key in set(sa) | set(sb):
        ca = sa.get(key, (0, 0, 0.0, 0.0))
        cb = sb.get(key, (0, 0, 0.0, 0.0))
        file, line, func = key
        label = f"{func} ({Path(file).name}:{line})" if line else func
        deltas[label] = ((ca[2] - cb[2]) / (n * per) * 1e6, (ca[1] - cb[1]) / (n * per))
    total = sum(v[0] for v in deltas.values())
    rows = []
    for label, (dt, dcalls) in sorted(deltas.items(), key=lambda kv: -kv[1][0])[:24]:
        share = dt / total if total else 0.0
        est = f"{share * slope_us:.2f}" if slope_us is not None else "-"
        rows.append([label, f"{dcalls:.2f}", f"{dt:.2f}", f"{100 * share:.1f}%", est])
    print(f"\n### Profile: {title} (cProfile; profiled total {total:.2f} us, inflated by the profiler)\n")
    print(md_table(["function (own time)", "calls", "profiled us", "share", "share x measured us"], rows))


def profile_reads(model: nn.Module, x: torch.Tensor, n: int, slope_us: float | None) -> None:
    idx = read_indices(32)
    _cprofile_delta(
        trace_fn(model, x, read_block, idx),
        trace_fn(model, x, read_block, []),
        n,
        len(idx),
        slope_us,
        "one read-and-return (32-read minus 0-read traces, per read)",
    )


def profile_invokes(model: nn.Module, n: int, slope_us: float | None) -> None:
    x4 = torch.randn(4, WIDTH)
    _cprofile_delta(
        invokes_fn(model, [x4[i : i + 1] for i in range(4)]),
        invokes_fn(model, [x4]),
        n,
        3,
        slope_us,
        "one extra invoke (4 invokes of 1 row minus 1 invoke of 4 rows, per extra invoke)",
    )


@contextlib.contextmanager
def patched(obj: Any, attr: str, new: Any):
    """Set ``obj.attr`` to ``new`` for the duration (in this process only)."""
    old = getattr(obj, attr)
    setattr(obj, attr, new)
    try:
        yield
    finally:
        setattr(obj, attr, old)


def _ablations(model: nn.Module) -> dict[str, Callable[[], Any]]:
    """Pieces of a run that can be swapped out at run time, each as a context factory. Ones whose
    target no longer exists are left out."""
    from asyncpp.engines.local import engine as engine_mod
    from asyncpp.kernel import batching
    from asyncpp.kernel.interleaver import Interleaver
    from asyncpp.trace import api

    engine = asyncpp.LocalEngine.for_model(model)
    table = {
        "torch TLS swap off (engine switch = None)": (engine, "_switch", None),
        "results not copied (batching.detach = identity)": (batching, "detach", lambda v: v),
        "no position string per served visit (_name = constant)": (Interleaver, "_name", lambda *a: "?"),
        "invoke outputs not narrowed (engine's narrow = identity)": (engine_mod, "narrow", lambda v, r, b: v),
        "no block path check in invoke() (check_block_paths = no-op)": (
            api,
            "check_block_paths",
            lambda *a: None,
        ),
    }
    out: dict[str, Callable[[], Any]] = {"as is": contextlib.nullcontext}
    for name, (obj, attr, new) in table.items():
        if hasattr(obj, attr):
            out[name] = lambda obj=obj, attr=attr, new=new: patched(obj, attr, new)
    return out


def profile_read_ablations(model: nn.Module, x: torch.Tensor, rounds: int, inner: int) -> None:
    """Read slopes with pieces of the read path swapped out at run time (nothing is edited)."""
    keep = ("as is", "torch TLS", "results not", "no position")
    configs = {k: v for k, v in _ablations(model).items() if k.startswith(keep)}
    variants = []
    for cname, ctx in configs.items():
        for k in (0, 32):
            variants.append(Variant(f"{cname}|{k}", trace_fn(model, x, read_block, read_indices(k)), ctx))
    run_rounds(variants, rounds, inner, 100, seed=3)
    rows = []
    base = None
    for i, cname in enumerate(configs):
        v0, v32 = variants[2 * i], variants[2 * i + 1]
        per = diff(v32, v0) / 32
        base = per if base is None else base
        rows.append([cname, f"{per:.2f}", f"{per - base:+.2f}", f"{v0.med():.1f}"])
    print("\n### Profile: read path ablations (us per read = (k=32 - k=0) / 32, paired by round)\n")
    print(md_table(["read path", "us/read", "vs as is", "k=0 trace, median us"], rows))


def profile_invoke_ablations(model: nn.Module, rounds: int, inner: int) -> None:
    """Extra-invoke and fixed costs with pieces of a run swapped out at run time."""
    keep = ("as is", "torch TLS", "invoke outputs", "no block path")
    configs = {k: v for k, v in _ablations(model).items() if k.startswith(keep)}
    x4 = torch.randn(4, WIDTH)
    rows1, rows4 = [x4[:1]], [x4[i : i + 1] for i in range(4)]
    p1 = Variant("plain 1", plain_fn(model, x4[:1]), torch.no_grad)
    p4 = Variant("plain 4", plain_fn(model, x4), torch.no_grad)
    variants = [p1, p4]
    for cname, ctx in configs.items():
        variants.append(Variant(f"{cname}|1", invokes_fn(model, rows1), ctx))
        variants.append(Variant(f"{cname}|4", invokes_fn(model, rows4), ctx))
    run_rounds(variants, rounds, inner, 100, seed=4)
    plain_step = diff(p4, p1)
    rows = []
    base = None
    for i, cname in enumerate(configs):
        v1, v4 = variants[2 + 2 * i], variants[3 + 2 * i]
        per = (diff(v4, v1) - plain_step) / 3
        base = per if base is None else base
        rows.append([cname, f"{per:.2f}", f"{per - base:+.2f}", f"{diff(v1, p1):.1f}"])
    print(
        "\n### Profile: invoke ablations (us per extra invoke = (4 invokes - 1 invoke - plain(4 rows - 1 "
        "row)) / 3; fixed = 1-invoke trace - plain, 1 row)\n"
    )
    print(md_table(["run", "us/extra invoke", "vs as is", "fixed us"], rows))


def profile_micro(model: nn.Module, x: torch.Tensor) -> None:
    from asyncpp.kernel.traps import OUTPUT, Read

    tree = asyncpp.LocalEngine.for_model(model).tree
    out = model[0](x).detach()

    def coro_roundtrip():
        async def c():
            await Read(0, OUTPUT, "")

        co = c()
        co.send(None)
        with contextlib.suppress(StopIteration):
            co.send(out)

    rows = [
        ["tensor.detach().clone() (4x16)", f"{timeit_us(lambda: out.detach().clone()):.2f}"],
        ["tensor.clone() (4x16)", f"{timeit_us(lambda: out.clone()):.2f}"],
        ["tensor[0:1] (a row view, as narrow() makes)", f"{timeit_us(lambda: out[0:1]):.2f}"],
        ["m[i].output (location lookup in a block)", f"{timeit_us(lambda: tree[17].output):.2f}"],
        ["coroutine: create, one await of a Read, finish", f"{timeit_us(coro_roundtrip):.2f}"],
        [
            "register_forward_hook + handle.remove()",
            f"{timeit_us(lambda: model[3].register_forward_hook(id).remove()):.2f}",
        ],
    ]
    print("\n### Micro-timings (median us per call)\n")
    print(md_table(["piece", "us"], rows))


def run_profiles(r: dict[str, Any], args) -> None:
    model = build_model()
    x = torch.randn(BATCH, WIDTH, generator=torch.Generator().manual_seed(BATCH))
    ks, ns = list(READ_COUNTS), list(INVOKE_COUNTS)
    read_slope = paired_slope(ks, [r["reads"][k] for k in ks])
    inv_slope = paired_slope(ns, [r["invokes"][n] for n in ns], [r["plain"][n] for n in ns])
    rounds, inner = max(5, args.rounds // 2), args.inner
    steps = [
        ("empty trace", lambda: profile_empty_trace(model, x, 3000)),
        ("idle", lambda: profile_idle(model, x, rounds, inner)),
        ("reads", lambda: profile_reads(model, x, 300, read_slope)),
        ("read ablations", lambda: profile_read_ablations(model, x, rounds, inner)),
        ("invokes", lambda: profile_invokes(model, 1000, inv_slope)),
        ("invoke ablations", lambda: profile_invoke_ablations(model, rounds, inner)),
        ("micro", lambda: profile_micro(model, x)),
    ]
    for name, step in steps:
        try:
            step()
        except Exception as err:  # the internals moved: say so, keep the rest
            print(f"\n(profile step {name!r} failed: {type(err).__name__}: {err})")
    asyncpp.LocalEngine.for_model(model).close()


# ------------------------------------------------------------------------------------------------


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--write", action="store_true", help=f"update the section in {DOC.relative_to(ROOT)}")
    ap.add_argument("--rounds", type=int, default=120, help="shuffled rounds (default 120)")
    ap.add_argument("--inner", type=int, default=20, help="timed calls per variant per round (default 20)")
    ap.add_argument("--warmup", type=int, default=200, help="untimed calls per variant first (default 200)")
    ap.add_argument("--quick", action="store_true", help="a short run (10 rounds x 20) to try the script")
    ap.add_argument("--profile", action="store_true", help="also print where the time goes (internals)")
    args = ap.parse_args()
    if args.quick:
        args.rounds, args.inner, args.warmup = 10, 20, 50
    torch.set_num_threads(1)

    info = machine_info()
    r = measure(args)
    main_table, details = report(r, args)
    text = render(main_table, details, info, r["seconds"], args)
    print(text)
    if args.write:
        write_section(text)
        print(f"updated {DOC.relative_to(ROOT)}")
    if args.profile:
        run_profiles(r, args)


if __name__ == "__main__":
    main()
