"""The data-only wire format of asyncpp's serving API: tensors as safetensors, the rest as JSON.

Nothing here ever unpickles. A payload is any nesting of ``dict`` (string keys), ``list``,
``tuple``, ``str``, ``int``, ``float``, ``bool``, ``None`` and ``torch.Tensor``; it round-trips
exactly (tuples stay tuples, ``nan``/``inf`` survive, tensors keep dtype, shape and values).

Two encodings of one HTTP body:

- **binary** (:data:`CONTENT_TYPE`, :func:`encode` / :func:`decode`)::

      b"APW1" | JSON length (8 bytes, unsigned little-endian) | JSON (UTF-8) | safetensors blob

  The blob holds every tensor of the payload (absent when there are none); the JSON refers to each
  by name, ``{"__tensor__": "t0"}``.
- **JSON** (:data:`JSON_CONTENT_TYPE`, :func:`encode_json` / :func:`decode_json`), for clients
  without safetensors: a tensor is
  ``{"__tensor__": {"dtype": "float32", "shape": [2, 3], "data": "<base64>"}}``, the data being the
  tensor's elements in row-major order, little-endian (the bytes safetensors stores).

In the JSON of both, a one-key object whose key starts and ends with ``__`` is a marker:
``{"__tensor__": ...}``, ``{"__tuple__": [...]}``, ``{"__float__": "nan" | "inf" | "-inf"}``, and
``{"__dict__": {...}}``, which escapes a payload dict that would itself look like a marker (such
as ``{"__tuple__": 1}``). Any other such object is an error.

Decoding is strict and bounded (:class:`WireLimits`): total bytes, number of tensors, elements per
tensor, dimensions, nesting depth; duplicate JSON keys, ``NaN``/``Infinity`` literals, numbers out
of float range, unknown dtypes, tensors referenced twice or never, and safetensors headers that
point outside their buffer are refused. Every failure is a :class:`WireError` (a
:class:`WireLimitError` when a limit is exceeded), never anything else.
"""

from __future__ import annotations

import base64
import binascii
import json
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from ..kernel.errors import AsyncppError
from .registry import DTYPE_NAMES, DTYPES

__all__ = [
    "CONTENT_TYPE",
    "DEFAULT_LIMITS",
    "JSON_CONTENT_TYPE",
    "MAGIC",
    "WireError",
    "WireLimitError",
    "WireLimits",
    "decode",
    "decode_body",
    "decode_json",
    "encode",
    "encode_json",
]

MAGIC = b"APW1"
CONTENT_TYPE = "application/vnd.asyncpp.wire"
JSON_CONTENT_TYPE = "application/json"
_PREFIX = len(MAGIC) + 8


class WireError(AsyncppError, ValueError):
    """A payload cannot be encoded, or a body is malformed (the message says what and where)."""


class WireLimitError(WireError):
    """A body exceeds one of the decoder's :class:`WireLimits` (a server answers 413 or 422)."""


@dataclass(frozen=True)
class WireLimits:
    """Bounds a decoder enforces before it allocates anything for a body."""

    max_bytes: int = 64 * 2**20  # the whole body
    max_tensors: int = 256
    max_tensor_elements: int = 2**24  # per tensor
    max_dims: int = 8  # per tensor
    max_depth: int = 32  # nested lists/tuples/dicts


DEFAULT_LIMITS = WireLimits()

# safetensors' dtype codes for the dtypes the wire carries
_ST_CODES: dict[str, str] = {
    "float64": "F64",
    "float32": "F32",
    "float16": "F16",
    "bfloat16": "BF16",
    "int64": "I64",
    "int32": "I32",
    "int16": "I16",
    "int8": "I8",
    "uint8": "U8",
    "bool": "BOOL",
}
_ST_DTYPES: dict[str, str] = {v: k for k, v in _ST_CODES.items()}
_ITEMSIZE: dict[str, int] = {name: torch.empty((), dtype=dt).element_size() for name, dt in DTYPES.items()}
_FLOAT_MARKS = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}


def _is_marker_key(key: str) -> bool:
    return len(key) >= 4 and key.startswith("__") and key.endswith("__")


def _where(path: tuple) -> str:
    """``$.args.vec[2]`` from the linked path tuples the walkers carry."""
    parts: list[str] = []
    while path:
        path, key = path
        parts.append(
            f"[{key}]" if isinstance(key, int) else f".{key}" if key.isidentifier() else f"[{key!r}]"
        )
    return "$" + "".join(reversed(parts))


