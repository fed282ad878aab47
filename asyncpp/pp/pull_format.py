"""The wire format of the cross-stage pull transport (:mod:`asyncpp.pp.pulls`), as pure functions.

Nothing here sends, receives or starts a thread: these are the bytes both ends agree on.

* Every message starts with a fixed-size int64 header of :data:`HEADER_WORDS` words, sent with the
  gloo message tag :data:`TAG_HEADER`:
  ``[magic, kind, sender, req, key, visit, ticket, status, dtype, meta_words, payload_bytes,
  body_bytes]``. A value is addressed by (req, key, visit): the request's number, the location's wait
  key (module index * 4 + kind) and the visit (the request's round and the call number of the
  location within it, :func:`asyncpp.pp.stage.visit_of`).
* Kinds: :data:`PULL` (requester -> owner), :data:`CANCEL` (the requester gave up: the owner drops
  the waiting pull), :data:`REPLY` (owner -> requester, echoes the ticket), :data:`DRAIN` (request
  end, to every peer), :data:`BYE` (the last message a rank sends to a peer).
* A message whose header and body together fit in :data:`FRAME_BYTES` travels as one gloo message
  (the header's bytes, then the body's) with :data:`TAG_HEADER`, received into a buffer of that
  size; a longer one is its header alone, followed at once by one uint8 body with the gloo message
  tag :data:`TAG_BODY` (:func:`inline`). Only REPLY and PULL carry bodies. An ok body (status :data:`OK`) is ``meta (int64 words, padded to 16 bytes) +
  payload``: the payload is every tensor of the value flattened into one buffer, each starting at a
  multiple of its item size; meta encodes the structure and shapes: ``[LEAF, ndim, *shape]`` (a
  tensor of the header's dtype), ``[TLEAF, ndim, dtype, *shape]`` (of another dtype),
  ``[TUPLE|LIST, n, *children]``, ``[DICT, n, *(key, child)]`` (string keys), and constants:
  ``[NONE, 0]``, ``[BOOL, 0|1]``, ``[INT, v]``, ``[FLOAT, IEEE bits]``, ``[STR, n, *code points]``.
  An error body (status :data:`ERR`) is the UTF-8 message. Status :data:`WHOLE` is
  an ok body of the whole value where the pull asked for a selection the owner could not apply:
  the requester applies it, so that it fails there as it would on one stage.
* A PULL with ``body_bytes > 0`` carries a *selection* in the same way: what the requester applies
  to the value first (indexing, slicing, a standard view's remote form), which the owner applies
  instead, so that only the selected part crosses. The body is int64 words: per operation
  ``[SEL_INDEX, n, *key items]`` or ``[SEL_VIEW, code]`` (:func:`encode_selection`).
"""

from __future__ import annotations

import math
import struct
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch

from ..kernel.errors import AsyncppError
from ..kernel.views import ValueView, view_code, view_of_code

Buffer = bytes | bytearray | memoryview  # a message body as it crosses: raw bytes

MAGIC = 0x41505050
TAG_HEADER = 0x5A50  # gloo message tag of every header
TAG_BODY = 0x5A51  # gloo message tag of a reply's body
HEADER_WORDS = 12
HEADER_BYTES = HEADER_WORDS * 8
(
    H_MAGIC,
    H_KIND,
    H_SENDER,
    H_REQ,
    H_KEY,
    H_VISIT,
    H_TICKET,
    H_STATUS,
    H_DTYPE,
    H_META,
    H_PAYLOAD,
    H_BODY,
) = range(HEADER_WORDS)

PULL, CANCEL, REPLY, DRAIN, BYE = 1, 2, 3, 4, 5
KIND_NAMES = {PULL: "PULL", CANCEL: "CANCEL", REPLY: "REPLY", DRAIN: "DRAIN", BYE: "BYE"}
OK, ERR, WHOLE = 0, 1, 2
LEAF, TUPLE, LIST = 0, 1, 2
TLEAF, DICT, NONE, BOOL, INT, FLOAT, STR = 3, 4, 5, 6, 7, 8, 9

MAX_MESSAGE = 1 << 16  # bytes of an error body at most
FRAME_BYTES = HEADER_BYTES + (1 << 16)  # a header and a body up to 64 KiB: one gloo message
HEADER = struct.Struct(f"<{HEADER_WORDS}q")  # a header's bytes (little-endian int64 words)


