"""Portability: one set of blocks, written on the standard view (``m.std``) only and never changed,
on every engine and architecture, compared with the Hugging Face reference at float32; and what the
standard view costs against the raw module tree on vLLM.

**Matrix.** For each architecture (``--archs``; default llama qwen2 qwen3 mistral gemma2 phi3 gpt2
mixtral qwen2_moe, and phi and gpt_neox, which vLLM runs through its Transformers backend: the
tiny random checkpoints of ``asyncpp.models.tiny_checkpoint(arch)``, 2
layers, hidden 128, vocab 259, byte-level tokenizer) the same blocks run on each engine
(``--engines``): ``hf``, the reference (``asyncpp.LocalEngine(build_tiny(arch, checkpoint=True))``,
the very model the checkpoint holds), and ``asyncpp.VllmEngine(path, dtype="float32",
mode="eager", ...)`` as ``pp1`` (one worker), ``tp2`` (``tensor_parallel_size=2``), ``pp2``
(``pipeline_parallel_size=2``: layer 0 on stage 0, layer 1 and the head on stage 1) and ``tp2pp2``
(both, four workers: by default only for gemma2 and qwen2_moe, the others skip it). One vLLM engine
is alive at a time (each is closed before the next starts). Prompts: 3 clean prompts and 3
corrupted ones, all of the same token length (no padding on Hugging Face), greedy. Workloads:

1. **hidden states**: every layer's ``resid_out`` at the last position, and the final logits, of
   the clean and the corrupted prompts (cells: 6 prompts; the states are compared too);
2. **logit lens**: ``m.std.unembed`` of every layer's ``resid_out`` at the last position (cells:
   layers x prompts), and ``m.std.logits``;
3. **steering**: a fixed vector (seed 0, unit norm, times ``STEER_SCALE``) added in place to the
   middle layer's ``resid_out`` at the last position (layer ``(n - 1) // 2``: layer 0 here, stage 0
   on PP); the final logits;
4. **ablation**: the last layer's ``mlp_out`` replaced by zeros with ``await point.set(...)`` (the
   last stage on PP); the final logits;
5. **activation patching**: a clean trace returns the middle layer's ``resid_out`` at the last
   position; a second trace writes it into the corrupted prompt's run
   (``await resid_out[:, -1].set(clean)``); the final logits;
6. **generation steering**: ``NEW_TOKENS`` greedy new tokens with the steering vector added at
   every step (``async for _ in m.steps()``); the logits of every step (cells: steps x prompts) and
   the tokens, which must be equal. EOS is masked for all of them on every engine (Hugging Face
   ``min_new_tokens``, vLLM ``min_tokens``: the same logits processor), so that every engine
   generates the same number of tokens; blocks see the logits before it.

All invokes of a workload run in one trace (patching: two). Per cell (workload x architecture x
engine, against ``hf``): **top-1 agreement** (the fraction of next-token distributions whose
argmax equals the reference's), the largest **total variation distance** ``0.5 * sum |softmax(a) -
softmax(b)|`` in float64, and the largest **absolute difference** of the logits (hidden states: of
the states). Targets: top-1 1.00 and TV < ``TV_TARGET`` (1e-5) per cell, hidden states within
``HIDDEN_ATOL`` (1e-4, the tolerance of tests/vllm/test_vllm_architectures.py), equal tokens. An
**effect-size guard** runs on every engine (``hf`` included), so that a no-op cannot pass: each
intervention's logits must differ from the un-intervened run on the same engine (steering,
ablation: the clean prompts' logits of the hidden-states run; patching: the corrupted prompts';
generation steering: a generation without steering, step by step) by more than ``EFFECT_MIN``
(0.01) in some logit of every cell, and the lens of the last layer must equal ``std.logits``
(max abs <= ``LENS_ATOL``) while the lens block leaves the model's own logits as the plain run's.
An engine that fails to start, or a workload that raises, is a failed cell (the run goes on).

**Cost.** On vLLM PP=1 (``--cost-arch``, default llama) a generation of ``--cost-tokens`` (32)
greedy tokens with ``ignore_eos`` for ``--cost-invokes`` (4) prompts in one ``asyncpp.generate``,
whose block reads every layer's residual stream at every step and clones its last position:
(a) **std**: ``(await layer.resid_out)[:, -1].clone()`` for each layer in ``m.std.layers``;
(b) **raw**: ``out = await layer.output; (out[0] + out[1])[-1].clone()`` for each layer in
``m.model.layers`` (vLLM's decoder layer returns ``(mlp_out, residual)`` over the batch's flat
token rows; the stream is their sum); (c) **baseline**: the same generation without a block. The
two reads are not the same work: std's view moves the sum into ``residual`` in place
(``residual += mlp_out; mlp_out.zero_()``, the request's rows only, no copy; the next layer then
adds zero) and its result is a view of the model's storage that edits land in, while raw allocates
``out[0] + out[1]`` over the request's rows and leaves the layer's output alone: what is compared
is what a block pays for the standard point against what it pays for computing the stream itself.
The variants alternate (rotated order) over ``--repeats`` rounds (10) after one untimed warm-up
round; reported: the medians, the ratio std / raw (target <= ``COST_TARGET``, 1.05x; the median of
the per-round ratios, in CPU seconds of all processes; wall times reported too) and each over the
baseline. The cost has its own section of docs/performance.md. The std and raw runs must read the
same values (within ``HIDDEN_ATOL``: vLLM may batch the two runs' steps differently) and generate
the same tokens.

Usage::

    .venv/bin/python benchmarks/portability.py            # the whole matrix and the cost (~25 min)
    .venv/bin/python benchmarks/portability.py --quick    # llama, gemma2 on hf and pp1; 3 cost rounds
    .venv/bin/python benchmarks/portability.py --engines hf --no-cost   # the blocks on HF only
    .venv/bin/python benchmarks/portability.py --archs llama qwen3 --engines hf pp2

Prints markdown tables, then one ``FAIL: ...`` line per failed check (stderr); the exit status is 1
if any check failed. Progress goes to stderr. ``VLLM_CPU_OMP_THREADS_BIND`` defaults to ``nobind``
(the environment's value wins). Results are recorded in docs/performance.md, section "Portability
(benchmarks/portability.py)".
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
import textwrap
import time
import traceback
from dataclasses import dataclass, field
from statistics import median
from typing import Any

import bench_common
import torch
from bench_common import max_abs, tv

SECTION = "## Portability (benchmarks/portability.py)"
COST_SECTION = "## The standard view's cost (benchmarks/portability.py)"

ARCHS = [
    "llama",
    "qwen2",
    "qwen3",
    "mistral",
    "gemma2",
    "phi3",
    "gpt2",
    "mixtral",
    "qwen2_moe",
    "phi",
    "gpt_neox",
]
ENGINES = ["hf", "pp1", "tp2", "pp2", "tp2pp2"]
LAYOUTS: dict[str, dict[str, int]] = {
    "pp1": {},
    "tp2": {"tensor_parallel_size": 2},
    "pp2": {"pipeline_parallel_size": 2},
    "tp2pp2": {"tensor_parallel_size": 2, "pipeline_parallel_size": 2},
}
TP2PP2_ARCHS = ("gemma2", "qwen2_moe")  # tp2pp2 by default only for these (the others skip it)
QUICK_ARCHS = ["llama", "gemma2"]
QUICK_ENGINES = ["hf", "pp1"]

# (clean, corrupted): all of one length, so that a Hugging Face batch has no padding; they differ
# at the end, within Gemma-2's sliding window (8 here), else its last position sees no difference
PROMPT_PAIRS = [
    ("The cat sat on the mat", "The cat sat on the rug"),
    ("Once upon a time there", "Once upon a time thing"),
    ("1, 2, 3, 4, 5, 6, 7, 8", "1, 2, 3, 4, 5, 6, 7, 9"),
]
STEER_SCALE = 8.0
STEER_SEED = 0
NEW_TOKENS = 6

TOP1_TARGET = 1.0
TV_TARGET = 1e-5
HIDDEN_ATOL = 1e-4
EFFECT_MIN = 0.01  # an intervention must move some logit of every cell by more than this (noise: ~1e-6)
LENS_ATOL = 1e-5  # the last layer's lens against std.logits, on each engine
COST_TARGET = 1.05  # std / raw

WORKLOADS = [
    "hidden states",
    "logit lens",
    "steering",
    "ablation",
    "activation patching",
    "generation steering",
]
SHORT = {
    "hidden states": "hidden",
    "logit lens": "lens",
    "steering": "steer",
    "ablation": "ablate",
    "activation patching": "patch",
    "generation steering": "gen steer",
}

perf = time.perf_counter
T0 = perf()


def log(msg: str) -> None:
    print(f"[{perf() - T0:7.1f} s] {msg}", file=sys.stderr, flush=True)


# ------------------------------------------------------------------------------------------------
# the blocks: the standard view only, the same on every engine


async def hidden_states(m):
    """Every layer's residual stream at the last position, and the final logits."""
    states = [(await layer.resid_out)[:, -1].clone() for layer in m.std.layers]
    return states, (await m.std.logits)[:, -1].clone()


