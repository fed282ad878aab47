"""The invoke-time path check follows Python: methods, partials, inner scopes and branches.

Every block here runs for real on the embedded tiny Llama (and, where a block chooses between
architectures, on a tiny GPT-2 too); results are compared with plain blocks on the same prompt.
"""

from __future__ import annotations

import functools
import inspect

import pytest
import torch

import asyncpp

PROMPT = "Hello"


@pytest.fixture(scope="module")
def gpt2(tiny):
    transformers = pytest.importorskip("transformers")
    _, tok = tiny
    config = transformers.GPT2Config(
        n_layer=2, n_head=2, n_embd=32, n_positions=64, vocab_size=len(tok), bos_token_id=0, eos_token_id=0
    )
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config).eval()
    eng = asyncpp.LocalEngine(model, tok)
    yield eng
    eng.close()


def _line_of(fn, text: str) -> int:
    """The file line of the first line of ``fn``'s source containing ``text``."""
    lines, first = inspect.getsourcelines(fn)
    return first + next(i for i, line in enumerate(lines) if text in line)


def _suffix(fn, text: str) -> str:
    return f"\n  in block {fn.__qualname__}, {__file__}:{_line_of(fn, text)}"


async def layer_output(m, layer):
    return await m.model.layers[layer].output


def _run(engine, block, *args, **kwargs):
    with asyncpp.trace(engine) as t:
        h = t.invoke(PROMPT, block, *args, **kwargs)
    return h


# --- bound methods -------------------------------------------------------------------------------


class Probe:
    def __init__(self, layer: int, scale: float = 1.0):
        self.layer, self.scale = layer, scale

    async def block(self, m):
        return (await m.model.layers[self.layer].output) * self.scale

    async def at(self, layer, m):  # the tree after a bound positional (used through a partial)
        return await m.model.layers[layer + self.layer].output

    async def typo(self, m):
        return await m.model.layerz[self.layer].output


def test_bound_method_block_runs(engine):
    want = _run(engine, layer_output, 2).result
    h = _run(engine, Probe(2, scale=3.0).block)
    assert h.name == "Probe.block"
    torch.testing.assert_close(h.result, want * 3.0, rtol=0, atol=0)


def test_bound_method_block_paths_are_checked_on_its_tree_parameter(engine):
    probe = Probe(1)
    with pytest.raises(asyncpp.PathError) as info:
        with asyncpp.trace(engine) as t:
            t.invoke(PROMPT, probe.typo)
    assert str(info.value) == (
        "the model has no module 'model.layerz'; did you mean 'layers'? "
        "(children of model: embed_tokens, layers, norm, rotary_emb)" + _suffix(Probe.typo, "layerz")
    )


# --- functools.partial ---------------------------------------------------------------------------


async def scaled(m, layer, scale=1.0):
    return (await m.model.layers[layer].output) * scale


async def at_layer(layer, m):
    return await m.model.layers[layer].output


async def partial_typo(layer, m):
    return await m.model.layers[layer].mpl.output


def test_partial_blocks_run_with_their_own_name(engine):
    want = _run(engine, layer_output, 1).result
    with asyncpp.trace(engine) as t:
        a = t.invoke(PROMPT, functools.partial(scaled, scale=2.0), 1)
        b = t.invoke(PROMPT, functools.partial(at_layer, 1))
        c = t.invoke(PROMPT, functools.partial(Probe(1).at, 0))  # at(self, 0, m): layer 0 + 1
    assert a.name == "partial(scaled)"
    assert b.name == "partial(at_layer)"
    assert c.name == "partial(Probe.at)"
    assert a.result.shape == b.result.shape == c.result.shape == want.shape  # each its own row
    torch.testing.assert_close(a.result, want * 2.0)  # (one batch of three rows: close, not equal)
    torch.testing.assert_close(b.result, want)
    torch.testing.assert_close(c.result, want)


def test_partial_blocks_have_their_paths_checked(engine):
    with pytest.raises(
        asyncpp.PathError, match=r"model\.layers\.0 and its siblings has a child 'mpl'"
    ) as info:
        with asyncpp.trace(engine) as t:
            t.invoke(PROMPT, functools.partial(partial_typo, 0))  # the tree is its second parameter
    assert str(info.value).endswith(_suffix(partial_typo, ".mpl."))


# --- names bound in inner scopes, and rebound in the block ---------------------------------------