def inline(body_bytes: int) -> bool:
    """Whether a body of this size travels in its header's message (else in one of its own)."""
    return HEADER_BYTES + body_bytes <= FRAME_BYTES


# Same order on every rank (same torch build): the index is the wire code.
DTYPES: tuple[torch.dtype, ...] = tuple(
    d
    for d in (
        getattr(torch, name, None)
        for name in (
            "float32",
            "float64",
            "float16",
            "bfloat16",
            "uint8",
            "int8",
            "int16",
            "int32",
            "int64",
            "bool",
            "complex64",
            "complex128",
            "uint16",
            "uint32",
            "uint64",
            "float8_e4m3fn",
            "float8_e5m2",
            "float8_e4m3fnuz",
            "float8_e5m2fnuz",
        )
    )
    if isinstance(d, torch.dtype)
)
DTYPE_CODE = {d: i for i, d in enumerate(DTYPES)}


class WireError(AsyncppError, ValueError):
    """A message that does not follow the pull wire format."""


class UnknownKind(WireError):
    """A header whose magic is right but whose kind is not one this format knows."""

    def __init__(self, message: str, header: Header):
        super().__init__(message)
        self.header = header


class Refused(AsyncppError, ValueError):
    """A value that cannot cross stages; the message says why."""


class Header(NamedTuple):
    """One parsed header (every word but the magic)."""

    kind: int
    sender: int
    req: int = 0
    key: int = 0
    visit: int = 0
    ticket: int = 0
    status: int = 0
    dtype: int = 0
    meta_words: int = 0
    payload_bytes: int = 0
    body_bytes: int = 0


def header_bytes(
    kind: int,
    sender: int,
    req: int = 0,
    key: int = 0,
    visit: int = 0,
    ticket: int = 0,
    status: int = 0,
    dtype: int = 0,
    meta_words: int = 0,
    payload_bytes: int = 0,
    body_bytes: int = 0,
) -> bytes:
    """A header as the bytes that go on the wire."""
    if kind not in KIND_NAMES:
        raise WireError(f"unknown message kind {kind}: the kinds are {_kinds()}")
    return HEADER.pack(
        MAGIC, kind, sender, req, key, visit, ticket, status, dtype, meta_words, payload_bytes, body_bytes
    )


def header(*args: int, **kwargs: int) -> torch.Tensor:
    """A header as an int64 tensor (:func:`header_bytes`' arguments)."""
    return torch.frombuffer(bytearray(header_bytes(*args, **kwargs)), dtype=torch.int64)


def read_header(words: Sequence[int]) -> Header:
    """Parse a received header's words. Raises WireError for a wrong length or magic, and its
    subclass UnknownKind (carrying the parsed header) for a kind this format does not know."""
    if len(words) != HEADER_WORDS:
        raise WireError(f"a header has {HEADER_WORDS} words, not {len(words)}: {list(words)}")
    if words[H_MAGIC] != MAGIC:
        raise WireError(f"bad magic {words[H_MAGIC]:#x} (expected {MAGIC:#x}) in header {list(words)}")
    parsed = Header(*words[H_KIND:])
    if parsed.kind not in KIND_NAMES:
        raise UnknownKind(f"unknown message kind {parsed.kind} from stage {parsed.sender}", parsed)
    return parsed


def _kinds() -> str:
    return ", ".join(f"{code} ({name})" for code, name in KIND_NAMES.items())


@dataclass
class Encoded:
    """One value (or failure), serialized once for the wire: a REPLY's status, the header words that
    describe the body, and the body itself. ``message`` is an error's text."""

    status: int
    dtype: int = 0
    meta_words: int = 0
    payload_bytes: int = 0
    body: torch.Tensor | None = None
    message: str = ""
    _decoded: Any = field(default=None, repr=False, compare=False)
    _layout: Any = field(default=None, repr=False, compare=False)
    _data: memoryview | None = field(default=None, repr=False, compare=False)

    def data(self) -> memoryview | None:
        """The body's bytes (no copy; made once): what a wire sends."""
        if self._data is None and self.body is not None:
            self._data = buffer_of(self.body)
        return self._data

    def value(self) -> Any:
        """The ok value as views of ``body`` (decoded once; the owner selects parts from it)."""
        if self._decoded is None:
            self._decoded = decode(self.dtype, self.meta_words, self.payload_bytes, self.body)
        return self._decoded

    def reply_header(self, sender: int, req: int, key: int, visit: int, ticket: int) -> bytes:
        """The REPLY header announcing this value to the pull ``ticket``, as bytes."""
        body = 0 if self.body is None else self.body.numel()
        return header_bytes(
            REPLY,
            sender,
            req,
            key,
            visit,
            ticket,
            self.status,
            self.dtype,
            self.meta_words,
            self.payload_bytes,
            body,
        )