# ---------------------------------------------------------------------------------------------
# Encoding


def _tensor_for_wire(t: torch.Tensor, where: str) -> tuple[str, torch.Tensor]:
    if t.layout is not torch.strided:
        raise WireError(f"{where}: cannot encode a {t.layout} tensor (only dense tensors)")
    if t.device.type == "meta":
        raise WireError(f"{where}: cannot encode a meta tensor (it has no data)")
    name = DTYPE_NAMES.get(t.dtype)
    if name is None:
        raise WireError(f"{where}: cannot encode dtype {t.dtype} (supported: {', '.join(DTYPES)})")
    t = t.detach().to("cpu").resolve_conj().resolve_neg()
    # an own contiguous copy: safetensors refuses tensors that share storage, and views must not
    # drag their whole base along
    return name, t.clone(memory_format=torch.contiguous_format)


def _to_tree(obj: Any, on_tensor: Callable[[torch.Tensor, str], Any], limits: WireLimits) -> Any:
    active: set[int] = set()

    def walk(v: Any, depth: int, path: tuple) -> Any:
        if v is None or v is True or v is False:
            return v
        if isinstance(v, str):
            return str(v)
        if isinstance(v, int) and not isinstance(v, bool):
            return int(v)
        if isinstance(v, float):
            v = float(v)
            if math.isfinite(v):
                return v
            return {"__float__": "nan" if math.isnan(v) else "inf" if v > 0 else "-inf"}
        if isinstance(v, torch.Tensor):
            return on_tensor(v, _where(path))
        if not isinstance(v, Mapping | list | tuple):
            raise WireError(
                f"{_where(path)}: cannot encode {type(v).__name__} (only dict, list, tuple, "
                "str, int, float, bool, None and tensors)"
            )
        if depth >= limits.max_depth:
            raise WireLimitError(f"{_where(path)}: nested deeper than {limits.max_depth} levels")
        if id(v) in active:
            raise WireError(f"{_where(path)}: the payload contains itself (a cycle)")
        active.add(id(v))
        try:
            if isinstance(v, Mapping):
                out: dict[str, Any] = {}
                for k, item in v.items():
                    if not isinstance(k, str):
                        raise WireError(
                            f"{_where(path)}: dict keys must be strings, got {type(k).__name__} {k!r}"
                        )
                    out[str(k)] = walk(item, depth + 1, (path, str(k)))
                if len(out) == 1 and _is_marker_key(next(iter(out))):
                    return {"__dict__": out}
                return out
            items = [walk(item, depth + 1, (path, i)) for i, item in enumerate(v)]
            return {"__tuple__": items} if isinstance(v, tuple) else items
        finally:
            active.discard(id(v))

    return walk(obj, 0, ())


def _dumps(tree: Any) -> bytes:
    try:
        text = json.dumps(tree, ensure_ascii=True, allow_nan=False, separators=(",", ":"))
    except ValueError as e:  # an int with more digits than Python converts to text
        raise WireError(f"cannot encode the payload as JSON: {e}") from None
    return text.encode("ascii")


def encode(obj: Any, *, limits: WireLimits = DEFAULT_LIMITS) -> bytes:
    """The binary body (:data:`CONTENT_TYPE`) for ``obj``: framed JSON plus a safetensors blob.

    Tensors are detached and copied to the CPU. Raises :class:`WireError` for anything that is not
    data (a set, an object, a non-string key, a cycle, a dtype the wire does not carry)."""
    tensors: dict[str, torch.Tensor] = {}

    def on_tensor(t: torch.Tensor, where: str) -> Any:
        _, t = _tensor_for_wire(t, where)
        name = f"t{len(tensors)}"
        tensors[name] = t
        return {"__tensor__": name}

    text = _dumps(_to_tree(obj, on_tensor, limits))
    blob = b""
    if tensors:
        from safetensors.torch import save

        blob = save(tensors)
    return MAGIC + len(text).to_bytes(8, "little") + text + blob


