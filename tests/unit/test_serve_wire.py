"""asyncpp.serve.wire: exact round trips (binary safetensors framing and pure JSON), the format on
the wire, and strict decoding: every malformed body is a WireError, never anything else."""

from __future__ import annotations

import base64
import json
import math
import random
import struct

import pytest
import safetensors.torch
import torch

import asyncpp
from asyncpp.serve import (
    CONTENT_TYPE,
    JSON_CONTENT_TYPE,
    WireError,
    WireLimits,
    decode,
    decode_body,
    decode_json,
    encode,
    encode_json,
)
from asyncpp.serve.wire import MAGIC, WireLimitError

MODES = {"binary": (encode, decode), "json": (encode_json, decode_json)}


def assert_same(a, b, path="$"):
    """Exact equality: same types (tuple is not list, float is not int), NaN equals NaN, -0.0 is not
    0.0, tensors of the same dtype, shape and bytes."""
    assert type(a) is type(b), f"{path}: {type(a).__name__} != {type(b).__name__}"
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype, f"{path}: {a.dtype} != {b.dtype}"
        assert a.shape == b.shape, f"{path}: {tuple(a.shape)} != {tuple(b.shape)}"
        assert a.device.type == b.device.type == "cpu"
        assert not b.requires_grad
        ac = a.detach().contiguous().reshape(-1)
        bc = b.contiguous().reshape(-1)
        if a.numel():
            assert torch.equal(ac.view(torch.uint8), bc.view(torch.uint8)), f"{path}: values differ"
    elif isinstance(a, dict):
        assert list(a) == list(b), f"{path}: keys {list(a)} != {list(b)}"
        for k in a:
            assert_same(a[k], b[k], f"{path}.{k}")
    elif isinstance(a, list | tuple):
        assert len(a) == len(b), f"{path}: length {len(a)} != {len(b)}"
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{path}[{i}]")
    elif isinstance(a, float):
        assert (math.isnan(a) and math.isnan(b)) or (a == b and math.copysign(1, a) == math.copysign(1, b)), (
            f"{path}: {a!r} != {b!r}"
        )
    else:
        assert a == b, f"{path}: {a!r} != {b!r}"


def all_dtype_tensors():
    g = torch.Generator().manual_seed(0)
    f = torch.randn(3, 5, generator=g)
    return {
        "float64": f.double() * 1e200,
        "float32": torch.tensor([1.5, -0.0, float("nan"), float("inf"), -float("inf"), 1e-45]),
        "float16": f.half(),
        "bfloat16": (f * 1e30).bfloat16(),  # beyond float16's range: must stay bfloat16 bits
        "int64": torch.tensor([2**63 - 1, -(2**63), 0]),
        "int32": torch.tensor([2**31 - 1, -(2**31)], dtype=torch.int32),
        "int16": torch.tensor([-7, 300], dtype=torch.int16),
        "int8": torch.tensor([-128, 127], dtype=torch.int8),
        "uint8": torch.arange(256, dtype=torch.uint8),
        "bool": torch.tensor([[True, False], [False, True]]),
    }


PAYLOADS = [
    None,
    0,
    True,
    "",
    [],
    {},
    (),
    {"a": 1, "b": [1, 2.0, "x", None, False], "c": {"d": (1, (2, [3]))}},
    [1.0, -0.0, 0.1, 1e308, 5e-324, float("nan"), float("inf"), -float("inf")],
    [2**200, -(2**70), 1, True, 1.0],
    ["ünïcødé ✓ 🦊", "\x00\n\"'\\", "\ud800 lone surrogate", "__tensor__"],
    ((), [()], ([],), ({},)),
    # dicts that look like markers must come back as the very same dicts
    {"__tuple__": 1},
    {"__tensor__": "t0"},
    {"__tensor__": {"dtype": "float32", "shape": [1], "data": "AAAAAA=="}},
    {"__float__": "nan"},
    {"__dict__": {"__dict__": {}}},
    {"__whatever__": [1]},
    {"__tuple__": 1, "__tensor__": 2},  # two keys: an ordinary dict, no escape needed
    [{"__dict__": 1}, ({"__tuple__": ({"__float__": "inf"},)},)],
    {"": 1, "a.b": 2, "0": 3, "with space": {"ü": 4}},
]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("payload", PAYLOADS, ids=range(len(PAYLOADS)))
def test_plain_payloads_round_trip_exactly(mode, payload):
    enc, dec = MODES[mode]
    assert_same(payload, dec(enc(payload)))


