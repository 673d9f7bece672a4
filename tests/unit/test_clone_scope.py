"""vLLM's clone of a request's params shares a steering vector's tensor only inside `process_inputs`
(`protocol.clone_scope`); a caller's own deep copy still copies, and the frontend's rows never alias the
caller's tensor."""

import copy

import torch
from vllm import SamplingParams

from vllm_worker.api.steering import SteeringVector
from vllm_worker.frontend.validation import parse_request
from vllm_worker.protocol.clone_scope import sharing_tensors, tensors_shared
from vllm_worker.protocol.spec import ModelShape


def _sp() -> SamplingParams:
    v = torch.randn(2, 64, generator=torch.Generator().manual_seed(0))
    return SamplingParams(extra_args={"apply_steering_vectors": [SteeringVector(v, [0, 1], op="ablate")]})


def _acts(sp: SamplingParams) -> torch.Tensor:
    return sp.extra_args["apply_steering_vectors"][0].activations


def test_deep_copy_copies_outside_the_scope():
    sp = _sp()
    for c in (sp.clone(), copy.deepcopy(sp)):
        assert not tensors_shared()
        assert _acts(c).data_ptr() != _acts(sp).data_ptr() and torch.equal(_acts(c), _acts(sp))
        _acts(c).zero_()
        assert _acts(sp).abs().sum() > 0  # the caller's tensor untouched


def test_clone_shares_inside_the_scope_and_the_scope_ends():
    sp = _sp()
    with sharing_tensors():
        assert tensors_shared()
        c = sp.clone()
    assert not tensors_shared()
    assert _acts(c) is _acts(sp)  # (no copy: read and dropped by the frontend in the same call)
    assert c.extra_args["apply_steering_vectors"][0] is not sp.extra_args["apply_steering_vectors"][0]
    assert _acts(sp.clone()).data_ptr() != _acts(sp).data_ptr()


def test_frontend_rows_never_alias_the_shared_tensor():
    sp = _sp()
    want = _acts(sp).clone()
    with sharing_tensors():
        c = sp.clone()
    spec = parse_request(c.extra_args, ModelShape(n_layers=2, d_model=64), 8)
    rows = spec.steers[0].vectors
    assert rows.data_ptr() != _acts(sp).data_ptr()
    assert torch.allclose(rows, want / want.norm(dim=-1, keepdim=True), atol=1e-6)
    rows.zero_()
    assert torch.equal(_acts(sp), want)  # writing the request's rows never reaches the caller
