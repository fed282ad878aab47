"""asyncpp.serve.registry: registering typed blocks, binding client data to them, describing them,
loading an operator's module, and running a bound block in a real trace on the tiny model."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from typing import Annotated, Optional

import pytest
import torch

import asyncpp
from asyncpp.serve import (
    BlockArgumentError,
    MaxLen,
    Range,
    Registry,
    Tensor,
    UnknownBlockError,
    block,
    decode,
    decode_json,
    encode,
    encode_json,
    load_module,
)

HIDDEN = 128  # the tiny model's hidden size


def make_registry() -> Registry:
    blocks = Registry()

    @blocks.block
    async def steer(
        m,
        layer: Annotated[int, Range(0, 3)],
        vec: Tensor[torch.float32, (HIDDEN,)],  # a torch dtype: linters read a string as a name
        scale: float = 1.0,
    ):
        """Add scale * vec to one layer's last position.

        Returns the last position's argmax and the scale used."""
        out = await m.model.layers[layer].output
        out[:, -1] += scale * vec
        return {"argmax": (await m.logits)[:, -1].argmax(-1), "scale": scale}

    @blocks.block(name="read")
    async def read_layers(
        m,
        layers: Annotated[list[int], MaxLen(4)],
        tag: Annotated[str, MaxLen(8)] = "x",
        keep: bool = False,
        weights: list[float] | None = None,
        mask: Optional[Tensor[torch.bool, (None, 2)]] = None,  # noqa: UP045 (Optional spelled out on purpose)
    ):
        return layers

    return blocks


# ---------------------------------------------------------------------------------------------
# registration


def test_decorator_forms_return_the_function_and_register_it():
    blocks = make_registry()
    assert blocks.names() == ["steer", "read"]
    assert len(blocks) == 2 and "steer" in blocks and "read_layers" not in blocks
    spec = blocks["read"]
    assert spec.fn.__name__ == "read_layers"
    assert [p.name for p in spec.params] == ["layers", "tag", "keep", "weights", "mask"]
    assert [p.required for p in spec.params] == [True, False, False, False, False]
    assert spec.doc == ""
    assert blocks["steer"].doc == "Add scale * vec to one layer's last position."

    other = Registry()

    async def plain(m, x: int):
        return x

    assert other.block(plain) is plain  # still the same function: invokable locally
    assert other.block(name="again")(plain) is plain
    assert other.names() == ["plain", "again"]


def _refused(annotation_src: str, exc=TypeError) -> str:
    """Register a block with one parameter declared as ``annotation_src``; return the error message."""
    ns = {
        "Tensor": Tensor,
        "Annotated": Annotated,
        "MaxLen": MaxLen,
        "Range": Range,
        "Optional": Optional,
        "torch": torch,
    }
    exec(f"async def blk(m, p{annotation_src}):\n    return None\n", ns)
    with pytest.raises(exc) as info:
        Registry().add(ns["blk"])
    return str(info.value)


@pytest.mark.parametrize(
    "decl, expect",
    [
        (": dict", "'dict' is not allowed"),
        (": set[int]", "is not allowed"),
        (": list", "list needs an item type"),
        (": list[list[int]]", "list items must be"),
        (": list[Tensor['float32', (2,)]]", "list items must be"),
        (": list[int | None]", "list items must be"),
        (": int | str", "only X | None unions"),
        (": torch.Tensor", "needs a dtype and a max shape"),
        (": Tensor", "needs a dtype and a max shape"),
        (": Annotated[int, MaxLen(3)]", "does not apply to int"),
        (": Annotated[list[int], Range(0, 1)]", "does not apply to list"),
        (": Annotated[int, 'doc']", "does not apply"),
        ("", "needs a type annotation"),
        (": int = 'a'", "does not fit its type"),
        (": int = True", "does not fit its type"),
        (": int = None", "does not fit its type"),
        (": Annotated[int, Range(0, 3)] = 7", "does not fit its type"),
        (": Annotated[list[int], MaxLen(1)] = [1, 2]", "does not fit its type"),
        (": float = float('inf')", "not a finite number"),
        (": Optional[Tensor['float32', (2,)]] = torch.zeros(2)", "default can only be None"),
    ],
)
def test_parameter_types_refused_at_registration_name_block_and_parameter(decl, expect):
    msg = _refused(decl)
    assert "block 'blk', parameter 'p'" in msg
    assert expect in msg


