"""The pickle-free tensor wire format: exact round trips (bfloat16 included) and clear errors."""

from __future__ import annotations

import json

import pytest
import torch

from vllm_worker.wire import from_jsonable, tensor_from_json, tensor_to_json, to_jsonable


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


@pytest.mark.parametrize("obj,message", [
    ({"dtype": "float32", "shape": [2], "b64": "!!"}, "t.b64: not valid base64"),
    ({"dtype": "float32", "shape": [3], "b64": "AAAAAA=="}, "do not match shape"),
    ({"dtype": "nope", "shape": [1], "b64": "AAAAAA=="}, "t.dtype"),
    ({"dtype": "float32", "shape": [-1], "b64": "AAAAAA=="}, "t.shape"),
    ({"dtype": "float32", "shape": [1], "b64": "AAAAAA==", "compression": "lz4"}, "t.compression"),
    ([1, 2], "t: expected a tensor object"),
])
def test_malformed_is_a_value_error_naming_the_field(obj, message):
    with pytest.raises(ValueError, match=message.replace(".", r"\.")):
        tensor_from_json(obj, "t")


def test_size_limit_applies_after_decompression():
    obj = tensor_to_json(torch.zeros(1 << 16), compress=True)  # 256 KiB of zeros compresses to ~1 KiB
    with pytest.raises(ValueError, match="exceeds the limit"):
        tensor_from_json(obj, "t", max_bytes=1 << 12)
