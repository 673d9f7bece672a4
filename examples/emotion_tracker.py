"""Emotion tracker: emotion directions from labelled texts, and how strongly each token of a conversation
points along them — an interactive HTML page.

    vllm-lens serve MODEL                       # capture only: no remote hooks needed
    python examples/emotion_tracker.py --base-url http://127.0.0.1:8000 --out emotions.html

1. Directions: every labelled text is sent with capture on at one layer (middle by default); its
   residual stream is averaged over its tokens (the first, BOS-like position left out). An emotion's
   direction is its texts' mean minus the mean of the other emotions' means, unit-normed (difference of
   means).
2. The conversation (built-in, or `--conversation FILE` with a JSON list of chat messages) is sent through
   the chat template; the model writes a reply, and the capture covers every prompt and generated
   position. Each token's projection on each direction is `(h - m) . u_e`, m = the mean of the
   emotions' means.
3. The page (one standalone file, no network): tokens coloured by the chosen emotion (or by the
   strongest), hover a token for all its projections, and a line plot per emotion over the tokens.
"""

from __future__ import annotations

import argparse
import html
import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from vllm_worker import LensClient

EMOTIONS: dict[str, list[str]] = {
    "joy": [
        "I just got the job and I can't stop smiling!",
        "What a wonderful surprise, thank you so much!",
        "We laughed all evening; it was the best day ever.",
        "The sun is out and I feel fantastic.",
        "She hugged me and said she was proud of me.",
        "Hooray, we won the championship!",
        "I love this song, it makes me want to dance.",
        "Finally on holiday, everything feels perfect.",
    ],
    "anger": [
        "How dare you lie to me again!",
        "I am furious that they cancelled without telling anyone.",
        "Stop interrupting me, this is outrageous.",
        "He smashed the door and shouted at everyone.",
        "This is the third time the bill is wrong and I am livid.",
        "Get out of my office right now!",
        "They stole my idea and I want them punished.",
        "I hate being treated like an idiot.",
    ],
    "fear": [
        "I heard footsteps behind me in the dark alley.",
        "My hands are shaking, what if the test is positive?",
        "Something is scratching at the window and I'm terrified.",
        "Please don't leave me alone here.",
        "The plane dropped suddenly and everyone screamed.",
        "I think someone is following me home.",
        "What if I lose everything tomorrow?",
        "The doctor said we need to talk, and I'm scared.",
    ],
    "sadness": [
        "My dog died this morning and the house feels empty.",
        "I miss her so much it hurts.",
        "Nobody came to my birthday party.",
        "He packed his bags and left without a word.",
        "I failed again, no matter how hard I try.",
        "The old photos made me cry all night.",
        "We had to say goodbye at the funeral today.",
        "I feel so lonely since moving here.",
    ],
}

CONVERSATION = [
    {
        "role": "user",
        "content": "My best friend just told me she is moving abroad next week and I only found out "
        "today. Honestly I'm upset, but I'm also a bit scared of being alone.",
    },
]

COLOURS = ["#f4a300", "#d62828", "#7b2cbf", "#1d70b8", "#2a9d8f", "#6c757d"]


def directions(client: LensClient, layer: int, emotions: dict[str, list[str]]) -> tuple[torch.Tensor, torch.Tensor]:
    """((n_emotions, d) unit difference-of-means directions at `layer`, (d,) the mean of the emotions'
    means — the origin projections are measured from)."""

    def mean_stream(text: str) -> torch.Tensor:
        r = client.generate(text, max_tokens=1, temperature=0, capture_layers=[layer])
        return r.activations["residual_stream"][0, 1 : len(r.prompt_token_ids)].float().mean(0)

    with ThreadPoolExecutor(8) as pool:  # concurrent requests: vLLM batches them
        means_t = torch.stack([torch.stack(list(pool.map(mean_stream, texts))).mean(0) for texts in emotions.values()])
    dirs = []
    for e in range(len(means_t)):
        others = torch.cat([means_t[:e], means_t[e + 1 :]]).mean(0)
        dirs.append(means_t[e] - others)
    d = torch.stack(dirs)
    return d / d.norm(dim=-1, keepdim=True), means_t.mean(0)