def test_inner_scopes_that_rebind_the_tree_name_are_not_the_tree(engine):
    model = engine.model

    async def block(m, torch_model):
        out = await m.model.layers[0].output
        norms = [m.weight.norm() for m in torch_model.modules() if hasattr(m, "weight")]
        # sure to run (a literal of two), and `m` is the comprehension's own there too
        shapes = [m.weight.shape for m in (torch_model.lm_head, torch_model.model.embed_tokens)]
        by_size = sorted(torch_model.model.layers, key=lambda m: m.mlp.up_proj.weight.numel())

        def width(m):
            return m.embed_tokens.weight.shape[1]

        return out, torch.stack(norms), shapes, len(by_size), width(torch_model.model)

    h = _run(engine, block, model)
    out, norms, shapes, n_layers, width = h.result
    assert shapes == [model.lm_head.weight.shape, model.model.embed_tokens.weight.shape]
    want = torch.stack([mod.weight.norm() for mod in model.modules() if hasattr(mod, "weight")])
    torch.testing.assert_close(norms, want, rtol=0, atol=0)
    torch.testing.assert_close(out, _run(engine, layer_output, 0).result, rtol=0, atol=0)
    assert (n_layers, width) == (len(model.model.layers), model.config.hidden_size)


def test_a_block_that_rebinds_its_tree_name_runs(engine):
    model = engine.model

    async def block(m, torch_model):
        out = await m.model.layers[1].output
        m = torch_model  # from here on `m` is the torch model, not the tree
        return out.shape[-1] == m.model.embed_tokens.weight.shape[1]

    assert _run(engine, block, model).result is True


def test_a_comprehension_over_the_tree_is_still_checked(engine):
    async def over_a_typo(m):
        return [layer.path for layer in m.model.layerz]  # the first iterable is the block's scope

    async def in_the_element(m):
        return [(await m.model.layers[i].mpl.output) for i in range(2)]  # runs twice: sure to run

    with pytest.raises(asyncpp.PathError, match=r"no module 'model\.layerz'") as info:
        _run(engine, over_a_typo)
    assert str(info.value).endswith(_suffix(over_a_typo, "layerz"))
    with pytest.raises(
        asyncpp.PathError, match=r"no module of model\.layers\.0 and its siblings has a child 'mpl'"
    ):
        _run(engine, in_the_element)


# --- choosing between architectures --------------------------------------------------------------


async def by_ifexp(m, gpt2):
    layers = m.transformer.h if gpt2 else m.model.layers
    return await layers[0].output


async def by_if(m, gpt2):
    if gpt2:
        out = await m.transformer.h[0].output
    else:
        out = await m.model.layers[0].output
    return out


async def by_hasattr_and_early_return(m):
    if hasattr(m, "transformer"):
        return await m.transformer.h[0].output
    return await m.model.layers[0].output


async def by_try_attribute_error(m):
    try:
        layers = m.transformer.h
    except AttributeError:
        layers = m.model.layers
    return await layers[0].output


async def by_try_path_error(m):
    try:
        return await m.model.layers[0].output
    except asyncpp.PathError:
        return await m.transformer.h[0].output


async def by_and_or(m):
    layers = (getattr(m, "transformer", None) and m.transformer.h) or m.model.layers
    return await layers[0].output


async def llama_only(m):
    if not hasattr(m, "model"):
        raise ValueError("this block is for Llama models")
    return await m.model.layers[0].output


async def first_llama(m):
    return await m.model.layers[0].output


async def first_gpt2(m):
    return await m.transformer.h[0].output


BRANCHING = [
    by_ifexp,
    by_if,
    by_hasattr_and_early_return,
    by_try_attribute_error,
    by_try_path_error,
    by_and_or,
]


@pytest.mark.parametrize("block", BRANCHING, ids=lambda b: b.__name__)
def test_a_block_that_chooses_between_architectures_runs_on_both(engine, gpt2, block):
    args = (False,) if "gpt2" in inspect.signature(block).parameters else ()
    gargs = (True,) if args else ()
    llama, gpt = _run(engine, block, *args), _run(gpt2, block, *gargs)
    torch.testing.assert_close(llama.result, _run(engine, first_llama).result, rtol=0, atol=0)
    torch.testing.assert_close(gpt.result, _run(gpt2, first_gpt2).result, rtol=0, atol=0)
    assert llama.result.shape[-1] == 128 and gpt.result.shape[-1] == 32


def test_a_guard_that_raises_is_the_blocks_own_error(engine, gpt2):
    torch.testing.assert_close(_run(engine, llama_only).result, _run(engine, first_llama).result)
    with pytest.raises(ValueError, match="this block is for Llama models"):
        _run(gpt2, llama_only)


def test_hasattr_and_getattr_defaults_see_a_missing_module(engine):
    async def probe(m):
        await m.model.layers[0].output
        return hasattr(m, "transformer"), getattr(m.model, "h", None), hasattr(m.model, "layers")

    assert _run(engine, probe).result == (False, None, True)


# --- what is not proven is checked when it runs, with the same message ---------------------------


async def misspelled_branch(m, gpt2):
    if gpt2:
        return await m.transformer.hh[0].output
    return await m.model.layers[0].output


async def misspelled_straight(m):
    return await m.transformer.hh[0].output


