"""The tap set of a compiled vLLM engine, planned from a module tree (no engine needed), and the
tap operator itself in a model compiled by torch.compile (inductor), as vLLM compiles its model."""

from __future__ import annotations

import contextlib
import enum
import inspect
import re

import pytest
import torch
from torch import nn
from torch.fx.experimental.proxy_tensor import make_fx

from asyncpp.engines.vllm import taps
from asyncpp.kernel.errors import TapError, WriteError
from asyncpp.kernel.hooks import RunHooks
from asyncpp.kernel.interleaver import Interleaver
from asyncpp.kernel.traps import INPUT, INPUTS, OUTPUT, SKIP
from asyncpp.locations.footprint import block_footprint
from asyncpp.locations.tree import build_tree, tree_from_paths
from asyncpp.locations.validate import check_block_paths
from asyncpp.native import enabled
from asyncpp.native.controllers import Controllers

PATHS = [
    "",
    "model",
    "model.embed_tokens",
    "model.layers",
    "model.layers.0",
    "model.layers.0.self_attn",
    "model.layers.0.self_attn.o_proj",
    "model.layers.0.mlp",
    "model.layers.1",
    "model.layers.1.self_attn",
    "model.layers.1.self_attn.o_proj",
    "model.layers.1.mlp",
    "model.norm",
    "logits_processor",
    "sampler",
]
TYPES = (
    ["LlamaForCausalLM", "LlamaModel", "Embedding", "ModuleList"]
    + ["Layer", "Attention", "Linear", "MLP"] * 2
    + ["RMSNorm", "LogitsProcessor", "Sampler"]
)


def plan(*patterns: str) -> taps.TapPlan:
    return taps.TapPlan(PATHS, TYPES, ["model"], patterns)


def test_default_taps_are_the_compiled_models_children_and_each_decoder_layer():
    p = plan()
    assert p.tap_paths == ["model.embed_tokens", "model.layers.0", "model.layers.1", "model.norm"]
    assert p.describe() == "model.embed_tokens, model.layers.{0..1}, model.norm"
    assert p.inside == frozenset(range(1, 13))  # everything under model, not the sampler


def test_default_taps_find_a_layer_list_held_deeper_in_the_compiled_model():
    paths = [
        "",
        "model",
        "model.decoder",
        "model.decoder.embed_tokens",
        "model.decoder.layers",
        "model.decoder.layers.0",
        "model.decoder.layers.0.experts",
        "model.decoder.layers.0.experts.0",
        "model.decoder.layers.1",
        "model.decoder.final_layer_norm",
        "lm_head",
    ]
    types = ["OPTForCausalLM", "OPTModel", "OPTDecoder", "Embedding", "ModuleList", "Layer"]
    types += ["ModuleList", "Expert", "Layer", "LayerNorm", "Linear"]
    p = taps.TapPlan(paths, types, ["model"], [])
    assert p.tap_paths == [
        "model.decoder",
        "model.decoder.embed_tokens",
        "model.decoder.layers.0",
        "model.decoder.layers.1",
        "model.decoder.final_layer_norm",
    ]  # the experts' list, held by a layer, is no layer list


def test_patterns_add_output_and_input_taps():
    p = plan("model.layers.*.mlp", "**.o_proj.input")
    assert "model.layers.0.mlp" in p.tap_paths and "model.layers.1.mlp" in p.tap_paths
    assert "model.layers.1.self_attn.o_proj.input" in p.tap_paths
    assert p.error() is None
    o_proj = PATHS.index("model.layers.1.self_attn.o_proj")
    assert p.refuse(o_proj, INPUT) is None
    assert isinstance(p.refuse(o_proj, OUTPUT), TapError)  # tapped at its input only


def test_patterns_pass_over_module_containers_which_are_never_called():
    p = plan("**.inputs", "model.*")
    assert "model.layers.inputs" not in p.tap_paths and "model.layers" not in p.tap_paths
    assert "model.layers.0.inputs" in p.tap_paths and "model.embed_tokens" in p.tap_paths
    assert "'model.layers'" in plan("model.layers").error()  # named alone: it matches nothing