def track(
    client: LensClient, layer: int, messages: list[dict], dirs: torch.Tensor, origin: torch.Tensor, max_tokens: int = 48
) -> dict:
    """The conversation plus the model's reply: token ids, texts, and projections `(h - origin) . u_e`
    (n_tokens, n_emotions) of every captured position (the last generated token is never fed back, so
    it has none)."""
    r = client.chat(messages, max_tokens=max_tokens, temperature=0, capture_layers=[layer])
    ids = list(r.prompt_token_ids) + list(r.token_ids)
    stream = r.activations["residual_stream"][0].float()  # (n_prompt + n_gen - 1, d)
    proj = (stream - origin) @ dirs.T
    return {
        "ids": ids[: stream.shape[0]],
        "texts": [client.detokenize([i]) for i in ids[: stream.shape[0]]],
        "n_prompt": len(r.prompt_token_ids),
        "projections": proj,
        "reply": r.text,
    }


PAGE = r"""<!doctype html>
<html><head><meta charset="utf-8"><title>Emotion tracker</title>
<style>
body{font-family:system-ui,sans-serif;margin:16px;color:#222;max-width:1100px}
#text{line-height:1.9;white-space:pre-wrap;border:1px solid #ddd;padding:10px;border-radius:6px}
.tok{border-radius:3px;cursor:default}.tok.reply{border-bottom:2px solid #999}
#info{min-height:3em;font-family:monospace;font-size:13px;margin:8px 0}
svg{border:1px solid #ddd;border-radius:6px;background:#fff}
.legend span{margin-right:14px;font-size:13px}
</style></head><body>
<h2>Emotion tracker <small style="font-weight:normal;color:#888">__TITLE__</small></h2>
<label>colour by <select id="by"></select></label>
<label style="margin-left:16px">plot smoothing <select id="smooth"><option>1</option><option>3</option><option selected>5</option><option>9</option></select> tokens</label>
<div id="info">hover a token</div>
<div id="text"></div>
<h3>projection per token</h3>
<div class="legend" id="legend"></div>
<svg id="plot" width="1060" height="260"></svg>
<script>
const D = __DATA__;
const $ = (id) => document.getElementById(id);
const E = D.emotions, P = D.projections, n = P.length;
const lo = Math.min(...P.slice(1).flat()), hi = Math.max(...P.slice(1).flat());
const Z = P.map(p => p.map((v, k) => (v - D.mean[k]) / (D.std[k] || 1)));
let marker = null;
E.concat(["strongest"]).forEach(e => { const o = document.createElement("option"); o.value = o.textContent = e; $("by").appendChild(o); });
function rgba(hex, a){ const v = parseInt(hex.slice(1), 16); return `rgba(${v >> 16},${(v >> 8) & 255},${v & 255},${a.toFixed(3)})`; }
function colour(i){
  const by = $("by").value;
  let e = E.indexOf(by);
  if (by === "strongest") e = Z[i].indexOf(Math.max(...Z[i]));
  const z = Z[i][e];
  return rgba(D.colours[e], Math.max(0, Math.min(1, z / 2.5)));
}
function paint(){ document.querySelectorAll(".tok").forEach(s => s.style.background = colour(+s.dataset.i)); }
D.texts.forEach((t, i) => {
  const s = document.createElement("span"); s.className = "tok" + (i >= D.n_prompt ? " reply" : "");
  s.textContent = t; s.dataset.i = i;
  s.onmouseenter = () => {
    $("info").textContent = "token " + i + " " + JSON.stringify(t) + (i >= D.n_prompt ? " (reply)" : "") + ": " +
      E.map((e, k) => e + " " + P[i][k].toFixed(3)).join("  ");
    marker.setAttribute("x1", x(i)); marker.setAttribute("x2", x(i)); marker.style.display = "";
  };
  $("text").appendChild(s);
});
const W = 1060, H = 260, pad = 30;
const x = (i) => pad + (W - 2 * pad) * (n > 1 ? i / (n - 1) : 0.5);
const y = (v) => H - pad - (H - 2 * pad) * (v - lo) / ((hi - lo) || 1);
const svg = $("plot"), NS = "http://www.w3.org/2000/svg";
function el(tag, attrs){ const e = document.createElementNS(NS, tag); for (const k in attrs) e.setAttribute(k, attrs[k]); svg.appendChild(e); return e; }
el("line", {x1: x(D.n_prompt), x2: x(D.n_prompt), y1: pad, y2: H - pad, stroke: "#bbb", "stroke-dasharray": "4"});
el("text", {x: x(D.n_prompt) + 4, y: pad + 10, "font-size": 11, fill: "#888"}).textContent = "reply starts";
const lines = E.map((e, k) => {
  const l = document.createElement("span"); l.style.color = D.colours[k]; l.textContent = "\u25A0 " + e; $("legend").appendChild(l);
  return el("polyline", {fill: "none", stroke: D.colours[k], "stroke-width": 1.5});
});
function draw(){  // moving average over `w` tokens (the first position left out, as for the colours)
  const w = parseInt($("smooth").value), h = (w - 1) / 2;
  lines.forEach((line, k) => {
    const pts = [];
    for (let i = 1; i < n; i++){
      const win = P.slice(Math.max(1, i - h), Math.min(n, i + h + 1)).map(p => p[k]);
      pts.push(x(i) + "," + y(win.reduce((a, b) => a + b, 0) / win.length));
    }
    line.setAttribute("points", pts.join(" "));
  });
}
$("smooth").onchange = draw; draw();
marker = el("line", {y1: pad, y2: H - pad, stroke: "#000", "stroke-width": 1});
marker.style.display = "none";
$("by").onchange = paint; paint();
</script></body></html>
"""


