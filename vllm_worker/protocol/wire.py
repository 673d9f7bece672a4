"""A pickle-free tensor encoding that survives msgspec (engine IPC) and JSON (HTTP).

`{"dtype": "float32", "shape": [2, 576], "data": <raw little-endian bytes>}`; over JSON the bytes are
base64 (`"b64"`), optionally zlib-compressed (`"compression": "zlib"`). bfloat16 round-trips exactly
because the raw bytes are moved, never converted.
"""

from __future__ import annotations

import base64
import json
import warnings
import zlib
from typing import Any

import msgspec
import torch

_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float64": torch.float64,
    "int64": torch.int64,
    "int32": torch.int32,
    "int8": torch.int8,
    "uint8": torch.uint8,
    "bool": torch.bool,
}
_NAMES = {v: k for k, v in _DTYPES.items()}


def dtype_name(dtype: torch.dtype) -> str:
    try:
        return _NAMES[dtype]
    except KeyError:
        raise ValueError(f"unsupported tensor dtype {dtype}") from None


def dtype_from_name(name: str) -> torch.dtype:
    try:
        return _DTYPES[name]
    except KeyError:
        raise ValueError(f"unsupported tensor dtype {name!r}") from None


def tensor_to_bytes(t: torch.Tensor) -> dict[str, Any]:
    """Raw-bytes form (for in-engine IPC): dtype, shape, little-endian bytes."""
    t = t.detach().to("cpu").contiguous()
    raw = t.view(torch.uint8).numpy().tobytes() if t.numel() else b""
    return {"dtype": dtype_name(t.dtype), "shape": list(t.shape), "data": raw}


def tensor_from_bytes(obj: dict[str, Any], field: str = "tensor", view: bool = False) -> torch.Tensor:
    """Inverse of `tensor_to_bytes`; validates sizes and names `field` in errors. `view`: the tensor reads
    the payload's own (immutable) bytes, no copy — only for a caller that never writes it and copies what
    it keeps (the worker's admission: `spec.decode`); writing it would change a `bytes` object or the
    received message (`compat.raw_view`: the data may be a `memoryview` or a msgpack `Ext`)."""
    if not isinstance(obj, dict):
        raise ValueError(f"{field}: expected a tensor object, got {type(obj).__name__}")
    name = obj.get("dtype")
    if name not in _DTYPES:
        raise ValueError(f"{field}.dtype: unsupported dtype {name!r} (one of {sorted(_DTYPES)})")
    shape = obj.get("shape")
    if not isinstance(shape, (list, tuple)) or not all(
        isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in shape
    ):
        raise ValueError(f"{field}.shape: expected a list of non-negative ints, got {shape!r}")
    raw = obj.get("data")
    if isinstance(raw, msgspec.msgpack.Ext):  # (the frontend's view form, in an in-process engine: not serialised)
        raw = raw.data
    if isinstance(raw, memoryview):  # (a view of the engine core's received message: read, never written)
        raw = raw.cast("B") if view else raw.tobytes()
    if not isinstance(raw, (bytes, bytearray, memoryview)):
        raise ValueError(f"{field}.data: expected bytes")
    dtype = _DTYPES[name]
    n = 1
    for s in shape:
        n *= s
    itemsize = dtype.itemsize
    if len(raw) != n * itemsize:
        raise ValueError(f"{field}.data: {len(raw)} bytes do not match shape {list(shape)} of {name}")
    if n == 0:
        return torch.empty(shape, dtype=dtype)
    if view:
        with warnings.catch_warnings():  # (torch's warning that the buffer is not writable: known, never written)
            warnings.filterwarnings("ignore", "The given buffer is not writable", UserWarning)
            return torch.frombuffer(raw, dtype=torch.uint8).view(dtype).reshape(shape)
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(dtype).reshape(shape)


def tensor_to_json(t: torch.Tensor, compress: bool = False) -> dict[str, Any]:
    """JSON-safe form: bytes as base64, optionally zlib-compressed (lossless)."""
    obj = tensor_to_bytes(t)
    raw = obj.pop("data")
    if compress:
        raw = zlib.compress(raw, 1)
        obj["compression"] = "zlib"
    obj["b64"] = b64_text(raw)
    return obj


_B64_CHUNK = 3 << 20  # input bytes per base64 call (a multiple of 3: the pieces join without padding)


def _b64_pieces(raw: Any) -> Any:
    mv = memoryview(raw).cast("B")
    for i in range(0, len(mv), _B64_CHUNK):
        yield base64.b64encode(mv[i : i + _B64_CHUNK])


def b64_text(raw: bytes) -> str:
    """base64 in pieces: one call over a GiB holds the GIL for most of a second."""
    if len(raw) <= _B64_CHUNK:
        return base64.b64encode(raw).decode("ascii")
    return b"".join(_b64_pieces(raw)).decode("ascii")


