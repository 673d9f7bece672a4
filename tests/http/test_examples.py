"""Examples run against a real server, their numbers checked against HF transformers on the same weights."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from support import load_script
from support.reference import hf_model, residuals
from support.servers import KEY

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def _example(name: str):
    """An example script imported as a module (they are standalone files, not a package)."""
    return load_script(EXAMPLES / f"{name}.py")


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
        e[0, span[0] : span[1]] += noise
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
    proc = subprocess.run(
        [
            sys.executable,
            str(EXAMPLES / "causal_tracing.py"),
            "--base-url",
            server,
            "--api-key",
            KEY,
            "--prompt",
            "the water of people will come down",
            "--subject",
            "water of people",
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "p(clean)" in proc.stdout and out.stat().st_size > 5000
    from PIL import Image

    with Image.open(out) as im:
        assert im.size[0] > 400 and im.size[1] > 300
    help_ = subprocess.run(
        [sys.executable, str(EXAMPLES / "causal_tracing.py"), "--help"], capture_output=True, text=True, timeout=120
    )
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
    proc = subprocess.run(
        [
            sys.executable,
            str(EXAMPLES / "logit_lens.py"),
            "--base-url",
            server,
            "--api-key",
            KEY,
            "--prompt",
            "the water of people",
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "layer  3:" in proc.stdout and out.stat().st_size > 5000


# ---- Jacobian lens -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def jl():
    return _example("jacobian_lens")


@pytest.fixture(scope="module")
def lens_file(tmp_path_factory):
    """A lens fitted by the script on the tiny model (the same weights the server runs)."""
    from support.engines import model_path

    out = tmp_path_factory.mktemp("jlens") / "lens.pt"
    proc = subprocess.run(
        [
            sys.executable,
            str(EXAMPLES / "jacobian_lens_fit.py"),
            "--model",
            str(model_path("llama")),
            "--samples-per-text",
            "2",
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "layer  3: |J - I|_F / |I|_F = 0.000" in proc.stdout  # the last layer's stream is the final one
    return out


def test_jacobian_lens_fit_is_the_jacobian():
    """One sample: the fitted J_l equals the autograd Jacobian of the final stream at the last position
    with respect to layer l's stream there (computed by replacing that row)."""
    from transformers import AutoTokenizer

    from support.engines import model_path

    fit_mod = _example("jacobian_lens_fit")
    hf = hf_model("llama")
    tok = AutoTokenizer.from_pretrained(str(model_path("llama")))
    text = "the water of people will come down to the side"
    ids = tok.encode(text)
    J, n = fit_mod.fit(hf, tok, [text], [0, 2], samples_per_text=1, min_len=len(ids))
    assert n == 1
    layers = hf.model.layers

    def final_given(layer: int):
        def f(v):
            def put(mod, args, out):
                h = out[0] if isinstance(out, tuple) else out
                h = torch.cat([h[:, :-1], v.view(1, 1, -1)], dim=1)
                return (h,) + tuple(out[1:]) if isinstance(out, tuple) else h

            got = []
            handles = [
                layers[layer].register_forward_hook(put),
                layers[-1].register_forward_hook(lambda m, a, o: got.append(o[0] if isinstance(o, tuple) else o)),
            ]
            try:
                hf(torch.tensor([ids]), use_cache=False)
            finally:
                for h in handles:
                    h.remove()
            return got[0][0, -1]

        return f

    streams, _ = residuals(hf, ids)
    for k, layer in enumerate([0, 2]):
        ref = torch.autograd.functional.jacobian(final_given(layer), streams[layer, -1])
        assert (J[k] - ref).abs().max() <= 1e-4 * max(1.0, ref.abs().max().item()), layer


