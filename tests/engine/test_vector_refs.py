"""Named vectors by reference (`frontend.vector_refs`): a request naming a registered vector sends its id
and the workers use the rows pushed at register time — the numbers equal HF float32 with the edit by hand
(ablate at every layer, addition), in a batch mixing named, inline and plain requests; replacing or
deleting a name while requests naming it are in flight leaves them the old vector's numbers; the
workers forget a registration only once no request names it."""

from __future__ import annotations

import pytest
import torch
from vllm import SamplingParams

from support.reference import greedy, hf_model, residuals
from vllm_worker import SteeringVector
from vllm_worker.counters import VECTOR_REFS
from vllm_worker.frontend.fetch import attach_outputs
from vllm_worker.worker.vector_refs import HELD

D, LAYERS = 128, [0, 1, 2, 3]
PROMPTS = ["the water of people will come down to the side", "a long thing to see him", "they said the first"]
NEW = 5


def _vec(seed: int, shape=(D,), norm: float = 3.0) -> torch.Tensor:
    v = torch.randn(*shape, generator=torch.Generator().manual_seed(seed))
    return v / v.norm(dim=-1, keepdim=True) * norm


def _edit(ops: list[tuple[str, torch.Tensor, list[int], float]]):
    """HF reference: each (op, rows (len(layers), d), layers, scale) on the stream after those layers."""

    def edit(layer: int, h: torch.Tensor):
        x = h[0].clone()
        for op, rows, layers, scale in ops:
            if layer not in layers:
                continue
            v = rows[layers.index(layer)].float()
            if op == "add":
                x = x + scale * v
            else:
                d = v / v.norm()
                x = x - (x @ d)[:, None] * d
        return x.unsqueeze(0)

    return edit


def _check(out, ops) -> None:
    hf = hf_model("llama")
    prompt, got = list(out.prompt_token_ids), list(out.outputs[0].token_ids)
    assert got == greedy(hf, prompt, len(got), _edit(ops))
    ref, _ = residuals(hf, (prompt + got)[:-1], _edit(ops))
    acts = out.activations["residual_stream"]
    assert (acts - ref).abs().max().item() <= 1e-4 * max(1.0, ref.abs().max().item())


def _sp(steer, capture=True, **kw) -> SamplingParams:
    extra = {"apply_steering_vectors": steer} if steer else {}
    if capture:
        extra["output_residual_stream"] = LAYERS
    return SamplingParams(max_tokens=NEW, temperature=0, ignore_eos=True, extra_args=extra or None, **kw)


@pytest.fixture
def names(llama):
    made: list[str] = []
    yield made
    for n in made:
        llama.delete_vector(n)


def test_by_reference_equals_hf_in_a_mixed_batch(llama, names):
    one, two = _vec(1), _vec(2, (len(LAYERS), D), norm=4.0)
    llama.register_vector("ref-dir", one)
    llama.register_vector("ref-rows", two)
    names += ["ref-dir", "ref-rows"]
    inline = _vec(3)
    cases = [
        (
            [SteeringVector(name="ref-dir", layer_indices=LAYERS, op="ablate")],
            [("ablate", one.expand(4, D), LAYERS, 1)],
        ),
        ([{"name": "ref-rows", "layer_indices": LAYERS, "scale": 2.0}], [("add", two, LAYERS, 2.0)]),
        (
            [SteeringVector(name="ref-dir", layer_indices=[2], scale=1.5), SteeringVector(inline[None], [1])],
            [("add", one[None], [2], 1.5), ("add", inline[None], [1], 1.0)],
        ),
        ([], []),  # a plain batch-mate
    ]
    sent = VECTOR_REFS["sent"]
    outs = llama.generate(PROMPTS + PROMPTS[:1], [_sp(s) for s, _ in cases], use_tqdm=False)
    assert VECTOR_REFS["sent"] - sent == 3  # the named steers went by reference, the inline one by bytes
    for out, (_, ops) in zip(outs, cases):
        _check(out, ops)
    # by bytes (the same steering inline) gives the same numbers, bit for bit
    again = llama.generate(
        PROMPTS[:1], [_sp([SteeringVector(one.expand(4, D).clone(), LAYERS, op="ablate")])], use_tqdm=False
    )[0]
    assert torch.equal(again.activations["residual_stream"], outs[0].activations["residual_stream"])


