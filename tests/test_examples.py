"""Examples run against a real server, their numbers checked against HF transformers on the same weights."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from reference import hf_model, residuals
from servers import KEY

pytestmark = pytest.mark.http  # uses the HTTP session's server (remote hooks allowed)
EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def _example(name: str):
    """An example script imported as a module (they are standalone files, not a package)."""
    import importlib

    sys.path.insert(0, str(EXAMPLES))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.remove(str(EXAMPLES))


@pytest.fixture(scope="module")
def causal_tracing():
    return _example("causal_tracing")


def test_causal_tracing_cells_equal_hf(server, causal_tracing):
    """Clean, corrupted and restored probabilities of the answer equal the same computation in HF:
    corrupt the subject's embeddings with the same seeded noise, restore one (layer, token) state."""
    from vllm_worker import LensClient

    ct = causal_tracing
    client = LensClient(server, api_key=KEY)
    ids = client.tokenize("the water of people will come down to the side")
    span = ct.subject_span(client, ids, "water of people")
    noise = ct.subject_noise(span[1] - span[0], 128, seed=7, scale=2.0)
    layers, positions = [0, 2, 3], [span[0], span[1] - 1, len(ids) - 1]
    res = ct.trace(client, ids, span, noise, layers=layers, positions=positions)
    hf = hf_model("llama")

    def embed_edit(e):
        e = e.clone()
        e[0, span[0]:span[1]] += noise
        return e

    clean_streams, clean_logits = residuals(hf, ids)
    answer = int(clean_logits[-1].argmax())
    assert res["answer"] == answer
    assert abs(res["p_clean"] - clean_logits[-1].softmax(-1)[answer].item()) <= 1e-4
    _, corrupt_logits = residuals(hf, ids, embed_edit=embed_edit)
    assert abs(res["p_corrupt"] - corrupt_logits[-1].softmax(-1)[answer].item()) <= 1e-4
    assert res["grid"].shape == (3, 3)
    for i, layer in enumerate(layers):
        for j, t in enumerate(positions):
            def restore(l, h, layer=layer, t=t):
                if l != layer:
                    return None
                h = h.clone()
                h[0, t] = clean_streams[layer, t]
                return h
            _, logits = residuals(hf, ids, edit=restore, embed_edit=embed_edit)
            assert abs(res["grid"][i, j].item() - logits[-1].softmax(-1)[answer].item()) <= 1e-4, (layer, t)
    # restoring the last position at the last layer gives the clean answer back exactly
    assert abs(res["grid"][2, 2].item() - res["p_clean"]) <= 1e-4


def test_causal_tracing_script_writes_its_heatmap(server, tmp_path):
    out = tmp_path / "trace.png"
    proc = subprocess.run([sys.executable, str(EXAMPLES / "causal_tracing.py"), "--base-url", server, "--api-key", KEY,
                           "--prompt", "the water of people will come down", "--subject", "water of people",
                           "--out", str(out)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "p(clean)" in proc.stdout and out.stat().st_size > 5000
    from PIL import Image

    with Image.open(out) as im:
        assert im.size[0] > 400 and im.size[1] > 300
    help_ = subprocess.run([sys.executable, str(EXAMPLES / "causal_tracing.py"), "--help"], capture_output=True,
                           text=True, timeout=120)
    assert help_.returncode == 0 and "--subject" in help_.stdout


@pytest.fixture(scope="module")
def logit_lens():
    return _example("logit_lens")


def test_logit_lens_grid_equals_hf(server, logit_lens, tmp_path):
    """Top token and probability at every (layer, position), read by the hook on the server, equal HF's
    final norm + unembedding of the same residual stream; the script writes its PNG."""
    res = logit_lens.run_server(server, KEY, "the water of people will come down to the side")
    hf = hf_model("llama")
    streams, _ = residuals(hf, res["ids"])
    with torch.no_grad():
        p, i = (hf.model.norm(streams) @ hf.lm_head.weight.T).softmax(-1).max(-1)
    assert res["top"].shape == p.shape == (4, len(res["ids"]))
    assert torch.equal(res["top"], i) and (res["probs"] - p).abs().max() <= 1e-4
    out = tmp_path / "lens.png"
    proc = subprocess.run([sys.executable, str(EXAMPLES / "logit_lens.py"), "--base-url", server, "--api-key", KEY,
                           "--prompt", "the water of people", "--out", str(out)], capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "layer  3:" in proc.stdout and out.stat().st_size > 5000