def error_body(message: str) -> Encoded:
    """A failure for the pullers: the message, UTF-8, cut to :data:`MAX_MESSAGE` bytes (never empty)."""
    data = message.encode("utf-8", "replace")[:MAX_MESSAGE] or b"error"
    return Encoded(ERR, body=torch.frombuffer(bytearray(data), dtype=torch.uint8), message=message)


def error_message(body: torch.Tensor | Buffer | None) -> str:
    """The text of an error body, a uint8 tensor or the received bytes (empty for none)."""
    if body is None:
        return ""
    return bytes(buffer_of(body) if isinstance(body, torch.Tensor) else body).decode("utf-8", "replace")


def buffer_of(t: torch.Tensor) -> memoryview:
    """A tensor's bytes, without a copy (they stay valid while the view is held)."""
    return memoryview(t.contiguous().numpy()).cast("B")


def _path(path: tuple[int, ...]) -> str:
    return "value" + "".join(f"[{i!r}]" for i in path)


def encode(value: Any) -> Encoded:
    """Serialize a tensor, a constant (None, bool, int, float, str) or a nested tuple, list or dict
    (string keys) of them into one private CPU buffer; tensors keep their own dtypes. Raises
    Refused for anything else (other objects, sparse tensors)."""
    meta: list[int] = []
    leaves: list[torch.Tensor] = []
    first: list[torch.dtype] = []  # the header's dtype: the first tensor's

    def walk(v: Any, path: tuple[Any, ...]) -> None:
        if isinstance(v, torch.Tensor):
            if v.layout != torch.strided:
                raise Refused(f"{_path(path)} is a {v.layout} tensor; only dense tensors can cross stages")
            if v.dtype not in DTYPE_CODE:
                raise Refused(f"{_path(path)} has dtype {v.dtype}, which cannot cross stages")
            if not first:
                first.append(v.dtype)
            if v.dtype == first[0]:
                meta.extend((LEAF, v.dim(), *v.shape))
            else:
                meta.extend((TLEAF, v.dim(), DTYPE_CODE[v.dtype], *v.shape))
            leaves.append(v)
        elif type(v) in (tuple, list):
            meta.extend((TUPLE if type(v) is tuple else LIST, len(v)))
            for i, item in enumerate(v):
                walk(item, (*path, i))
        elif type(v) is dict:
            meta.extend((DICT, len(v)))
            for k, item in v.items():
                if type(k) is not str:
                    raise Refused(
                        f"{_path(path)} is a dict with a {type(k).__name__} key; only string keys cross stages"
                    )
                meta.extend((STR, len(k), *map(ord, k)))
                walk(item, (*path, k))
        elif v is None:
            meta.extend((NONE, 0))
        elif type(v) is bool:
            meta.extend((BOOL, int(v)))
        elif type(v) is int and _int_ok(v):
            meta.extend((INT, v))
        elif type(v) is float:
            meta.extend((FLOAT, struct.unpack("<q", struct.pack("<d", v))[0]))
        elif type(v) is str:
            meta.extend((STR, len(v), *map(ord, v)))
        else:
            raise Refused(
                f"{_path(path)} is a {type(v).__name__}: only tensors, None, Python numbers and strings, "
                "and tuples, lists and dicts of them can cross stages"
            )

    walk(value, ())
    dtype = first[0] if first else torch.float32
    if len(meta) % 2:
        meta.append(0)  # 16-byte aligned payload, so a view as any dtype is legal
    # one copy of every leaf into one buffer, after the meta words (torch.cat: the cheapest way),
    # each leaf at a multiple of its item size
    parts = [torch.tensor(meta, dtype=torch.int64).view(torch.uint8)]
    offset = 0
    for leaf in leaves:
        pad = -offset % leaf.element_size()
        if pad:
            parts.append(torch.zeros(pad, dtype=torch.uint8))
        part = leaf.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
        parts.append(part)
        offset += pad + part.numel()
    body = torch.cat(parts)
    return Encoded(OK, DTYPE_CODE[dtype], len(meta), offset, body)