def test_bad_tensor_annotations_are_type_errors():
    with pytest.raises(TypeError, match="unknown dtype 'float33'"):
        Tensor["float33", (2,)]
    with pytest.raises(TypeError, match="must be a tuple"):
        Tensor["float32", 128]
    with pytest.raises(TypeError, match="int >= 0 or None"):
        Tensor["float32", (-1,)]
    with pytest.raises(TypeError, match="int >= 0 or None"):
        Tensor["float32", (True,)]
    with pytest.raises(TypeError, match="takes a dtype and a max shape"):
        Tensor["float32"]
    with pytest.raises(TypeError, match="not supported"):
        Tensor[torch.complex64, (2,)]
    assert Tensor[torch.float32, (2,)] is Tensor["float32", [2]]  # one class per declaration
    with pytest.raises(TypeError):
        Tensor["float32", (2,)]()
    with pytest.raises(TypeError):
        MaxLen(-1)
    with pytest.raises(TypeError):
        Range(2, 1)


def test_signatures_refused_at_registration():
    blocks = Registry()

    async def star(m, *args):
        return None

    async def kw(m, x: int, **kwargs):
        return None

    async def posonly(m, x: int, /):
        return None

    async def nothing():
        return None

    async def kwonly_tree(*, m):
        return None

    def sync(m, x: int):
        return x

    async def agen(m, x: int):
        yield x

    async def bad_ref(m, x: NoSuchType):  # noqa: F821 (unresolvable on purpose)
        return None

    with pytest.raises(TypeError, match=r"block 'star', parameter 'args': \*args is not allowed"):
        blocks.add(star)
    with pytest.raises(TypeError, match=r"block 'kw', parameter 'kwargs': \*\*kwargs is not allowed"):
        blocks.add(kw)
    with pytest.raises(TypeError, match="block 'posonly', parameter 'x': positional-only"):
        blocks.add(posonly)
    with pytest.raises(TypeError, match="block 'nothing': its first parameter must be the model tree"):
        blocks.add(nothing)
    with pytest.raises(TypeError, match="first parameter must be the model tree"):
        blocks.add(kwonly_tree)
    with pytest.raises(TypeError, match="block 'sync' must be an `async def` function"):
        blocks.add(sync)
    with pytest.raises(TypeError, match="block 'agen' must be an `async def` function"):
        blocks.add(agen)
    with pytest.raises(TypeError, match="block 'bad_ref': cannot read its parameter annotations"):
        blocks.add(bad_ref)
    with pytest.raises(TypeError, match="give it a name"):
        blocks.add(lambda m: None)
    assert len(blocks) == 0


def test_names_unique_and_well_formed():
    blocks = Registry()

    async def a(m, x: int):
        return x

    async def b(m):
        return None

    blocks.add(a)
    blocks.add(a)  # the very same spec again is not a conflict...
    with pytest.raises(ValueError, match="a block named 'a' is already registered"):
        blocks.add(b, name="a")  # ...another block under its name is
    for bad in ["", "1x", "a b", "a/b", "../x"]:
        with pytest.raises(ValueError, match="is not allowed"):
            blocks.add(b, name=bad)
    blocks.add(b, name="ns.b-2")
    assert blocks.names() == ["a", "ns.b-2"]


def test_bound_methods_and_partials_register():
    import functools

    class Holder:
        def __init__(self, k):
            self.k = k

        async def blk(self, m, x: int):
            return self.k * x

    async def scaled(m, x: int, factor: float = 1.0):
        return x * factor

    blocks = Registry()
    blocks.add(Holder(3).blk, name="method")
    blocks.add(functools.partial(scaled, factor=2.0), name="partial")
    assert [p.name for p in blocks["method"].params] == ["x"]
    assert [p.name for p in blocks["partial"].params] == ["x", "factor"]
    fn, kwargs = blocks.bind("method", {"x": 2})
    assert fn.__self__.k == 3 and kwargs == {"x": 2}


