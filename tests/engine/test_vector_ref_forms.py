"""A registered vector whose rows are all equal ((n_layers, d) or (n_layers, n_pos, d) with equal blocks)
goes by reference like any other: the rows the workers hold (`vector_refs.forms`) are all of its rows,
never the first row alone that `steer_rows` sends inline for equal rows (rowrep) — held so, no request's
digest ever matched and such a vector always carried its bytes (review3). Numbers equal HF float32."""

from __future__ import annotations

import types

import pytest
import torch
from vllm import SamplingParams

from support.reference import greedy, hf_model, residuals
from vllm_worker import SteeringVector
from vllm_worker.counters import VECTOR_REFS
from vllm_worker.frontend.validation import parse_request
from vllm_worker.frontend.vector_refs import forms
from vllm_worker.protocol.spec import ModelShape

D, LAYERS = 128, [0, 1, 2, 3]
PROMPT = "the water of people will come down to the side"
NEW = 5


def _rows(seed: int, shape: tuple[int, ...]) -> torch.Tensor:
    v = torch.randn(*shape[1:], generator=torch.Generator().manual_seed(seed))
    return v.expand(*shape).clone()  # (dense, every row equal)


@pytest.mark.parametrize("shape", [(4, D), (2, 3, D)])
def test_held_rows_are_every_row_and_their_digest_is_a_requests(shape):
    rows = _rows(1, shape)
    held = forms(types.SimpleNamespace(tensor=rows))
    assert held.shape == shape and len(held.plain) == rows.numel() * 4
    assert held.unit is not None and len(held.unit) == rows.numel() * 4
    layers = list(range(shape[0]))
    extra = {} if len(shape) == 2 else {"position_indices": list(range(shape[1]))}
    for op, unit in (("add", False), ("ablate", True)):
        sv = SteeringVector(activations=rows, layer_indices=layers, op=op, **extra)
        spec = parse_request({"apply_steering_vectors": [sv]}, ModelShape(n_layers=8, d_model=D), 7)
        assert spec is not None and spec.steers[0].repeat == shape[0]  # (inline: one row crosses)
        assert held.digest(unit, 1) == spec.steers[0].digest  # (what `by_reference` matches)


def _edit(rows: torch.Tensor, op: str):
    def edit(layer: int, h: torch.Tensor):
        if layer not in LAYERS:
            return None
        x, v = h[0].clone(), rows[LAYERS.index(layer)].float()
        if op == "add":
            return (x + v).unsqueeze(0)
        d = v / v.norm()
        return (x - (x @ d)[:, None] * d).unsqueeze(0)

    return edit


@pytest.mark.parametrize("op", ["add", "ablate"])
def test_a_registered_vector_of_equal_rows_goes_by_reference_equal_to_hf(llama, op):
    rows = _rows(2, (len(LAYERS), D)) * 3.0
    llama.register_vector("eq-rows", rows)
    try:
        sent = VECTOR_REFS["sent"]
        sp = SamplingParams(
            max_tokens=NEW,
            temperature=0,
            ignore_eos=True,
            extra_args={
                "apply_steering_vectors": [SteeringVector(name="eq-rows", layer_indices=LAYERS, op=op)],
                "output_residual_stream": LAYERS,
            },
        )
        out = llama.generate([PROMPT], [sp], use_tqdm=False)[0]
        assert VECTOR_REFS["sent"] - sent == 1  # (by reference: the held rows)
    finally:
        llama.delete_vector("eq-rows")
    hf = hf_model("llama")
    prompt, got = list(out.prompt_token_ids), list(out.outputs[0].token_ids)
    assert got == greedy(hf, prompt, len(got), _edit(rows, op))
    ref, _ = residuals(hf, (prompt + got)[:-1], _edit(rows, op))
    acts = out.activations["residual_stream"]
    assert (acts - ref).abs().max().item() <= 1e-4 * max(1.0, ref.abs().max().item())