def decode(dtype_code: int, meta_words: int, payload_bytes: int, body: torch.Tensor | Buffer) -> Any:
    """Rebuild a value from an ok body (a uint8 tensor, or the received bytes: a writable buffer);
    its tensors are views of ``body``. Raises WireError for an unknown dtype code or a body too
    short for its header."""
    if not 0 <= dtype_code < len(DTYPES):
        raise WireError(f"reply carries an unknown dtype code {dtype_code}")
    data = buffer_of(body) if isinstance(body, torch.Tensor) else memoryview(body)
    dtype = DTYPES[dtype_code]
    meta_bytes = 8 * meta_words
    if meta_bytes + payload_bytes > len(data):
        raise WireError(
            f"a body of {len(data)} bytes cannot hold {meta_words} meta words and a {dtype} payload of "
            f"{payload_bytes} bytes"
        )
    meta = data[:meta_bytes].cast("q").tolist()
    if meta and meta[0] == LEAF and len(meta) - 2 - meta[1] in (0, 1):  # one tensor (the common case)
        shape = meta[2 : 2 + meta[1]]
        if math.prod(shape) * dtype.itemsize == payload_bytes:
            n = payload_bytes // dtype.itemsize
            if not n:
                return torch.empty(shape, dtype=dtype)
            return torch.frombuffer(data, dtype=dtype, offset=meta_bytes, count=n).view(shape)
    raw = (
        torch.frombuffer(data, dtype=torch.uint8, offset=meta_bytes, count=payload_bytes)
        if payload_bytes
        else torch.empty(0, dtype=torch.uint8)
    )
    return _build(_structure(meta, dtype_code), raw)


class _Leaf(NamedTuple):
    """A tensor in a value's structure: its shape, where its bytes start in the payload, its dtype."""

    shape: tuple[int, ...]
    offset: int
    dtype: int


class _Const(NamedTuple):
    """A constant in a value's structure (None, a bool, an int, a float, a string)."""

    value: Any


def _structure(meta: Sequence[int], dtype_code: int) -> Any:
    """The structure the meta words describe: a :class:`_Leaf` per tensor, a :class:`_Const` per
    constant, a tuple, list or dict of children per container. Raises WireError for an unknown
    node kind."""
    pos, offset = 0, 0

    def walk() -> Any:
        nonlocal pos, offset
        kind, n = meta[pos], meta[pos + 1]
        pos += 2
        if kind == LEAF or kind == TLEAF:
            code = dtype_code
            if kind == TLEAF:
                code = meta[pos]
                pos += 1
                if not 0 <= code < len(DTYPES):
                    raise WireError(f"reply meta has an unknown dtype code {code} at word {pos - 1}")
            shape = tuple(meta[pos : pos + n])
            pos += n
            size = DTYPES[code].itemsize
            offset += -offset % size
            leaf = _Leaf(shape, offset, code)
            offset += math.prod(shape) * size
            return leaf
        if kind in (TUPLE, LIST):
            items = [walk() for _ in range(n)]
            return tuple(items) if kind == TUPLE else items
        if kind == DICT:
            out = {}
            for _ in range(n):
                key = walk()
                out[key.value] = walk()
            return out
        if kind == STR:
            text = "".join(map(chr, meta[pos : pos + n]))
            pos += n
            return _Const(text)
        if kind == NONE:
            return _Const(None)
        if kind == BOOL:
            return _Const(bool(n))
        if kind == INT:
            return _Const(n)
        if kind == FLOAT:
            return _Const(struct.unpack("<d", struct.pack("<q", n))[0])
        raise WireError(f"reply meta has an unknown node kind {kind} at word {pos - 2}")

    return walk()