def encode_json(obj: Any, *, limits: WireLimits = DEFAULT_LIMITS) -> bytes:
    """The pure JSON body (:data:`JSON_CONTENT_TYPE`) for ``obj``, tensors inline in base64."""

    def on_tensor(t: torch.Tensor, where: str) -> Any:
        name, t = _tensor_for_wire(t, where)
        raw = t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
        data = base64.b64encode(raw).decode("ascii")
        return {"__tensor__": {"dtype": name, "shape": list(t.shape), "data": data}}

    return _dumps(_to_tree(obj, on_tensor, limits))


# ---------------------------------------------------------------------------------------------
# Decoding


def _no_constants(name: str) -> Any:
    raise WireError(
        f"JSON literal {name} is not allowed (non-finite floats are sent as {{'__float__': ...}})"
    )


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise WireError(f"JSON number {text[:40]} is out of the float range")
    return value


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out = dict(pairs)
    if len(out) != len(pairs):
        seen: set[str] = set()
        dup = next(k for k, _ in pairs if k in seen or seen.add(k))
        raise WireError(f"JSON object has the key {dup!r} twice")
    return out


def _loads(raw: bytes | memoryview, what: str) -> Any:
    try:
        text = bytes(raw).decode("utf-8")
    except UnicodeDecodeError as e:
        raise WireError(f"{what} is not valid UTF-8 ({e.reason} at byte {e.start})") from None
    try:
        return json.loads(
            text, parse_constant=_no_constants, parse_float=_finite_float, object_pairs_hook=_no_duplicates
        )
    except WireError as e:
        raise WireError(f"{what}: {e}") from None
    except json.JSONDecodeError as e:
        raise WireError(f"{what} is not valid JSON: {e.msg} at line {e.lineno} column {e.colno}") from None
    except RecursionError:
        raise WireLimitError(f"{what} is nested too deeply") from None
    except ValueError as e:  # e.g. an int literal with too many digits
        raise WireError(f"{what} is not acceptable JSON: {e}") from None


def _bytes(data: Any) -> bytes | bytearray | memoryview:
    if isinstance(data, bytes | bytearray):
        return data
    if isinstance(data, memoryview):
        return data if data.format == "B" and data.ndim == 1 and data.c_contiguous else data.tobytes()
    raise WireError(f"a body must be bytes, got {type(data).__name__}")


def _check_shape(shape: Any, dtype: str, limits: WireLimits, where: str) -> int:
    if not isinstance(shape, list) or any(type(d) is not int or d < 0 for d in shape):
        raise WireError(f"{where}: shape must be a list of ints >= 0, got {str(shape)[:80]}")
    if len(shape) > limits.max_dims:
        raise WireLimitError(f"{where}: {len(shape)} dims, more than the limit of {limits.max_dims}")
    numel = math.prod(shape)
    if numel > limits.max_tensor_elements:
        raise WireLimitError(
            f"{where}: a {dtype} tensor of shape {tuple(shape)} has {numel} elements, more than the "
            f"limit of {limits.max_tensor_elements}"
        )
    return numel


def _check_bool(t: torch.Tensor, where: str) -> torch.Tensor:
    if t.dtype is torch.bool and t.numel() and bool((t.view(torch.uint8) > 1).any()):
        raise WireError(f"{where}: a bool tensor holds bytes other than 0 and 1")
    return t


def _from_tree(tree: Any, on_tensor: Callable[[Any, str], torch.Tensor], limits: WireLimits) -> Any:
    def walk(v: Any, depth: int, path: tuple) -> Any:
        if v is None or type(v) in (bool, int, float, str):
            return v
        if depth >= limits.max_depth:
            raise WireLimitError(f"{_where(path)}: nested deeper than {limits.max_depth} levels")
        if type(v) is list:
            return [walk(item, depth + 1, (path, i)) for i, item in enumerate(v)]
        # a dict (json.loads makes nothing else)
        if len(v) == 1:
            ((key, inner),) = v.items()
            if _is_marker_key(key):
                if key == "__tensor__":
                    return on_tensor(inner, _where(path))
                if key == "__tuple__":
                    if type(inner) is not list:
                        raise WireError(
                            f"{_where(path)}: __tuple__ must hold a list, got {type(inner).__name__}"
                        )
                    return tuple(walk(item, depth + 1, (path, i)) for i, item in enumerate(inner))
                if key == "__float__":
                    if not isinstance(inner, str) or inner not in _FLOAT_MARKS:
                        raise WireError(
                            f"{_where(path)}: __float__ must be 'nan', 'inf' or '-inf', got {inner!r}"
                        )
                    return _FLOAT_MARKS[inner]
                if key == "__dict__":
                    if type(inner) is not dict:
                        raise WireError(
                            f"{_where(path)}: __dict__ must hold an object, got {type(inner).__name__}"
                        )
                    v = inner
                else:
                    raise WireError(
                        f"{_where(path)}: unknown marker {key!r} (a dict with one such key is sent as "
                        "{'__dict__': {...}})"
                    )
        return {k: walk(item, depth + 1, (path, k)) for k, item in v.items()}

    return walk(tree, 0, ())


