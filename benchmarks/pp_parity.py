"""Pipeline-parallel parity: interpretability workloads on a vLLM engine split over two stages,
compared cell by cell with the same workloads on one stage.

Every configuration is an ``asyncpp.VllmEngine(dtype="float32", mode="eager")`` on the embedded tiny 4-layer
Llama (random weights, hidden 128, vocab 259, byte-level tokenizer), started one at a time (each is
closed before the next starts): PP=1 (one stage, the reference), PP=2 (layers 0-1 on stage 0,
2-3 on stage 1) and, with ``--tp``, TP=2 (one stage, two tensor-parallel ranks) and TP=2 x PP=2
(four workers; compared with TP=2). Each runs the same blocks on the same prompts, greedy:

1. **logit lens**: every layer's residual stream at the last token, ``(out[0] + out[1])[-1]``,
   through the final RMSNorm and the unembedding, computed inside the block from the weights of
   ``asyncpp.models.load_tiny()`` passed as block arguments (cells: layers x prompts);
2. **steering**: a fixed random vector (seed 0, unit norm, times 4) added to layer 1's residual
   stream at the last token; the final logits (cells: prompts);
3. **ablation**: layer 2's MLP output zeroed; the final logits;
4. **activation patching**: a clean run returns layer 1's residual at its last token; a second
   trace runs the corrupted prompt with that value written into layer 1's output
   (``out[0][-1] = patched - out[1][-1]``); the final logits;
5. **generation steering**: 8 greedy tokens (``ignore_eos``) with the steering vector added at
   layer 1 (last row) at every step; the logits of every step (cells: steps x prompts), and the
   tokens (they must be equal too);
6. **attribution**: for each layer, its MLP output zeroed, and the change of the clean run's top-1
   logit (cells: layers x prompts; the changes themselves are compared too).

All invokes of a workload run concurrently, in one trace (patching: two traces, clean then
patched). Per workload and configuration: **top-1 agreement** (the fraction of cells whose argmax
equals the reference's), the **largest total variation distance** between next-token distributions,
``0.5 * sum |softmax(a) - softmax(b)|`` in float64, the largest absolute difference of the raw
logits (attribution: of the recorded changes), the **bytes pulled across stages** per run of the
workload (the sum over ranks of the change of ``engine.worker_stats()[r]["pull_bytes"]``), and the
**wall time ratio** to the reference (the median of ``--repeats`` timed runs each, after one
untimed warm-up run whose results are the ones compared). Targets: top-1 agreement 1.00 and total
variation 0.000 at float32. Two baselines run the same way, blocks that only return the logits (of
the prompt, and of every step of an 8-token generation): their time ratio is what the pipeline split
itself costs here, without any cross-stage work of asyncpp's.

The script also checks, on every engine, that each intervention did something, so that a no-op
cannot pass: steering, ablation, patching and generation steering must change every cell's logits
against a run without the intervention (max |logit change| > ``EFFECT_MIN``), every attribution
ablation must change the clean logits, and the lens of the last layer must reproduce the model's
own final logits (same argmax, total variation < ``LENS_TV_MAX``). A failed check is printed as
``FAIL: ...`` and the exit status is 1.

``--mode`` chooses the engines. ``eager`` (the default) is all of the above. ``compiled`` runs every
configuration on vLLM's compiled model instead, ``VllmEngine(dtype="float32", mode="compiled",
taps=COMPILED_TAPS)``: blocks are served at taps, the default ones (every decoder layer's output:
the lens, steering, patching) and every layer's MLP output (``model.layers.*.mlp``: the ablation
and attribution); PP=2 is compared with compiled PP=1 and so on, as above, with the same targets
and effect checks. ``both`` runs each configuration twice, eager then compiled (one engine at a
time still), makes both comparisons above, and adds one table, **compiled against eager**, per
configuration and workload: top-1 agreement, the largest total variation, the largest absolute
difference of the logits (attribution: and of the recorded changes) and, for the logit lens (and
the residual that activation patching reads), of the hidden states, the residual stream the block
reads; targets top-1 1.00 and max abs difference <= ``MAX_ABS_TARGET`` (1e-4) for logits and
hidden states, equal tokens; the wall time ratio compiled / eager is information only. In these
two modes the lens block also returns the residuals it reads, to compare them. An engine that fails
to start or to run a workload in compiled mode is reported as a failed check (an eager one stops
the script, as before).

Usage::

    .venv/bin/python benchmarks/pp_parity.py                 # PP=2 against PP=1, print the table
    .venv/bin/python benchmarks/pp_parity.py --write         # also update docs/performance.md
    .venv/bin/python benchmarks/pp_parity.py --tp            # also TP=2 x PP=2 against TP=2 (slow)
    .venv/bin/python benchmarks/pp_parity.py --quick         # 3 prompts, 1 timed run: to try it
    .venv/bin/python benchmarks/pp_parity.py --mode compiled # the same on compiled engines
    .venv/bin/python benchmarks/pp_parity.py --mode both     # both, and compiled against eager
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import sys
import textwrap
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from statistics import median
from typing import Any

import bench_common
import torch
import torch.nn.functional as F
from bench_common import max_abs, tv

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "performance.md"
SECTION = "## Pipeline parallel parity (benchmarks/pp_parity.py)"

# (clean prompt, corrupted prompt): the clean ones serve every workload; the corrupted ones are
# the patching runs' targets
PROMPT_PAIRS = [
    ("The capital of France is", "The capital of Italy is"),
    ("The quick brown fox jumps over the", "The quick brown cat jumps over the"),
    ("Once upon a time, there was a little", "Once upon a time, there was a giant"),
    ("def add(a, b): return a +", "def sub(a, b): return a -"),
    ("1, 2, 3, 4, 5,", "9, 8, 7, 6, 5,"),
    ("She opened the door and saw", "He closed the window and saw"),
]
QUICK_PROMPTS = 3
STEER_LAYER = 1
ABLATE_LAYER = 2
PATCH_LAYER = 1
STEER_SCALE = 4.0
STEER_SEED = 0
NEW_TOKENS = 8

TOP1_TARGET = 1.0
TV_TARGET = 0.0005  # "0.000" at 3 decimals
EFFECT_MIN = 1e-3  # an intervention must move some logit of every cell by more than this
LENS_TV_MAX = 1e-4  # the last layer's lens against the model's own logits
MAX_ABS_TARGET = 1e-4  # compiled against eager: logits and hidden states, float32

MODES = ("eager", "compiled", "both")
# the taps a compiled engine needs besides the default ones (every decoder layer's output, for the
# lens, steering and patching): the ablation and attribution zero a layer's MLP output
COMPILED_TAPS = ["model.layers.*.mlp"]


perf = time.perf_counter


# ------------------------------------------------------------------------------------------------
# the blocks (pickled by value into every request, run by every stage)


async def final_logits(m):
    return (await m.logits)[0].clone()


async def logit_lens(m, w_norm, w_lm, eps, keep_resid=False):
    lens, resid = [], []
    for layer in m.model.layers:
        out = await layer.output  # (mlp_out, residual): index, never unpack (a remote value)
        h = out[0][-1] + out[1][-1]  # the last row of each first: only those cross stages
        lens.append((F.rms_norm(h, (w_norm.shape[0],), w_norm, eps) @ w_lm.T).clone())
        if keep_resid:  # the residual stream the lens reads, to compare engines by it too
            resid.append(h.clone())
    found = {"lens": lens, "logits": (await m.logits)[0].clone()}
    if keep_resid:
        found["resid"] = resid
    return found


async def steer(m, vec, layer):
    out = await m.model.layers[layer].output
    out[0][-1] += vec  # adds vec to the residual stream at the last token
    return (await m.logits)[0].clone()


async def ablate_mlp(m, layer):
    (await m.model.layers[layer].mlp.output)[:] = 0
    return (await m.logits)[0].clone()


async def read_residual(m, layer):
    out = await m.model.layers[layer].output
    return {"resid": (out[0][-1] + out[1][-1]).clone(), "logits": (await m.logits)[0].clone()}


async def patch_residual(m, patched, layer):
    out = await m.model.layers[layer].output
    out[0][-1] = patched - out[1][-1]  # the residual stream at the last token becomes `patched`
    return (await m.logits)[0].clone()


async def steer_every_step(m, vec, layer):
    logits = []
    async for _ in m.steps():
        if vec is not None:
            out = await m.model.layers[layer].output
            out[0][-1] += vec
        logits.append((await m.logits)[0].clone())
    return logits


# ------------------------------------------------------------------------------------------------
# the workloads: each runs its traces on one engine and returns its cells


@dataclass
class Out:
    cells: list[torch.Tensor]  # next-token logits, [vocab] each
    labels: list[str]
    values: list[float] | None = None  # attribution: the change of the clean top-1 logit
    tokens: list[list[int]] | None = None  # generation: the tokens of every prompt
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass
class Ctx:
    prompts: list[str]
    corrupt: list[str]
    vec: torch.Tensor
    w_norm: torch.Tensor
    w_lm: torch.Tensor
    eps: float
    layers: int
    new_tokens: int
    keep_resid: bool = False  # the lens returns the residuals it reads (compiled and both modes)


def run(engine: Any, invokes: list[tuple], **kw: Any) -> list[Any]:
    import asyncpp

    entry = asyncpp.generate if "max_new_tokens" in kw else asyncpp.trace
    with entry(engine, **kw) as t:
        handles = [t.invoke(prompt, block, *args) for prompt, block, *args in invokes]
    return handles


def w_plain(engine: Any, ctx: Ctx) -> Out:
    hs = run(engine, [(p, final_logits) for p in ctx.prompts])
    return Out([h.result for h in hs], [f"p{i}" for i in range(len(hs))])


def w_plain_corrupt(engine: Any, ctx: Ctx) -> Out:
    """The corrupted prompts without intervention: what activation patching must change."""
    hs = run(engine, [(c, final_logits) for c in ctx.corrupt])
    return Out([h.result for h in hs], [f"p{i}" for i in range(len(hs))])


def w_plain_gen(engine: Any, ctx: Ctx) -> Out:
    return _generate(engine, ctx, None, 0)


def w_lens(engine: Any, ctx: Ctx) -> Out:
    args = (ctx.w_norm, ctx.w_lm, ctx.eps) + ((True,) if ctx.keep_resid else ())
    hs = run(engine, [(p, logit_lens, *args) for p in ctx.prompts])
    extra: dict[str, Any] = {"final": [h.result["logits"] for h in hs]}
    if ctx.keep_resid:
        extra["resid"] = [r for h in hs for r in h.result["resid"]]
    return Out(
        [c for h in hs for c in h.result["lens"]],
        [f"p{i} layer {k}" for i, h in enumerate(hs) for k in range(len(h.result["lens"]))],
        extra=extra,
    )


def w_steer(engine: Any, ctx: Ctx) -> Out:
    hs = run(engine, [(p, steer, ctx.vec, STEER_LAYER) for p in ctx.prompts])
    return Out([h.result for h in hs], [f"p{i}" for i in range(len(hs))])


def w_ablate(engine: Any, ctx: Ctx) -> Out:
    hs = run(engine, [(p, ablate_mlp, ABLATE_LAYER) for p in ctx.prompts])
    return Out([h.result for h in hs], [f"p{i}" for i in range(len(hs))])


def w_patch(engine: Any, ctx: Ctx) -> Out:
    clean = run(engine, [(p, read_residual, PATCH_LAYER) for p in ctx.prompts])
    resid = [h.result["resid"] for h in clean]
    hs = run(engine, [(c, patch_residual, r, PATCH_LAYER) for c, r in zip(ctx.corrupt, resid, strict=True)])
    return Out([h.result for h in hs], [f"p{i}" for i in range(len(hs))], extra={"resid": resid})


def w_gen(engine: Any, ctx: Ctx) -> Out:
    return _generate(engine, ctx, ctx.vec, STEER_LAYER)


def _generate(engine: Any, ctx: Ctx, vec: torch.Tensor | None, layer: int) -> Out:
    """Generation with ``vec`` added at ``layer`` every step (None: no steering); every step's
    logits and the tokens."""
    hs = run(
        engine,
        [(p, steer_every_step, vec, layer) for p in ctx.prompts],
        max_new_tokens=ctx.new_tokens,
        ignore_eos=True,
    )
    return Out(
        [c for h in hs for c in h.result],
        [f"p{i} step {s}" for i, h in enumerate(hs) for s in range(len(h.result))],
        tokens=[h.tokens[0].tolist() for h in hs],
    )


def w_attrib(engine: Any, ctx: Ctx) -> Out:
    n = len(ctx.prompts)
    invokes = [(p, final_logits) for p in ctx.prompts]
    invokes += [(p, ablate_mlp, k) for k in range(ctx.layers) for p in ctx.prompts]
    hs = run(engine, invokes)
    clean = [h.result for h in hs[:n]]
    cells, labels, values = [], [], []
    for k in range(ctx.layers):
        for i in range(n):
            ablated = hs[n + k * n + i].result
            top = int(clean[i].argmax())
            cells.append(ablated)
            labels.append(f"p{i} layer {k}")
            values.append(float(ablated[top] - clean[i][top]))
    return Out(cells, labels, values=values, extra={"clean": clean})


WORKLOADS = {
    "baseline: final logits": w_plain,
    "baseline: generation": w_plain_gen,
    "logit lens": w_lens,
    "steering": w_steer,
    "ablation": w_ablate,
    "activation patching": w_patch,
    "generation steering": w_gen,
    "attribution": w_attrib,
}
CELLS = {
    "baseline: final logits": "prompts",
    "baseline: generation": "steps x prompts",
    "logit lens": "layers x prompts",
    "steering": "prompts",
    "ablation": "prompts",
    "activation patching": "prompts",
    "generation steering": "steps x prompts",
    "attribution": "layers x prompts",
}


# ------------------------------------------------------------------------------------------------
# measuring


@dataclass
class Measured:
    out: Out
    times: list[float]
    pulled: list[int]  # bytes pulled across stages, per run (warm-up first)
    pulls: list[int]


def pulled(engine: Any) -> tuple[int, int]:
    stats = engine.worker_stats()
    return sum(s.get("pull_bytes", 0) for s in stats), sum(s.get("pulls", 0) for s in stats)


def measure(engine: Any, fn: Any, ctx: Ctx, repeats: int) -> Measured:
    outs, times, nbytes, npulls = [], [], [], []
    for _ in range(1 + repeats):  # the first run is the untimed warm-up; its cells are compared
        b0, p0 = pulled(engine)
        t0 = perf()
        outs.append(fn(engine, ctx))
        times.append(perf() - t0)
        b1, p1 = pulled(engine)
        nbytes.append(b1 - b0)
        npulls.append(p1 - p0)
    return Measured(outs[0], times[1:], nbytes, npulls)


@dataclass
class Compared:
    cells: int
    top1: float
    max_tv: float
    max_abs: float
    values_abs: float | None
    tokens_equal: bool | None
    worst: str


def _pair_cells(workload: str, label: str, c: Any) -> list[str]:
    """The first cells of a comparison row: the workload, the pair, the cell count, top-1."""
    return [f"{workload} ({CELLS[workload]})", label, str(c.cells), f"{c.top1:.2f}"]


def _time_cell(ref: Any, got: Any) -> str:
    """Wall time of ``got`` over ``ref``: medians, then the fastest runs."""
    t_ref, t_got = median(ref.times), median(got.times)
    return (
        f"{t_got / t_ref:.2f}x ({t_got * 1000:.0f} / {t_ref * 1000:.0f} ms); "
        f"fastest runs {min(got.times) / min(ref.times):.2f}x"
    )


def _diff_cell(c: Compared) -> str:
    """A comparison's "max abs" cell: the logits' difference, the top-1 logit changes, the tokens."""
    diff = f"{c.max_abs:.1e}"
    if c.values_abs is not None:
        diff += f"; top-1 logit changes {c.values_abs:.1e}"
    if c.tokens_equal is not None:
        diff += "; tokens " + ("equal" if c.tokens_equal else "**DIFFER**")
    return diff


def compare(ref: Out, got: Out) -> Compared:
    if ref.labels != got.labels:
        raise SystemExit(f"FAIL: the cells differ: {ref.labels} against {got.labels}")
    tvs = [tv(a, b) for a, b in zip(ref.cells, got.cells, strict=True)]
    agree = [int(a.argmax()) == int(b.argmax()) for a, b in zip(ref.cells, got.cells, strict=True)]
    worst = max(range(len(tvs)), key=tvs.__getitem__)
    values_abs = None
    if ref.values is not None and got.values is not None:
        values_abs = max(abs(a - b) for a, b in zip(ref.values, got.values, strict=True))
    return Compared(
        cells=len(tvs),
        top1=sum(agree) / len(agree),
        max_tv=max(tvs),
        max_abs=max(max_abs(a, b) for a, b in zip(ref.cells, got.cells, strict=True)),
        values_abs=values_abs,
        tokens_equal=None if ref.tokens is None else ref.tokens == got.tokens,
        worst=ref.labels[worst],
    )


def hidden_abs(ref: Out, got: Out) -> float | None:
    """The largest absolute difference of the hidden states a workload returned (the lens: the
    residual of every layer it reads; patching: the clean runs' residual), None when it has none."""
    a, b = ref.extra.get("resid"), got.extra.get("resid")
    if a is None or b is None:
        return None
    if len(a) != len(b):
        return float("inf")
    return max(max_abs(x, y) for x, y in zip(a, b, strict=True))


def effect_checks(name: str, res: dict[str, Measured], corrupt: Out) -> tuple[dict[str, str], list[str]]:
    """What each intervention did against a run without it, on this engine; and the failures."""
    notes, fails = {}, []
    plain, plain_gen = res["baseline: final logits"].out, res["baseline: generation"].out
    notes["baseline: final logits"] = notes["baseline: generation"] = (
        "no intervention (a block that only returns the logits): the reference of the checks"
    )

    def changed(
        workload: str, cells: list[torch.Tensor], base: list[torch.Tensor], labels: list[str]
    ) -> None:
        moves = [max_abs(a, b) for a, b in zip(cells, base, strict=True)]
        tvs = [tv(a, b) for a, b in zip(cells, base, strict=True)]
        flips = sum(int(a.argmax()) != int(b.argmax()) for a, b in zip(cells, base, strict=True))
        notes[workload] = (
            f"vs no intervention: min TV {min(tvs):.3f}, min max-abs {min(moves):.3g}, "
            f"top-1 changed {flips}/{len(cells)}"
        )
        for lab, mv in zip(labels, moves, strict=True):
            if not mv > EFFECT_MIN:
                fails.append(
                    f"{name}, {workload}, {lab}: the intervention moved no logit by more than {EFFECT_MIN} ({mv:.3g})"
                )

    changed("steering", res["steering"].out.cells, plain.cells, plain.labels)
    changed("ablation", res["ablation"].out.cells, plain.cells, plain.labels)
    changed("activation patching", res["activation patching"].out.cells, corrupt.cells, corrupt.labels)
    gen = res["generation steering"].out
    changed("generation steering", gen.cells[: len(plain_gen.cells)], plain_gen.cells, plain_gen.labels)
    if len(gen.cells) != len(plain_gen.cells):
        fails.append(
            f"{name}, generation steering: {len(gen.cells)} steps against {len(plain_gen.cells)} without steering"
        )
    if gen.tokens is not None and plain_gen.tokens is not None:
        differ = sum(a != b for a, b in zip(gen.tokens, plain_gen.tokens, strict=True))
        notes["generation steering"] += f"; token sequences changed {differ}/{len(gen.tokens)}"
    at = res["attribution"].out
    n = len(plain.cells)
    changed("attribution", at.cells, plain.cells * (len(at.cells) // n), at.labels)
    notes["attribution"] += f"; largest top-1 logit change (abs) {max(abs(v) for v in at.values or [0]):.3g}"
    lens = res["logit lens"].out
    layers = len(lens.cells) // n
    lens_tv = []
    for i, final in enumerate(lens.extra["final"]):
        last = lens.cells[i * layers + layers - 1]
        lens_tv.append(tv(last, final))
        if int(last.argmax()) != int(final.argmax()) or lens_tv[-1] > LENS_TV_MAX:
            fails.append(
                f"{name}, logit lens, p{i}: the last layer's lens is not the model's logits (TV {lens_tv[-1]:.3g})"
            )
    notes["logit lens"] = f"last layer's lens vs the model's logits: max TV {max(lens_tv):.1e}"
    for i, (a, b) in enumerate(zip(lens.extra["final"], plain.cells, strict=True)):
        if max_abs(a, b) > 1e-4:
            fails.append(
                f"{name}, logit lens, p{i}: the lens block changed the final logits ({max_abs(a, b):.3g})"
            )
    return notes, fails


@dataclass
class Config:
    name: str
    options: dict[str, int]
    ref: str | None
    workers: int
    mode: str = "eager"  # the engine's: "eager" or "compiled"
    twin: str | None = None  # --mode both, compiled: the eager configuration of the same layout


def config_name(layout: str, mode: str) -> str:
    return layout if mode == "eager" else f"{layout} compiled"


def engine_options(cfg: Config) -> dict[str, Any]:
    """What ``VllmEngine`` gets besides ``dtype``: the layout, and for compiled engines the mode
    and the taps the workloads need."""
    if cfg.mode == "compiled":
        return {**cfg.options, "mode": "compiled", "taps": COMPILED_TAPS}
    return {**cfg.options, "mode": "eager"}


def held_state(engine: Any, patience_s: float = 10.0) -> list[dict[str, int]]:
    """Per-request state the workers still hold. A stage frees a request's pull buffers once every
    stage has released it (a message on its way), so give that a moment before calling it a leak."""
    keys = ("requests", "blocks", "waits", "parked_pulls", "buffered", "waiting", "drains")
    end = perf() + patience_s
    while True:
        left = [{k: v for k, v in s.items() if k in keys and v} for s in engine.worker_stats()]
        if not any(left) or perf() > end:
            return left
        time.sleep(0.05)


def run_config(cfg: Config, ctx: Ctx, repeats: int) -> dict[str, Any]:
    import asyncpp

    t0 = perf()
    engine = asyncpp.VllmEngine(dtype="float32", **engine_options(cfg))
    startup = perf() - t0
    compiled = None
    if cfg.mode == "compiled":
        compiled = {
            "taps": list(engine.taps),
            "compile_seconds": engine.compile_seconds,
            "cached": engine.compile_cached,
        }
    try:
        if len(engine.worker_stats()) != cfg.workers:
            raise SystemExit(
                f"FAIL: {cfg.name}: {len(engine.worker_stats())} workers, expected {cfg.workers}"
            )
        corrupt = w_plain_corrupt(engine, ctx)
        res = {}
        for name, fn in WORKLOADS.items():
            try:
                res[name] = measure(engine, fn, ctx, repeats)
            except Exception as e:
                if cfg.mode != "compiled":
                    raise
                raise RuntimeError(f"{name}: {type(e).__name__}: {e}") from e
            print(
                f"  {cfg.name}: {name}: {median(res[name].times) * 1000:.0f} ms, "
                f"{res[name].pulled[-1]} bytes pulled per run",
                flush=True,
            )
        leftover = held_state(engine)
    finally:
        t1 = perf()
        engine.close()
        closing = perf() - t1
    notes, fails = effect_checks(cfg.name, res, corrupt)
    if any(leftover):
        fails.append(f"{cfg.name}: state left on the workers after the run: {leftover}")
    return {
        "res": res,
        "notes": notes,
        "fails": fails,
        "startup": startup,
        "close": closing,
        "compiled": compiled,
    }


# ------------------------------------------------------------------------------------------------
# the report


def report_modes(configs: list[Config], done: dict[str, dict[str, Any]]) -> tuple[str, list[str]]:
    """--mode both: every compiled configuration against the eager one of the same layout."""
    header = [
        "workload (cells)",
        "config",
        "cells",
        "top-1 agreement",
        "max TV",
        "max abs logit diff",
        "max abs hidden-state diff",
        "wall time ratio compiled / eager: medians (ms); fastest runs (info)",
        "target",
        "verdict",
    ]
    rows, fails = [], []
    pairs = [
        (c.twin, c)
        for c in configs
        if c.twin is not None and "error" not in done[c.name] and "error" not in done[c.twin]
    ]
    for twin, cfg in pairs:
        for name in WORKLOADS:
            ref, got = done[twin]["res"][name], done[cfg.name]["res"][name]
            c = compare(ref.out, got.out)
            hidden = hidden_abs(ref.out, got.out)
            worst_abs = max(c.max_abs, c.values_abs or 0.0, hidden or 0.0)
            ok = c.top1 >= TOP1_TARGET and worst_abs <= MAX_ABS_TARGET and c.tokens_equal is not False
            if not ok:
                fails.append(
                    f"{cfg.name} vs {twin}, {name}: top-1 {c.top1:.2f}, max abs logit diff {c.max_abs:.2e}"
                    + (f", top-1 logit changes {c.values_abs:.2e}" if c.values_abs is not None else "")
                    + (f", hidden states {hidden:.2e}" if hidden is not None else "")
                    + (", tokens differ" if c.tokens_equal is False else "")
                    + f" (max TV {c.max_tv:.2e} at {c.worst})"
                )
            rows.append(
                [
                    *_pair_cells(name, f"{cfg.name} vs {twin}", c),
                    f"{c.max_tv:.2e}",
                    _diff_cell(c),
                    "-" if hidden is None else f"{hidden:.1e}",
                    _time_cell(ref, got),
                    f"top-1 1.00, max abs <= {MAX_ABS_TARGET:g}",
                    "pass" if ok else "**FAIL**",
                ]
            )
    if not rows:
        return "(no compiled configuration ran next to its eager one)", fails
    return bench_common.md_table(header, rows), fails


def compiled_text(configs: list[Config], done: dict[str, dict[str, Any]], args: Any) -> str:
    """What the compiled engines were: their taps and how long they took to start."""
    taps: list[str] = []
    starts = []
    for cfg in configs:
        found = done[cfg.name]
        if cfg.mode != "compiled" or "error" in found:
            continue
        info = found["compiled"]
        taps = taps or info["taps"]
        how = "from the compile cache" if info["cached"] else "cold"
        starts.append(
            f"{cfg.name} started in {found['startup']:.0f} s (compiled {how} in {info['compile_seconds']:.1f} s)"
        )
    text = (
        'Compiled engines: `asyncpp.VllmEngine(dtype="float32", mode="compiled", '
        f"taps={COMPILED_TAPS!r})`, blocks served at taps: the default ones (every decoder "
        "layer's output, which the lens, steering and patching read or edit) and every layer's MLP "
        "output (zeroed by the ablation and attribution); `m.logits` and `m.steps()` are outside "
        "the compiled model."
    )
    if taps:
        text += f" Their taps: {', '.join(f'`{t}`' for t in taps)}."
    if starts:
        text += " " + "; ".join(starts) + "."
    if args.mode == "both":
        text += (
            " The table *compiled against eager* compares each compiled configuration cell by cell "
            "with the eager one of the same layout: top-1 agreement, the largest TV, the largest "
            "absolute difference of the logits (attribution: and of the recorded top-1 logit "
            "changes), and of the hidden states where a workload returns them (the logit lens: "
            "every layer's last-token residual the lens reads; patching: the clean runs' residual). "
            f"Targets: top-1 1.00, max abs difference <= {MAX_ABS_TARGET:g} (logits and hidden "
            "states), equal tokens. The wall time ratio compiled / eager (medians; fastest runs) is "
            "information only."
        )
    return wrap(text)


def machine_info() -> dict[str, str]:
    import vllm

    import asyncpp

    rev = bench_common.git_rev()
    where = Path(asyncpp.__file__).resolve().parent
    version = f"{asyncpp.__version__}, {rev}" if where.is_relative_to(ROOT) and rev else str(where)
    return {
        "cpu": bench_common.cpu_model(),
        "cores": f"{os.cpu_count()} logical, {bench_common.usable_cores()} usable",
        "torch": torch.__version__,
        "vllm": vllm.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "asyncpp": version,
    }


def human_bytes(n: float) -> str:
    if n < 1024:
        return f"{n:.0f} B"
    if n < 1024**2:
        return f"{n / 1024:.1f} KiB"
    return f"{n / 1024**2:.2f} MiB"


def pulled_text(m: Measured, stages: bool) -> str:
    if not stages:
        return "- (one stage)"
    lo, hi = min(m.pulled), max(m.pulled)
    text = human_bytes(median(m.pulled))
    if lo != hi:
        text += f" ({human_bytes(lo)} to {human_bytes(hi)})"
    return text + f", {round(median(m.pulls))} pulls"


def report(configs: list[Config], done: dict[str, dict[str, Any]]) -> tuple[str, str, list[str]]:
    header = [
        "workload (cells)",
        "config vs reference",
        "cells",
        "top-1 agreement",
        "max TV",
        "max TV (raw)",
        "max abs logit diff",
        "bytes pulled per run",
        "wall time ratio: medians (ms); fastest runs",
        "target",
        "verdict",
    ]
    rows, fails = [], []
    failed = {c.name for c in configs if "error" in done[c.name]}
    fails += [f"{c.name}: {done[c.name]['error']}" for c in configs if c.name in failed]
    configs = [c for c in configs if c.name not in failed]
    for name in WORKLOADS:
        for cfg in configs:
            if cfg.ref is None or cfg.ref in failed:
                continue
            ref, got = done[cfg.ref]["res"][name], done[cfg.name]["res"][name]
            c = compare(ref.out, got.out)
            ok = c.top1 >= TOP1_TARGET and c.max_tv < TV_TARGET and c.tokens_equal is not False
            if not ok:
                fails.append(
                    f"{cfg.name} vs {cfg.ref}, {name}: top-1 {c.top1:.2f}, max TV {c.max_tv:.3e} at {c.worst}"
                )
            rows.append(
                [
                    *_pair_cells(name, f"{cfg.name} vs {cfg.ref}", c),
                    f"{c.max_tv:.3f}",
                    f"{c.max_tv:.2e}",
                    _diff_cell(c),
                    pulled_text(got, cfg.options.get("pipeline_parallel_size", 1) > 1),
                    _time_cell(ref, got),
                    "top-1 1.00, TV 0.000",
                    "pass" if ok else "**FAIL**",
                ]
            )
    main = bench_common.md_table(header, rows)
    checks = []
    for cfg in configs:
        for name in WORKLOADS:
            checks.append([cfg.name, name, done[cfg.name]["notes"].get(name, "-")])
        fails += done[cfg.name]["fails"]
    effects = bench_common.md_table(
        ["config", "workload", "what the intervention did on this engine"], checks
    )
    spread = []
    for name in WORKLOADS:
        for cfg in configs:
            ts = sorted(t * 1000 for t in done[cfg.name]["res"][name].times)
            spread.append(
                [name, cfg.name, f"{ts[0]:.0f}", f"{median(ts):.0f}", f"{ts[-1]:.0f}", str(len(ts))]
            )
    times = bench_common.md_table(["workload", "config", "min ms", "median ms", "max ms", "runs"], spread)
    return (
        main,
        effects
        + "\n\n<details><summary>Wall time of every timed run</summary>\n\n"
        + times
        + "\n\n</details>",
        fails,
    )


def render(
    main: str,
    effects: str,
    fails: list[str],
    info: dict[str, str],
    secs: dict[str, float],
    ctx: Ctx,
    args: Any,
    compiled: str = "",
    modes: str | None = None,
) -> str:
    date = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    machine = "\n".join(f"- {k}: {v}" for k, v in info.items())
    took = ", ".join(f"{k} {v:.0f} s" for k, v in secs.items())
    prompts = ", ".join(f"`{p!r}`" for p in ctx.prompts)
    tp = (
        " With `--tp`, also TP=2 (one stage, two tensor-parallel ranks) against PP=1, and TP=2 x PP=2 "
        "(four workers) against TP=2."
        if args.tp
        else " (`--tp` adds TP=2 against PP=1 and TP=2 x PP=2 against TP=2.)"
    )
    runs = f"{args.repeats} timed run{'s' if args.repeats != 1 else ''}"
    engines = {
        "eager": 'Every configuration is an `asyncpp.VllmEngine(dtype="float32", mode="eager")`',
        "compiled": (
            "Every configuration is a compiled `asyncpp.VllmEngine` (`--mode compiled`: vLLM's "
            "compiled model, blocks served at taps)"
        ),
        "both": (
            'Every configuration runs twice (`--mode both`), on an eager `asyncpp.VllmEngine(dtype="float32")` '
            "and on a compiled one (vLLM's compiled model, blocks served at taps),"
        ),
    }[args.mode]
    if args.mode == "both":
        tp += (
            " Each split is compared with the one-stage engine of its own mode, and every compiled "
            "engine with the eager one of the same layout."
        )
    what = (
        "Whether interpretability workloads give the same numbers when the engine is split into "
        f"pipeline stages. {engines} on the "
        "embedded tiny 4-layer Llama (random weights), one engine at a time: PP=2 (layers 0-1 / 2-3) "
        f"against PP=1.{tp} The same blocks run on the same {len(ctx.prompts)} prompts ({prompts}), "
        "greedy. Workloads: the logit lens (each layer's last-token residual through the final norm "
        "and the unembedding, computed inside the block from the weights passed as arguments), "
        f"steering (a seed-{STEER_SEED} random unit vector times {STEER_SCALE:g} added to layer "
        f"{STEER_LAYER}'s residual at the last token), ablation (layer {ABLATE_LAYER}'s MLP output "
        f"zeroed), activation patching (layer {PATCH_LAYER}'s last-token residual of a clean run "
        "written into a corrupted prompt's run: two traces), generation steering "
        f"({ctx.new_tokens} tokens, the vector added every step; the logits of every step, and the "
        "tokens) and attribution (each layer's MLP ablated in turn; the change of the clean top-1 "
        "logit is compared too)."
    )
    how = (
        "A cell is one next-token distribution: top-1 agreement is the fraction of cells whose "
        "argmax equals the reference's; TV is the largest total variation distance "
        "`0.5 * sum |softmax(a) - softmax(b)|` (float64) over the cells. Bytes pulled: the sum over "
        'ranks of `worker_stats()["pull_bytes"]` grown by one run of the workload (all its invokes '
        "run concurrently in one trace). Reading, steering, ablating and patching pull nothing (a "
        "returned value computed from one stage's values alone is returned by that stage); the lens "
        "pulls: its value mixes an upstream layer's output with tensors the block holds (the norm "
        "and unembedding weights), so the downstream stage computes it too, pulling what it uses: "
        "the last token's row of `mlp_out` and of `residual` (`out[0][-1] + out[1][-1]`; the "
        "owner selects them). The "
        f"wall time ratio divides the medians of {runs} each, after an untimed warm-up run whose "
        "cells are the ones compared. The two baseline rows run blocks that only return the logits "
        "(of the prompt; of every generation step): their ratio is what the pipeline split itself "
        "costs on this machine, without cross-stage work of asyncpp's. The ratio of the fastest "
        "runs is given too: with other work on the 2 cores the medians swing (every run's time is "
        "in the details). On every engine the script also checks that each intervention "
        f"changed every cell's logits against a run without it (by more than {EFFECT_MIN:g} in some "
        f"logit), and that the last layer's lens reproduces the model's own logits; the {'second' if modes is None else 'last'} table "
        "says what each did."
    )
    status = bench_common.verdict(fails)
    paras = [
        SECTION,
        wrap(what),
        wrap(how),
        f"Command: `{bench_common.command_line(__file__)}` ({date}; {took})",
    ]
    if compiled:
        paras.insert(3, compiled)
    paras += [f"{machine}\n- load average before the run: {args.load}"]
    if modes is not None:
        paras += ["**Split against one stage**", main, "**Compiled against eager**", modes]
    else:
        paras.append(main)
    paras.append(effects)

    paras.append(status)
    return "\n\n".join(paras) + "\n"


def wrap(text: str) -> str:
    return textwrap.fill(text, 100, break_long_words=False, break_on_hyphens=False)


# ------------------------------------------------------------------------------------------------


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tp", action="store_true", help="also TP=2 and TP=2 x PP=2 (four workers: slow)")
    ap.add_argument("--repeats", type=int, default=9, help="timed runs per workload (default 9)")
    ap.add_argument(
        "--prompts", type=int, default=len(PROMPT_PAIRS), help=f"prompts (at most {len(PROMPT_PAIRS)})"
    )
    ap.add_argument(
        "--quick", action="store_true", help=f"{QUICK_PROMPTS} prompts, 1 timed run: to try the script"
    )
    ap.add_argument(
        "--mode",
        choices=MODES,
        default="eager",
        help="the engines: eager (default), compiled (vLLM's compiled model, blocks at taps), or both "
        "(each configuration on both, and compiled against eager)",
    )
    ap.add_argument("--write", action="store_true", help="update the section in docs/performance.md")
    args = ap.parse_args()
    if args.quick:
        args.prompts, args.repeats = QUICK_PROMPTS, 1
    if not 1 <= args.prompts <= len(PROMPT_PAIRS) or args.repeats < 1:
        ap.error(f"--prompts must be 1 to {len(PROMPT_PAIRS)} and --repeats positive")
    return args


def make_ctx(n_prompts: int) -> Ctx:
    from asyncpp.models import load_tiny

    model, _tok = load_tiny()
    gen = torch.Generator().manual_seed(STEER_SEED)
    v = torch.randn(model.config.hidden_size, generator=gen)
    pairs = PROMPT_PAIRS[:n_prompts]
    return Ctx(
        prompts=[c for c, _ in pairs],
        corrupt=[x for _, x in pairs],
        vec=STEER_SCALE * v / v.norm(),
        w_norm=model.model.norm.weight.detach().float().clone(),
        w_lm=model.lm_head.weight.detach().float().clone(),
        eps=float(model.config.rms_norm_eps),
        layers=model.config.num_hidden_layers,
        new_tokens=NEW_TOKENS,
    )


def main() -> int:
    args = parse_args()
    load = os.getloadavg() if hasattr(os, "getloadavg") else None
    args.load = "?"
    if load is not None:
        note = " (other work was running: expect noisier times)" if load[0] > 0.5 else ""
        args.load = ", ".join(f"{x:.2f}" for x in load) + note

    t_all = perf()
    info = machine_info()
    ctx = make_ctx(args.prompts)
    ctx.keep_resid = args.mode != "eager"
    layouts = [
        Config("PP=1", {}, None, 1),
        Config("PP=2", {"pipeline_parallel_size": 2}, "PP=1", 2),
    ]
    if args.tp:
        layouts += [
            Config("TP=2", {"tensor_parallel_size": 2}, "PP=1", 2),
            Config("TP=2 x PP=2", {"tensor_parallel_size": 2, "pipeline_parallel_size": 2}, "TP=2", 4),
        ]
    modes = ["eager", "compiled"] if args.mode == "both" else [args.mode]
    configs = [
        Config(
            config_name(lay.name, mode),
            lay.options,
            None if lay.ref is None else config_name(lay.ref, mode),
            lay.workers,
            mode,
            twin=lay.name if mode == "compiled" and "eager" in modes else None,
        )
        for lay in layouts
        for mode in modes
    ]
    done, secs = {}, {}
    for cfg in configs:
        print(f"{cfg.name}: starting the engine", flush=True)
        t0 = perf()
        try:
            done[cfg.name] = run_config(cfg, ctx, args.repeats)
        except Exception as e:
            if cfg.mode != "compiled":
                raise
            # a compiled engine that fails is a finding, not the end of the run
            traceback.print_exc()
            done[cfg.name] = {"error": f"{type(e).__name__}: {e}"}
            secs[cfg.name] = perf() - t0
            print(f"{cfg.name}: FAILED after {secs[cfg.name]:.0f} s: {done[cfg.name]['error']}", flush=True)
            continue
        secs[cfg.name] = perf() - t0
        start = ""
        if done[cfg.name]["compiled"] is not None:
            info_c = done[cfg.name]["compiled"]
            start = f", {'cached' if info_c['cached'] else 'cold'} compile {info_c['compile_seconds']:.1f} s"
        print(
            f"{cfg.name}: done in {secs[cfg.name]:.0f} s (engine start {done[cfg.name]['startup']:.0f} s"
            f"{start}, close {done[cfg.name]['close']:.0f} s)",
            flush=True,
        )
    main_table, effects, fails = report(configs, done)
    modes_table = None
    if args.mode == "both":
        modes_table, mode_fails = report_modes(configs, done)
        fails += mode_fails
    compiled = compiled_text(configs, done, args) if args.mode != "eager" else ""
    secs = {"total": perf() - t_all, **{f"{k} engine": v for k, v in secs.items()}}
    text = render(main_table, effects, fails, info, secs, ctx, args, compiled, modes_table)
    return bench_common.finish(SECTION, text, fails, args.write, DOC)


if __name__ == "__main__":
    sys.exit(main())
