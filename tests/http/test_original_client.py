"""The original vllm-lens's own client (PyPI `vllm-lens==1.3.0`, unpacked into a throwaway folder and
run in its own process — the product never imports it) talking to our server: capture, steering,
per-request hooks and persistent hooks give the numbers our own client gets."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import torch

from support.engines import model_path
from support.servers import KEY
from vllm_worker import Hook, SteeringVector
from vllm_worker.api.client import LensClient
from vllm_worker.shipped_model import cache_root

PROMPT = "the water of people will come down to the side"
WHEEL = "vllm_lens-1.3.0-py3-none-any.whl"


def _original_package() -> Path:
    """A folder holding the original's package, unpacked from its wheel (downloaded once into the cache;
    it declares Python >= 3.12, so pip is asked for the file only)."""
    root = cache_root() / "original-vllm-lens-1.3.0"
    if (root / "site" / "vllm_lens" / "client.py").exists():
        return root / "site"
    (root / "wheels").mkdir(parents=True, exist_ok=True)
    if not (root / "wheels" / WHEEL).exists():
        subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "download",
                "-q",
                "--no-deps",
                "--only-binary=:all:",
                "--python-version",
                "3.12",
                "vllm-lens==1.3.0",
                "-d",
                str(root / "wheels"),
            ],
            check=True,
        )
    with zipfile.ZipFile(root / "wheels" / WHEEL) as z:
        z.extractall(root / "site.tmp")
    os.replace(root / "site.tmp", root / "site")
    return root / "site"


# Runs with the original's package first on the path. Everything it sends is in its own forms (layer list as
# a JSON string, its zstd tensor objects, hooks as {"fn": {"cloudpickle": ...}}); results come back through
# its own decoders.
SCRIPT = textwrap.dedent("""
    import json, sys, torch
    import vllm_lens
    from vllm_lens import Hook, SteeringVector
    from vllm_lens.client import VLLMLensClient
    assert vllm_lens.__file__.startswith(sys.argv[3]), vllm_lens.__file__   # the original, not ours

    def count(ctx, h):
        ctx.saved["calls"] = ctx.saved.get("calls", 0) + 1
        ctx.saved["last_row"] = h[-1].clone()
        ctx.saved["rows"] = ctx.saved.get("rows", 0) + h.shape[0]

    c = VLLMLensClient(sys.argv[1], api_key=sys.argv[4])
    out = {"model": c.model}
    kw = dict(max_tokens=4, temperature=0.0, ignore_eos=True, return_token_ids=True)
    r = c.generate(PROMPT, capture_layers=[0, 3], **kw)
    out["capture"] = {"acts": r.activations["residual_stream"], "layers": r.activations.get("layers"),
                      "tokens": r.raw["choices"][0]["token_ids"], "top_level": sorted(k for k in r.raw if k in ("activations", "hook_results")),
                      "per_choice": "activations" in r.raw["choices"][0]}
    v = torch.randn(1, 128, generator=torch.Generator().manual_seed(5)) * 4
    sv = SteeringVector(activations=v, layer_indices=[1], scale=1.5, norm_match=False)
    r = c.generate(PROMPT, capture_layers=[3], steering_vectors=[sv], **kw)
    out["steer"] = {"acts": r.activations["residual_stream"], "tokens": r.raw["choices"][0]["token_ids"]}
    r = c.chat([{"role": "user", "content": "the people will come"}], hooks=[Hook(fn=count, layer_indices=[2])], **kw)
    out["hook"] = {"results": r.hook_results, "tokens": r.raw["choices"][0]["token_ids"]}
    c.register_hooks([Hook(fn=count, layer_indices=[1])])
    toks = [c.generate(PROMPT + w, **kw).raw["choices"][0]["token_ids"] for w in (" one", " two")]
    out["persistent"] = {"results": c.collect_hook_results(), "tokens": toks}
    c.clear_hooks()
    out["after_clear"] = c.collect_hook_results()
    torch.save(out, sys.argv[2])
""").replace("PROMPT", repr(PROMPT))


def count(ctx, h):
    ctx.saved["calls"] = ctx.saved.get("calls", 0) + 1
    ctx.saved["last_row"] = h[-1].clone()
    ctx.saved["rows"] = ctx.saved.get("rows", 0) + h.shape[0]


def test_the_original_client_gets_our_numbers(server, tmp_path):
    site = _original_package()
    script, result = tmp_path / "original_client.py", tmp_path / "out.pt"
    script.write_text(SCRIPT)
    env = dict(os.environ, PYTHONPATH=str(site))
    proc = subprocess.run(
        [sys.executable, str(script), server, str(result), str(site), KEY],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    got = torch.load(result, weights_only=False)
    ours = LensClient(server, api_key=KEY)
    kw = dict(max_tokens=4, temperature=0, ignore_eos=True)
    assert got["model"] == str(model_path("llama"))

    # capture: its decoder reads the first choice's results at the top level, sent once (not per choice too)
    want = ours.generate(PROMPT, capture_layers=[0, 3], **kw)
    assert got["capture"]["top_level"] == ["activations"] and not got["capture"]["per_choice"]
    assert got["capture"]["tokens"] == want.token_ids
    assert got["capture"]["layers"] == [0, 3]
    assert torch.equal(got["capture"]["acts"], want.activations["residual_stream"])

    # steering with its zstd tensor object = ours with the same vector
    v = torch.randn(1, 128, generator=torch.Generator().manual_seed(5)) * 4
    want = ours.generate(PROMPT, capture_layers=[3], steering_vectors=[SteeringVector(v, [1], scale=1.5)], **kw)
    plain = ours.generate(PROMPT, capture_layers=[3], **kw)
    assert got["steer"]["tokens"] == want.token_ids
    assert torch.equal(got["steer"]["acts"], want.activations["residual_stream"])
    assert not torch.equal(got["steer"]["acts"], plain.activations["residual_stream"])  # it did steer

    # a per-request hook pickled by the original's Hook: its hook_results decoder gets our values, tensors too
    want = ours.chat([{"role": "user", "content": "the people will come"}], hooks=[Hook(count, [2])], **kw)
    assert got["hook"]["tokens"] == want.token_ids
    mine, theirs = want.hook_results["0"], got["hook"]["results"]["0"]
    assert theirs["calls"] == mine["calls"] == 4 and theirs["rows"] == mine["rows"]
    assert isinstance(theirs["last_row"], torch.Tensor) and torch.equal(theirs["last_row"], mine["last_row"])

    # persistent hooks: register / collect / clear through its client
    results = got["persistent"]["results"]
    assert len(results) == 2 and got["after_clear"] == {}
    rows = sorted(r["0"]["rows"] for r in results.values())
    n_prompt = [len(ours.generate(PROMPT + w, max_tokens=1).prompt_token_ids) for w in (" one", " two")]
    assert rows == sorted(n + 3 for n in n_prompt)  # prompt + 3 decode steps (the 4th token never runs)
    assert all(
        isinstance(r["0"]["last_row"], torch.Tensor) and r["0"]["last_row"].shape == (128,) for r in results.values()
    )