@pytest.mark.parametrize("mode", MODES)
def test_tensors_round_trip_exactly(mode):
    enc, dec = MODES[mode]
    base = torch.arange(24, dtype=torch.float32).reshape(2, 3, 4)
    payload = {
        "dtypes": all_dtype_tensors(),
        "scalar": torch.tensor(3.25),
        "empty": torch.zeros(0, 3),
        "empty_bf16": torch.zeros(2, 0, dtype=torch.bfloat16),
        "transposed": base.transpose(0, 2),
        "strided": base[:, ::2, 1::2],
        "expanded": torch.tensor([1.0, 2.0]).expand(3, 2),  # stride 0
        "needs_grad": torch.ones(2, requires_grad=True) * 2,
        "same_twice": (base[0], base[0]),
        "nested": [{"x": (torch.tensor([True]), 1)}],
    }
    assert not payload["transposed"].is_contiguous() and payload["expanded"].stride() == (0, 1)
    back = dec(enc(payload))
    assert_same(
        {**payload, "needs_grad": payload["needs_grad"].detach()},
        back,
    )
    assert back["same_twice"][0] is not back["same_twice"][1]
    back["dtypes"]["float32"][0] = 7.0  # decoded tensors are writable, own memory
    assert payload["dtypes"]["float32"][0] == 1.5


def test_a_view_sends_only_its_own_elements():
    big = torch.zeros(1000, 1000)
    row = big[3]
    assert len(encode(row)) < 5000
    assert len(encode_json(row)) < 7000
    assert_same(row.clone(), decode(encode(row)))


def test_binary_layout_is_magic_length_json_then_real_safetensors():
    a = torch.arange(6, dtype=torch.int32).reshape(2, 3)
    b = torch.ones(2, dtype=torch.bfloat16)
    body = encode({"a": a, "rest": (b, 1.5)})
    assert body[:4] == MAGIC == b"APW1"
    (n,) = struct.unpack("<Q", body[4:12])
    tree = json.loads(body[12 : 12 + n])
    assert tree == {"a": {"__tensor__": "t0"}, "rest": {"__tuple__": [{"__tensor__": "t1"}, 1.5]}}
    tensors = safetensors.torch.load(body[12 + n :])  # the blob is a plain safetensors file
    assert set(tensors) == {"t0", "t1"}
    assert torch.equal(tensors["t0"], a) and torch.equal(tensors["t1"], b)
    assert tensors["t1"].dtype == torch.bfloat16
    # no tensors: no blob at all
    plain = encode({"x": 1})
    assert plain == MAGIC + struct.pack("<Q", 7) + b'{"x":1}'


def test_binary_body_built_by_another_client_decodes():
    """A client that writes the format with its own JSON and safetensors.torch.save."""
    v = torch.linspace(0, 1, 128)
    text = json.dumps({"block": "steer", "args": {"layer": 2, "vec": {"__tensor__": "vector"}}}).encode()
    body = (
        MAGIC
        + struct.pack("<Q", len(text))
        + text
        + safetensors.torch.save({"vector": v}, metadata={"k": "v"})
    )
    out = decode(body)
    assert out["args"]["layer"] == 2 and torch.equal(out["args"]["vec"], v)