# ---------------------------------------------------------------------------------------------
# bind


def test_bind_accepts_and_normalizes_valid_arguments():
    blocks = make_registry()
    vec = torch.randn(HIDDEN)
    fn, kwargs = blocks.bind("steer", {"layer": 3, "vec": vec, "scale": 2})
    assert fn is blocks["steer"].fn
    assert kwargs["layer"] == 3 and kwargs["vec"] is vec
    assert kwargs["scale"] == 2.0 and type(kwargs["scale"]) is float  # int accepted for float, converted
    _, kwargs = blocks.bind("steer", {"layer": 0, "vec": vec})
    assert "scale" not in kwargs  # the function's own default applies

    mask = torch.zeros(5, 2, dtype=torch.bool)
    _, kwargs = blocks.bind(
        "read",
        {"layers": (0, 1, 2, 3), "tag": "abcdefgh", "keep": True, "weights": [1, 2.5], "mask": mask},
    )
    assert kwargs["layers"] == [0, 1, 2, 3] and type(kwargs["layers"]) is list
    assert kwargs["weights"] == [1.0, 2.5] and all(type(w) is float for w in kwargs["weights"])
    assert kwargs["keep"] is True and kwargs["mask"] is mask
    _, kwargs = blocks.bind("read", {"layers": [], "weights": None, "mask": None})
    assert kwargs == {"layers": [], "weights": None, "mask": None}
    _, kwargs = blocks.bind("read", {"layers": [1], "mask": torch.zeros(0, 1, dtype=torch.bool)})
    assert kwargs["mask"].shape == (0, 1)


@pytest.mark.parametrize(
    "name, args, param, expect",
    [
        ("steer", {"layer": True}, "layer", "expected int in [0, 3], got bool True"),
        ("steer", {"layer": 1.0}, "layer", "expected int in [0, 3], got float 1.0"),
        ("steer", {"layer": "1"}, "layer", "expected int in [0, 3], got str '1'"),
        ("steer", {"layer": 4}, "layer", "expected int in [0, 3], got int 4"),
        ("steer", {"layer": -1}, "layer", "expected int in [0, 3], got int -1"),
        ("steer", {"layer": None}, "layer", "expected int in [0, 3], got null"),
        (
            "steer",
            {"layer": 1, "vec": [0.0] * HIDDEN},
            "vec",
            "expected a float32 tensor with 1 dims (<= 128), got list",
        ),
        (
            "steer",
            {"layer": 1, "vec": torch.zeros(HIDDEN, dtype=torch.float16)},
            "vec",
            "float16 tensor of shape (128,) (wrong dtype)",
        ),
        ("steer", {"layer": 1, "vec": torch.zeros(HIDDEN, dtype=torch.float64)}, "vec", "(wrong dtype)"),
        ("steer", {"layer": 1, "vec": torch.zeros(1, HIDDEN)}, "vec", "shape (1, 128) (2 dims)"),
        ("steer", {"layer": 1, "vec": torch.tensor(0.0)}, "vec", "shape () (0 dims)"),
        ("steer", {"layer": 1, "vec": torch.zeros(HIDDEN + 1)}, "vec", "(dim 0 is 129 > 128)"),
        (
            "steer",
            {"layer": 1, "vec": torch.zeros(HIDDEN), "scale": True},
            "scale",
            "expected float, got bool True",
        ),
        ("steer", {"layer": 1, "vec": torch.zeros(HIDDEN), "scale": "2"}, "scale", "expected float, got str"),
        (
            "steer",
            {"layer": 1, "vec": torch.zeros(HIDDEN), "scale": [1.0]},
            "scale",
            "expected float, got list",
        ),
        (
            "steer",
            {"layer": 1, "vec": torch.zeros(HIDDEN), "scale": 10**400},
            "scale",
            "too large for a float",
        ),
        ("read", {"layers": [0, 1, 2, 3, 4]}, "layers", "of at most 4 items, got a list of 5 items"),
        ("read", {"layers": [0, True]}, "layers", "item 1: expected int, got bool True"),
        ("read", {"layers": [0, 1.5]}, "layers", "item 1: expected int, got float 1.5"),
        ("read", {"layers": "0123"}, "layers", "expected list[int] of at most 4 items, got str"),
        ("read", {"layers": {"0": 1}}, "layers", "got object"),
        (
            "read",
            {"layers": [], "tag": "123456789"},
            "tag",
            "at most 8 characters, got a str of 9 characters",
        ),
        ("read", {"layers": [], "tag": 5}, "tag", "expected str of at most 8 characters, got int 5"),
        ("read", {"layers": [], "keep": 1}, "keep", "expected bool, got int 1"),
        ("read", {"layers": [], "weights": [1, "2"]}, "weights", "item 1: expected float, got str '2'"),
        ("read", {"layers": [], "mask": torch.zeros(2, 3, dtype=torch.bool)}, "mask", "(dim 1 is 3 > 2)"),
        ("read", {"layers": [], "mask": torch.zeros(2, 2)}, "mask", "(wrong dtype)"),
    ],
)
def test_bind_refuses_wrong_arguments_naming_block_parameter_and_expectation(name, args, param, expect):
    blocks = make_registry()
    if name == "steer":  # the other required parameters valid
        args = {"layer": 1, "vec": torch.zeros(HIDDEN), **args}
    with pytest.raises(BlockArgumentError) as info:
        blocks.bind(name, args)
    err = info.value
    assert isinstance(err, asyncpp.AsyncppError) and isinstance(err, ValueError)
    assert err.block == name and err.parameter == param
    assert f"block {name!r}, parameter {param!r}: " in str(err)
    assert expect in str(err)