def test_a_pattern_naming_no_compiled_module_is_an_error():
    p = plan("model.layers.*.mpl")
    msg = p.error()
    assert "'model.layers.*.mpl'" in msg and "matches no module" in msg and "model.embed_tokens" in msg


def test_refusals_name_the_location_the_taps_and_the_option():
    p = plan()
    mlp = PATHS.index("model.layers.0.mlp")
    msg = str(p.refuse(mlp, OUTPUT))
    assert msg.startswith("model.layers.0.mlp.output is not a tap")
    assert "model.layers.{0..1}" in msg and "taps=['model.layers.0.mlp']" in msg and "mode='eager'" in msg
    assert "taps=['model.layers.0.mlp.input']" in str(p.refuse(mlp, INPUT))
    layer = PATHS.index("model.layers.0")
    assert p.refuse(layer, OUTPUT) is None
    for kind in (INPUTS, SKIP):
        assert "mode='eager'" in str(p.refuse(layer, kind))
    assert "m.output" in str(p.refuse(PATHS.index("model"), OUTPUT))
    for outside in ("", "logits_processor", "sampler"):
        assert p.refuse(PATHS.index(outside), INPUTS) is None  # served by controllers, as in eager


def test_an_auto_plan_runs_eagerly_what_reaches_past_its_taps():
    async def on_taps(m):
        for layer in m.model.layers:
            await layer.output
        return await m.logits, await m.inputs

    async def on_a_sub_module(m, i):
        return await m.model.layers[i].mlp.output

    async def inputs_of_a_layer(m):
        return await m.model.layers[0].inputs

    p = taps.TapPlan(PATHS, TYPES, ["model"], [], auto=True)
    assert not p.needs_eager(block_footprint(on_taps))
    assert p.needs_eager(block_footprint(on_a_sub_module, (0,)))
    assert p.needs_eager(block_footprint(inputs_of_a_layer))
    assert p.needs_eager(None)  # a block whose code cannot be read
    tapped = taps.TapPlan(PATHS, TYPES, ["model"], ["model.layers.*.mlp"], auto=True)
    assert not tapped.needs_eager(block_footprint(on_a_sub_module, (1,)))
    mlp = PATHS.index("model.layers.0.mlp")
    assert "mode='auto'" in str(p.refuse(mlp, OUTPUT))
    p.eager_now = True  # an eager step serves every location
    assert p.refuse(mlp, OUTPUT) is None and p.refuse(PATHS.index("model.layers.0"), INPUTS) is None


def test_a_compiled_plan_refuses_at_invoke_the_waits_a_block_is_sure_to_make():
    refuse = plan().refuse

    async def sure(m):
        h, _ = await m.model.layers[0].output  # a tap
        return await m.model.layers[1].mlp.output  # no tap, and on every path through the block

    async def inputs(m):
        return await m.model.layers[0].inputs

    async def skip(m):
        await m.model.embed_tokens.output  # a tap
        await m.model.layers[1].mlp.skip(None)

    async def at(m):
        return await m.model.layers[1].self_attn.o_proj.output.at(1)

    async def write(m):
        await m.model.layers[1].mlp.output.set(None)

    async def maybe(m, flag, i):
        if flag:
            await m.model.layers[1].mlp.output  # a branch: not sure to run
        await m.model.layers[i].mlp.output  # an index known at run time
        try:
            await m.model.layers[0].mlp.output
        except LookupError:  # (TapError is one): the block handles it
            pass
        unused = m.model.layers[0].mlp.output  # a location not awaited
        return unused, await m.model.layers[0].output, await m.logits, await m.output

    with pytest.raises(TapError) as info:
        check_block_paths(sure, tree_from_paths(list(zip(PATHS, TYPES))), refuse)
    lines, first = inspect.getsourcelines(sure)
    line = first + next(i for i, text in enumerate(lines) if "layers[1].mlp" in text)
    assert str(info.value) == str(refuse(PATHS.index("model.layers.1.mlp"), OUTPUT)) + (
        f"\n  in block {sure.__qualname__}, {__file__}:{line}"
    )
    for block, what in [
        (inputs, "model.layers.0.inputs is not a tap"),
        (skip, "model.layers.1.mlp.skip:"),
        (at, "model.layers.1.self_attn.o_proj.output is not a tap"),
        (write, "model.layers.1.mlp.output is not a tap"),
    ]:
        with pytest.raises(TapError, match=re.escape(what)):
            check_block_paths(block, tree_from_paths(list(zip(PATHS, TYPES))), refuse)
    check_block_paths(maybe, tree_from_paths(list(zip(PATHS, TYPES))), refuse)  # left to the await
    check_block_paths(sure, tree_from_paths(list(zip(PATHS, TYPES))))  # an engine refusing nothing