def test_json_mode_layout_is_little_endian_base64():
    body = encode_json({"v": torch.tensor([1.0, -2.0]), "b": torch.tensor([[True], [False]])})
    tree = json.loads(body)
    assert tree == {
        "v": {
            "__tensor__": {
                "dtype": "float32",
                "shape": [2],
                "data": base64.b64encode(struct.pack("<2f", 1.0, -2.0)).decode(),
            }
        },
        "b": {
            "__tensor__": {"dtype": "bool", "shape": [2, 1], "data": base64.b64encode(b"\x01\x00").decode()}
        },
    }
    # a client writing it by hand (e.g. from JavaScript)
    data = base64.b64encode(struct.pack("<q", -5)).decode()
    hand = '{"x": {"__tensor__": {"dtype": "int64", "shape": [], "data": "' + data + '"}}}'
    assert_same(decode_json(hand), {"x": torch.tensor(-5)})
    assert body.isascii()


def test_decode_body_dispatches_on_content_type():
    v = {"a": (torch.tensor([1, 2]),)}
    assert_same(v, decode_body(encode(v), CONTENT_TYPE))
    assert_same(v, decode_body(encode_json(v), "application/json; charset=utf-8"))
    assert_same(v, decode_body(encode_json(v), "Application/JSON"))
    assert JSON_CONTENT_TYPE == "application/json"
    with pytest.raises(WireError, match="unsupported content type 'application/octet-stream'"):
        decode_body(encode(v), "application/octet-stream")
    with pytest.raises(WireError, match="unsupported content type None"):
        decode_body(encode(v), None)


# ---------------------------------------------------------------------------------------------
# encoding refusals


class Thing:
    pass


@pytest.mark.parametrize("mode", MODES)
def test_encode_refuses_what_is_not_data(mode):
    enc, _ = MODES[mode]
    cyc: list = [1]
    cyc.append(cyc)
    cases = [
        ({"a": {1, 2}}, r"\$\.a: cannot encode set"),
        ([Thing()], r"\$\[0\]: cannot encode Thing"),
        ({1: "x"}, r"\$: dict keys must be strings, got int 1"),
        ({"a": {None: 1}}, r"\$\.a: dict keys must be strings"),
        (cyc, r"\$\[1\]: the payload contains itself"),
        (b"bytes", "cannot encode bytes"),
        ({"z": torch.zeros(2, dtype=torch.complex64)}, r"\$\.z: cannot encode dtype torch.complex64"),
        (torch.zeros(2, 2).to_sparse(), "cannot encode a torch.sparse_coo tensor"),
        (torch.zeros(2, device="meta"), "cannot encode a meta tensor"),
        ([10**5000], "cannot encode the payload as JSON"),
    ]
    for obj, msg in cases:
        with pytest.raises(WireError, match=msg):
            enc(obj)
    deep: list = []
    for _ in range(40):
        deep = [deep]
    with pytest.raises(WireLimitError, match="nested deeper than 32 levels"):
        enc(deep)
    assert_same(deep, MODES[mode][1](enc(deep, limits=WireLimits(max_depth=50)), WireLimits(max_depth=50)))


def test_equal_depth_limit_on_both_sides():
    x: list = []
    for _ in range(30):
        x = [x]
    x = (x,)  # 32 levels (31 lists in a tuple)
    for enc, dec in MODES.values():
        assert_same(x, dec(enc(x)))
        with pytest.raises(WireLimitError, match="nested deeper than 32 levels"):
            enc([x])
        body = json.dumps([json.loads(encode_json(x))]).encode()
        with pytest.raises(WireLimitError, match="nested deeper than 32 levels"):
            decode_json(body)


# ---------------------------------------------------------------------------------------------
# strict decoding


def frame(text: bytes | str, blob: bytes = b"", n: int | None = None) -> bytes:
    if isinstance(text, str):
        text = text.encode()
    return MAGIC + struct.pack("<Q", len(text) if n is None else n) + text + blob


def st_blob(header: dict, data: bytes, hlen: int | None = None) -> bytes:
    h = json.dumps(header).encode()
    return struct.pack("<Q", len(h) if hlen is None else hlen) + h + data


REF = '{"x":{"__tensor__":"a"}}'
F32_2 = struct.pack("<2f", 1.0, 2.0)