def test_bind_refuses_unknown_missing_and_malformed_requests():
    blocks = make_registry()
    with pytest.raises(UnknownBlockError) as info:
        blocks.bind("stear", {})
    assert str(info.value) == "no block named 'stear'; did you mean 'steer'? (registered blocks: steer, read)"
    assert isinstance(info.value, BlockArgumentError) and info.value.block == "stear"
    with pytest.raises(UnknownBlockError, match=r"no block named 'zzz' \(registered blocks: steer, read\)"):
        blocks.bind("zzz", {})
    with pytest.raises(UnknownBlockError, match=r"registered blocks: \(none\)"):
        Registry().bind("steer", {})
    with pytest.raises(BlockArgumentError, match="the block name must be a string, got int 3"):
        blocks.bind(3, {})

    with pytest.raises(BlockArgumentError) as info:
        blocks.bind("steer", {"vec": torch.zeros(HIDDEN)})
    assert str(info.value) == "block 'steer', parameter 'layer': missing (expected int in [0, 3])"
    with pytest.raises(BlockArgumentError) as info:
        blocks.bind("steer", {"layer": 0, "vec": torch.zeros(HIDDEN), "sclae": 1.0})
    assert str(info.value) == "block 'steer' has no parameter 'sclae' (its parameters: layer, vec, scale)"
    assert info.value.parameter == "sclae"
    with pytest.raises(BlockArgumentError, match="has no parameter 'm'"):  # the model tree is not a parameter
        blocks.bind("steer", {"m": 1, "layer": 0, "vec": torch.zeros(HIDDEN)})
    with pytest.raises(BlockArgumentError, match="has no parameter 1"):
        blocks.bind("steer", {1: 2})
    with pytest.raises(BlockArgumentError, match="the arguments must be an object .* got list"):
        blocks.bind("steer", [0, torch.zeros(HIDDEN)])
    with pytest.raises(BlockArgumentError, match="parameter 'layers': missing"):
        blocks.bind("read", None)


def test_float_range_refuses_nan_and_plain_float_accepts_it():
    blocks = Registry()

    @blocks.block
    async def f(m, a: Annotated[float, Range(0.0, None)], b: float = 0.0):
        return a

    assert blocks.bind("f", {"a": 0, "b": float("nan")}).kwargs["a"] == 0.0
    with pytest.raises(BlockArgumentError, match=r"parameter 'a': expected float >= 0.0, got float nan"):
        blocks.bind("f", {"a": float("nan")})
    with pytest.raises(BlockArgumentError, match=r"expected float >= 0.0, got float -1e-09"):
        blocks.bind("f", {"a": -1e-9})
    assert blocks.describe()[0]["params"][0] == {
        "name": "a",
        "type": "float",
        "min": 0.0,
        "nullable": False,
        "required": True,
    }