def _read_safetensors(blob: bytes | bytearray | memoryview, limits: WireLimits) -> dict[str, torch.Tensor]:
    """The tensors of a safetensors blob, its header checked against ``limits`` before loading."""
    if len(blob) < 8:
        raise WireError(f"the safetensors blob is truncated ({len(blob)} bytes, its header length needs 8)")
    hlen = int.from_bytes(blob[:8], "little")
    if hlen > len(blob) - 8:
        raise WireError(
            f"the safetensors header claims {hlen} bytes, but only {len(blob) - 8} follow its length"
        )
    header = _loads(blob[8 : 8 + hlen], "the safetensors header")
    if type(header) is not dict:
        raise WireError("the safetensors header is not a JSON object")
    meta = header.pop("__metadata__", None)
    if meta is not None and (type(meta) is not dict or any(type(x) is not str for x in meta.values())):
        raise WireError("the safetensors __metadata__ must be an object of strings")
    if len(header) > limits.max_tensors:
        raise WireLimitError(
            f"the body has {len(header)} tensors, more than the limit of {limits.max_tensors}"
        )
    size = len(blob) - 8 - hlen
    spans = []
    for name, info in header.items():
        where = f"safetensors tensor {name!r}"
        if type(info) is not dict or set(info) != {"dtype", "shape", "data_offsets"}:
            raise WireError(f"{where}: needs exactly dtype, shape and data_offsets")
        dtype = _ST_DTYPES.get(info["dtype"]) if isinstance(info["dtype"], str) else None
        if dtype is None:
            raise WireError(
                f"{where}: unknown or unsupported dtype {str(info['dtype'])[:40]!r} "
                f"(supported: {', '.join(_ST_DTYPES)})"
            )
        numel = _check_shape(info["shape"], dtype, limits, where)
        offsets = info["data_offsets"]
        if type(offsets) is not list or len(offsets) != 2 or any(type(o) is not int for o in offsets):
            raise WireError(f"{where}: data_offsets must be two ints")
        begin, end = offsets
        if not 0 <= begin <= end <= size:
            raise WireError(f"{where}: data_offsets {offsets} point outside the {size} data bytes")
        if end - begin != numel * _ITEMSIZE[dtype]:
            raise WireError(
                f"{where}: data_offsets span {end - begin} bytes, but a {dtype} tensor of shape "
                f"{tuple(info['shape'])} needs {numel * _ITEMSIZE[dtype]}"
            )
        spans.append((begin, end))
    spans.sort()
    pos = 0
    for begin, end in spans:
        if begin != pos:
            raise WireError("the safetensors data has overlapping tensors or gaps between them")
        pos = end
    if pos != size:
        raise WireError(f"the safetensors data has {size - pos} bytes that belong to no tensor")
    from safetensors.torch import load

    try:
        tensors = load(bytes(blob))
    except Exception as e:  # the library's own checks; its error class is not ours
        raise WireError(f"the safetensors blob is malformed: {e}") from None
    if set(tensors) != set(header):
        raise WireError("the safetensors blob does not hold the tensors its header names")
    for name, t in tensors.items():
        _check_bool(t, f"safetensors tensor {name!r}")
    return tensors