BAD_BINARY = [
    (b"", "not an asyncpp wire body"),
    (b"APW1", "not an asyncpp wire body"),
    (b'{"a": 1}', "it looks like JSON: send it as application/json"),
    (b"APW2" + struct.pack("<Q", 2) + b"{}", "must start with b'APW1'"),
    (frame("{}", n=3), "claims 3 bytes of JSON, but only 2 follow"),
    (frame("{}", n=2**64 - 1), "claims 18446744073709551615 bytes of JSON"),
    (frame('{"a": 1'), "the body's JSON is not valid JSON"),
    (frame(b"\xff\xfe{}"), "not valid UTF-8"),
    (frame('{"a": NaN}'), "JSON literal NaN is not allowed"),
    (frame("[Infinity]"), "JSON literal Infinity is not allowed"),
    (frame("[-Infinity]"), "JSON literal -Infinity is not allowed"),
    (frame("[1e400]"), "out of the float range"),
    (frame('{"a": 1, "a": 2}'), "has the key 'a' twice"),
    (frame("[" + "1" * 5000 + "]"), "not acceptable JSON"),
    (frame("[" * 100000 + "]" * 100000), "nested too deeply"),
    (frame('{"__tuple__": 1}'), "__tuple__ must hold a list"),
    (frame('{"__float__": "NaN"}'), "__float__ must be 'nan', 'inf' or '-inf'"),
    (frame('{"__dict__": [1]}'), "__dict__ must hold an object"),
    (frame('{"__pickle__": "gASVAAA="}'), "unknown marker '__pickle__'"),
    (frame('{"a": [{"__tensor__": 0}]}'), "$.a[0]: __tensor__ must name a tensor"),
    (frame('{"__tensor__": "t0"}'), "the body has no tensor named 't0'"),
    (
        frame(
            '[{"__tensor__": "a"}, {"__tensor__": "a"}]',
            st_blob({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}, F32_2),
        ),
        "tensor 'a' is referenced twice",
    ),
    (
        frame("[]", st_blob({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}, F32_2)),
        "never refers to: ['a']",
    ),
    (frame(REF, b"\x01\x00"), "safetensors blob is truncated"),
    (
        frame(REF, st_blob({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}, F32_2, hlen=10**9)),
        "header claims 1000000000 bytes",
    ),
    (frame(REF, struct.pack("<Q", 3) + b"abc"), "the safetensors header is not valid JSON"),
    (frame(REF, st_blob([1], b"")), "the safetensors header is not a JSON object"),
    (
        frame(REF, st_blob({"a": {"dtype": "F32", "shape": [2]}}, F32_2)),
        "needs exactly dtype, shape and data_offsets",
    ),
    (
        frame(REF, st_blob({"a": {"dtype": "F8_E4M3", "shape": [2], "data_offsets": [0, 2]}}, b"\0\0")),
        "unknown or unsupported dtype 'F8_E4M3'",
    ),
    (
        frame(REF, st_blob({"a": {"dtype": "C64", "shape": [1], "data_offsets": [0, 8]}}, F32_2)),
        "unknown or unsupported dtype 'C64'",
    ),
    (
        frame(REF, st_blob({"a": {"dtype": 5, "shape": [1], "data_offsets": [0, 4]}}, F32_2[:4])),
        "unknown or unsupported dtype '5'",
    ),
    (
        frame(REF, st_blob({"a": {"dtype": "F32", "shape": [-2], "data_offsets": [0, 8]}}, F32_2)),
        "shape must be a list of ints >= 0",
    ),
    (
        frame(REF, st_blob({"a": {"dtype": "F32", "shape": [True, 2], "data_offsets": [0, 8]}}, F32_2)),
        "shape must be a list of ints >= 0",
    ),
    (
        frame(REF, st_blob({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 80]}}, F32_2)),
        "data_offsets [0, 80] point outside the 8 data bytes",
    ),
    (
        frame(REF, st_blob({"a": {"dtype": "F32", "shape": [2], "data_offsets": [-8, 0]}}, F32_2)),
        "point outside",
    ),
    (
        frame(REF, st_blob({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 4]}}, F32_2)),
        "span 4 bytes, but a float32 tensor of shape (2,) needs 8",
    ),
    (
        frame(REF, st_blob({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8.0]}}, F32_2)),
        "data_offsets must be two ints",
    ),
    (
        frame(REF, st_blob({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}, F32_2 + b"junk")),
        "4 bytes that belong to no tensor",
    ),
    (
        frame(
            '[{"__tensor__": "a"}, {"__tensor__": "b"}]',
            st_blob(
                {
                    "a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
                    "b": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]},
                },
                F32_2,
            ),
        ),
        "overlapping tensors or gaps",
    ),
    (
        frame(
            REF,
            st_blob(
                {"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}, "__metadata__": {"k": 1}}, F32_2
            ),
        ),
        "__metadata__ must be an object of strings",
    ),
    (
        frame(REF, st_blob({"a": {"dtype": "BOOL", "shape": [2], "data_offsets": [0, 2]}}, b"\x01\x02")),
        "bool tensor holds bytes other than 0 and 1",
    ),
    (
        frame(
            REF,
            st_blob(
                {
                    "a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
                    "a ": {"dtype": "F32", "shape": [0], "data_offsets": [8, 8]},
                },
                F32_2,
            ),
        ),
        "never refers to",
    ),
]