def test_pattern_matching_is_name_by_name():
    assert taps.matches("model.layers.*.mlp", "model.layers.12.mlp")
    assert not taps.matches("model.*", "model.layers.0")
    assert taps.matches("**.mlp", "model.layers.0.mlp")
    assert taps.matches("model.layers.1?", "model.layers.10")
    with pytest.raises(ValueError, match="not a module path pattern"):
        taps.check_patterns(["model..layers"])


def test_summaries_fold_numbered_names():
    assert taps.summarize(["a.0.b", "a.1.b", "a.3.b", "c"]) == "a.{0,1,3}.b, c"
    assert taps.summarize(["x.0.y.1"]) == "x.0.y.1"


# --- the operator in a compiled graph ------------------------------------------------------------


class Layer(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x, r):
        r = x + r
        return torch.relu(self.lin(input=r)), r  # (by keyword: for the inputs taps' keywords)


class Stack(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([Layer() for _ in range(3)])

    def forward(self, x):
        r = torch.zeros_like(x)
        for layer in self.layers:
            x, r = layer(x, r)
        return x + r


class Outer(nn.Module):
    """The top-level model, run eagerly with a controller; its ``inner`` stack runs compiled."""

    def __init__(self):
        super().__init__()
        self.inner = Stack()

    def forward(self, x):
        return self.inner(x)


@contextlib.contextmanager
def compiled_outer(
    choice: str,
    monkeypatch,
    batch: int,
    inputs: bool = False,
    warm: torch.Tensor | None = None,
    patterns: tuple[str, ...] = (),
    make: type[nn.Module] | None = None,
):
    """An ``Outer`` (or ``make()``) whose stack is compiled by inductor with its layers tapped, served by a real
    interleaver through real controllers (``choice``): yields the model, its tree and the kernel.
    ``warm``: an input the model runs on first, before the taps are bound (the graph is compiled
    then; else at the first forward the caller runs, with the taps bound)."""
    monkeypatch.setenv("ASYNCPP_CONTROLLERS", choice)
    torch.manual_seed(0)
    model = (make or Outer)().eval()
    tree, modules, paths = build_tree(model, {})
    plan = taps.TapPlan(
        paths,
        [type(m).__name__ for m in modules],
        ["inner"],
        [*(["inner.layers.*.input"] if inputs else []), *patterns],
    )
    names = taps.tap_modules(modules, paths, plan)
    model.inner.forward = torch.compile(model.inner.forward, backend="inductor", dynamic=True)
    if warm is not None:
        with torch.inference_mode():
            model(warm)
        for (i, kind), why in taps.dropped().items():  # (as vLLM's worker does after the trace)
            plan.drop(i, kind, why)
    controllers = Controllers([m if i not in plan.inside else None for i, m in enumerate(modules)])
    hooks = RunHooks(refuse=plan.refuse, refuse_at=plan.refuse_at)
    kernel = Interleaver(paths, batch, step_index=0, hooks=hooks, link=controllers.link)
    controllers.install(kernel)
    taps.bind(kernel, controllers, plan.sites, names)
    try:
        yield model, tree, kernel
    finally:
        taps.unbind()
        controllers.remove()


def compiled_run(
    choice: str, monkeypatch, blocks, x: torch.Tensor, inputs: bool = False, patterns: tuple[str, ...] = ()
):
    """Run ``blocks`` (pairs of block function and rows) on a compiled ``Outer``
    (:func:`compiled_outer`) in one forward."""
    with compiled_outer(choice, monkeypatch, x.shape[0], inputs, patterns=patterns) as (model, tree, kernel):
        with kernel.active(), torch.inference_mode():
            started = [kernel.start(fn(tree), n, rows) for n, (fn, rows) in enumerate(blocks)]
            out = model(x)
            kernel.finish()
    return model, out, started


CHOICES = ["native", "python"] if enabled() else ["python"]


@pytest.mark.parametrize("choice", CHOICES)
def test_compiled_taps_serve_reads_edits_and_replacements_per_rows(choice, monkeypatch):
    x = torch.randn(5, 8)

    async def reader(m):
        return [(await layer.output)[0].clone() for layer in m.inner.layers]

    async def editor(m):
        h, r = await m.inner.layers[0].output
        h += 100.0  # in place: lands in the graph's tensor, these rows only
        h, r = await m.inner.layers[1].output
        await m.inner.layers[1].output.set((h * 0, r))
        return (await m.inner.layers[2].output)[1].clone()

    model, out, (a, b) = compiled_run(choice, monkeypatch, [(reader, (0, 2)), (editor, (2, 5))], x)
    assert a.error is None and b.error is None, (a.error, b.error)

    def edit0(mod, args, o):
        h = o[0].clone()
        h[2:5] += 100.0
        return h, o[1]

    def edit1(mod, args, o):
        h = o[0].clone()
        h[2:5] = 0
        return h, o[1]

    torch.manual_seed(0)
    ref_model = Outer().eval()
    seen = []
    hooks = [
        ref_model.inner.layers[0].register_forward_hook(edit0),
        ref_model.inner.layers[1].register_forward_hook(edit1),
    ] + [layer.register_forward_hook(lambda mod, args, o: seen.append(o)) for layer in ref_model.inner.layers]
    with torch.no_grad():
        ref = ref_model(x)
    for h in hooks:
        h.remove()
    torch.testing.assert_close(out, ref)
    for got, want in zip(a.result, seen, strict=True):
        torch.testing.assert_close(got, want[0][0:2])
    torch.testing.assert_close(b.result, seen[2][1][2:5])
    assert not torch.allclose(out, model(x))  # (the edits changed the output)


@pytest.mark.parametrize("choice", CHOICES)
def test_an_untapped_compiled_location_is_refused_after_a_fast_served_read(choice, monkeypatch):
    async def block(m):
        await m.inner.layers[0].output  # a tap (served natively where the fast path may)
        return await m.inner.layers[1].lin.output  # not a tap: refused, not parked for ever

    _, _, (blk,) = compiled_run(choice, monkeypatch, [(block, None)], torch.randn(3, 8))
    assert isinstance(blk.error, TapError), blk.error
    assert "inner.layers.1.lin.output is not a tap" in str(blk.error)


@pytest.mark.parametrize("choice", CHOICES)
def test_compiled_input_taps_serve_the_first_argument(choice, monkeypatch):
    x = torch.randn(4, 8)

    async def block(m):
        first = await m.inner.layers[2].input
        kept = first.clone()
        first.zero_()  # an in-place edit of the argument the layer runs on
        return kept

    _, out, (blk,) = compiled_run(choice, monkeypatch, [(block, None)], x, inputs=True)
    assert blk.error is None, blk.error
    torch.manual_seed(0)
    ref_model = Outer().eval()
    ref_model.inner.layers[2].register_forward_pre_hook(lambda mod, a: (a[0] * 0, a[1]))
    with torch.no_grad():
        ref = ref_model(x)
    torch.testing.assert_close(out, ref)


@pytest.mark.parametrize("choice", CHOICES)
def test_compiled_inputs_taps_serve_every_argument(choice, monkeypatch):
    x = torch.randn(5, 8)

    async def reader(m):  # rows 0..2: reads layer 1's arguments, zeroes its residual in place
        args, kwargs = await m.inner.layers[1].inputs
        kept = [a.clone() for a in args]
        args[1].zero_()
        return kept, kwargs, (await m.inner.layers[1].input).clone()  # (served by the same tap)

    async def writer(m):  # rows 2..5: replaces layer 2's first argument
        args, kwargs = await m.inner.layers[2].inputs
        await m.inner.layers[2].inputs.set(((args[0] * 0 + 1, args[1]), kwargs))

    _, out, (a, b) = compiled_run(
        choice, monkeypatch, [(reader, (0, 2)), (writer, (2, 5))], x, patterns=("inner.layers.*.inputs",)
    )
    assert a.error is None and b.error is None, (a.error, b.error)

    def edit1(mod, args):
        r = args[1].clone()
        r[0:2] = 0
        return args[0], r

    def edit2(mod, args):
        h = args[0].clone()
        h[2:5] = 1
        return h, args[1]

    torch.manual_seed(0)
    ref_model = Outer().eval()
    seen = []
    ref_model.inner.layers[1].register_forward_pre_hook(
        lambda mod, args: seen.append([t.clone() for t in args])
    )
    ref_model.inner.layers[1].register_forward_pre_hook(edit1)
    ref_model.inner.layers[2].register_forward_pre_hook(edit2)
    with torch.no_grad():
        ref = ref_model(x)
    torch.testing.assert_close(out, ref)
    kept, kwargs, first = a.result
    assert kwargs == {} and len(kept) == 2
    torch.testing.assert_close(kept[0], seen[0][0][0:2])
    torch.testing.assert_close(kept[1], seen[0][1][0:2])
    torch.testing.assert_close(first, seen[0][0][0:2])
    p = plan("model.layers.*.inputs")
    assert "model.layers.0.inputs" in p.tap_paths
    layer = PATHS.index("model.layers.1")
    assert p.refuse(layer, INPUTS) is None and p.refuse(layer, INPUT) is None
    assert "taps=['model.layers.1.inputs']" in str(plan().refuse(layer, INPUTS))


@pytest.mark.parametrize("choice", CHOICES)
def test_compiled_inputs_taps_serve_keyword_arguments(choice, monkeypatch):
    x = torch.randn(5, 8)

    async def reader(m):  # rows 0..2: the keyword argument, as (args, kwargs) and as .input
        args, kwargs = await m.inner.layers[1].lin.inputs
        return args, {k: v.clone() for k, v in kwargs.items()}, (await m.inner.layers[1].lin.input).clone()

    async def writer(m):  # rows 2..5: replaces it
        _, kwargs = await m.inner.layers[1].lin.inputs
        await m.inner.layers[1].lin.inputs.set(((), {"input": kwargs["input"] * 0 + 1}))

    async def renamer(m):  # rows 2..5: a replacement with other keywords fails this block only
        await m.inner.layers[2].lin.inputs.set(((), {"other": torch.ones(3, 8)}))

    _, out, (a, b, c) = compiled_run(
        choice,
        monkeypatch,
        [(reader, (0, 2)), (writer, (2, 5)), (renamer, (2, 5))],
        x,
        patterns=("inner.layers.*.lin.inputs",),
    )
    assert a.error is None and b.error is None, (a.error, b.error)
    assert isinstance(c.error, WriteError) and "keys ['other'] differ from ['input']" in str(c.error)

    torch.manual_seed(0)
    ref_model = Outer().eval()
    seen = []

    def edit(mod, args, kwargs):  # in place, as at a tap: the layer's residual is the same tensor
        seen.append(kwargs["input"].clone())
        kwargs["input"][2:5] = 1

    ref_model.inner.layers[1].lin.register_forward_pre_hook(edit, with_kwargs=True)
    with torch.no_grad():
        ref = ref_model(x)
    torch.testing.assert_close(out, ref)
    args, kwargs, first = a.result
    assert args == () and list(kwargs) == ["input"]
    torch.testing.assert_close(kwargs["input"], seen[0][0:2])
    torch.testing.assert_close(first, seen[0][0:2])


class Order(enum.IntEnum):
    FIRST = 1


def test_an_inputs_tap_needs_arguments_it_can_carry():
    forward = taps.tapped_forward(lambda x, m=None: x, 3, "mod.x", output=False, inputs=True)
    with pytest.raises(
        TapError, match=r"mod\.x\.inputs cannot be a tap: the module is called with \(Tensor, m=ReLU\)"
    ):
        forward(torch.ones(2), m=nn.ReLU())  # a module argument
    with pytest.raises(TapError, match=r"called with \(float, str\); .* at least one tensor"):
        forward(1.0, "a")
    with pytest.raises(TapError, match=r"called with \(Tensor, m=Order\)"):
        forward(torch.ones(2), m=Order.FIRST)  # (an enum would come back a plain int)
    taps.tap_modules([None] * len(PATHS), PATHS, plan())  # (a new model: forgets what was left out)
    optional = taps.tapped_forward(
        lambda x, m=None: x * 2, 3, "mod.x", output=False, inputs=True, optional=frozenset([INPUTS])
    )
    torch.testing.assert_close(optional(torch.ones(2), m=nn.ReLU()), torch.full((2,), 2.0))
    assert list(taps.dropped()) == [(3, INPUTS)] and "(Tensor, m=ReLU)" in taps.dropped()[(3, INPUTS)]


@pytest.mark.parametrize(
    "call",
    [
        ((1, True, False, None, -7, 2.5, -0.0, "héllo", ""), {}),
        ((), {"a": [1, (2.0, "x")], "b": {"k": None, "j": [[]]}, "c": ()}),
        ((3,), {"n": 2**40, "f": float("inf")}),
    ],
    ids=["scalars", "containers", "large"],
)
def test_a_general_call_is_put_back_together_as_it_was(call):
    args, kwargs = call
    t = torch.ones(2)
    args = (t, *args)
    values, layout = taps.flatten_args(args, kwargs, "p")
    assert layout[0] == taps.GENERAL and values == [t]
    again_args, again_kwargs = taps._assemble_call(values, layout, ())
    assert again_args == args and again_kwargs == kwargs
    assert again_args[0] is t
    assert [type(x) for x in again_args] == [type(x) for x in args]


class Gate(nn.Module):
    def forward(self, h, owner):  # called with a module: cannot be an inputs tap
        return torch.relu(h) * owner.lin.weight[0, 0]


class MixedLayer(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.gate = Gate()

    def forward(self, x, pair, use_cache=False, scale=1.0, name="", **extra):
        a, b = pair
        h = self.lin(x) * scale + a - b
        if use_cache and name.startswith("layer"):
            h = h + 1
        return self.gate(h, self) + extra["bias"][0] * extra["n"]


class MixedStack(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([MixedLayer() for _ in range(2)])

    def forward(self, x):
        for i, layer in enumerate(self.layers):
            bias = [x.sum(-1, keepdim=True)]
            x = layer(
                x, (x * 0.5, x * 0.25), use_cache=True, scale=0.5, name=f"layer{i}", bias=bias, n=x.shape[0]
            )
        return x


class MixedOuter(nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = MixedStack()

    def forward(self, x):
        return self.inner(x)


@pytest.mark.parametrize("choice", CHOICES)
def test_compiled_inputs_taps_serve_calls_with_constants_and_containers(choice, monkeypatch):
    """A call with a tuple of tensors, a bool, a float, a string, a list and an integer the graph
    keeps symbolic is an inputs tap: read as (args, kwargs), its tensors edited in place and
    replaced per rows, its constants not replaceable; a module the wildcard reaches whose call
    has a module argument is left out, and a wait there is refused with why."""
    x = torch.randn(5, 8)

    async def reader(m):  # rows 0..2: reads layer 1's call, edits a tensor inside its tuple
        args, kwargs = await m.inner.layers[1].inputs
        seen = ([a.clone() for a in args[1]], {k: v for k, v in kwargs.items() if k != "bias"})
        args[1][0].add_(1.0)
        return seen, kwargs["bias"][0].clone()

    async def writer(m):  # rows 2..5: replaces the tensor in the keyword list
        args, kwargs = await m.inner.layers[1].inputs
        await m.inner.layers[1].inputs.set((args, {**kwargs, "bias": [kwargs["bias"][0] * 0]}))

    async def flipper(m):  # a constant of the graph cannot be replaced: this block fails
        args, kwargs = await m.inner.layers[0].inputs
        await m.inner.layers[0].inputs.set((args, {**kwargs, "use_cache": False}))

    async def gated(m):
        return await m.inner.layers[0].gate.inputs

    torch._dynamo.reset()  # (traced anew: what is left out is found while dynamo traces)
    with compiled_outer(
        choice, monkeypatch, x.shape[0], warm=torch.randn(3, 8), patterns=("**.inputs",), make=MixedOuter
    ) as (model, tree, kernel):
        with kernel.active(), torch.inference_mode():
            blocks = [(reader, (0, 2)), (writer, (2, 5)), (flipper, (2, 5)), (gated, None)]
            a, b, c, d = [kernel.start(fn(tree), n, rows) for n, (fn, rows) in enumerate(blocks)]
            out = model(x)
            kernel.finish()
    assert a.error is None and b.error is None, (a.error, b.error)
    assert isinstance(c.error, WriteError) and "shared by the whole batch" in str(c.error)
    assert isinstance(d.error, TapError)
    msg = str(d.error)
    assert "inner.layers.0.gate.inputs is not a tap" in msg and "left out" in msg
    assert "called with (Tensor, MixedLayer)" in msg and "mode='eager'" in msg

    torch.manual_seed(0)
    ref_model = MixedOuter().eval()
    seen = []

    def edit(mod, args, kwargs):
        seen.append(([t.clone() for t in args[1]], dict(kwargs), kwargs["bias"][0].clone()))
        args[1][0][0:2] += 1.0
        kwargs["bias"][0][2:5] = 0

    ref_model.inner.layers[1].register_forward_pre_hook(edit, with_kwargs=True)
    with torch.no_grad():
        ref = ref_model(x)
    torch.testing.assert_close(out, ref)
    (pair, consts), bias = a.result
    torch.testing.assert_close(pair[0], seen[0][0][0][0:2])
    torch.testing.assert_close(pair[1], seen[0][0][1][0:2])
    torch.testing.assert_close(bias, seen[0][2][0:2])
    assert consts == {"use_cache": True, "scale": 0.5, "name": "layer1", "n": 5}


def test_an_output_that_cannot_be_a_tap_is_named():
    with pytest.raises(TapError, match="mod.x cannot be a tap: its output is a dict"):
        taps.flatten({"a": torch.ones(1)}, "mod.x")
    assert taps.flatten((torch.ones(1), None), "p")[1] == [1, 0]


@pytest.mark.parametrize("out", [(1, 2), (1, None, 2), (None, 3), (4,)], ids=repr)
def test_a_tapped_tuple_is_put_back_together_as_it_was(out):
    tensors = tuple(None if x is None else torch.full((1,), float(x)) for x in out)
    values, layout = taps.flatten(tensors, "p")
    again = taps._assemble(values, layout)
    assert len(again) == len(tensors)
    assert all(a is b for a, b in zip(again, tensors, strict=True))


@pytest.mark.skipif(not enabled(), reason="the native extension is off")
def test_the_native_tap_kernel_counts_cold_calls_and_hands_hot_ones_to_python(monkeypatch):
    """The C++ kernel of ``asyncpp::tap`` (bound while native controllers serve the taps) makes
    the check and the count of a tap nobody waits on itself, calls ``taps._tap`` with the very
    same tensors for the others, lets its errors through, and is gone after ``unbind``."""
    from asyncpp.native import load

    native = load()
    op = torch.ops.asyncpp.tap.default
    hot_in, hot_out, counts, calls = set(), {5}, [0] * 8, []

    def slow(values, site, layout, stage):
        calls.append((values, site, layout, stage))
        if site == 6:
            raise ValueError("the Python kernel failed")

    native.tap_register()
    native.tap_bind(hot_in, hot_out, counts, slow)
    assert "tap_op.cpp" in torch._C._dispatch_dump_table("asyncpp::tap")
    try:
        h, r = torch.randn(3, 4), torch.randn(3, 4)
        with torch.inference_mode():
            for _ in range(3):
                op([h, r], 3, [1, 1], OUTPUT)
            op([h], 2, [taps.BARE], INPUT)  # a cold input tap: neither counted nor passed on
            assert counts == [0, 0, 0, 3, 0, 0, 0, 0] and calls == []
            op([h, r], 5, [1, 0, 1], OUTPUT)
            ((values, site, layout, stage),) = calls
            assert values[0] is h and values[1] is r and (site, layout, stage) == (5, [1, 0, 1], OUTPUT)
            hot_in.add(2)
            op([h], 2, [taps.BARE], INPUT)
            assert calls[-1][1:] == (2, [taps.BARE], INPUT)
            hot_out.add(6)
            with pytest.raises(ValueError, match="the Python kernel failed"):
                op([h], 6, [taps.BARE], OUTPUT)
            native.tap_active(False)  # standing aside: nothing served, nothing counted
            op([h, r], 3, [1, 1], OUTPUT)
            op([h, r], 5, [1, 1], OUTPUT)
            assert counts[3] == 3 and len(calls) == 3
    finally:
        native.tap_unbind()
        native.tap_register(False)
    # the operator's Python kernel serves CPU tensors again
    assert "tap_op.cpp" not in torch._C._dispatch_dump_table("asyncpp::tap")


def traced_tap(t: torch.Tensor) -> torch.Tensor:
    torch.ops.asyncpp.tap.default([t], 3, [taps.BARE], OUTPUT)
    return t + 1


@pytest.mark.skipif(not enabled(), reason="the native extension is not built here")
def test_compiled_taps_are_served_at_the_native_front_door_not_through_torchs_dispatcher(monkeypatch):
    """With native controllers, the compiled graph's calls of ``torch.ops.asyncpp.tap.default``
    reach the native front door, which serves cold and hot taps alike without a trip through
    torch's dispatcher, and unbind puts torch's entry back. (The tests above compile their graph
    with the front door in place: tracing still sees the operator.)"""
    from asyncpp.native import load

    x = torch.randn(4, 8)
    overload = torch.ops.asyncpp.tap.default
    entry = overload._op

    async def reader(m):
        return (await m.inner.layers[1].output)[0].clone()

    with compiled_outer("native", monkeypatch, x.shape[0], warm=x) as (model, tree, kernel):
        assert overload._op is load().tap_front
        for mode in ("real", "fake", "symbolic"):  # tracing passes the call on: the graph has it
            graph = make_fx(traced_tap, tracing_mode=mode)(torch.randn(2, 8))
            assert [n.target for n in graph.graph.nodes if n.op == "call_function"][0] is overload
        before = kernel.counts[3]
        with torch.inference_mode():
            overload([torch.randn(2, 8)], 3, [taps.BARE], stage=OUTPUT)  # keywords: via the dispatcher
        assert kernel.counts[3] == before + 1
        with torch.profiler.profile() as prof, kernel.active(), torch.inference_mode():
            blk = kernel.start(reader(tree), 0, None)
            out = model(x)
            kernel.finish()
        assert blk.error is None, blk.error
    assert overload._op is entry
    assert [e.name for e in prof.events() if "asyncpp" in e.name] == []
    with compiled_outer("python", monkeypatch, x.shape[0]):
        assert overload._op is entry  # the Python twin serves through the dispatcher
    ref_seen = []
    torch.manual_seed(0)
    ref_model = Outer().eval()
    ref_model.inner.layers[1].register_forward_hook(lambda mod, a, o: ref_seen.append(o[0]))
    with torch.no_grad():
        torch.testing.assert_close(out, ref_model(x))
    torch.testing.assert_close(blk.result, ref_seen[0])