async def logit_lens(m):
    """Every layer's last position decoded by the model's head, and the model's own logits."""
    lens = [m.std.unembed((await layer.resid_out)[:, -1]) for layer in m.std.layers]
    return lens, (await m.std.logits)[:, -1].clone()


async def steer(m, vec, layer):
    (await m.std.layers[layer].resid_out)[:, -1] += vec
    return (await m.std.logits)[:, -1].clone()


async def ablate(m, layer):
    point = m.std.layers[layer].mlp_out
    await point.set(torch.zeros_like(await point))
    return (await m.std.logits)[:, -1].clone()


async def read_resid(m, layer):
    return (await m.std.layers[layer].resid_out)[:, -1].clone(), (await m.std.logits)[:, -1].clone()


async def patch(m, clean, layer):
    await m.std.layers[layer].resid_out[:, -1].set(clean)
    return (await m.std.logits)[:, -1].clone()


async def steer_steps(m, vec, layer):
    """Every step's logits; with ``vec``, added to ``layer``'s stream at the newest position first."""
    logits = []
    async for _ in m.steps():
        if vec is not None:
            (await m.std.layers[layer].resid_out)[:, -1] += vec
        logits.append((await m.std.logits)[:, -1].clone())
    return logits


# the cost blocks (vLLM): every layer's residual stream at every step, std against raw


async def read_std(m):
    kept = []
    async for _ in m.steps():
        for layer in m.std.layers:
            kept.append((await layer.resid_out)[:, -1].clone())
    return kept[-len(m.std.layers) :]  # the last step's (to check that both read the same)