class LazyTensorJSON:
    """A tensor object (`tensor_to_json`'s form, uncompressed) whose base64 is written piece by piece,
    straight from the tensor's memory, when `json_chunks` writes the response: no copy of the bytes, no
    GiB-sized string, and no single call that holds the GIL for long (the HTTP server's event loop keeps
    answering while a thread encodes a large capture)."""

    __slots__ = ("t", "raw")

    def __init__(self, t: torch.Tensor) -> None:
        self.t = t.detach().to("cpu").contiguous()
        # the bytes as numpy now, not while writing: torch calls release and retake the GIL, and a thread
        # doing that every millisecond starves the event loop (CPython only forces a switch after 5 ms
        # without one; docs/decisions.md)
        self.raw = self.t.view(torch.uint8).numpy() if self.t.numel() else None

    def head(self) -> str:
        return f'{{"dtype": "{dtype_name(self.t.dtype)}", "shape": {json.dumps(list(self.t.shape))}, "b64": "'

    def pieces(self) -> Any:
        if self.raw is not None:
            yield from _b64_pieces(self.raw)


_JSON_CHUNK = 4 << 20  # characters of one string encoded per json.dumps call


def json_chunks(obj: Any) -> list[bytes]:
    """`json.dumps(obj).encode()` as a list of pieces, none made by one long call: strings longer than a
    few MiB (base64 captures) are escaped piece by piece, so a thread encoding a GiB-sized response lets
    the event loop run between pieces. Joined, the pieces are exactly `json.dumps(obj)`."""
    out: list[bytes] = []
    small: list[str] = []

    def flush() -> None:
        if small:
            out.append("".join(small).encode())
            small.clear()

    def walk(o: Any) -> None:
        if isinstance(o, LazyTensorJSON):
            small.append(o.head())
            flush()
            out.extend(o.pieces())
            small.append('"}')
        elif isinstance(o, str) and len(o) > _JSON_CHUNK:
            flush()
            out.append(b'"')
            for i in range(0, len(o), _JSON_CHUNK):
                out.append(json.dumps(o[i : i + _JSON_CHUNK])[1:-1].encode())
            out.append(b'"')
        elif isinstance(o, dict):
            small.append("{")
            for j, (k, v) in enumerate(o.items()):
                small.append((", " if j else "") + json.dumps(k if isinstance(k, str) else str(k)) + ": ")
                walk(v)
            small.append("}")
        elif isinstance(o, (list, tuple)) and o:
            small.append("[")
            for j, v in enumerate(o):
                if j:
                    small.append(", ")
                walk(v)
            small.append("]")
        else:
            small.append(json.dumps(o))
            if len(small) > 4096:
                flush()

    walk(obj)
    flush()
    return out


# The original vllm-lens's tensor object: {"data": b64, "dtype": numpy storage dtype, "original_dtype":
# "torch.<dtype>", "shape", "compression": "zstd" | null}; bfloat16 travels as int16 storage.
_ORIGINAL_DTYPES = {
    "torch.float32": "float32",
    "torch.float16": "float16",
    "torch.float64": "float64",
    "torch.bfloat16": "bfloat16",
}
_STORAGE = {"float32": "float32", "float16": "float16", "float64": "float64", "int16": "bfloat16"}
_STORAGE_OF = {name: storage for storage, name in _STORAGE.items()}  # what we send
# ... and what its hook results may also hold (read by our client, never accepted as steering)
_ORIGINAL_OTHER = {f"torch.{n}": n for n in ("int64", "int32", "int8", "uint8", "bool")}
_MAX_DECOMPRESSED = 1 << 30  # when the caller gives no limit


def _b64_bytes(text: str, field: str, key: str, max_bytes: int | None) -> bytes:
    """Decoded base64 of a tensor object's `key`, refused before decoding when it is over the limit."""
    if max_bytes is not None and len(text) * 3 // 4 > max_bytes:
        raise ValueError(f"{field}: payload exceeds the limit of {max_bytes} bytes")
    try:
        return base64.b64decode(text, validate=True)
    except Exception:
        raise ValueError(f"{field}.{key}: not valid base64") from None