def page(result: dict[str, Any], emotions: list[str], title: str) -> str:
    proj = result["projections"]
    data = {
        "emotions": emotions,
        "texts": result["texts"],
        "n_prompt": result["n_prompt"],
        "projections": [[round(float(v), 5) for v in row] for row in proj],
        # colour and plot scales leave out the first position: its stream (the attention sink) has a
        # norm many times the others' and would flatten every other token's colour
        "mean": proj[1:].mean(0).tolist(),
        "std": proj[1:].std(0).tolist(),
        "colours": COLOURS[: len(emotions)],
    }
    # `</` inside the JSON would end the script element
    return PAGE.replace("__DATA__", json.dumps(data).replace("</", "<\\/")).replace("__TITLE__", html.escape(title))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base-url", default="http://127.0.0.1:8000")
    ap.add_argument("--api-key", default=None)
    ap.add_argument("--layer", type=int, default=None, help="default: the middle layer")
    ap.add_argument("--conversation", default=None, help="JSON file: a list of {role, content} messages")
    ap.add_argument("--max-tokens", type=int, default=48, help="length of the model's reply")
    ap.add_argument("--out", default="emotions.html")
    args = ap.parse_args()
    client = LensClient(args.base_url, api_key=args.api_key)
    info = client.info()
    layer = info["n_layers"] // 2 if args.layer is None else args.layer
    messages = CONVERSATION if args.conversation is None else json.loads(Path(args.conversation).read_text())
    dirs, origin = directions(client, layer, EMOTIONS)
    result = track(client, layer, messages, dirs, origin, args.max_tokens)
    Path(args.out).write_text(page(result, list(EMOTIONS), f"{client._model()}, layer {layer}"))
    proj = result["projections"]
    print(f"layer {layer}; reply: {result['reply']!r}")
    for k, e in enumerate(EMOTIONS):
        i = 1 + int(proj[1:, k].argmax())
        print(f"{e:>8}: mean {float(proj[1:, k].mean()):+.3f}, strongest at token {i} {result['texts'][i]!r}")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