def _build(node: Any, payload: torch.Tensor) -> Any:
    """The value of a structure: its leaves as views of ``payload`` (bytes)."""
    t = type(node)
    if t is _Leaf:
        dtype = DTYPES[node.dtype]
        nbytes = math.prod(node.shape) * dtype.itemsize
        if not nbytes:
            return torch.empty(node.shape, dtype=dtype)
        return payload[node.offset : node.offset + nbytes].view(dtype).view(node.shape)
    if t is _Const:
        return node.value
    if t is dict:
        return {k: _build(child, payload) for k, child in node.items()}
    return t(_build(child, payload) for child in node)


def decode_copy(encoded: Encoded) -> Any:
    """A fresh copy of an encoded ok value (the owner reading its own buffer), private to the caller.
    Raises WireError for an error."""
    if encoded.status != OK or encoded.body is None:
        raise WireError(f"not an ok value: {encoded.message or 'no body'}")
    return decode(encoded.dtype, encoded.meta_words, encoded.payload_bytes, encoded.body.clone())


# ---------------------------------------------------------------------------------------------- selections

# A selection is a tuple of operations applied in turn: ("index", key) is ``value[key]`` for a key
# made of ints, slices of ints, None, Ellipsis and strings (or a tuple of them); ("view", view) is
# ``view.remote(value)`` for a stateless ValueView.
SEL_INDEX, SEL_VIEW = 1, 2
K_INT, K_SLICE, K_NONE, K_ELLIPSIS, K_STR = 0, 1, 2, 3, 4
_INT64 = (-(1 << 63), (1 << 63) - 1)


def selectable_key(key: Any) -> bool:
    """Whether ``value[key]`` can travel with a pull (and means the same on the owner)."""
    items = key if type(key) is tuple else (key,)
    return all(_item_words(k) is not None for k in items)


def selectable_view(view: Any) -> bool:
    """Whether ``view.remote`` can travel with a pull: a stateless view that allows it."""
    return isinstance(view, ValueView) and view.travels and not getattr(view, "__dict__", None)


def _int_ok(v: Any) -> bool:
    return type(v) is int and _INT64[0] < v <= _INT64[1]


def _item_words(k: Any) -> list[int] | None:
    if _int_ok(k):
        return [K_INT, k]
    if k is None:
        return [K_NONE]
    if k is Ellipsis:
        return [K_ELLIPSIS]
    if type(k) is str:
        return [K_STR, len(k), *map(ord, k)]
    if type(k) is slice and all(b is None or _int_ok(b) for b in (k.start, k.stop, k.step)):
        return [K_SLICE] + [_INT64[0] if b is None else b for b in (k.start, k.stop, k.step)]
    return None


def encode_selection(ops: Sequence[tuple[str, Any]]) -> bytes:
    """A selection as a PULL's body: int64 words, as bytes."""
    words: list[int] = []
    for op, arg in ops:
        if op == "index":
            items = arg if type(arg) is tuple else (arg,)
            encoded = [_item_words(k) for k in items]
            if any(e is None for e in encoded):
                raise WireError(f"the key {arg!r} cannot travel with a pull")
            words += [SEL_INDEX, len(items) if type(arg) is tuple else -1]
            for e in encoded:
                words += e
        elif op == "view":
            words += [SEL_VIEW, view_code(arg)]
        else:
            raise WireError(f"unknown selection operation {op!r}")
    return struct.pack(f"<{len(words)}q", *words)


def words_of(body: Buffer) -> list[int]:
    """The int64 words of a received selection body. Raises WireError for a ragged length."""
    if len(body) % 8:
        raise WireError(f"a selection body of {len(body)} bytes is not a run of int64 words")
    return list(struct.unpack(f"<{len(body) // 8}q", body))