def test_jacobian_lens_identity_is_the_logit_lens_and_fitted_equals_hf(server, jl, logit_lens, lens_file):
    """J = identity gives the logit lens's numbers exactly; a fitted lens gives HF's norm(J h) @ W_U^T top-k."""
    from vllm_worker import LensClient

    client = LensClient(server, api_key=KEY)
    prompt = "the water of people will come down to the side"
    ll = logit_lens.run_server(server, KEY, prompt)
    ident = jl.run(client, prompt, {l: torch.eye(128) for l in range(4)}, list(range(4)), k=3)
    assert torch.equal(ident["top"], ll["top"]) and (ident["probs"] - ll["probs"]).abs().max() <= 1e-6
    J, layers = jl.load_lens(str(lens_file), 4, baseline=False)
    res = jl.run(client, prompt, J, layers, k=5)
    hf = hf_model("llama")
    streams, _ = residuals(hf, res["ids"])
    with torch.no_grad():
        for row, l in enumerate(layers):
            p, i = (hf.model.norm(streams[l] @ J[l].T) @ hf.lm_head.weight.T).softmax(-1).topk(5, dim=-1)
            assert (res["topk_probs"][row] - p).abs().max() <= 1e-4, l
            assert torch.equal(res["topk"][row, :, 0], i[:, 0]), l