async def read_raw(m):
    kept = []
    async for _ in m.steps():
        for layer in m.model.layers:
            out = await layer.output  # (mlp_out, residual) over the request's token rows
            kept.append((out[0] + out[1])[-1].clone())
    return kept[-len(m.model.layers) :]


# ------------------------------------------------------------------------------------------------
# the workloads: each runs its traces on one engine


@dataclass
class Out:
    cells: list[torch.Tensor]  # next-token logits, [vocab] each
    labels: list[str]
    states: list[torch.Tensor] | None = None  # hidden states: [hidden] each
    tokens: list[list[int]] | None = None  # generation: every prompt's tokens
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass
class Ctx:
    clean: list[str]
    corrupt: list[str]
    vec: torch.Tensor
    layers: int
    kind: str  # "hf" or "vllm": only the sampling options' names differ

    @property
    def middle(self) -> int:
        return (self.layers - 1) // 2

    def gen_options(self) -> dict[str, Any]:
        # mask EOS for NEW_TOKENS steps: every engine generates them all, by the same rule
        return {"min_new_tokens": NEW_TOKENS} if self.kind == "hf" else {"min_tokens": NEW_TOKENS}


def invoke_all(engine: Any, invokes: list[tuple], **kw: Any) -> list[Any]:
    import asyncpp

    entry = asyncpp.generate if "max_new_tokens" in kw else asyncpp.trace
    with entry(engine, **kw) as t:
        handles = [t.invoke(prompt, block, *args) for prompt, block, *args in invokes]
    return handles


def row(x: torch.Tensor) -> torch.Tensor:
    """One invoke's value ``[1, n]`` as ``[n]``, float64 on the CPU."""
    if x.dim() != 2 or x.shape[0] != 1:
        raise ValueError(f"expected one row [1, n], got {tuple(x.shape)}")
    return x[0].detach().double().cpu()


def w_hidden(engine: Any, ctx: Ctx) -> Out:
    prompts = ctx.clean + ctx.corrupt
    hs = invoke_all(engine, [(p, hidden_states) for p in prompts])
    labels = [f"clean {i}" for i in range(len(ctx.clean))] + [f"corrupt {i}" for i in range(len(ctx.corrupt))]
    states = [row(s) for h in hs for s in h.result[0]]
    return Out([row(h.result[1]) for h in hs], labels, states=states)


def w_lens(engine: Any, ctx: Ctx) -> Out:
    hs = invoke_all(engine, [(p, logit_lens) for p in ctx.clean])
    cells = [row(c) for h in hs for c in h.result[0]]
    labels = [f"p{i} layer {k}" for i, h in enumerate(hs) for k in range(len(h.result[0]))]
    return Out(cells, labels, extra={"final": [row(h.result[1]) for h in hs]})


def w_steer(engine: Any, ctx: Ctx) -> Out:
    hs = invoke_all(engine, [(p, steer, ctx.vec, ctx.middle) for p in ctx.clean])
    return Out([row(h.result) for h in hs], [f"p{i}" for i in range(len(hs))])


def w_ablate(engine: Any, ctx: Ctx) -> Out:
    hs = invoke_all(engine, [(p, ablate, ctx.layers - 1) for p in ctx.clean])
    return Out([row(h.result) for h in hs], [f"p{i}" for i in range(len(hs))])


def w_patch(engine: Any, ctx: Ctx) -> Out:
    clean = invoke_all(engine, [(p, read_resid, ctx.middle) for p in ctx.clean])
    reads = [h.result[0] for h in clean]
    hs = invoke_all(engine, [(c, patch, r, ctx.middle) for c, r in zip(ctx.corrupt, reads, strict=True)])
    return Out([row(h.result) for h in hs], [f"p{i}" for i in range(len(hs))], states=[row(r) for r in reads])


def _generate(engine: Any, ctx: Ctx, vec: torch.Tensor | None) -> Out:
    hs = invoke_all(
        engine,
        [(p, steer_steps, vec, ctx.middle) for p in ctx.clean],
        max_new_tokens=NEW_TOKENS,
        **ctx.gen_options(),
    )
    return Out(
        [row(c) for h in hs for c in h.result],
        [f"p{i} step {s}" for i, h in enumerate(hs) for s in range(len(h.result))],
        tokens=[h.tokens[0].tolist() for h in hs],
    )


def w_gen(engine: Any, ctx: Ctx) -> Out:
    return _generate(engine, ctx, ctx.vec)


def w_gen_plain(engine: Any, ctx: Ctx) -> Out:
    return _generate(engine, ctx, None)


RUNS = {
    "hidden states": w_hidden,
    "logit lens": w_lens,
    "steering": w_steer,
    "ablation": w_ablate,
    "activation patching": w_patch,
    "generation steering": w_gen,
    "baseline: generation": w_gen_plain,  # no steering: what generation steering must change
}


def short_error(e: BaseException) -> str:
    text = f"{type(e).__name__}: {e}".strip().splitlines()
    first = text[0] if text else type(e).__name__
    return first[:300] + ("..." if len(first) > 300 else "")


