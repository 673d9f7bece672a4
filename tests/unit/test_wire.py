"""The pickle-free tensor wire format: exact round trips (bfloat16 included) and clear errors."""

from __future__ import annotations

import json

import pytest
import torch

from vllm_worker.protocol.wire import from_jsonable, tensor_from_json, tensor_to_json, to_jsonable


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.int64])
@pytest.mark.parametrize("compress", [False, True])
def test_round_trip_is_bit_exact(dtype, compress):
    t = (torch.randn(3, 5, 7) * 100).to(dtype)
    obj = json.loads(json.dumps(tensor_to_json(t, compress=compress)))
    back = tensor_from_json(obj)
    assert back.dtype == dtype and back.shape == t.shape
    assert torch.equal(back.view(torch.uint8), t.contiguous().view(torch.uint8))


def test_hook_state_as_json():
    state = {"a": [torch.ones(2), (1, "x")], 3: {"b": None}, "obj": object}
    back = from_jsonable(json.loads(json.dumps(to_jsonable(state))))
    assert torch.equal(back["a"][0], torch.ones(2)) and back["a"][1] == [1, "x"]
    assert back["3"] == {"b": None} and back["obj"].startswith("<class")


@pytest.mark.parametrize(
    "obj,message",
    [
        ({"dtype": "float32", "shape": [2], "b64": "!!"}, "t.b64: not valid base64"),
        ({"dtype": "float32", "shape": [3], "b64": "AAAAAA=="}, "do not match shape"),
        ({"dtype": "nope", "shape": [1], "b64": "AAAAAA=="}, "t.dtype"),
        ({"dtype": "float32", "shape": [-1], "b64": "AAAAAA=="}, "t.shape"),
        ({"dtype": "float32", "shape": [1], "b64": "AAAAAA==", "compression": "lz4"}, "t.compression"),
        ([1, 2], "t: expected a tensor object"),
    ],
)
def test_malformed_is_a_value_error_naming_the_field(obj, message):
    with pytest.raises(ValueError, match=message.replace(".", r"\.")):
        tensor_from_json(obj, "t")


def test_size_limit_applies_after_decompression():
    obj = tensor_to_json(torch.zeros(1 << 16), compress=True)  # 256 KiB of zeros compresses to ~1 KiB
    with pytest.raises(ValueError, match="exceeds the limit"):
        tensor_from_json(obj, "t", max_bytes=1 << 12)


def _original_form(t: torch.Tensor, zstd: bool = True) -> dict:
    """A tensor object as the original vllm-lens sends it: numpy storage dtype (bfloat16 as int16),
    `original_dtype`, base64 `data`, zstd or no compression."""
    import base64

    import zstandard

    arr = (t.view(torch.int16) if t.dtype == torch.bfloat16 else t).numpy()
    raw = arr.tobytes()
    return {
        "data": base64.b64encode(zstandard.ZstdCompressor(level=1).compress(raw) if zstd else raw).decode(),
        "dtype": str(arr.dtype),
        "original_dtype": str(t.dtype),
        "shape": list(arr.shape),
        "compression": "zstd" if zstd else None,
    }


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("zstd", [True, False])
def test_the_original_tensor_objects_are_read_exactly(dtype, zstd):
    t = (torch.randn(2, 3, 64) * 10).to(dtype)
    back = tensor_from_json(json.loads(json.dumps(_original_form(t, zstd))), "v", max_bytes=1 << 20)
    assert back.dtype == dtype and torch.equal(back.view(torch.uint8), t.view(torch.uint8))


def test_original_tensor_objects_are_bounded_and_checked():
    import base64

    import zstandard

    bomb = {
        "data": base64.b64encode(zstandard.ZstdCompressor().compress(bytes(64 << 20))).decode(),
        "dtype": "float32",
        "original_dtype": "torch.float32",
        "shape": [16 << 20],
        "compression": "zstd",
    }
    assert len(bomb["data"]) < 10_000  # 64 MB of zeros in a few kB
    with pytest.raises(ValueError, match=r"v: decompressed payload exceeds the limit"):
        tensor_from_json(bomb, "v", max_bytes=1 << 20)
    good = _original_form(torch.ones(2, 4))
    for key, value, match in [
        ("compression", "lz4", r"v.compression"),
        ("data", "@@", r"v.data: not valid"),
        ("original_dtype", "torch.int64", r"v.original_dtype"),
        ("dtype", "int16", r"v.dtype"),
        ("shape", [3, 4], r"v.data: .* do not match"),
    ]:
        with pytest.raises(ValueError, match=match):
            tensor_from_json({**good, key: value}, "v", max_bytes=1 << 20)
    with pytest.raises(ValueError, match=r"v.data: not valid zstd"):
        tensor_from_json({**good, "data": base64.b64encode(b"not zstd at all").decode()}, "v")