# ---------------------------------------------------------------------------------------------
# describe


def test_describe_is_exact_and_json_able():
    desc = make_registry().describe()
    assert json.loads(json.dumps(desc, allow_nan=False)) == desc
    assert desc == [
        {
            "name": "steer",
            "doc": "Add scale * vec to one layer's last position.",
            "params": [
                {"name": "layer", "type": "int", "min": 0, "max": 3, "nullable": False, "required": True},
                {
                    "name": "vec",
                    "type": "tensor",
                    "dtype": "float32",
                    "max_shape": [128],
                    "nullable": False,
                    "required": True,
                },
                {"name": "scale", "type": "float", "nullable": False, "required": False, "default": 1.0},
            ],
        },
        {
            "name": "read",
            "doc": "",
            "params": [
                {
                    "name": "layers",
                    "type": "list",
                    "items": {"type": "int"},
                    "max_len": 4,
                    "nullable": False,
                    "required": True,
                },
                {
                    "name": "tag",
                    "type": "str",
                    "max_len": 8,
                    "nullable": False,
                    "required": False,
                    "default": "x",
                },
                {"name": "keep", "type": "bool", "nullable": False, "required": False, "default": False},
                {
                    "name": "weights",
                    "type": "list",
                    "items": {"type": "float"},
                    "nullable": True,
                    "required": False,
                    "default": None,
                },
                {
                    "name": "mask",
                    "type": "tensor",
                    "dtype": "bool",
                    "max_shape": [None, 2],
                    "nullable": True,
                    "required": False,
                    "default": None,
                },
            ],
        },
    ]


def test_list_default_described_as_list_and_not_shared():
    blocks = Registry()

    @blocks.block
    async def f(m, xs: list[int] = [1, 2]):  # noqa: B006 (a list default on purpose)
        return xs

    (param,) = blocks.describe()[0]["params"]
    assert param["default"] == [1, 2]
    param["default"].append(3)
    assert blocks.describe()[0]["params"][0]["default"] == [1, 2]


# ---------------------------------------------------------------------------------------------
# load_module

MODULE_SRC = '''
from typing import Annotated
from asyncpp.serve import MaxLen, Registry, Tensor, block

blocks = Registry()

@blocks.block
async def steer(m, layer: int, vec: Tensor["float32", (128,)], scale: float = 1.0):
    """Steer one layer."""
    out = await m.model.layers[layer].output
    out[:, -1] += scale * vec
    return (await m.logits)[:, -1]

@block(name="lens")
async def logit_lens(m, layers: Annotated[list[int], MaxLen(4)]):
    """Logit lens at some layers."""
    return [await m.model.layers[i].output for i in layers]

async def not_registered(m):
    return None
'''


def test_load_module_from_a_file_and_a_dotted_name(tmp_path, monkeypatch):
    path = tmp_path / "opblocks.py"
    path.write_text(MODULE_SRC)
    reg = load_module(str(path))
    assert reg.names() == ["steer", "lens"]
    assert reg["lens"].fn.__name__ == "logit_lens"
    assert reg.describe()[1]["doc"] == "Logit lens at some layers."
    assert load_module(str(path)).names() == ["steer", "lens"]  # loading twice is fine

    pkg = tmp_path / "oppkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "served.py").write_text(MODULE_SRC)
    monkeypatch.syspath_prepend(str(tmp_path))
    reg2 = load_module("oppkg.served")
    assert reg2.names() == ["steer", "lens"]
    import oppkg.served

    assert load_module(oppkg.served)["steer"].fn is oppkg.served.steer
    monkeypatch.delitem(sys.modules, "oppkg.served")
    monkeypatch.delitem(sys.modules, "oppkg")