def test_an_unproven_misspelling_fails_when_it_runs_with_the_static_message(engine, gpt2):
    with pytest.raises(asyncpp.PathError) as static:
        _run(gpt2, misspelled_straight)  # straight-line: refused at invoke
    # in a branch: the invoke is accepted, and the branch that is right for a Llama runs fine
    assert _run(engine, misspelled_branch, False).result.shape[-1] == 128
    with pytest.raises(asyncpp.PathError) as run_time:  # at the with exit: the run's error
        with asyncpp.trace(gpt2) as t:
            h = t.invoke(PROMPT, misspelled_branch, True)
            ok = t.invoke(PROMPT, first_gpt2)
    assert isinstance(h.exception, asyncpp.PathError) and isinstance(h.exception, AttributeError)
    assert ok.exception is None and ok.result.shape[-1] == 32
    message = "the model has no module 'transformer.hh'; did you mean 'h'? (children of transformer: "
    assert str(static.value).startswith(message)
    assert str(static.value).endswith(_suffix(misspelled_straight, "hh"))
    assert run_time.value is h.exception
    assert str(run_time.value) == str(static.value).replace(
        _suffix(misspelled_straight, "hh"), _suffix(misspelled_branch, "hh")
    )


def test_a_path_built_at_run_time_names_the_block_and_line(engine):
    async def by_getattr(m, name):
        return await getattr(m.model, name).output

    async def by_index(m, k):
        return await m.model.layers[k].output

    with pytest.raises(asyncpp.PathError) as info:
        _run(engine, by_getattr, "layer")
    assert str(info.value) == (
        "the model has no module 'model.layer'; did you mean 'layers'? "
        "(children of model: embed_tokens, layers, norm, rotary_emb)" + _suffix(by_getattr, "getattr(m.model")
    )
    with pytest.raises(asyncpp.PathError, match=r"no module 'model\.layers\.7'") as info:
        _run(engine, by_index, 7)
    assert str(info.value).endswith(_suffix(by_index, "layers[k]"))


def test_a_loop_that_may_not_run_is_checked_when_it_runs(engine):
    async def loop(m, n):
        outs = [await m.model.layers[0].output]
        for i in range(n):
            outs.append(await m.model.layerz[i].output)
        return len(outs)

    assert _run(engine, loop, 0).result == 1  # the loop body never runs: nothing to refuse
    with pytest.raises(asyncpp.PathError, match=r"no module 'model\.layerz'") as info:
        _run(engine, loop, 2)
    assert str(info.value).endswith(_suffix(loop, "layerz"))


# --- straight-line misspellings still fail at invoke ---------------------------------------------


async def straight_typo(m):
    h = await m.model.layers[0].output
    return h + (await m.model.layerz[1].output)


async def typo_in_sure_loop(m):
    for layer in m.model.layers:  # a node with children: the body runs
        await m.model.layers[0].mpl.output
        await layer.output


async def typo_in_step_loop(m):
    async for _ in m.steps():  # step 0 always comes
        await m.model.norn.output


async def typo_under_no_grad(m):
    with torch.no_grad():
        return await m.lm_haed.output


async def typo_in_try_body_not_caught(m):
    try:
        return await m.model.layers[-1].mpl.output
    except KeyError:
        return None


@pytest.mark.parametrize(
    "block, message, text",
    [
        (straight_typo, "no module 'model.layerz'; did you mean 'layers'?", "layerz"),
        (typo_in_sure_loop, "no module 'model.layers.0.mpl'; did you mean 'mlp'?", "mpl"),
        (typo_in_step_loop, "no module 'model.norn'; did you mean 'norm'?", "norn"),
        (typo_under_no_grad, "no module 'lm_haed'; did you mean 'lm_head'?", "lm_haed"),
        (typo_in_try_body_not_caught, "no module 'model.layers.3.mpl'; did you mean 'mlp'?", "mpl"),
    ],
    ids=lambda v: v.__name__ if callable(v) else "",
)
def test_a_misspelling_on_every_path_fails_at_invoke(engine, block, message, text):
    started = []

    async def witness(m):
        started.append(True)
        return await m.model.layers[0].output

    with pytest.raises(asyncpp.PathError) as info:
        with asyncpp.trace(engine) as t:
            t.invoke(PROMPT, witness)
            t.invoke(PROMPT, block)
    assert started == []  # refused at invoke: nothing ran
    assert str(info.value).startswith("the model has " + message)
    assert str(info.value).endswith(_suffix(block, text))


def test_a_missing_logits_location_says_so_where_it_is_awaited(mlp):
    async def logits(m):
        return await m.logits

    async def probe(m):
        await m[0].output
        return hasattr(m, "logits")

    with pytest.raises(asyncpp.PathError) as info:
        with asyncpp.trace(mlp) as t:
            t.invoke(torch.randn(1, 8), logits)
    assert str(info.value) == (
        "this model has no logits location on this engine (a Sequential); await m.output or a "
        "module's output instead" + _suffix(logits, "m.logits")
    )
    with asyncpp.trace(mlp) as t:
        h = t.invoke(torch.randn(1, 8), probe)
    assert h.result is False
