"""Named vectors offline: `llm.register_vector` once, then steering entries name it — the same tokens and
activations as carrying the tensor inline; unknown names and bad tensors are errors naming them."""

from __future__ import annotations

import pytest
import torch
from vllm import SamplingParams

from vllm_worker import SteeringVector

PROMPT = "the water of people will come down to the side"


def _run(llm, steer):
    sp = SamplingParams(
        max_tokens=6,
        temperature=0,
        ignore_eos=True,
        extra_args={"apply_steering_vectors": steer, "output_residual_stream": [2, 3]},
    )
    return llm.generate([PROMPT], sp, use_tqdm=False)[0]


def test_steering_by_registered_name_equals_inline(llama):
    v = torch.randn(128, generator=torch.Generator().manual_seed(4)) * 3
    desc = llama.register_vector("offline-push", v)
    assert desc == {"name": "offline-push", "shape": [128], "dtype": "float32", "bytes": 512}
    v.mul_(0)  # the registry keeps its own copy
    v = torch.randn(128, generator=torch.Generator().manual_seed(4)) * 3
    inline = _run(llama, [SteeringVector(v.expand(2, 128), [1, 2], scale=2.0)])
    named = _run(llama, [SteeringVector(name="offline-push", layer_indices=[1, 2], scale=2.0)])
    plain = _run(llama, [])
    assert list(named.outputs[0].token_ids) == list(inline.outputs[0].token_ids)
    assert torch.equal(named.activations["residual_stream"], inline.activations["residual_stream"])
    assert not torch.equal(named.activations["residual_stream"], plain.activations["residual_stream"])
    # the dict form names it too, at another point
    as_dict = _run(llama, [{"name": "offline-push", "layer_indices": [1], "point": "resid_pre"}])
    ref = _run(llama, [SteeringVector(v[None], [1], point="resid_pre")])
    assert torch.equal(as_dict.activations["residual_stream"], ref.activations["residual_stream"])

    assert {"name": "offline-push", "shape": [128], "dtype": "float32", "bytes": 512} in llama.list_vectors()
    assert llama.delete_vector("offline-push") and not llama.delete_vector("offline-push")
    with pytest.raises(ValueError, match=r"apply_steering_vectors\[0\]\.name: unknown vector 'offline-push'"):
        _run(llama, [SteeringVector(name="offline-push", layer_indices=[1])])


@pytest.mark.parametrize(
    "tensor, match",
    [
        (torch.ones(100), "last dimension 100 != d_model 128"),
        (torch.tensor([float("nan")] * 128), "contains NaN or inf"),
        (torch.ones(128, dtype=torch.int64), "expected a floating-point"),
        (torch.ones(1, 1, 1, 128), "expected \\(d_model,\\)"),
    ],
    ids=["width", "nan", "int", "4-d"],
)
def test_bad_vectors_are_refused_naming_the_field(llama, tensor, match):
    with pytest.raises(ValueError, match="register_vector.tensor: " + match):
        llama.register_vector("bad", tensor)
    with pytest.raises(ValueError, match="register_vector.name"):
        llama.register_vector("no/slash", torch.ones(128))
    assert all(v["name"] != "bad" for v in llama.list_vectors())


def test_the_registry_is_bounded(llama, monkeypatch):
    monkeypatch.setenv("VLLM_LENS_MAX_VECTORS_MB", str(1.5 * 512 / 2**20))  # one 512-byte vector fits
    llama.register_vector("first", torch.ones(128))
    llama.register_vector("first", torch.zeros(128))  # replacing it frees its bytes first
    with pytest.raises(
        ValueError,
        match=r"activations: registering .second. \(512 bytes\) .*limit of 768 bytes \(VLLM_LENS_MAX_VECTORS_MB\)",
    ):
        llama.register_vector("second", torch.ones(128))
    assert llama.delete_vector("first")
    llama.register_vector("second", torch.ones(128))
    assert llama.delete_vector("second")
