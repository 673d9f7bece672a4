"""On the CPU engine a request's probe scores do not depend on the batch around it, bit for bit: one request
scored alone and the same request batched with other prompts (longer and shorter prompts, so that its
prefill and decode rows share steps with other requests' prefill chunks and decode rows; batch-mates naming
other probes at the same layers, or none) give `torch.equal` per-token scores and aggregates — on the
graph-safe path and on the Python path (the request also hooks a later layer).

This can only hold where vLLM's own activations are batch-invariant: the request's captured residuals at the
probes' layers are checked bitwise equal alone and batched first (plain vLLM 0.28+ on CPU is: the last
column of docs/compatibility.md's matrix; on 0.26 / 0.27 it is not, and only the next check can hold there).
In every run the scores are bitwise the captured rows through `projection.project`, the bias and the
sigmoid, row by row: a score depends on its own row only."""

from __future__ import annotations

import pytest
import torch
import vllm
from packaging.version import Version
from vllm import SamplingParams

from support.hook_fns import ablate
from vllm_worker import Hook, counters
from vllm_worker.worker.projection import project

D = 128
PROMPT = "the water of people will come down to the side"
OTHERS = [
    "a long thing to see him",
    "how many water did she see when the people of the long side will come down to see him again and again",
    "the side",
    "did she come",
]
LAYERS = [0, 1, 2]


def _probe(seed: int, n_out: int, layers: list[int], output: str) -> dict:
    g = torch.Generator().manual_seed(seed)
    k = len(layers) * D
    return dict(weight=torch.randn(n_out, k, generator=g) / k**0.5, bias=torch.randn(n_out, generator=g),
                layers=layers, output=output)  # fmt: skip


PROBES = {
    "ri_l1": _probe(31, 2, [1], "logit"),
    "ri_l02": _probe(32, 1, [0, 2], "sigmoid"),
    "ri_other": _probe(33, 3, [1], "logit"),  # batch-mates': more columns at the request's site
}


@pytest.fixture(scope="module")
def llm(llama):
    for name, p in PROBES.items():
        llama.load_probe(name, **p)
    yield llama
    for name in PROBES:
        llama.delete_probe(name)


def _sp(**extra) -> SamplingParams:
    return SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, extra_args=extra or None)


def _mine(hooks: bool) -> SamplingParams:
    extra: dict = {"output_probe_scores": {"ri_l1": {}, "ri_l02": {"aggregate": ["rolling_max:3", "ema:0.8"]}}}
    extra["output_residual_stream"] = LAYERS
    if hooks:  # layer 3 follows every probe layer: the same residuals there
        extra["apply_hooks"] = [Hook(ablate(5), [3])]
    return _sp(**extra)


def _mates() -> list[SamplingParams]:
    return [
        _sp(output_probe_scores=["ri_other", "ri_l1"]),
        _sp(),
        _sp(output_probe_scores=["ri_l02"]),
        _sp(output_probe_scores=["ri_other"]),
    ]


@pytest.mark.parametrize("hooks", [False, True], ids=["graph_path", "python_path"])
def test_a_requests_scores_are_bitwise_the_same_alone_and_batched(llm, hooks, monkeypatch):
    if hooks:
        monkeypatch.setenv("VLLM_LENS_SEAMS", "0")  # a hook sends the whole step to the Python path
    key = "python_steps" if hooks else "graph_steps"
    before = counters.STEP_TIMINGS[key]
    alone = llm.generate([PROMPT], [_mine(hooks)], use_tqdm=False)[0]
    assert counters.STEP_TIMINGS[key] > before  # on the path named
    batched = llm.generate([*OTHERS[:2], PROMPT, *OTHERS[2:]], [*_mates()[:2], _mine(hooks), *_mates()[2:]],
                           use_tqdm=False)[2]  # fmt: skip
    assert list(alone.outputs[0].token_ids) == list(batched.outputs[0].token_ids)
    a, b = alone.activations, batched.activations
    # vLLM's own residuals at the probes' layers: bitwise the same alone and batched (else the scores could
    # only match row by row, below)
    vllm_invariant = all(torch.equal(a["residual_stream"][l], b["residual_stream"][l]) for l in LAYERS)
    if Version(vllm.__version__).release >= (0, 28):
        assert vllm_invariant, "plain vLLM's residuals differ alone vs batched"
    for out in (a, b):  # every release: a score is its own captured row's, bit for bit
        for name in ("ri_l1", "ri_l02"):
            assert torch.equal(out["probe_scores"][name], _from_rows(out["residual_stream"], name)), name
    if not vllm_invariant:
        return
    for name in ("ri_l1", "ri_l02"):
        assert torch.equal(a["probe_scores"][name], b["probe_scores"][name]), name
        assert list(a["probe_aggregates"][name]) == list(b["probe_aggregates"][name])
        for k, v in a["probe_aggregates"][name].items():
            assert torch.equal(v, b["probe_aggregates"][name][k]), (name, k)


def _from_rows(streams: dict, name: str) -> torch.Tensor:
    """A probe's scores of captured rows as the worker computes them: per layer a projection (`project`, the
    weights split by layer), the parts added in layer order, then the bias, then the sigmoid."""
    p = PROBES[name]
    total = None
    for l, w in zip(p["layers"], p["weight"].double().split(D, dim=1)):
        x = streams[l]
        y = torch.empty(len(x), w.shape[0])
        project(x, w.float().contiguous(), y)
        total = y if total is None else total + y
    assert total is not None
    total = total + p["bias"].double().float()
    return torch.sigmoid(total) if p["output"] == "sigmoid" else total