def test_replace_and_delete_in_flight_keep_the_old_numbers(llama, names):
    old, new = _vec(4), _vec(5)
    llama.register_vector("ref-live", old)
    names.append("ref-live")
    engine = llama.llm_engine
    sent = VECTOR_REFS["sent"]
    engine.add_request("live-0", PROMPTS[0], _sp([SteeringVector(name="ref-live", layer_indices=LAYERS, op="ablate")]))
    engine.add_request("live-1", PROMPTS[1], _sp([SteeringVector(name="ref-live", layer_indices=[1, 3], scale=2.0)]))
    held = HELD.count()
    llama.register_vector("ref-live", new)  # replaced before any worker admitted them
    engine.add_request("live-2", PROMPTS[2], _sp([SteeringVector(name="ref-live", layer_indices=[1, 3], scale=2.0)]))
    assert HELD.count() == held + 1  # the old rows stay while requests name them
    assert VECTOR_REFS["sent"] - sent == 3  # (all three by reference)
    done: dict = {}
    steps = 0
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                done[o.request_id] = o
        steps += 1
        if steps == 1:
            assert llama.delete_vector("ref-live")  # deleted while all three run
            names.remove("ref-live")
    attach_outputs(llama, list(done.values()))
    assert all(done[r].activations.get("errors") is None for r in done), {r: done[r].activations for r in done}
    _check(done["live-0"], [("ablate", old.expand(4, D), LAYERS, 1)])
    _check(done["live-1"], [("add", old.expand(2, D), [1, 3], 2.0)])
    _check(done["live-2"], [("add", new.expand(2, D), [1, 3], 2.0)])
    # nothing names them now: the next request carries their drops and the workers forget both
    drops = VECTOR_REFS["drops_sent"]
    llama.generate(PROMPTS[:1], [_sp([SteeringVector(_vec(6)[None], [1])], capture=False)], use_tqdm=False)
    assert VECTOR_REFS["drops_sent"] - drops == 2 and HELD.count() == held - 1


def test_errors_still_name_the_field(llama, names):
    llama.register_vector("ref-zero", torch.zeros(D))
    names.append("ref-zero")
    with pytest.raises(ValueError, match=r"apply_steering_vectors\[0\]\.activations: row \[0\] is zero"):
        llama.generate(PROMPTS[:1], [_sp([{"name": "ref-zero", "layer_indices": [1], "op": "ablate"}])])
    with pytest.raises(ValueError, match=r"apply_steering_vectors\[1\]\.name: unknown vector 'ref-none'"):
        llama.generate(
            PROMPTS[:1],
            [_sp([{"name": "ref-zero", "layer_indices": [1]}, {"name": "ref-none", "layer_indices": [1]}])],
        )


def test_an_aborted_request_unpins_what_it_named(llama, names):
    llama.register_vector("ref-abort", _vec(7))
    engine = llama.llm_engine
    held = HELD.count()
    engine.add_request("abort-0", PROMPTS[0], _sp([SteeringVector(name="ref-abort", layer_indices=[1], scale=2.0)]))
    assert llama.delete_vector("ref-abort")  # retired, still named by the request in flight
    engine.abort_request(["abort-0"])
    drops = VECTOR_REFS["drops_sent"]
    out = llama.generate(PROMPTS[:1], [_sp([SteeringVector(_vec(8)[None], [2])])], use_tqdm=False)[0]
    _check(out, [("add", _vec(8)[None], [2], 1.0)])
    assert VECTOR_REFS["drops_sent"] - drops == 1 and HELD.count() == held - 1
    assert not engine.has_unfinished_requests()
