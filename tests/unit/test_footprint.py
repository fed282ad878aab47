"""A block's footprint: every location its code can reach, read from its source (an over-estimate),
or None where the tree goes somewhere the reading does not follow. An auto VllmEngine runs a
request eagerly on it, so a footprint that missed a location would leave a block without it."""

from __future__ import annotations

import functools

import pytest

from asyncpp.locations.footprint import block_footprint
from asyncpp.locations.tree import tree_from_paths

PATHS = [
    "",
    "model",
    "model.layers",
    "model.layers.0",
    "model.layers.0.mlp",
    "model.layers.1",
    "model.layers.1.mlp",
    "model.norm",
]
TREE = tree_from_paths([(p, "Module") for p in PATHS])


def locations(block, *args, **kwargs):
    fp = block_footprint(block, args, kwargs)
    return None if fp is None else sorted(fp.locations, key=repr)


async def constant_paths(m):
    h = await m.model.layers[1].output
    await m.model.layers[0].mlp.output.set(h)
    return await m.model["norm"].input


async def a_loop(m):
    out = []
    for layer in m.model.layers:
        out.append(await layer.mlp.output)
    for _i, layer in enumerate(m.model.layers):
        out.append(await layer.inputs)
    for _a, b in zip(m.model.layers, m.model.layers[1:]):
        out.append(await b.output)
    return [await x.output for x in m.model.layers], out


async def a_computed_index(m, i):
    node = m.model.layers[i]
    async for _ in m.steps():
        await node.mlp.skip(None)


async def branches(m, deep):
    if deep:
        return await m.model.layers[0].mlp.output
    return await m.model.layers[0].output


async def found(m):
    layer = m.find("model.layers.1")
    return await layer.mlp.output, await m.logits, await m.samples


async def children(m):
    for _name, child in m.model.children().items():
        await child.output
    return [await c.output for c in m.model.layers.children().values()]


def test_paths_kinds_loops_and_branches_are_all_counted():
    assert locations(constant_paths) == [
        (("model", "layers", "0", "mlp"), "output"),
        (("model", "layers", "1"), "output"),
        (("model", "norm"), "input"),
    ]
    assert locations(a_loop) == [
        (("model", "layers", None), "inputs"),
        (("model", "layers", None), "output"),
        (("model", "layers", None, "mlp"), "output"),
    ]
    assert locations(a_computed_index, 1) == [(("model", "layers", None, "mlp"), "skip")]
    assert locations(branches, False) == [
        (("model", "layers", "0"), "output"),
        (("model", "layers", "0", "mlp"), "output"),
    ]
    fp = block_footprint(found)
    assert sorted(fp.locations, key=repr) == [(("model", "layers", "1", "mlp"), "output")]
    assert fp.aliases == {"logits", "samples"}
    assert locations(children) == [(("model", "layers", None), "output"), (("model", None), "output")]


def test_patterns_resolve_against_the_tree():
    fp = block_footprint(a_loop)
    got = fp.modules(PATHS)
    assert got["model.layers.0.mlp"] == {"output"} and got["model.layers.1.mlp"] == {"output"}
    assert got["model.layers.1"] == {"inputs", "output"}
    assert "model.norm" not in got and "model.layers" not in got


def test_bound_methods_and_partials_read_the_tree_parameter():
    class Probe:
        async def read(self, m, layer):
            return await m.model.layers[layer].mlp.output

    assert locations(Probe().read, 0) == [(("model", "layers", None, "mlp"), "output")]
    assert locations(functools.partial(branches, deep=True)) == locations(branches, True)
    assert locations(functools.partial(a_computed_index)) == locations(a_computed_index, 0)


async def helper(m):
    return await m.model.layers[0].mlp.output


async def to_a_helper(m):
    return await helper(m)


async def a_node_to_a_helper(m):
    return await helper_on(m.model.layers[0])


async def helper_on(layer):
    return await layer.mlp.output


async def a_node_in_a_list(m):
    nodes = [m.model.layers[0]]
    return await nodes[0].mlp.output


async def a_computed_path(m, path):
    return await m.find(path).output


async def a_computed_name(m, name):
    return await getattr(m.model.layers[0], name).output


async def a_constant_getattr(m):
    return await getattr(m.model.layers[0], "mlp").output  # noqa: B009 (what is checked)


async def pairs_kept(m):
    kids = list(m.model.children().items())
    return await kids[0][1].output


async def reordered(m):
    first = m.model.layers[1:][0]  # model.layers.1
    last = sorted(m.model.layers, key=str)[0]
    for layer in reversed(m.model.layers[:1]):
        await layer.mlp.output
    return await first.output, await last.inputs


async def unpacked(m):
    a, b = m.model.layers[0], m.model.norm
    return await a.mlp.output, await b.output


async def harmless_uses(m):
    n = len(m.model.layers)
    print(m.model, isinstance(m.model, object), f"{m.model.layers[0]}")
    return n, await m.model.layers[n - 1].output


@pytest.mark.parametrize(
    "block, args",
    [
        (to_a_helper, ()),
        (a_node_to_a_helper, ()),
        (a_node_in_a_list, ()),
        (a_computed_path, ("model.layers.0",)),
        (a_computed_name, ("mlp",)),
        (pairs_kept, ()),
        (lambda m: m.model.output, ()),
    ],
)
def test_where_the_tree_escapes_the_footprint_is_unknown(block, args):
    assert block_footprint(block, args) is None


def test_what_does_not_escape_is_read():
    assert locations(a_constant_getattr) == [(("model", "layers", "0", "mlp"), "output")]
    assert locations(harmless_uses) == [(("model", "layers", None), "output")]
    assert locations(reordered) == [
        (("model", "layers", None), "inputs"),
        (("model", "layers", None), "output"),
        (("model", "layers", None, "mlp"), "output"),
    ]
    assert locations(unpacked) == [(("model", "layers", "0", "mlp"), "output"), (("model", "norm"), "output")]


def test_a_node_passed_in_or_code_without_source_is_unknown():
    assert block_footprint(helper_on, (TREE.model.layers[0],)) is None
    assert block_footprint(branches, (), {"deep": TREE.model.output}) is None
    scope: dict = {}
    exec("async def made(m):\n    return await m.model.output\n", scope)
    assert block_footprint(scope["made"]) is None