def run_workloads(engine: Any, ctx: Ctx, where: str) -> tuple[dict[str, Out], dict[str, str]]:
    outs, errors = {}, {}
    for name, fn in RUNS.items():
        t0 = perf()
        try:
            outs[name] = fn(engine, ctx)
        except Exception as e:
            errors[name] = short_error(e)
            log(f"  {where}: {name}: ERROR {errors[name]}")
            traceback.print_exc(file=sys.stderr)
            continue
        log(f"  {where}: {name}: {(perf() - t0) * 1000:.0f} ms")
    return outs, errors


# ------------------------------------------------------------------------------------------------
# comparing


@dataclass
class Compared:
    top1: float
    max_tv: float
    max_abs: float  # of the logits
    states_abs: float | None  # of the hidden states, where the workload returns them
    tokens_equal: bool | None
    worst: str


def compare(ref: Out, got: Out) -> Compared:
    if ref.labels != got.labels:
        raise ValueError(
            f"the cells differ: {len(got.labels)} ({got.labels[:4]}...) against {len(ref.labels)}"
        )
    pairs = list(zip(ref.cells, got.cells, strict=True))
    tvs = [tv(a, b) for a, b in pairs]
    worst = max(range(len(tvs)), key=tvs.__getitem__)
    states = None
    if ref.states is not None and got.states is not None:
        if len(ref.states) != len(got.states):
            raise ValueError(f"{len(got.states)} hidden states against {len(ref.states)}")
        states = max(max_abs(a, b) for a, b in zip(ref.states, got.states, strict=True))
    return Compared(
        top1=sum(int(a.argmax()) == int(b.argmax()) for a, b in pairs) / len(pairs),
        max_tv=max(tvs),
        max_abs=max(max_abs(a, b) for a, b in pairs),
        states_abs=states,
        tokens_equal=None if ref.tokens is None else ref.tokens == got.tokens,
        worst=ref.labels[worst],
    )


def verdict(name: str, c: Compared) -> list[str]:
    """What fails in one comparison (nothing: it passes)."""
    bad = []
    if c.top1 < TOP1_TARGET:
        bad.append(f"top-1 agreement {c.top1:.2f}")
    if not c.max_tv < TV_TARGET:
        bad.append(f"max TV {c.max_tv:.2e} (at {c.worst})")
    if name == "hidden states" and c.states_abs is not None and not c.states_abs <= HIDDEN_ATOL:
        bad.append(f"hidden states differ by {c.states_abs:.2e}")
    if c.tokens_equal is False:
        bad.append("the tokens differ")
    return bad


def effects(outs: dict[str, Out]) -> tuple[dict[str, float], list[str]]:
    """On one engine: the smallest max |logit change| of each intervention against the run without
    it (over its cells), the lens check; and what fails."""
    found: dict[str, float] = {}
    fails: list[str] = []
    hidden = outs.get("hidden states")

    def moved(name: str, cells: list[torch.Tensor], base: list[torch.Tensor], labels: list[str]) -> None:
        if len(cells) != len(base):
            fails.append(f"{name}: {len(cells)} cells against {len(base)} without the intervention")
            return
        moves = [max_abs(a, b) for a, b in zip(cells, base, strict=True)]
        found[name] = min(moves)
        for lab, mv in zip(labels, moves, strict=True):
            if not mv > EFFECT_MIN:
                fails.append(
                    f"{name}, {lab}: the intervention moved no logit by more than {EFFECT_MIN:g} ({mv:.3g})"
                )

    if hidden is not None:
        n = len(hidden.cells) // 2
        clean, corrupt = hidden.cells[:n], hidden.cells[n:]
        for name, base in (("steering", clean), ("ablation", clean), ("activation patching", corrupt)):
            if name in outs:
                moved(name, outs[name].cells, base, outs[name].labels)
    if "generation steering" in outs and "baseline: generation" in outs:
        g, b = outs["generation steering"], outs["baseline: generation"]
        moved("generation steering", g.cells, b.cells, g.labels)
    lens = outs.get("logit lens")
    if lens is not None:
        finals = lens.extra["final"]
        layers = len(lens.cells) // len(finals)
        gaps = [max_abs(lens.cells[i * layers + layers - 1], f) for i, f in enumerate(finals)]
        found["lens"] = max(gaps)
        for i, g in enumerate(gaps):
            if not g <= LENS_ATOL:
                fails.append(f"logit lens, p{i}: the last layer's lens differs from std.logits by {g:.3g}")
        if hidden is not None:
            for i, (a, b) in enumerate(zip(finals, hidden.cells, strict=False)):
                if max_abs(a, b) > LENS_ATOL:
                    fails.append(
                        f"logit lens, p{i}: std.logits with the lens differ from the plain run's by {max_abs(a, b):.3g}"
                    )
    return found, fails


# ------------------------------------------------------------------------------------------------
# the engines


@dataclass
class Cell:
    """One engine of one architecture: what its workloads returned, and how long it took."""

    outs: dict[str, Out] = field(default_factory=dict)
    errors: dict[str, str] = field(default_factory=dict)
    start_s: float = 0.0
    run_s: float = 0.0
    close_s: float = 0.0
    skipped: str | None = None


def make_ctx(arch: str, kind: str) -> Ctx:
    from asyncpp.models.architectures import tiny_config

    config = tiny_config(arch, checkpoint=True)
    hidden = config.hidden_size
    gen = torch.Generator().manual_seed(STEER_SEED)
    v = torch.randn(hidden, generator=gen)
    return Ctx(
        clean=[c for c, _ in PROMPT_PAIRS],
        corrupt=[x for _, x in PROMPT_PAIRS],
        vec=STEER_SCALE * v / v.norm(),
        layers=config.num_hidden_layers,
        kind=kind,
    )


