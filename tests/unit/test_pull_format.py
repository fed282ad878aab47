"""The pull transport's wire format (asyncpp.pp.pull_format) in one process: headers, encoding values
into meta + payload and back, error bodies, and the errors for what the format does not allow."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from pull_helpers import same_value

from asyncpp.pp import pull_format as fmt


def _roundtrip(value: Any) -> Any:
    enc = fmt.encode(value)
    assert enc.status == fmt.OK and enc.body is not None and enc.body.dtype == torch.uint8
    return fmt.decode(enc.dtype, enc.meta_words, enc.payload_bytes, enc.body)


# ---------------------------------------------------------------------------------------------- headers


def test_constants_are_the_wire_format():
    # these are on the wire between ranks: changing any of them breaks mixed versions
    assert fmt.HEADER_WORDS == 12 and fmt.HEADER_BYTES == 96
    assert (fmt.MAGIC, fmt.TAG_HEADER, fmt.TAG_BODY) == (0x41505050, 0x5A50, 0x5A51)
    assert (fmt.PULL, fmt.CANCEL, fmt.REPLY, fmt.DRAIN, fmt.BYE) == (1, 2, 3, 4, 5)
    assert (fmt.OK, fmt.ERR, fmt.WHOLE) == (0, 1, 2) and (fmt.LEAF, fmt.TUPLE, fmt.LIST) == (0, 1, 2)
    assert (fmt.SEL_INDEX, fmt.SEL_VIEW) == (1, 2)
    assert (fmt.K_INT, fmt.K_SLICE, fmt.K_NONE, fmt.K_ELLIPSIS) == (0, 1, 2, 3)
    first = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.uint8, torch.int8]
    first += [torch.int16, torch.int32, torch.int64, torch.bool, torch.complex64, torch.complex128]
    assert list(fmt.DTYPES[: len(first)]) == first
    assert all(fmt.DTYPE_CODE[d] == i for i, d in enumerate(fmt.DTYPES))


def test_header_words_and_parse():
    h = fmt.header(fmt.REPLY, 1, 7, 42, 4096 + 3, 9, fmt.ERR, 2, 4, 100, 132)
    assert h.dtype == torch.int64 and h.shape == (fmt.HEADER_WORDS,)
    assert h.tolist() == [fmt.MAGIC, fmt.REPLY, 1, 7, 42, 4096 + 3, 9, fmt.ERR, 2, 4, 100, 132]
    parsed = fmt.read_header(h.tolist())
    assert parsed == fmt.Header(fmt.REPLY, 1, 7, 42, 4099, 9, fmt.ERR, 2, 4, 100, 132)
    assert parsed.visit == 4099 and parsed.ticket == 9 and parsed.body_bytes == 132
    # the words after the sender default to zero
    assert fmt.header(fmt.BYE, 2).tolist() == [fmt.MAGIC, fmt.BYE, 2] + [0] * 9
    assert fmt.read_header(fmt.header(fmt.DRAIN, 0, 5).tolist()) == fmt.Header(fmt.DRAIN, 0, 5)


def test_bad_headers_raise_clear_errors():
    words = fmt.header(fmt.PULL, 1, 2, 3, 4, 5).tolist()
    with pytest.raises(fmt.WireError, match=r"bad magic 0x1234 \(expected 0x41505050\)"):
        fmt.read_header([0x1234, *words[1:]])
    with pytest.raises(fmt.WireError, match="a header has 12 words, not 11"):
        fmt.read_header(words[:-1])
    with pytest.raises(fmt.UnknownKind, match="unknown message kind 99 from stage 1") as got:
        fmt.read_header([fmt.MAGIC, 99, *words[2:]])
    assert got.value.header.kind == 99 and got.value.header.sender == 1 and got.value.header.ticket == 5
    assert issubclass(fmt.UnknownKind, fmt.WireError) and issubclass(fmt.WireError, ValueError)
    with pytest.raises(fmt.WireError, match=r"unknown message kind 0: the kinds are 1 \(PULL\)"):
        fmt.header(0, 1)


# ---------------------------------------------------------------------------------------------- values


@pytest.mark.parametrize("dtype", fmt.DTYPES, ids=str)
def test_every_dtype_round_trips(dtype):
    base = torch.arange(-3, 9, dtype=torch.float32).reshape(3, 4) / 2
    if dtype.is_complex:
        value = torch.complex(base, -base).to(dtype)
    elif dtype == torch.bool:
        value = base > 0
    elif not dtype.is_floating_point and not dtype.is_signed:
        value = base.abs().to(torch.int64).to(dtype)
    else:
        value = base.to(dtype)
    enc = fmt.encode(value)
    assert fmt.DTYPES[enc.dtype] == dtype
    assert enc.payload_bytes == value.numel() * value.element_size()
    back = _roundtrip(value)
    assert same_value(back, value)
    assert same_value(_roundtrip((value, value[1:])), (value, value[1:]))


def test_nesting_shapes_and_layouts_round_trip():
    g = torch.Generator().manual_seed(7)
    base = torch.randn(4, 6, generator=g)
    values = [
        torch.randn(3, 4, generator=g),
        torch.tensor(2.5),  # 0-dim
        torch.empty(0, 4, dtype=torch.float16),  # no elements
        base.t(),  # not contiguous
        base[:, ::2],  # strided
        torch.arange(7, dtype=torch.int64) + (1 << 40),
        (torch.randn(2, 3, generator=g), torch.randn(4, generator=g)),
        [torch.tensor([1, -2]), (torch.tensor([[3, 4]]), torch.tensor(5))],
        (torch.ones(2, 2, dtype=torch.bfloat16),) * 2,  # one tensor twice
        ((), [], ([],)),  # containers without tensors
        (),
        [],
    ]
    for value in values:
        back = _roundtrip(value)
        assert same_value(back, value), value
    assert _roundtrip(base.t()).is_contiguous()


def test_meta_layout_and_alignment():
    value = [torch.zeros(2, 3), (torch.ones(5),)]
    enc = fmt.encode(value)
    # [LIST, 2, [LEAF, 2, 2, 3], [TUPLE, 1, [LEAF, 1, 5]]] is 11 words, padded to 12 (16-byte payload)
    assert enc.meta_words == 12
    meta = enc.body[: 8 * enc.meta_words].view(torch.int64).tolist()
    assert meta == [fmt.LIST, 2, fmt.LEAF, 2, 2, 3, fmt.TUPLE, 1, fmt.LEAF, 1, 5, 0]
    assert enc.payload_bytes == 11 * 4 and enc.body.numel() == 8 * 12 + 11 * 4
    payload = enc.body[8 * enc.meta_words :].view(torch.float32)
    assert payload.tolist() == [0.0] * 6 + [1.0] * 5
    assert fmt.encode(torch.ones(3)).meta_words == 4  # [LEAF, 1, 3] + padding
    header = list(fmt.HEADER.unpack(enc.reply_header(1, 7, 9, 3, 11)))
    assert header == [fmt.MAGIC, fmt.REPLY, 1, 7, 9, 3, 11, fmt.OK, enc.dtype, 12, 44, 8 * 12 + 44]


def test_encode_copies_and_decode_views_the_body():
    source = torch.arange(5.0)
    enc = fmt.encode(source)
    source.add_(100)  # the owner keeps a private copy
    back = fmt.decode(enc.dtype, enc.meta_words, enc.payload_bytes, enc.body)
    assert back.tolist() == [0.0, 1.0, 2.0, 3.0, 4.0]
    enc.body[8 * enc.meta_words :].view(torch.float32)[0] = -1.0
    assert back[0].item() == -1.0  # decode hands out views of the received body
    copy = fmt.decode_copy(enc)
    copy.add_(1)  # decode_copy (the owner reading its own buffer) hands out a private copy
    assert fmt.decode_copy(enc).tolist() == [-1.0, 1.0, 2.0, 3.0, 4.0]


def test_unsupported_values_are_refused_with_the_reason():
    with pytest.raises(fmt.Refused, match=r"value\[1\]\[1\] is a object: only tensors, None, Python numbers"):
        fmt.encode([torch.ones(1), [torch.ones(1), object()]])
    with pytest.raises(fmt.Refused, match=r"value\['a'\] is a torch\.sparse_coo tensor; only dense tensors"):
        fmt.encode({"a": torch.eye(2).to_sparse()})
    with pytest.raises(fmt.Refused, match="value is a dict with a int key; only string keys"):
        fmt.encode({1: torch.ones(1)})
    with pytest.raises(fmt.Refused, match=r"value\[0\] is a int"):
        fmt.encode((1 << 70,))  # (beyond int64)


def test_a_call_with_mixed_dtypes_constants_and_keywords_round_trips():
    """A module's ``.inputs``, ``(args, kwargs)``: tensors of several dtypes (each at a multiple of
    its item size in the payload), constants and a dict cross stages as they are."""
    g = torch.Generator().manual_seed(5)
    value = (
        (torch.randn(3, 4, generator=g), None, True, -7, 0.25, "naïve ✓"),
        {
            "positions": torch.arange(3, dtype=torch.int64),
            "mask": torch.tensor([True, False, True]),
            "half": torch.randn(2, generator=g).to(torch.float16),
            "nested": [{"k": (torch.ones(1, dtype=torch.float64),)}, {}],
            "empty": torch.empty(0, 2, dtype=torch.int32),
        },
    )
    enc = fmt.encode(value)
    assert fmt.DTYPES[enc.dtype] == torch.float32  # the first tensor's: the others say their own
    back = _roundtrip(value)
    assert same_value(back, value)
    assert back[0][1:] == value[0][1:] and [type(x) for x in back[0]] == [type(x) for x in value[0]]
    assert list(back[1]) == list(value[1]) and type(back[1]["nested"][0]["k"]) is tuple
    received = bytearray(fmt.buffer_of(enc.body))  # views of the received bytes, every dtype
    again = fmt.decode(enc.dtype, enc.meta_words, enc.payload_bytes, received)
    assert same_value(again, value)
    for x in (None, 3, "s", {}, {"a": 1.5}):  # no tensor at all
        assert _roundtrip(x) == x


def test_bad_bodies_raise_wire_errors():
    enc = fmt.encode(torch.ones(2))
    with pytest.raises(fmt.WireError, match="unknown dtype code 99"):
        fmt.decode(99, enc.meta_words, enc.payload_bytes, enc.body)
    with pytest.raises(fmt.WireError, match="unknown dtype code -1"):
        fmt.decode(-1, enc.meta_words, enc.payload_bytes, enc.body)
    bad = enc.body.clone()
    bad[:8].view(torch.int64)[0] = 77  # no node kind
    with pytest.raises(fmt.WireError, match="unknown node kind 77 at word 0"):
        fmt.decode(enc.dtype, enc.meta_words, enc.payload_bytes, bad)
    with pytest.raises(fmt.WireError, match="not an ok value: boom"):
        fmt.decode_copy(fmt.error_body("boom"))
    short = bytearray(fmt.buffer_of(enc.body))[:-1]  # a body cut short on the way
    with pytest.raises(
        fmt.WireError,
        match="a body of 39 bytes cannot hold 4 meta words and a torch.float32 payload of 8 bytes",
    ):
        fmt.decode(enc.dtype, enc.meta_words, enc.payload_bytes, short)


def test_received_bytes_decode_to_views_of_them():
    value = (torch.arange(6.0).view(2, 3), [torch.ones(4), torch.zeros(0)])
    enc = fmt.encode(value)
    received = bytearray(fmt.buffer_of(enc.body))  # what a wire hands the listener
    back = fmt.decode(enc.dtype, enc.meta_words, enc.payload_bytes, received)
    assert torch.equal(back[0], value[0]) and torch.equal(back[1][0], value[1][0])
    assert back[1][1].shape == (0,) and type(back[1]) is list
    received[8 * enc.meta_words : 8 * enc.meta_words + 4] = bytes(4)  # the first float, zeroed
    assert back[0][0, 0].item() == 0.0 and back[0][0, 1].item() == 1.0


# ---------------------------------------------------------------------------------------------- errors


def test_error_bodies():
    enc = fmt.error_body("stage 1 could not produce b: naïve ✓")
    assert enc.status == fmt.ERR and enc.message == "stage 1 could not produce b: naïve ✓"
    assert enc.body is not None and enc.body.dtype == torch.uint8
    assert fmt.error_message(enc.body) == enc.message
    assert list(fmt.HEADER.unpack(enc.reply_header(0, 5, 6, 7, 8))) == [
        fmt.MAGIC,
        fmt.REPLY,
        0,
        5,
        6,
        7,
        8,
        fmt.ERR,
        0,
        0,
        0,
        enc.body.numel(),
    ]
    assert fmt.error_message(fmt.error_body("").body) == "error"  # a body is never empty
    assert fmt.error_message(None) == ""
    long = fmt.error_body("x" * (fmt.MAX_MESSAGE + 10))
    assert long.body.numel() == fmt.MAX_MESSAGE and len(long.message) == fmt.MAX_MESSAGE + 10


# ---------------------------------------------------------------------------------------------- selections


def test_selections_round_trip_through_their_words():
    from asyncpp.engines.vllm.views import LastPosition, SplitResidual

    ops = (
        ("index", 0),
        ("index", -1),
        ("index", slice(None)),
        ("index", slice(2, None, 3)),
        ("index", (slice(None), -1)),
        ("index", (Ellipsis, None, 5)),
        ("index", ()),
        ("index", "hidden_states"),
        ("view", SplitResidual()),
    )
    body = fmt.encode_selection(ops)
    assert type(body) is bytes and len(body) % 8 == 0
    back = fmt.decode_selection(fmt.words_of(body))
    assert back[:-1] == ops[:-1] and type(back[-1][1]) is SplitResidual
    for key in (True, 1.5, torch.tensor([0]), [0, 1], slice(0, 2.5), 1 << 70, b"a"):
        assert not fmt.selectable_key(key), key  # (a bool is not the int it equals, as an index)
    assert fmt.selectable_view(SplitResidual()) and not fmt.selectable_view(LastPosition())
    assert not fmt.selectable_view(object())
    with pytest.raises(fmt.WireError, match="cannot travel"):
        fmt.encode_selection((("index", True),))
    for bad, match in (
        ([fmt.SEL_VIEW, 12345], "unknown view"),
        ([9], "unknown operation 9"),
        ([fmt.SEL_INDEX, 1, 7, 0], "unknown key kind 7"),
        ([fmt.SEL_INDEX, 2, fmt.K_INT], "ends inside"),
    ):
        with pytest.raises(fmt.WireError, match=match):
            fmt.decode_selection(bad)
    with pytest.raises(fmt.WireError, match="not a run of int64 words"):
        fmt.words_of(b"\x01\x02\x03")


def test_the_owner_selects_the_part_or_hands_back_the_whole_value():
    from asyncpp.engines.vllm.views import SplitResidual

    mlp, residual = torch.randn(5, 4), torch.randn(5, 4)
    entry = fmt.encode((mlp, residual))
    row = fmt.select(entry, (("index", 0), ("index", -1)))
    assert row.status == fmt.OK and row.payload_bytes == 4 * 4
    assert torch.equal(fmt.decode(row.dtype, row.meta_words, row.payload_bytes, row.body), mlp[-1])
    stream = fmt.select(entry, (("view", SplitResidual()), ("index", (slice(None), -1))))
    got = fmt.decode(stream.dtype, stream.meta_words, stream.payload_bytes, stream.body)
    assert torch.equal(got, (mlp + residual).unsqueeze(0)[:, -1])
    assert torch.equal(residual, fmt.decode_copy(entry)[1])  # the stored value is left as it was
    misfit = fmt.select(entry, (("index", 0), ("index", 9)))  # fails here as it would there
    assert misfit.status == fmt.WHOLE and misfit.body is entry.body
    with pytest.raises(IndexError):
        fmt.apply_selection(
            fmt.decode(misfit.dtype, misfit.meta_words, misfit.payload_bytes, misfit.body),
            (("index", 0), ("index", 9)),
        )
    error = fmt.error_body("gone")
    assert fmt.select(error, (("index", 0),)) is error and fmt.select(entry, ()) is entry
    # a call's (args, kwargs): a keyword picks its tensor, of its own dtype, out of the bytes
    call = ((mlp,), {"positions": torch.arange(5), "hidden_states": residual, "flag": True})
    entry = fmt.encode(call)
    for ops, want in (
        ((("index", 1), ("index", "positions"), ("index", -1)), call[1]["positions"][-1]),
        ((("index", 1), ("index", "hidden_states"), ("index", 2)), residual[2]),
        ((("index", 0), ("index", 0)), mlp),
    ):
        part = fmt.select(entry, ops)
        assert part.status == fmt.OK and part.payload_bytes == want.numel() * want.element_size()
        assert same_value(fmt.decode(part.dtype, part.meta_words, part.payload_bytes, part.body), want)
    flag = fmt.select(entry, (("index", 1), ("index", "flag")))  # a constant: through torch's path
    assert (
        flag.status == fmt.OK
        and fmt.decode(flag.dtype, flag.meta_words, flag.payload_bytes, flag.body) is True
    )
    assert fmt.select(entry, (("index", 1), ("index", "nope"))).status == fmt.WHOLE


def test_integer_selections_give_the_bytes_torch_would():
    """The owner cuts integer-only selections out of the stored bytes; the reply must be exactly
    what selecting with torch and encoding gives, for every dtype and position, and a selection
    that does not fit still comes back whole."""
    g = torch.Generator().manual_seed(3)
    values = [
        (torch.randn(5, 4, generator=g), torch.randn(5, 4, generator=g)),
        torch.randn(2, 3, 4, generator=g).to(torch.bfloat16),
        [torch.arange(6, dtype=torch.int64).view(2, 3), (torch.ones(3, dtype=torch.int64),)],
        torch.rand(4, 2, generator=g) > 0.5,
        torch.tensor(1.5),
    ]
    selections = [
        (("index", 0), ("index", -1)),
        (("index", 1), ("index", (2, 3))),
        (("index", -1),),
        (("index", (1, -1, 0)),),
        (("index", 1), ("index", 0), ("index", 2)),
        (("index", 0),),
        (("index", 1), ("index", 0)),
        (("index", 9),),
        (("index", (0, 0, 0, 0)),),
        (("index", ()),),
    ]
    checked = 0
    for value in values:
        entry = fmt.encode(value)
        for ops in selections:
            try:
                want = fmt.encode(fmt.apply_selection(value, ops))
            except (IndexError, TypeError, fmt.Refused):
                want = None
            got = fmt.select(entry, ops)
            if want is None:
                assert got.status == fmt.WHOLE, (value, ops)
                continue
            assert got.status == fmt.OK, (value, ops)
            assert (got.dtype, got.meta_words, got.payload_bytes) == (
                want.dtype,
                want.meta_words,
                want.payload_bytes,
            )
            assert torch.equal(got.body, want.body), (value, ops)
            checked += 1
    assert checked >= 20
    # the fast cut is a private copy: the stored value does not change with it
    entry = fmt.encode(torch.zeros(3, 2))
    part = fmt.select(entry, (("index", 1),))
    part.body.fill_(7)
    assert torch.equal(fmt.decode_copy(entry), torch.zeros(3, 2))