@pytest.mark.parametrize("body, msg", BAD_BINARY, ids=range(len(BAD_BINARY)))
def test_malformed_binary_bodies_are_wire_errors(body, msg):
    with pytest.raises(WireError) as info:
        decode(body)
    assert msg in str(info.value)
    assert isinstance(info.value, asyncpp.AsyncppError) and isinstance(info.value, ValueError)


def tensor_json(dtype="float32", shape=(2,), data=None, **extra):
    if data is None:
        data = base64.b64encode(F32_2).decode()
    return json.dumps({"x": {"__tensor__": {"dtype": dtype, "shape": list(shape), "data": data, **extra}}})


BAD_JSON = [
    ("", "the body is not valid JSON"),
    ("{", "not valid JSON"),
    (b"\xc3\x28", "not valid UTF-8"),
    ('{"a": NaN}', "NaN is not allowed"),
    ('{"a": 1, "a": 1}', "twice"),
    (tensor_json(dtype="float8"), "unknown dtype 'float8'"),
    (tensor_json(dtype="F32"), "unknown dtype 'F32'"),
    (tensor_json(shape=(3,)), "data has 8 bytes, but a float32 tensor of shape (3,) needs 12"),
    (tensor_json(shape=("2",)), "shape must be a list of ints"),
    (tensor_json(data="!!!notbase64"), "data is not valid base64"),
    (tensor_json(data="AAA"), "data is not valid base64"),
    (tensor_json(data=5), "data must be a base64 string"),
    (tensor_json(extra_key=1), "a tensor is"),
    ('{"x": {"__tensor__": "t0"}}', "a tensor is"),
    (
        tensor_json(dtype="bool", shape=(2,), data=base64.b64encode(b"\x00\x07").decode()),
        "bool tensor holds bytes other than 0 and 1",
    ),
    (tensor_json(shape=(10**6, 10**6)), "has 1000000000000 elements, more than the limit of 16777216"),
    (
        tensor_json(shape=[1] * 9, data=base64.b64encode(F32_2[:4]).decode()),
        "9 dims, more than the limit of 8",
    ),
]


@pytest.mark.parametrize("body, msg", BAD_JSON, ids=range(len(BAD_JSON)))
def test_malformed_json_bodies_are_wire_errors(body, msg):
    with pytest.raises(WireError) as info:
        decode_json(body)
    assert msg in str(info.value)