def check_prompts(tokenizer: Any) -> None:
    lengths = {len(tokenizer(p)["input_ids"]) for pair in PROMPT_PAIRS for p in pair}
    if len(lengths) != 1:
        raise SystemExit(
            f"the prompts must all have one token length (no padding), got lengths {sorted(lengths)}"
        )


def run_hf(arch: str) -> Cell:
    from transformers import AutoTokenizer

    import asyncpp
    from asyncpp.models import build_tiny, tiny_checkpoint

    cell = Cell()
    t0 = perf()
    path = tiny_checkpoint(arch)
    tok = AutoTokenizer.from_pretrained(path)
    check_prompts(tok)
    engine = asyncpp.LocalEngine(build_tiny(arch, checkpoint=True), tok)
    cell.start_s = perf() - t0
    t1 = perf()
    try:
        cell.outs, cell.errors = run_workloads(engine, make_ctx(arch, "hf"), f"{arch} hf")
    finally:
        cell.run_s = perf() - t1
        t2 = perf()
        engine.close()
        cell.close_s = perf() - t2
    return cell


def start_vllm(arch: str, layout: str) -> Any:
    import asyncpp
    from asyncpp.models import tiny_checkpoint

    return asyncpp.VllmEngine(tiny_checkpoint(arch), dtype="float32", mode="eager", **LAYOUTS[layout])


def run_vllm(arch: str, layout: str, cost: Any = None) -> Cell:
    """``layout``'s engine on ``arch``: the workloads (and ``cost(engine)`` before closing it)."""
    cell = Cell()
    t0 = perf()
    try:
        engine = start_vllm(arch, layout)
    except Exception as e:
        cell.start_s = perf() - t0
        traceback.print_exc(file=sys.stderr)
        cell.errors["engine"] = f"the engine did not start: {short_error(e)}"
        log(f"{arch} {layout}: {cell.errors['engine']}")
        return cell
    cell.start_s = perf() - t0
    log(f"{arch} {layout}: engine started in {cell.start_s:.0f} s")
    t1 = perf()
    try:
        cell.outs, cell.errors = run_workloads(engine, make_ctx(arch, "vllm"), f"{arch} {layout}")
        cell.run_s = perf() - t1
        if cost is not None:
            cost(engine)
    finally:
        t2 = perf()
        try:
            engine.close()
        except Exception as e:
            cell.errors["close"] = f"close failed: {short_error(e)}"
            traceback.print_exc(file=sys.stderr)
        cell.close_s = perf() - t2
    return cell


# ------------------------------------------------------------------------------------------------
# the cost of the standard view (vLLM, PP=1)


@dataclass
class Cost:
    arch: str
    invokes: int
    tokens: int
    layers: int = 0
    times: dict[str, list[float]] = field(default_factory=lambda: {"std": [], "raw": [], "baseline": []})
    cpu: dict[str, list[float]] = field(default_factory=lambda: {"std": [], "raw": [], "baseline": []})
    fails: list[str] = field(default_factory=list)
    error: str | None = None
    read_diff: float | None = None


def cost_prompts(n: int) -> list[str]:
    words = bench_common.PROMPT_TEXT.split()
    return [" ".join(words[i * 5 : i * 5 + 4 + i % 3]) for i in range(n)]


def run_cost(engine: Any, res: Cost, repeats: int) -> None:
    import asyncpp

    prompts = cost_prompts(res.invokes)
    blocks = {"std": read_std, "raw": read_raw, "baseline": None}

    def once(name: str) -> tuple[float, float, list[Any]]:
        c0, t0 = bench_common.tree_cpu_seconds(), perf()
        with asyncpp.generate(engine, max_new_tokens=res.tokens, ignore_eos=True) as t:
            hs = [t.invoke(p, blocks[name]) for p in prompts]
        return perf() - t0, bench_common.tree_cpu_seconds() - c0, hs

    try:
        runs = {name: once(name)[2] for name in blocks}  # the warm-up round: checked, not timed
        std, raw, base = runs["std"], runs["raw"], runs["baseline"]
        res.layers = len(std[0].result)
        diffs = [
            max_abs(a[0], b)
            for hs, hr in zip(std, raw, strict=True)
            for a, b in zip(hs.result, hr.result, strict=True)
        ]
        res.read_diff = max(diffs)
        if res.read_diff > HIDDEN_ATOL:  # (vLLM may batch the two runs' steps differently)
            res.fails.append(
                f"cost: std and raw read different residual streams (max abs {res.read_diff:.3g})"
            )
        for name, hs in runs.items():
            lengths = {len(h.tokens[0]) for h in hs}
            if name != "baseline" and [h.tokens[0].tolist() for h in hs] != [
                h.tokens[0].tolist() for h in base
            ]:
                res.fails.append(f"cost: the {name} runs generated other tokens than the baseline")
            if len(lengths) != 1:
                res.fails.append(f"cost: the {name} runs generated sequences of lengths {sorted(lengths)}")
        order = list(blocks)
        for r in range(repeats):
            k = r % len(order)
            for name in order[k:] + order[:k]:
                wall, cpu, _ = once(name)
                res.times[name].append(wall)
                res.cpu[name].append(cpu)
            log(
                f"  cost round {r + 1}/{repeats}: "
                + ", ".join(
                    f"{n} {res.times[n][-1] * 1000:.0f} ms ({res.cpu[n][-1] * 1000:.0f} CPU-ms)"
                    for n in order
                )
            )
    except Exception as e:
        traceback.print_exc(file=sys.stderr)
        res.error = short_error(e)
        res.fails.append(f"cost: {res.error}")


