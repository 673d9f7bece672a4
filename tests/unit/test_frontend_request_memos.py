"""The frontend's per-request shortcuts give what the full paths give: a steering vector's deep copy (vLLM
clones every request's params) equals pydantic's field for field; a probe action's condition, worked out
once per loaded probe, is byte-equal to a fresh one and does not follow a caller who writes into the
tensors it loaded the probe from; the plain-int layer list and the sites of every layer equal the loops,
and bad layer lists are still refused naming the field."""

import copy

import pytest
import torch
from pydantic import BaseModel

from vllm_worker.api.steering import SteeringVector
from vllm_worker.frontend import actions
from vllm_worker.frontend import probes as probe_keys
from vllm_worker.protocol import points as pts
from vllm_worker.protocol.clone_scope import sharing_tensors
from vllm_worker.protocol.spec import ModelShape, layer_list
from vllm_worker.protocol.wire import tensor_to_bytes

D = 64


def _vectors() -> list[SteeringVector]:
    g = torch.Generator().manual_seed(0)
    unit = torch.nn.functional.normalize(torch.randn(D, generator=g), dim=0)
    return [
        SteeringVector(activations=unit.expand(4, D).clone(), layer_indices=[0, 1, 2, 3], op="ablate"),
        SteeringVector(activations=unit.view(1, D).clone(), layer_indices=[1], op="cap", lo=-1.0, hi=1.0),
        SteeringVector(name="dir", layer_indices=[1, 2], op="ablate"),
        SteeringVector(activations=torch.randn(1, 3, D, generator=g), layer_indices=[3], position_indices=[0, 1, 2]),
        SteeringVector(point="z", heads=[0, 3], layer_indices=[0], scale=0.5),
        SteeringVector(activations=torch.randn(1, D, generator=g, requires_grad=True), layer_indices=[3]),
    ]


@pytest.mark.parametrize("shared", [False, True])
def test_steering_vector_deep_copy_equals_pydantics(shared):
    for sv in _vectors():
        with sharing_tensors() if shared else torch.no_grad():
            fast = copy.deepcopy(sv)
        slow = BaseModel.__deepcopy__(sv, {})
        assert fast.__dict__.keys() == slow.__dict__.keys()
        for k, x in fast.__dict__.items():
            y = slow.__dict__[k]
            if isinstance(x, torch.Tensor):
                assert x.dtype == y.dtype and x.shape == y.shape and torch.equal(x, y)
                if not x.requires_grad:  # (the tensor: shared only inside vLLM's clone)
                    assert (x.data_ptr() == sv.activations.data_ptr()) == shared
            else:
                assert x == y and type(x) is type(y), k
                if isinstance(x, list):  # the copy's own lists: the caller's never change with it
                    assert x is not sv.__dict__[k]
        assert fast.__pydantic_fields_set__ == sv.__pydantic_fields_set__
        assert fast.__pydantic_fields_set__ is not sv.__pydantic_fields_set__
        assert fast == sv and fast.model_dump_json() == sv.model_dump_json()
        with pytest.raises(Exception):  # still frozen
            fast.scale = 2.0


def test_deep_copy_keeps_one_copy_of_a_shared_list():
    sv = SteeringVector(name="dir", layer_indices=[1, 2], op="ablate")
    outer = {"v": sv, "layers": sv.layer_indices}
    got = copy.deepcopy(outer)
    assert got["v"].layer_indices is got["layers"] and got["layers"] == [1, 2]
    assert got["layers"] is not sv.layer_indices


def _loaded(weight: torch.Tensor, **parts):
    shape = ModelShape(n_layers=4, d_model=D)
    return {"m": probe_keys.prepare("m", None, shape, {"weight": weight, "layers": [1], **parts})}


def test_probe_condition_once_equals_fresh_and_ignores_caller_writes():
    g = torch.Generator().manual_seed(1)
    w = torch.randn(2, D, generator=g)
    mean, std = torch.randn(D, generator=g), torch.rand(D, generator=g) + 0.5
    probes = _loaded(w, bias=torch.zeros(2), mean=mean, std=std)
    fresh = actions.probe_condition("m", "f", probes, 1, "o")
    first = actions.probe_wire("m", "f", probes, 1, "o")
    assert first[0] == fresh[0] == "m[1]" and first[1] == fresh[1] and first[3] == fresh[3]
    assert first[2] == tensor_to_bytes(fresh[2])
    w.mul_(-3.0)  # the caller writes into the tensors it loaded the probe from
    mean.zero_()
    again = actions.probe_wire("m", "f", probes, 1, "o")
    assert again == first and again[1] is not first[1] and again[2] is not first[2]
    assert again[2]["shape"] is not first[2]["shape"]
    assert tensor_to_bytes(actions.probe_condition("m", "f", probes, 1, "o")[2]) == first[2]


def test_probe_condition_errors_every_time():
    probes = _loaded(torch.randn(2, D))
    actions.probe_wire("m", "f", probes, 0, "o")
    for bad, field in ((True, "o"), (2, "o"), (None, "o"), ("0", "o")):
        with pytest.raises(ValueError, match=f"^{field}:"):
            actions.probe_wire("m", "f", probes, bad, "o")
    with pytest.raises(ValueError, match="^f: no probe named 'x'"):
        actions.probe_wire("x", "f", probes, 0, "o")


def test_layer_list_plain_ints_equal_the_loop_and_bad_lists_fail():
    for value in ([0, 1, 2, 3], [3, 1], (2, 0), [-1, 0], range(4), [True, 1][1:]):
        assert layer_list(value, "f", 4, unique=True) == [v % 4 for v in value]
    for value, match in (
        ([0, 1, 1], "duplicate"),
        ([0, 4], "out of range"),
        ([0, -5], "out of range"),
        ([0, True], "must be ints"),
        ([0, 1.0], "must be ints"),
        ([], "non-empty"),
    ):
        with pytest.raises(ValueError, match=f"^f: .*{match}"):
            layer_list(value, "f", 4, unique=True)


def test_canonical_sites_equal_one_by_one():
    for point in pts.CODE:
        layers = [0, 1, 5, 31]
        assert pts.canonical_sites(point, layers) == [pts.canonical_site(point, l) for l in layers]