def _original_tensor(obj: dict, field: str, max_bytes: int | None, any_dtype: bool = False) -> torch.Tensor:
    raw = _b64_bytes(obj["data"], field, "data", max_bytes)
    comp = obj.get("compression")
    if comp == "zstd":
        import io

        import zstandard

        cap = max_bytes or _MAX_DECOMPRESSED
        try:  # streamed with a cap: a small frame cannot make us allocate more than the limit
            raw = zstandard.ZstdDecompressor().stream_reader(io.BytesIO(raw)).read(cap + 1)
        except zstandard.ZstdError:
            raise ValueError(f"{field}.data: not valid zstd data") from None
        if len(raw) > cap:
            raise ValueError(f"{field}: decompressed payload exceeds the limit of {cap} bytes")
    elif comp is not None:
        raise ValueError(f"{field}.compression: unsupported {comp!r} (only 'zstd' or null)")
    storage, original = obj.get("dtype"), obj.get("original_dtype")
    name = _STORAGE.get(storage) if isinstance(storage, str) else None
    if any_dtype and original in _ORIGINAL_OTHER and storage == _ORIGINAL_OTHER[original]:
        name = storage
    elif original is not None:
        want = _ORIGINAL_DTYPES.get(original) if isinstance(original, str) else None
        if want is None:
            raise ValueError(f"{field}.original_dtype: unsupported {original!r} (one of {sorted(_ORIGINAL_DTYPES)})")
        if name != want:
            raise ValueError(f"{field}.dtype: {storage!r} does not carry {original}")
    elif name is None or storage == "int16":
        raise ValueError(f"{field}.dtype: unsupported {storage!r} (float32, float16 or float64)")
    return tensor_from_bytes({"dtype": name, "shape": obj.get("shape"), "data": raw}, field)


def tensor_to_original_json(t: torch.Tensor) -> dict[str, Any]:
    """The original vllm-lens's tensor object (what its client decodes): zstd-compressed bytes, numpy
    storage dtype (bfloat16 as int16) and the torch dtype it stands for."""
    import zstandard

    obj = tensor_to_bytes(t)
    name = obj["dtype"]
    return {
        "data": base64.b64encode(zstandard.ZstdCompressor(level=1).compress(obj["data"])).decode("ascii"),
        "dtype": _STORAGE_OF.get(name, name),
        "original_dtype": f"torch.{name}",
        "shape": obj["shape"],
        "compression": "zstd",
    }


def to_original_jsonable(obj: Any) -> Any:
    """Hook state in the original vllm-lens's form: like `to_jsonable`, with tensors as its
    `{"__type__": "tensor", ...}` objects (what the original pickles we send as `repr`; we never pickle)."""
    return _jsonable(obj, lambda t: {"__type__": "tensor", **tensor_to_original_json(t)})


def tensor_from_json(
    obj: Any, field: str = "tensor", max_bytes: int | None = None, any_dtype: bool = False
) -> torch.Tensor:
    """Inverse of `tensor_to_json`; every malformed piece is a `ValueError` naming `field`. Also reads
    the original vllm-lens's tensor objects (`"data"` base64, optional zstd; floats only unless
    `any_dtype`)."""
    if not isinstance(obj, dict):
        raise ValueError(f"{field}: expected a tensor object with dtype, shape, b64")
    if "b64" not in obj and isinstance(obj.get("data"), str):
        return _original_tensor(obj, field, max_bytes, any_dtype)
    b64 = obj.get("b64")
    if not isinstance(b64, str):
        raise ValueError(f"{field}.b64: expected a base64 string")
    raw = _b64_bytes(b64, field, "b64", max_bytes)
    comp = obj.get("compression")
    if comp == "zlib":
        try:
            d = zlib.decompressobj()
            raw = d.decompress(raw, max_bytes or 0)
            if d.unconsumed_tail:
                raise ValueError(f"{field}: decompressed payload exceeds the limit of {max_bytes} bytes")
        except zlib.error:
            raise ValueError(f"{field}.b64: not valid zlib data") from None
    elif comp is not None:
        raise ValueError(f"{field}.compression: unsupported {comp!r} (only 'zlib')")
    return tensor_from_bytes({"dtype": obj.get("dtype"), "shape": obj.get("shape"), "data": raw}, field)


def to_jsonable(obj: Any, compress: bool = False, lazy: bool = False) -> Any:
    """Hook state as JSON: tensors become tensor objects (see `tensor_to_json`), tuples lists, dict keys
    strings; anything else JSON cannot hold becomes its `repr` (never pickle). `lazy`: tensors become
    `LazyTensorJSON` (for a response written by `json_chunks`)."""
    return _jsonable(obj, LazyTensorJSON if lazy else (lambda t: tensor_to_json(t, compress)))


def _jsonable(obj: Any, tensor: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return tensor(obj)
    if isinstance(obj, dict):
        return {str(k): _jsonable(v, tensor) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_jsonable(v, tensor) for v in obj]
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    return repr(obj)


def from_jsonable(obj: Any) -> Any:
    """Inverse of `to_jsonable` (and of `to_original_jsonable`) for tensors (client side)."""
    if isinstance(obj, dict):
        if "b64" in obj and "dtype" in obj and "shape" in obj:
            return tensor_from_json(obj)
        if isinstance(obj.get("data"), str) and "original_dtype" in obj and "shape" in obj:
            return tensor_from_json({k: v for k, v in obj.items() if k != "__type__"}, any_dtype=True)
        if set(obj) == {"__json__"}:
            return obj["__json__"]
        return {k: from_jsonable(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [from_jsonable(v) for v in obj]
    return obj
