"""The example notebooks, executed top to bottom in a real kernel (nbclient), their outputs checked."""

from __future__ import annotations

import re
from pathlib import Path

import nbformat
from nbclient import NotebookClient

from support.engines import model_path
from support.servers import KEY

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def execute(name: str, cwd: Path, monkeypatch, **env: str) -> list[dict]:
    """Run the notebook; returns its executed code cells' outputs, one list per cell."""
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    nb = nbformat.read(EXAMPLES / name, as_version=4)
    NotebookClient(nb, timeout=900, kernel_name="python3", resources={"metadata": {"path": str(cwd)}}).execute()
    nbformat.write(nb, cwd / name)  # kept for a look when a check fails
    return [c.outputs for c in nb.cells if c.cell_type == "code"]


def text_of(outputs: list[dict]) -> str:
    return "".join(o.get("text", "") for o in outputs if o.get("output_type") == "stream")


def test_extract_residual_stream_notebook(server, tmp_path, monkeypatch):
    cells = execute(
        "extract_residual_stream.ipynb",
        tmp_path,
        monkeypatch,
        LENS_MODEL=str(model_path("llama")),
        LENS_BASE_URL=server,
        LENS_API_KEY=KEY,
    )
    out = "\n".join(text_of(c) for c in cells)
    assert re.search(r"shape: \(3, \d+, 128\) layers: \[0, 2, 3\]", out), out
    assert "offline == http (same weights, float32): True" in out, out
    assert out.count("steps: 3") == 2, out  # persistent hook offline: prefill + 2 decode steps per request
    assert "-0': 3}" in out, out  # and over HTTP, keyed by the engine's request id


def test_benchmark_notebook(tmp_path, monkeypatch):
    root = EXAMPLES.parent
    cells = execute(
        "benchmark.ipynb",
        tmp_path,
        monkeypatch,
        LENS_MODEL=str(model_path("llama")),
        LENS_LIVE_N="4",
        LENS_BENCH_JSON=str(root / "bench/results/2026-12-01-h200-s4b.json"),
    )
    out = "\n".join(text_of(c) for c in cells)
    assert "plain vLLM (CUDA graphs):" in out and "capture all layers" in out, out
    for arm in ("plain", "capture 1 layer", "steer 1 layer"):
        assert arm in out.split("Part 2")[-1] or arm in out, out
    images = [o for c in cells for o in c if "image/png" in o.get("data", {})]
    assert len(images) == 2
    assert (tmp_path / "bench_gpu.png").stat().st_size > 5000 and (tmp_path / "bench_live.png").stat().st_size > 3000


def test_inspect_demo_notebook(lora_server, tiny_oracle, tmp_path, monkeypatch):  # noqa: F811
    """Activation oracle through the provider: the eval with its controls, then the solver after generate()."""
    from support.servers import LORA_MODEL

    cells = execute(
        "inspect-demo.ipynb",
        tmp_path,
        monkeypatch,
        LENS_MODEL=str(model_path("llama")),
        LENS_ORACLE=str(tiny_oracle),
        LENS_BASE_URL=lora_server,
        LENS_SERVED_NAME=LORA_MODEL,
        LENS_API_KEY=KEY,
        LENS_LIMIT="8",
        LENS_ROOT=str(EXAMPLES.parent),
    )
    out = "\n".join(text_of(c) for c in cells)
    assert "status: success | samples: 8" in out, out
    for cond in ("real", "shuffled", "none"):
        assert re.search(rf"accuracy with +{cond} vector: [01]\.\d{{3}}", out), out
    assert out.count("status: success") == 2 and out.count("oracle (real / none):") == 3, out
    assert any("image/png" in o.get("data", {}) for c in cells for o in c)
    assert (tmp_path / "oracle_accuracy.png").stat().st_size > 3000