def cost_report(res: Cost) -> tuple[str, list[str]]:
    fails = list(res.fails)
    if res.error is not None or not res.times["std"]:
        return f"(the cost measurement failed: {res.error})", fails
    reads = res.invokes * res.tokens * res.layers  # one step per new token (step 0: the prompt's)
    rows = []
    ratios = {}
    for measure, data, unit in (("CPU", res.cpu, "CPU-ms"), ("wall", res.times, "ms")):
        med = {k: median(v) for k, v in data.items()}
        paired = sorted(s / r for s, r in zip(data["std"], data["raw"], strict=True))
        ratios[measure] = (
            median(paired),
            paired[0],
            paired[-1],
            med["std"] / med["raw"],
            min(data["std"]) / min(data["raw"]),
        )
        for name in ("baseline", "raw", "std"):
            ts = sorted(t * 1000 for t in data[name])
            over = "-" if name == "baseline" else f"{med[name] / med['baseline']:.3f}x"
            extra = "-" if name == "baseline" else f"{(med[name] - med['baseline']) / reads * 1e6:.1f} us"
            rows.append(
                [
                    f"{name} ({measure})",
                    f"{ts[0]:.0f}",
                    f"{median(ts):.0f}",
                    f"{ts[-1]:.0f}",
                    unit,
                    over,
                    extra,
                ]
            )
    table = bench_common.md_table(
        ["variant", "min", "median", "max", "unit", "median / baseline", "extra per read (medians)"], rows
    )
    ratio = ratios["CPU"][0]
    ok = ratio <= COST_TARGET
    if not ok:
        fails.append(f"cost: std / raw {ratio:.3f}x in CPU seconds, target <= {COST_TARGET:g}x")
    said = [
        f"{m}: {r:.3f}x (median of the {len(res.cpu['std'])} per-round ratios, from {lo:.3f} to {hi:.3f}; "
        f"ratio of the medians {rm:.3f}x, of the minimums {rmin:.3f}x)"
        for m, (r, lo, hi, rm, rmin) in ratios.items()
    ]
    summary = (
        f"std / raw in CPU seconds of all processes (the steady measure): **{ratio:.3f}x**; target <= "
        f"{COST_TARGET:g}x: {'pass' if ok else '**FAIL**'}. " + "; ".join(said) + ". The last step's reads, "
        f"std against raw: max abs {res.read_diff:.1e}; "
        + ("all three generate the same tokens." if not res.fails else "see the failed checks.")
    )
    return table + "\n\n" + summary, fails


# ------------------------------------------------------------------------------------------------
# the report


def fmt_cell(name: str, c: Compared | None, error: str | None) -> str:
    if error is not None:
        return "**ERROR**"
    if c is None:
        return "-"
    text = f"{c.top1:.2f} / {c.max_tv:.1e}"
    if c.tokens_equal is False:
        text += " tokens **differ**"
    if verdict(name, c):
        text = f"**{text}**"
    return text


def report(
    archs: list[str], engines: dict[str, list[str]], cells: dict[tuple[str, str], Cell]
) -> tuple[str, str, str, list[str]]:
    """The agreement table, the max abs table, the effects table and the failures."""
    rows, diffs, effs, fails = [], [], [], []
    for arch in archs:
        ref = cells.get((arch, "hf"))
        for eng in engines[arch]:
            cell = cells[(arch, eng)]
            where = f"{arch} {eng}"
            if cell.skipped:
                continue
            fails += [f"{where}, {k}: {v}" for k, v in cell.errors.items() if k not in WORKLOADS]
            found, eff_fails = effects(cell.outs)
            fails += [f"{where}, {f}" for f in eff_fails]
            effs.append(
                [
                    arch,
                    eng,
                    *[
                        f"{found[w]:.3g}" if w in found else "-"
                        for w in ("steering", "ablation", "activation patching", "generation steering")
                    ],
                    f"{found['lens']:.1e}" if "lens" in found else "-",
                    f"{cell.start_s:.0f} / {cell.run_s:.1f} / {cell.close_s:.0f}",
                ]
            )
            if eng == "hf":
                fails += [f"{where}, {w}: {cell.errors[w]}" for w in WORKLOADS if w in cell.errors]
                continue
            line, dline = [arch, eng], [arch, eng]
            for w in WORKLOADS:
                err = cell.errors.get(w) or cell.errors.get("engine")
                if err is None and (ref is None or w not in ref.outs):
                    err = "no reference (hf did not run it)"
                c = None
                if err is None and w in cell.outs:
                    try:
                        c = compare(ref.outs[w], cell.outs[w])
                    except ValueError as e:
                        err = str(e)
                if err is not None:
                    if "engine" not in cell.errors:  # (that one is reported once, above)
                        fails.append(f"{where}, {w}: {err}")
                    line.append("**ERROR**")
                    dline.append("-")
                    continue
                if c is None:
                    line.append("-")
                    dline.append("-")
                    continue
                bad = verdict(w, c)
                if bad:
                    fails.append(f"{where}, {w}: " + "; ".join(bad))
                line.append(fmt_cell(w, c, None))
                d = f"{c.max_abs:.1e}"
                if c.states_abs is not None:
                    d = f"{c.states_abs:.1e} (logits {c.max_abs:.1e})" if w == "hidden states" else d
                dline.append(d)
            rows.append(line)
            diffs.append(dline)
    header = ["arch", "engine", *[SHORT[w] for w in WORKLOADS]]
    agree = bench_common.md_table(header, rows) if rows else "(no vLLM engine ran)"
    absd = bench_common.md_table(header, diffs) if diffs else "(no vLLM engine ran)"
    eff = bench_common.md_table(
        [
            "arch",
            "engine",
            "steer",
            "ablate",
            "patch",
            "gen steer",
            "lens last vs logits",
            "start / run / close s",
        ],
        effs,
    )
    return agree, absd, eff, fails