def decode(data: bytes | bytearray | memoryview, limits: WireLimits = DEFAULT_LIMITS) -> Any:
    """The payload of a binary body (:data:`CONTENT_TYPE`). Raises :class:`WireError`."""
    data = _bytes(data)
    if len(data) > limits.max_bytes:
        raise WireLimitError(f"the body has {len(data)} bytes, more than the limit of {limits.max_bytes}")
    if len(data) < _PREFIX or bytes(data[: len(MAGIC)]) != MAGIC:
        head = bytes(data[:1])
        hint = " (it looks like JSON: send it as application/json)" if head in (b"{", b"[") else ""
        raise WireError(f"not an asyncpp wire body: it must start with {MAGIC!r} and a JSON length{hint}")
    n = int.from_bytes(data[len(MAGIC) : _PREFIX], "little")
    if n > len(data) - _PREFIX:
        raise WireError(
            f"the body claims {n} bytes of JSON, but only {len(data) - _PREFIX} follow its header"
        )
    tree = _loads(data[_PREFIX : _PREFIX + n], "the body's JSON")
    blob = data[_PREFIX + n :]
    tensors = _read_safetensors(blob, limits) if len(blob) else {}
    used: set[str] = set()

    def on_tensor(ref: Any, where: str) -> torch.Tensor:
        if not isinstance(ref, str):
            raise WireError(
                f"{where}: __tensor__ must name a tensor of the safetensors blob, got {str(ref)[:60]}"
            )
        if ref not in tensors:
            raise WireError(f"{where}: the body has no tensor named {ref[:60]!r}")
        if ref in used:
            raise WireError(f"{where}: tensor {ref[:60]!r} is referenced twice")
        used.add(ref)
        return tensors[ref]

    out = _from_tree(tree, on_tensor, limits)
    unused = set(tensors) - used
    if unused:
        raise WireError(f"the safetensors blob holds tensors the JSON never refers to: {sorted(unused)[:5]}")
    return out


def decode_json(data: bytes | bytearray | memoryview | str, limits: WireLimits = DEFAULT_LIMITS) -> Any:
    """The payload of a pure JSON body (:data:`JSON_CONTENT_TYPE`). Raises :class:`WireError`."""
    if isinstance(data, str):
        data = data.encode("utf-8", "surrogatepass")
    data = _bytes(data)
    if len(data) > limits.max_bytes:
        raise WireLimitError(f"the body has {len(data)} bytes, more than the limit of {limits.max_bytes}")
    tree = _loads(data, "the body")
    count = 0

    def on_tensor(spec: Any, where: str) -> torch.Tensor:
        nonlocal count
        if type(spec) is not dict or set(spec) != {"dtype", "shape", "data"}:
            raise WireError(f"{where}: a tensor is {{'__tensor__': {{'dtype', 'shape', 'data'}}}}")
        count += 1
        if count > limits.max_tensors:
            raise WireLimitError(f"the body has more than the limit of {limits.max_tensors} tensors")
        dtype = spec["dtype"]
        if not isinstance(dtype, str) or dtype not in DTYPES:
            raise WireError(f"{where}: unknown dtype {str(dtype)[:40]!r} (supported: {', '.join(DTYPES)})")
        numel = _check_shape(spec["shape"], dtype, limits, where)
        if not isinstance(spec["data"], str):
            raise WireError(f"{where}: data must be a base64 string")
        try:
            raw = base64.b64decode(spec["data"], validate=True)
        except (binascii.Error, ValueError) as e:
            raise WireError(f"{where}: data is not valid base64 ({e})") from None
        need = numel * _ITEMSIZE[dtype]
        if len(raw) != need:
            raise WireError(
                f"{where}: data has {len(raw)} bytes, but a {dtype} tensor of shape {tuple(spec['shape'])} "
                f"needs {need}"
            )
        if numel == 0:
            return torch.empty(spec["shape"], dtype=DTYPES[dtype])
        t = torch.frombuffer(bytearray(raw), dtype=DTYPES[dtype]).reshape(spec["shape"])
        return _check_bool(t, where)

    return _from_tree(tree, on_tensor, limits)


def decode_body(
    data: bytes | bytearray | memoryview, content_type: str | None, limits: WireLimits = DEFAULT_LIMITS
) -> Any:
    """Decode a request or response body by its ``Content-Type``: :data:`CONTENT_TYPE` is the
    binary format, ``application/json`` the pure JSON one; anything else is a :class:`WireError`."""
    kind = (content_type or "").split(";", 1)[0].strip().lower()
    if kind == CONTENT_TYPE:
        return decode(data, limits)
    if kind == JSON_CONTENT_TYPE:
        return decode_json(data, limits)
    raise WireError(f"unsupported content type {content_type!r} (use {CONTENT_TYPE} or {JSON_CONTENT_TYPE})")