def test_jacobian_lens_script_prints_and_writes_its_grid(server, lens_file, tmp_path):
    out = tmp_path / "jlens.png"
    proc = subprocess.run(
        [
            sys.executable,
            str(EXAMPLES / "jacobian_lens.py"),
            "run",
            "--lens",
            str(lens_file),
            "--base-url",
            server,
            "--api-key",
            KEY,
            "--prompt",
            "the water of people",
            "--grid-out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Jacobian lens, last position" in proc.stdout and "layer  3:" in proc.stdout and out.stat().st_size > 5000
    for script in (
        "logit_lens.py",
        "capture_and_steer.py",
        "jacobian_lens_fit.py",
        "jacobian_lens.py",
        "jacobian_lens_chat.py",
        "emotion_tracker.py",
        "deception_probe.py",
        "activation_oracle_fit.py",
        "activation_oracle.py",
    ):
        h = subprocess.run(
            [sys.executable, str(EXAMPLES / script), "--help"], capture_output=True, text=True, timeout=120
        )
        assert h.returncode == 0 and "usage:" in h.stdout, (script, h.stderr[-2000:])


def _sse(url: str, body: dict) -> list[tuple[str, object]]:
    import json

    import httpx

    events = []
    with httpx.stream("POST", url, json=body, timeout=300) as r:
        buf = ""
        for chunk in r.iter_text():
            buf += chunk
            while "\n\n" in buf:
                ev, buf = buf.split("\n\n", 1)
                kind = ev.split("\n")[0].removeprefix("event: ")
                events.append((kind, json.loads(ev.split("\n")[1].removeprefix("data: "))))
    return events


def test_jacobian_lens_chat_page_streams_replies_with_readouts(server, jl, lens_file, browser, tmp_path):
    """The chat page: a message typed in the browser gets a streamed reply from the real server; hovering
    a token shows its readout across layers, top-k adjustable, pinning by click; messages editable and
    regenerated. The relayed readout (persistent hook, one row per step) equals a one-shot readout of
    the same tokens; the hook is removed when the script stops."""
    import signal
    import socket
    import time

    import httpx

    from support.browser import open_page
    from vllm_worker import LensClient

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    page_file = tmp_path / "chat.html"
    proc = subprocess.Popen(
        [
            sys.executable,
            str(EXAMPLES / "jacobian_lens_chat.py"),
            "--lens",
            str(lens_file),
            "--base-url",
            server,
            "--api-key",
            KEY,
            "--port",
            str(port),
            "--max-tokens",
            "6",
            "--out",
            str(page_file),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    client = LensClient(server, api_key=KEY)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 120
        while True:
            try:
                httpx.get(url, timeout=2)
                break
            except httpx.HTTPError:
                assert proc.poll() is None and time.time() < deadline, (
                    proc.stdout.read() if proc.poll() is not None else "timeout"
                )
                time.sleep(0.5)
        assert page_file.stat().st_size > 2000
        # numbers: relayed readout == one-shot readout of prompt + reply
        messages = [{"role": "user", "content": "where does the water go"}]
        events = _sse(url + "/api/chat", {"messages": messages, "max_tokens": 5})
        kinds = [k for k, _ in events]
        assert kinds[-1] == "readout" and "token" in kinds, kinds
        tokens = events[-1][1]
        assert len(tokens) == 5
        prompt_ids = client.tokenize_chat(messages)
        ids = prompt_ids + [t["id"] for t in tokens]
        J, layers = jl.load_lens(str(lens_file), 4, baseline=False)
        ref = jl.run(client, ids[:-1], J, layers, k=10)
        for j, t in enumerate(tokens):
            assert t["position"] == len(prompt_ids) - 1 + j
            for row, entry in enumerate(t["readout"]):
                assert entry["layer"] == layers[row]
                probs = torch.tensor([p for _, p in entry["top"]])
                assert (probs - ref["topk_probs"][row, t["position"]]).abs().max() <= 2e-4
                assert entry["top"][0][0] == client.detokenize([int(ref["topk"][row, t["position"], 0])])
        # the page, in a real browser
        errors: list[str] = []
        page = open_page(browser, url, errors)
        page.fill("#input", "hello there")
        page.click("#send")
        page.wait_for_function("document.querySelectorAll('.assistant .tok').length == 6", timeout=120_000)
        page.hover(".assistant .tok >> nth=0")
        assert page.locator("#readout tr").count() == 1 + len(layers)
        assert page.locator("#readout tr >> nth=1").locator("td").count() == 1 + 5
        page.click(".assistant .tok >> nth=1")  # pin
        page.fill("#topk", "3")
        page.dispatch_event("#topk", "input")
        page.hover(".user .body")
        assert page.locator("#readout tr >> nth=1").locator("td").count() == 1 + 3
        assert "position" in page.inner_text("#rtitle")
        page.screenshot(path=str(tmp_path / "chat.png"))
        # edit the user's message, regenerate: a new streamed reply to the edited conversation
        page.click(".user .body")
        page.keyboard.press("Control+A")
        page.keyboard.type("where does the water go")
        page.click("#regen")
        page.wait_for_function(
            "document.querySelectorAll('.msg').length == 2 && document.querySelectorAll('.assistant .tok').length == 6",
            timeout=120_000,
        )
        text = page.inner_text(".assistant .body")
        first = "".join(t["text"] for t in tokens)
        assert text.startswith(first), (text, first)  # greedy: the same reply as the relayed one above
        # its readouts arrive too (the relay collects them after the stream): nothing is in flight when the
        # script is stopped below
        page.wait_for_function(
            "msgs.length == 2 && msgs[1].tokens && msgs[1].tokens.length > 0 && "
            "msgs[1].tokens[0].readout !== undefined",
            timeout=120_000,
        )
        assert errors == [], errors
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=120)
    client.generate("the water", max_tokens=2)
    assert client.collect_hook_results() == {}  # the persistent hook went away with the script


# ---- emotion tracker, deception probe ------------------------------------------------------------


def test_emotion_tracker_projections_equal_a_direct_capture_and_its_page_works(server, browser, tmp_path):
    """Projections are the dot products of a direct capture of the same conversation with the unit
    directions; the directions are the documented difference of means; the page opens in Chromium without
    errors and hovering a token shows its projections."""
    import json
    import re

    from support.browser import open_page
    from vllm_worker import LensClient

    et = _example("emotion_tracker")
    client = LensClient(server, api_key=KEY)
    emotions = {e: texts[:3] for e, texts in et.EMOTIONS.items()}
    dirs, origin = et.directions(client, 2, emotions)
    means = []
    for texts in emotions.values():
        per = [client.generate(t, max_tokens=1, capture_layers=[2]) for t in texts]
        means.append(
            torch.stack([r.activations["residual_stream"][0, 1 : len(r.prompt_token_ids)].mean(0) for r in per]).mean(0)
        )
    means = torch.stack(means)
    for e in range(len(means)):
        ref = means[e] - torch.cat([means[:e], means[e + 1 :]]).mean(0)
        assert (dirs[e] - ref / ref.norm()).abs().max() <= 1e-5
    assert (origin - means.mean(0)).abs().max() <= 1e-5
    res = et.track(client, 2, et.CONVERSATION, dirs, origin, max_tokens=6)
    direct = client.chat(et.CONVERSATION, max_tokens=6, temperature=0, capture_layers=[2])
    stream = direct.activations["residual_stream"][0]
    assert res["projections"].shape == (len(direct.prompt_token_ids) + 5, 4)
    assert (res["projections"] - (stream - origin) @ dirs.T).abs().max() <= 1e-4
    out = tmp_path / "emotions.html"
    proc = subprocess.run(
        [
            sys.executable,
            str(EXAMPLES / "emotion_tracker.py"),
            "--base-url",
            server,
            "--api-key",
            KEY,
            "--layer",
            "2",
            "--max-tokens",
            "6",
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "sadness:" in proc.stdout and out.stat().st_size > 3000
    errors: list[str] = []
    page = open_page(browser, out.as_uri(), errors)
    n_tokens = page.locator(".tok").count()
    assert n_tokens == res["projections"].shape[0]
    page.hover(".tok >> nth=5")
    info = page.inner_text("#info")
    data = json.loads(re.search(r"const D = (\{.*?\});\n", out.read_text()).group(1))
    assert info.startswith("token 5 ") and all(
        f"{e} {data['projections'][5][k]:.3f}" in info for k, e in enumerate(et.EMOTIONS)
    )
    assert page.locator("#plot polyline").count() == 4
    page.select_option("#by", "strongest")
    assert page.locator(".tok >> nth=5").evaluate("e => e.style.background") != ""
    page.screenshot(path=str(tmp_path / "emotions.png"))
    assert errors == [], errors


def test_deception_probe_features_and_auroc(server):
    """Features from the persistent hook equal a per-request capture over the same window; the torch
    probe separates separable data; AUROC equals scikit-learn's; the script prints AUROCs."""
    from sklearn.metrics import roc_auc_score

    from inspect_lens.datasets import instructed_pairs, roleplay
    from vllm_worker import LensClient

    dp = _example("deception_probe")
    client = LensClient(server, api_key=KEY)
    samples = instructed_pairs(2) + roleplay(limit=1)
    feats = dp.features(client, samples, layer=1)
    assert client.collect_hook_results() == {}  # the persistent hook is gone again
    for f, s in zip(feats, samples):
        ids, window = dp.teacher_forced(client, s)
        assert 1 <= window < len(ids)
        r = client.generate(ids, max_tokens=1, capture_layers=[1])
        assert (f - r.activations["residual_stream"][0, len(ids) - window : len(ids)]).abs().max() <= 1e-5
    g = torch.Generator().manual_seed(0)
    x = torch.randn(60, 16, generator=g)
    y = (x[:, 3] > 0).long()
    wl = torch.arange(20) % 2  # windows of 3 tokens; a window's tokens are shifted along feature 3 by its label
    windows = [torch.randn(3, 16, generator=g) + 3.0 * int(l) * torch.eye(16)[3] for l in wl]
    probe = dp.fit_tokens(windows, wl)
    assert dp.auroc(dp.score_samples(probe, windows), wl) == 1.0 and probe["w"][3].abs() == probe["w"].abs().max()
    probe = dp.fit_probe(x, y)
    assert dp.auroc(dp.score(probe, x), y) == 1.0
    s = torch.randn(50, generator=g)
    lab = (torch.rand(50, generator=g) > 0.5).long()
    assert abs(dp.auroc(s, lab) - roc_auc_score(lab.numpy(), s.numpy())) <= 1e-9
    proc = subprocess.run(
        [
            sys.executable,
            str(EXAMPLES / "deception_probe.py"),
            "--base-url",
            server,
            "--api-key",
            KEY,
            "--layer",
            "2",
            "--train-limit",
            "6",
            "--eval-limit",
            "4",
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "role-play AUROC" in proc.stdout and "12 training samples, 8 role-play samples" in proc.stdout