def wrap(text: str) -> str:
    return textwrap.fill(text, 100, break_long_words=False, break_on_hyphens=False)


def render(
    agree: str,
    absd: str,
    eff: str,
    fails: list[str],
    info: dict[str, str],
    args: Any,
    total_s: float,
    skipped: list[str],
) -> str:
    date = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    what = (
        "One set of blocks, written on the standard view (`m.std`) only, unchanged on every engine "
        "and architecture, against the Hugging Face reference at float32 (tiny random checkpoints, "
        '2 layers, hidden 128; `VllmEngine(dtype="float32", mode="eager")`, one engine at a time; '
        f"pp1 one worker, tp2 `tensor_parallel_size=2`, pp2 `pipeline_parallel_size=2`, tp2pp2 both). "
        f"Workloads on {len(PROMPT_PAIRS)} clean and {len(PROMPT_PAIRS)} corrupted prompts of one "
        "length, greedy: hidden states (every layer's `resid_out` at the last position, and the "
        "logits), logit lens (`std.unembed` of every layer's last position), steering (a seed-"
        f"{STEER_SEED} unit vector times {STEER_SCALE:g} added to the middle layer's `resid_out` at "
        "the last position), ablation (the last layer's `mlp_out` set to zeros), activation patching "
        "(the middle layer's last-position `resid_out` of a clean trace set into the corrupted "
        f"prompt's run), generation steering ({NEW_TOKENS} new tokens, steered at every step; every "
        "step's logits and the tokens)."
    )
    how = (
        "Each cell: top-1 agreement / the largest total variation distance `0.5 * sum |softmax(a) - "
        "softmax(b)|` (float64) against hf, over the workload's next-token distributions. Targets: "
        f"top-1 1.00 and TV < {TV_TARGET:g}; hidden states within {HIDDEN_ATOL:g}; equal tokens. "
        "The second table: the largest absolute difference of the logits (hidden: of the states). "
        "The third, on every engine: the smallest max |logit change| of each intervention against "
        f"the run without it (each cell must exceed {EFFECT_MIN:g}), the largest difference of the "
        f"last layer's lens from `std.logits` (<= {LENS_ATOL:g}), and the engine's start / workloads "
        "/ close seconds."
    )
    parts = [
        SECTION,
        wrap(what),
        wrap(how),
        f"Command: `{bench_common.command_line(__file__)}` ({date}; {total_s:.0f} s)",
        bench_common.machine_lines(info),
        "**Agreement with hf (top-1 / max TV)**",
        agree,
        "**Max abs difference from hf**",
        absd,
        "**Effect sizes and engine times**",
        eff,
    ]
    if skipped:
        parts.insert(4, "Skipped: " + "; ".join(skipped) + ".")
    parts.append(bench_common.verdict(fails))
    return "\n\n".join(parts) + "\n"


def render_cost(cost_text: str, fails: list[str], info: dict[str, str], args: Any, total_s: float) -> str:
    date = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    parts = [
        COST_SECTION,
        wrap(
            f"vLLM PP=1, {args.cost_arch}, {args.cost_invokes} invokes x {args.cost_tokens} tokens, "
            f"`ignore_eos`, every layer's residual stream read at every step, {args.repeats} rounds. "
            "std: `(await layer.resid_out)[:, -1].clone()` per layer of `m.std.layers` (the view "
            "moves the sum into `residual` in place and zeroes `mlp_out`, no copy); raw: `out = "
            "await layer.output; (out[0] + out[1])[-1].clone()` per layer of `m.model.layers` (an "
            "add over the request's rows; the layer's output untouched); baseline: no block. CPU: "
            "seconds of this process and vLLM's (the steady measure on this noisy machine); wall: "
            "the trace's. Extra per read: (median - baseline median) / (invokes x tokens x layers)."
        ),
        f"Command: `{bench_common.command_line(__file__)}` ({date}; {total_s:.0f} s)",
        bench_common.machine_lines(info),
        cost_text,
        bench_common.verdict(fails),
    ]
    return "\n\n".join(parts) + "\n"