def decode_selection(words: Sequence[int]) -> tuple[tuple[str, Any], ...]:
    """The operations of a PULL's selection body. Raises WireError for malformed words."""
    ops: list[tuple[str, Any]] = []
    pos, end = 0, len(words)

    def take(n: int) -> Sequence[int]:
        nonlocal pos
        if pos + n > end:
            raise WireError(f"a selection ends inside an operation: {list(words)}")
        got = words[pos : pos + n]
        pos += n
        return got

    while pos < end:
        op = take(1)[0]
        if op == SEL_VIEW:
            code = take(1)[0]
            view = view_of_code(code)
            if view is None:
                raise WireError(f"a selection names an unknown view (code {code})")
            ops.append(("view", view))
        elif op == SEL_INDEX:
            n = take(1)[0]
            items = []
            for _ in range(1 if n == -1 else n):
                kind = take(1)[0]
                if kind == K_INT:
                    items.append(take(1)[0])
                elif kind == K_NONE:
                    items.append(None)
                elif kind == K_ELLIPSIS:
                    items.append(Ellipsis)
                elif kind == K_SLICE:
                    a, b, c = (None if w == _INT64[0] else w for w in take(3))
                    items.append(slice(a, b, c))
                elif kind == K_STR:
                    items.append("".join(map(chr, take(take(1)[0]))))
                else:
                    raise WireError(f"a selection has an unknown key kind {kind}")
            ops.append(("index", items[0] if n == -1 else tuple(items)))
        else:
            raise WireError(f"a selection has an unknown operation {op}")
    return tuple(ops)


def apply_selection(value: Any, ops: Sequence[tuple[str, Any]]) -> Any:
    """``value`` with the selection's operations applied in turn (what the requester would do)."""
    for op, arg in ops:
        value = arg.remote(value) if op == "view" else value[arg]
    return value


def select(entry: Encoded, ops: Sequence[tuple[str, Any]]) -> Encoded:
    """The owner's reply to a pull with a selection: the selected part of a stored ok value,
    encoded on its own (a private copy), or the whole value as :data:`WHOLE` where the selection
    does not apply to it (the requester applies it and gets the error one stage would). Errors
    and empty selections return ``entry`` itself."""
    if not ops or entry.status != OK or entry.body is None:
        return entry
    part = _select_bytes(entry, ops)
    if part is not None:
        return part
    try:
        part = apply_selection(entry.value(), ops)
        return encode(part)
    except Exception:
        return Encoded(WHOLE, entry.dtype, entry.meta_words, entry.payload_bytes, entry.body)


# The common selection, integer indices only (a layer's last row: ``out[0][-1]``), picks a
# contiguous run of the stored payload: it is cut out of the body's bytes with no torch call.
# Anything else (slices, views, an index out of range) goes through torch.


def _layout(entry: Encoded) -> tuple[Any, memoryview]:
    """The stored value's structure (:func:`_structure`, parsed once) and the body's bytes."""
    if entry._layout is None:
        data = entry.data()
        entry._layout = (_structure(data[: 8 * entry.meta_words].cast("q").tolist(), entry.dtype), data)
    return entry._layout


def _select_bytes(entry: Encoded, ops: Sequence[tuple[str, Any]]) -> Encoded | None:
    """The part an integer-only selection picks (the bytes ``encode`` would give it), or None
    where torch must apply the selection."""
    node, data = _layout(entry)
    for op, arg in ops:
        if op != "index":
            return None
        t = type(node)
        if t is dict:  # a string picks an item
            if type(arg) is not str or arg not in node:
                return None
            node = node[arg]
            continue
        if t is tuple or t is list:  # one int picks an item
            if type(arg) is not int or not -len(node) <= arg < len(node):
                return None
            node = node[arg]
            continue
        if t is not _Leaf:
            return None
        shape, offset, code = node
        itemsize = DTYPES[code].itemsize
        keys = (arg,) if type(arg) is int else arg
        if type(keys) is not tuple or len(keys) > len(shape):
            return None
        for k in keys:
            size = shape[0]
            if type(k) is not int or not -size <= k < size:
                return None
            shape = shape[1:]
            offset += (k % size) * math.prod(shape) * itemsize
        node = _Leaf(shape, offset, code)
    if type(node) is not _Leaf:
        return None
    shape, offset, code = node
    itemsize = DTYPES[code].itemsize
    meta = (LEAF, len(shape), *shape) if len(shape) % 2 == 0 else (LEAF, len(shape), *shape, 0)
    start = 8 * entry.meta_words + offset
    nbytes = math.prod(shape) * itemsize
    body = bytearray(struct.pack(f"<{len(meta)}q", *meta))
    body += data[start : start + nbytes]
    tensor = torch.frombuffer(body, dtype=torch.uint8)
    return Encoded(OK, code, len(meta), nbytes, tensor, _data=memoryview(body))