def test_json_chunks_equal_json_dumps():
    from vllm_worker.protocol import wire

    obj = {
        "a": [1, 2.5, None, True, 'x"y\\z\n\u00e9\U0001f600' * 3, {"k": []}],
        "b": {},
        "c": [],
        "d": (1, 2),
        "big": 'q"\\' * 3_000_000,
        "t": tensor_to_json(torch.randn(700_000)),
    }
    assert b"".join(wire.json_chunks(obj)).decode() == json.dumps(obj)
    assert from_jsonable(json.loads(b"".join(wire.json_chunks(obj))))["t"].shape == (700_000,)
    # tensors written lazily (straight from their memory) give exactly tensor_to_json's text
    ts = {"x": torch.randn(3, 1_500_001), "e": torch.empty(0, 4), "h": torch.randn(5, dtype=torch.bfloat16)}
    assert b"".join(wire.json_chunks(wire.to_jsonable(ts, lazy=True))).decode() == json.dumps(wire.to_jsonable(ts))


def test_encoding_a_huge_capture_is_written_in_bounded_pieces():
    """The HTTP server encodes captures in a thread; the event loop gets the GIL between pieces only if no
    piece is made by one long call. The property tested here is the bound on every piece (the GIL wait itself
    is a timing, measured by bench/probes/gil_wait.py, not asserted in a test)."""
    from vllm_worker.protocol import wire

    t = torch.arange(15_000_000, dtype=torch.float32)  # 60 MB: 20 base64 pieces
    pieces = wire.json_chunks({"residual_stream": wire.to_jsonable(t, lazy=True)})
    assert len(pieces) > 10
    assert max(map(len, pieces)) <= 6 << 20
    whole = json.loads(b"".join(pieces))
    back = wire.tensor_from_json(whole["residual_stream"])
    assert torch.equal(back, t)


def test_pending_map_keeps_the_sum_of_reservations():
    from vllm_worker.frontend.state import Pending, PendingMap

    m = PendingMap()
    m["a"], m["b"] = Pending("k", 1, [0], 4, 10), Pending("k2", 1, [0], 4, 5)
    m["a"] = Pending("k", 1, [0], 4, 7)  # replaced: counted once
    assert m.reserved == 12
    assert m.pop("a").reserved == 7 and m.reserved == 5
    assert m.pop("missing", None) is None and m.reserved == 5
    del m["b"]
    assert m.reserved == 0 and not m


def test_a_view_reads_the_payload_bytes_and_the_worker_keeps_only_copies(monkeypatch):
    """`tensor_from_bytes(view=True)` (the worker's admission) reads the payload's bytes without a copy and
    without torch's warning; the default copies. What admission keeps of a steering vector is a copy, so
    nothing ever writes through the view into the payload's `bytes`."""
    import warnings

    from vllm_worker.protocol.ops import ABLATE
    from vllm_worker.protocol.spec import RequestSpec, Steer, decode, encode
    from vllm_worker.protocol.wire import tensor_from_bytes, tensor_to_bytes
    from vllm_worker.worker.admission import Admission
    from vllm_worker.worker.store import CaptureStore

    t = torch.randn(3, 8)
    obj = tensor_to_bytes(t)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        v = tensor_from_bytes(obj, view=True)
    c = tensor_from_bytes(obj)
    assert torch.equal(v, t) and torch.equal(c, t) and v.dtype == c.dtype == torch.float32
    addr = lambda x: x.untyped_storage().data_ptr()  # noqa: E731
    view_again = tensor_from_bytes(obj, view=True)
    assert addr(view_again) == addr(v)  # both read the same bytes object
    assert addr(c) != addr(v)
    for dtype in (torch.float32, torch.bfloat16):
        payload = encode(RequestSpec(key="k", steers=[Steer([0, 1], t[:2].clone(), None, 1.0, False, op=ABLATE)]))
        spec = decode(payload, view=True)
        assert addr(spec.steers[0].vectors) == addr(tensor_from_bytes(payload["steer"][0]["vec"], view=True))
        adm = Admission(
            None,
            torch.device("cpu"),
            dtype,
            8,
            frozenset({0, 1}),
            frozenset({0, 1}),
            {},
            True,
            None,
            CaptureStore(torch.device("cpu")),
            None,
            None,
            None,  # type: ignore[arg-type]
        )
        state = adm.admit("r0", payload)
        assert state.store is None and len(state.steers) == 1
        for _ in range(2):  # on the host until the step's flush, then on the device
            kept = state.steers[0].vectors
            assert addr(kept) != addr(spec.steers[0].vectors) and torch.equal(kept, t[:2].to(dtype))
            adm.flush()