# ------------------------------------------------------------------------------------------------


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--archs", nargs="+", choices=ARCHS, help="the architectures (default: all)")
    ap.add_argument(
        "--engines",
        nargs="+",
        choices=ENGINES,
        help="the engines (default: all; tp2pp2 only for gemma2 and qwen2_moe unless given)",
    )
    ap.add_argument("--quick", action="store_true", help="llama and gemma2 on hf and pp1, 3 cost rounds")
    ap.add_argument("--repeats", type=int, default=10, help="timed rounds of the cost (default 10)")
    ap.add_argument(
        "--cost-arch", default="llama", choices=ARCHS, help="the cost's architecture (default llama)"
    )
    ap.add_argument("--cost-tokens", type=int, default=32, help="new tokens per cost run (default 32)")
    ap.add_argument("--cost-invokes", type=int, default=4, help="invokes per cost run (default 4)")
    ap.add_argument("--no-cost", action="store_true", help="skip the cost measurement")
    ap.add_argument("--cost-only", action="store_true", help="only the cost measurement")
    ap.add_argument("--write", action="store_true", help="update the section in docs/performance.md")
    args = ap.parse_args()
    if args.quick:
        args.archs = args.archs or QUICK_ARCHS
        args.engines = args.engines or QUICK_ENGINES
        if "--repeats" not in sys.argv:
            args.repeats = 3
    args.explicit_engines = args.engines is not None
    args.archs = args.archs or ARCHS
    args.engines = args.engines or ENGINES
    if args.repeats < 1 or args.cost_tokens < 1 or args.cost_invokes < 1:
        ap.error("--repeats, --cost-tokens and --cost-invokes must be positive")
    if args.no_cost and args.cost_only:
        ap.error("--no-cost and --cost-only exclude each other")
    return args


def main() -> int:
    args = parse_args()
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    uses_vllm = not args.no_cost or any(e != "hf" for e in args.engines)
    extra = {}
    if uses_vllm:
        import vllm

        from asyncpp.engines.vllm import console

        extra = {
            "vllm": vllm.__version__,
            "VLLM_CPU_OMP_THREADS_BIND": os.environ["VLLM_CPU_OMP_THREADS_BIND"],
            "OMP_WAIT_POLICY of vLLM's processes": console.child_env(False).get("OMP_WAIT_POLICY", "unset")
            if "OMP_WAIT_POLICY" not in os.environ
            else os.environ["OMP_WAIT_POLICY"],
        }
    import transformers

    extra["transformers"] = transformers.__version__
    info = bench_common.machine_info(extra=extra)

    engines: dict[str, list[str]] = {}
    skipped: list[str] = []
    for arch in args.archs:
        engines[arch] = []
        for eng in args.engines:
            if eng == "tp2pp2" and not args.explicit_engines and arch not in TP2PP2_ARCHS:
                continue
            engines[arch].append(eng)
    if not args.explicit_engines:
        left_out = [a for a in args.archs if a not in TP2PP2_ARCHS]
        if left_out:
            skipped.append(
                f"tp2pp2 for {', '.join(left_out)} (by default only for {', '.join(TP2PP2_ARCHS)})"
            )
    if args.cost_only:
        engines = {}

    cost: Cost | None = None
    if not args.no_cost:
        cost = Cost(args.cost_arch, args.cost_invokes, args.cost_tokens)
    cost_done = False

    def measure_cost(engine: Any) -> None:
        nonlocal cost_done
        assert cost is not None
        log(f"cost: {args.cost_arch} pp1, {args.repeats} rounds of std / raw / baseline")
        run_cost(engine, cost, args.repeats)
        cost_done = True

    cells: dict[tuple[str, str], Cell] = {}
    total = sum(len(v) for v in engines.values())
    k = 0
    for arch in engines:
        for eng in engines[arch]:
            k += 1
            log(f"{arch} {eng} ({k}/{total}): starting")
            t0 = perf()
            if eng == "hf":
                try:
                    cells[(arch, eng)] = run_hf(arch)
                except Exception as e:
                    traceback.print_exc(file=sys.stderr)
                    cells[(arch, eng)] = Cell(errors={"engine": f"the engine did not run: {short_error(e)}"})
            else:
                with_cost = cost is not None and not cost_done and arch == args.cost_arch and eng == "pp1"
                cells[(arch, eng)] = run_vllm(arch, eng, measure_cost if with_cost else None)
            log(f"{arch} {eng}: done in {perf() - t0:.0f} s")
    if cost is not None and not cost_done:
        log(f"cost: starting {args.cost_arch} pp1")
        try:
            engine = start_vllm(args.cost_arch, "pp1")
        except Exception as e:
            traceback.print_exc(file=sys.stderr)
            cost.error = f"the engine did not start: {short_error(e)}"
            cost.fails.append(f"cost: {cost.error}")
        else:
            try:
                measure_cost(engine)
            finally:
                engine.close()

    sections: list[tuple[str, str]] = []
    all_fails: list[str] = []
    if engines:
        agree, absd, eff, fails = report(list(engines), engines, cells)
        sections.append((SECTION, render(agree, absd, eff, fails, info, args, perf() - T0, skipped)))
        all_fails += fails
    if cost is not None:
        cost_text, fails = cost_report(cost)
        sections.append((COST_SECTION, render_cost(cost_text, fails, info, args, perf() - T0)))
        all_fails += fails
    for _, text in sections:
        print(text, flush=True)
    for f in all_fails:
        print(f"FAIL: {f}", file=sys.stderr)
    if args.write:
        for section, text in sections:
            bench_common.write_section(section, text)
            print(f"wrote {section!r} to {bench_common.DOC.relative_to(bench_common.ROOT)}")
    return 1 if all_fails else 0


if __name__ == "__main__":
    sys.exit(main())