def test_limits_are_enforced_before_allocating():
    limits = WireLimits(max_bytes=1000, max_tensors=2, max_tensor_elements=10, max_depth=4)
    for enc, dec in MODES.values():
        ok = {"a": torch.zeros(10), "b": [[[1]]]}
        assert_same(ok, dec(enc(ok), limits))
        with pytest.raises(WireLimitError, match="more than the limit of 1000"):
            dec(enc({"a": "x" * 2000}), limits)
        with pytest.raises(
            WireLimitError, match="more than the limit of 2 tensors|has 3 tensors, more than the limit of 2"
        ):
            dec(enc([torch.zeros(1)] * 3), limits)
        with pytest.raises(WireLimitError, match="has 11 elements, more than the limit of 10"):
            dec(enc(torch.zeros(11)), limits)
        with pytest.raises(WireLimitError, match="nested deeper than 4 levels"):
            dec(enc([[[[[1]]]]]), limits)
        with pytest.raises(WireLimitError, match="nested deeper than 4 levels"):
            dec(enc(((((({"a": 1},),),),),)), limits)
    # a header that claims a huge tensor is refused on its shape, before any data is looked at
    body = frame(REF, st_blob({"a": {"dtype": "F32", "shape": [2**40], "data_offsets": [0, 8]}}, F32_2))
    with pytest.raises(WireLimitError, match="more than the limit of 16777216"):
        decode(body)


def test_non_bytes_input_is_a_wire_error():
    for bad in [None, 5, ["APW1"], {"a": 1}]:
        with pytest.raises(WireError, match="a body must be bytes"):
            decode(bad)
        with pytest.raises(WireError, match="a body must be bytes"):
            decode_json(bad)
    assert_same({"a": 1}, decode(memoryview(encode({"a": 1}))))
    assert_same({"a": 1}, decode(bytearray(encode({"a": 1}))))


def fuzz_payload():
    return {
        "block": "steer",
        "args": {
            "layer": 2,
            "vec": torch.randn(8),
            "ids": (1, 2, 3),
            "m": torch.ones(2, 2, dtype=torch.bfloat16),
        },
        "flags": [True, None, float("nan"), "s"],
    }


@pytest.mark.parametrize("mode", MODES)
def test_every_truncation_is_a_wire_error(mode):
    enc, dec = MODES[mode]
    body = enc(fuzz_payload())
    for n in range(len(body)):
        with pytest.raises(WireError):
            dec(body[:n])


@pytest.mark.parametrize("mode", MODES)
def test_fuzzed_bodies_decode_or_raise_wire_error_only(mode):
    enc, dec = MODES[mode]
    rng = random.Random(12)
    torch.manual_seed(0)
    body = enc(fuzz_payload())
    limits = WireLimits(max_tensor_elements=1000)
    outcomes = {"decoded": 0, "refused": 0}
    for i in range(3000):
        b = bytearray(body)
        op = i % 4
        if op == 0:  # flip a few bytes
            for _ in range(rng.randint(1, 4)):
                b[rng.randrange(len(b))] = rng.randrange(256)
        elif op == 1:  # cut and splice
            a, c = sorted(rng.randrange(len(b)) for _ in range(2))
            b = b[:a] + b[c:]
        elif op == 2:  # insert junk
            pos = rng.randrange(len(b))
            b[pos:pos] = bytes(rng.randrange(256) for _ in range(rng.randint(1, 8)))
        else:  # overwrite an 8-byte length field with a random size
            pos = (
                rng.choice([4, 12 + struct.unpack("<Q", body[4:12])[0]])
                if mode == "binary"
                else rng.randrange(len(b) - 8)
            )
            b[pos : pos + 8] = struct.pack("<Q", rng.choice([0, 1, 7, 2**31, 2**63, rng.randrange(len(b))]))
        try:
            dec(bytes(b), limits)
        except WireError:
            outcomes["refused"] += 1
        else:
            outcomes["decoded"] += 1
    assert outcomes["refused"] > 1000  # the fuzzing did produce broken bodies
    for _ in range(300):  # pure noise: refused (a few bytes may happen to be JSON, such as b"7")
        junk = bytes(rng.randrange(256) for _ in range(rng.randint(0, 64)))
        try:
            dec(MAGIC + junk if mode == "binary" and rng.random() < 0.5 else junk, limits)
        except WireError:
            outcomes["refused"] += 1