def test_load_module_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="no such file"):
        load_module(str(tmp_path / "missing.py"))
    empty = tmp_path / "empty_blocks.py"
    empty.write_text("async def f(m):\n    return 1\n")
    with pytest.raises(ValueError, match="registers no blocks"):
        load_module(str(empty))
    clash = tmp_path / "clash_blocks.py"
    clash.write_text(
        textwrap.dedent(
            """
            from asyncpp.serve import Registry
            a = Registry()
            b = Registry()

            @a.block(name="x")
            async def one(m, v: int):
                return v

            @b.block(name="x")
            async def two(m, v: int):
                return v
            """
        )
    )
    with pytest.raises(ValueError, match="a block named 'x' is already registered"):
        load_module(str(clash))
    broken = tmp_path / "broken_blocks.py"
    broken.write_text(
        "from asyncpp.serve import Registry\nr = Registry()\n@r.block\nasync def f(m, x: dict):\n    pass\n"
    )
    with pytest.raises(TypeError, match="block 'f', parameter 'x'"):
        load_module(str(broken))
    assert not any(name.startswith("_asyncpp_blocks_broken") for name in sys.modules)


def test_module_level_block_marks_without_registry():
    async def f(m, x: int):
        return x

    assert block(f) is f
    with pytest.raises(TypeError, match="parameter 'y'"):

        @block
        async def g(m, y: object):
            return y


# ---------------------------------------------------------------------------------------------
# import isolation


def test_import_asyncpp_does_not_import_serve_fastapi_or_safetensors():
    code = (
        "import sys, asyncpp\n"
        "print(sorted(m for m in ('asyncpp.serve', 'fastapi', 'safetensors') if m in sys.modules))\n"
        "import asyncpp.serve\n"
        "print(sorted(m for m in ('fastapi', 'safetensors') if m in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.splitlines() == ["[]", "[]"]


# ---------------------------------------------------------------------------------------------
# a registered block bound from a wire payload, run in a real trace, its result sent back


@pytest.mark.parametrize("mode", ["binary", "json"])
def test_wire_request_binds_and_runs_in_a_real_trace(engine, mode):
    enc, dec = (encode, decode) if mode == "binary" else (encode_json, decode_json)
    blocks = make_registry()
    torch.manual_seed(1)
    vec = torch.randn(HIDDEN) * 4
    prompt = "The quick brown fox"

    # what a client sends, as bytes, and what the server decodes
    body = enc({"block": "steer", "args": {"layer": 2, "vec": vec, "scale": 3}})
    request = dec(body)
    fn, kwargs = blocks.bind(request["block"], request["args"])
    assert torch.equal(kwargs["vec"], vec) and kwargs["scale"] == 3.0

    with asyncpp.trace(engine) as t:
        served = t.invoke(prompt, fn, **kwargs)
        plain = t.invoke(prompt, fn, layer=2, vec=torch.zeros(HIDDEN), scale=0.0)

    # the reference: the same edit by hand on the model itself
    model = engine.model
    ids = engine.tokenizer(prompt, return_tensors="pt").input_ids

    def hook(_mod, _inp, out):
        h = out[0] if isinstance(out, tuple) else out
        h[:, -1] += 3.0 * vec

    handle = model.model.layers[2].register_forward_hook(hook)
    try:
        with torch.no_grad():
            expected = model(ids).logits[:, -1].argmax(-1)
    finally:
        handle.remove()
    with torch.no_grad():
        unsteered = model(ids).logits[:, -1].argmax(-1)

    result = served.result
    assert torch.equal(result["argmax"], expected)
    assert torch.equal(plain.result["argmax"], unsteered)
    assert not torch.equal(expected, unsteered)  # the steering vector really changes the answer

    # the server's response, decoded by the client
    back = dec(enc({"result": result}))["result"]
    assert back.keys() == {"argmax", "scale"}
    assert back["argmax"].dtype == torch.int64 and torch.equal(back["argmax"], expected)
    assert type(back["scale"]) is float and back["scale"] == 3.0


def test_wire_request_with_wrong_tensor_is_refused_before_running(engine):
    blocks = make_registry()
    request = decode(
        encode({"block": "steer", "args": {"layer": 2, "vec": torch.zeros(HIDDEN, dtype=torch.bfloat16)}})
    )
    with pytest.raises(
        BlockArgumentError, match=r"parameter 'vec': expected a float32 tensor .* bfloat16 tensor"
    ):
        blocks.bind(request["block"], request["args"])
