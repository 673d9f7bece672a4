"""Probe calibration (`vllm-lens probes calibrate`) and the served form of `inspect_lens` probes, on the tiny
model: served scores equal `LinearProbe.score_tokens` on the captured residual; the threshold written into
probe.json equals the one fitted by hand on the same responses (teacher-forced replies and generated
tokens); the CLI end to end in its own engine; bad input refused before the engine starts."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from vllm import SamplingParams

from inspect_lens.probes import LinearProbe
from support.engines import model_path
from vllm_worker.probes import aggregation
from vllm_worker.probes.calibrate import calibrate, threshold_at_fpr
from vllm_worker.probes.format import load_probe_files

LAYER = 2
WORDS = "the water of people will come down to the side how many first time was said each".split()


def _text(i: int, n: int = 5) -> str:
    return " ".join(WORDS[(i * 7 + j) % len(WORDS)] for j in range(n + i % 4))


def _control_rows() -> list[dict]:
    rows: list[dict] = []
    for i in range(8):  # chats ending with the assistant's reply: read teacher-forced
        msgs = [{"role": "user", "content": _text(i)}, {"role": "assistant", "content": _text(i + 20, 3)}]
        rows.append({"id": f"chat{i}", "messages": msgs})
    for i in range(4):  # prompts: generated
        rows.append({"id": f"gen{i}", "prompt": _text(i + 40)})
    return rows


def _write(path: Path, rows: list) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture(scope="module")
def probe_dir(tmp_path_factory) -> tuple[LinearProbe, Path]:
    rng = np.random.default_rng(0)
    x = rng.normal(size=(80, 128)) * 3 + 1
    probe = LinearProbe.fit(x, np.r_[np.zeros(40), np.ones(40)], layer=LAYER)
    return probe, probe.save_served(tmp_path_factory.mktemp("probe") / "p")


def test_served_scores_equal_score_tokens(llama, probe_dir):
    """The engine's per-token scores of a probe written by `save_served` = the probe applied in float64 to the
    residual captured in the same request, at prompt and generated positions."""
    probe, folder = probe_dir
    llama.load_probe("roundtrip", str(folder))
    try:
        sp = SamplingParams(
            max_tokens=4,
            temperature=0,
            extra_args={"output_probe_scores": ["roundtrip"], "output_residual_stream": [LAYER]},
        )
        out = llama.generate(["the water of people will come"], sp, use_tqdm=False)[0]
    finally:
        llama.delete_probe("roundtrip")
    served = out.activations["probe_scores"]["roundtrip"]
    resid = out.activations["residual_stream"][0].double().numpy()
    assert served.shape == (resid.shape[0], 1) and served.dtype == torch.float32
    np.testing.assert_allclose(served[:, 0].double().numpy(), probe.score_tokens(resid), atol=1e-4)


def _by_hand(llama, probe: LinearProbe, rows: list[dict], agg: str, max_tokens: int) -> list[float]:
    """Each control response's aggregate from a capture of the residual and the probe in float64: replies
    read teacher-forced (window = the reply's tokens), prompts generated (window = the positions that
    produced the generated tokens)."""
    tok = llama.get_tokenizer()
    got = []
    for r in rows:
        sp = SamplingParams(
            max_tokens=1 if "messages" in r else max_tokens,
            temperature=0,
            extra_args={"output_residual_stream": [LAYER]},
        )
        if "messages" in r:
            out = llama.chat(
                r["messages"], sp, use_tqdm=False, add_generation_prompt=False, continue_final_message=True
            )[0]
            reply = r["messages"][-1]["content"]
            n = len(out.prompt_token_ids)
            k = next(k for k in range(1, n) if tok.decode(out.prompt_token_ids[n - k :]).strip() == reply)
            window = (n - k, n)
            assert tok.decode(out.prompt_token_ids[window[0] : window[1]]).strip() == reply
        else:
            out = llama.generate([r["prompt"]], sp, use_tqdm=False)[0]
            n = len(out.prompt_token_ids)
            window = (n - 1, n - 1 + len(out.outputs[0].token_ids))
        scores = probe.score_tokens(out.activations["residual_stream"][0, window[0] : window[1]].double().numpy())
        got.append(float(aggregation.aggregate(torch.as_tensor(scores), agg)))
    return got


@pytest.mark.parametrize("agg", ["mean", "rolling_max:2"])
def test_calibrate_writes_the_threshold_fitted_by_hand(llama, probe_dir, tmp_path, agg):
    probe, folder = probe_dir
    work = tmp_path / "p"
    work.mkdir()
    for f in folder.iterdir():
        (work / f.name).write_bytes(f.read_bytes())
    rows = _control_rows()
    control = _write(tmp_path / "control.jsonl", rows)
    got = calibrate(llama, work, control, fpr=0.2, aggregate=agg, max_tokens=3, progress=False)
    want_scores = _by_hand(llama, probe, rows, agg, 3)
    want = threshold_at_fpr(want_scores, 0.2)
    assert got["threshold"] == pytest.approx(want, abs=1e-4)
    # (the threshold is one of the scores: compare counts past float32 noise)
    assert got["n_control"] == 12 and got["above"] == sum(s > want + 1e-4 for s in want_scores) <= 2
    back = load_probe_files(work)  # the engine's reader accepts the updated file
    assert back.threshold == pytest.approx(want, abs=1e-4) and back.aggregate[0] == agg
    record = json.loads((work / "probe.json").read_text())["metadata"]["calibration"]
    assert (record["fpr"], record["aggregate"], record["n_control"]) == (0.2, agg, 12)
    assert record["provenance"]["dtype"] == "float32" and record["provenance"]["model"].endswith("tiny-llama")
    assert "lens-calibrate" not in [p["name"] for p in llama.list_probes()]  # its temporary name is gone
    # the inspect_lens view of the calibrated folder keeps the threshold
    assert LinearProbe.load(work).threshold == pytest.approx(want, abs=1e-4)


def _cli(args: list[str], timeout: int = 600) -> subprocess.CompletedProcess:
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(Path(__file__).parents[2]), os.environ.get("PYTHONPATH", "")]),
    }
    cmd = [sys.executable, "-m", "vllm_worker.plugin.cli", "probes", *args]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)


def test_cli_refuses_bad_input_before_the_engine_starts(probe_dir, tmp_path, capsys):
    """Exit 2 naming the flag, file or line (the command's own entry, in this process: no engine is made)."""
    from vllm_worker.probes.calibrate import main  # what `vllm-lens probes` runs

    _, folder = probe_dir
    control = _write(tmp_path / "c.jsonl", _control_rows())
    bad_line = tmp_path / "bad.jsonl"
    bad_line.write_text('{"id": 1, "prompt": "x"}\n{"id": 2, "promt": "y"}\n')
    model = str(model_path("llama"))
    cases = [
        (["calibrate", model, "--probe", str(folder), "--control", str(control), "--fpr", "1.5"], "--fpr"),
        (
            ["calibrate", model, "--probe", str(folder), "--control", str(control), "--aggregate", "median"],
            "--aggregate",
        ),
        (["calibrate", model, "--probe", str(tmp_path), "--control", str(control)], "probe.safetensors"),
        (["calibrate", model, "--probe", str(folder), "--control", str(bad_line)], "line 2"),
        (["calibrate", model, "--probe", str(folder), "--control", str(tmp_path / "none.jsonl")], "--control"),
        (["calibrate", model, "--probe", str(folder), "--control", str(control), "--output", "3"], "--output"),
        (["frobnicate"], "usage"),
    ]
    for args, word in cases:
        assert main(args) == 2, args
        err = capsys.readouterr().err
        assert word in err, (args, err[-2000:])


def test_cli_end_to_end(probe_dir, tmp_path):
    """`vllm-lens probes calibrate` in its own engine: the threshold in probe.json at the FPR on its controls,
    a progress bar on stderr, the summary line."""
    probe, folder = probe_dir
    work = tmp_path / "p"
    work.mkdir()
    for f in folder.iterdir():
        (work / f.name).write_bytes(f.read_bytes())
    control = _write(tmp_path / "control.jsonl", _control_rows()[:8])
    args = ["calibrate", str(model_path("llama")), "--probe", str(work), "--control", str(control), "--fpr", "0.25"]
    args += [
        "--dtype",
        "float32",
        "--max-model-len",
        "512",
        "--enforce-eager",
        "--kv-cache-memory-bytes",
        str(128 << 20),
    ]
    done = _cli(args)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "calibrate:" in done.stderr and "8/8" in done.stderr  # the progress bar
    cfg = json.loads((work / "probe.json").read_text())
    cal = cfg["metadata"]["calibration"]
    assert cal["n_control"] == 8 and cal["above"] <= 2 and cal["fpr"] == 0.25
    assert f"threshold {cfg['threshold']:.6g}" in done.stderr


def test_calibration_windows_are_the_inspect_scorers_windows(llama):
    """On the deception eval's own control chats, the reply window calibration scores is the one the Inspect
    scorers score (the detect text's tokens at the end of the teacher-forced prompt), so a threshold fitted
    by the command applies to the eval's response scores."""
    from inspect_lens.datasets import control
    from inspect_lens.solvers import answer_window
    from vllm_worker.extract.inputs import Row
    from vllm_worker.probes.calibrate import _tokens

    tok = llama.get_tokenizer()
    for i, s in enumerate(control(6)):
        msgs = [{"role": m.role, "content": m.text} for m in s.input]
        ids, start = _tokens(tok, Row(i + 1, s.id, messages=msgs))
        detect = s.metadata["detect_text"]
        cands = [tok.encode(detect, add_special_tokens=False), tok.encode(" " + detect, add_special_tokens=False)]
        window, exact = answer_window(ids, cands)
        assert exact and window == (start, len(ids)), s.id
