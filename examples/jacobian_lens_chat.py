"""A chat page where every generated token shows what each layer was about to say (Jacobian lens).

    vllm-lens serve MODEL --allow-remote-hooks
    python examples/jacobian_lens_chat.py --lens lens.pt --base-url http://127.0.0.1:8000 --port 8765
    # open http://127.0.0.1:8765/  (the page is also written to --out)

The readout of `jacobian_lens.py` is registered on the server as a *persistent* hook (every request
fires it; removed again when this script exits): at each forward step it reads the stream at the row
that predicts the next token, at every source layer, moved by J_l, through the final norm and the
unembedding, and keeps the top-k. This script serves the page and relays: replies stream in from the
server's chat endpoint; when one is complete, the hook's results for that request are collected, decoded
and sent to the page. Hover a token to see the readout across layers (click to pin it); every message is
editable (edit one, then "regenerate" replies from the conversation as it now reads); top-k and the
reply length are set in the page.
"""

from __future__ import annotations

import argparse
import json
import signal
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, Iterator

import httpx
from jacobian_lens import load_lens, readout_hook

from vllm_worker import Hook, LensClient

MAX_K = 10  # the hook keeps this many; the page shows up to it


class Relay:
    """Talks to the vllm-lens server: chat streams, the persistent readout's results, token texts."""

    def __init__(self, base_url: str, api_key: str | None, layers: list[int]) -> None:
        self.client = LensClient(base_url, api_key=api_key)
        self.base_url, self.layers = base_url.rstrip("/"), layers
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._texts: dict[int, str] = {}
        self._lock = threading.Lock()  # one reply at a time: results are collected per finished request

    def text(self, token_id: int) -> str:
        if token_id not in self._texts:
            self._texts[token_id] = self.client.detokenize([token_id])
        return self._texts[token_id]

    def chat(self, messages: list[dict], max_tokens: int) -> Iterator[tuple[str, Any]]:
        """Yields ("token", text) while the reply streams, then ("readout", per-token readouts)."""
        body = {
            "model": self.client._model(),
            "messages": messages,
            "max_tokens": max_tokens,
            "stream": True,
            "temperature": 0,
            "return_token_ids": True,
        }
        with self._lock:
            request_id, token_ids = None, []
            with httpx.stream(
                "POST", f"{self.base_url}/v1/chat/completions", json=body, headers=self.headers, timeout=600
            ) as resp:
                if resp.status_code != 200:
                    resp.read()
                    raise RuntimeError(f"server said {resp.status_code}: {resp.text[:500]}")
                for line in resp.iter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    chunk = json.loads(line[6:])
                    request_id = request_id or chunk.get("id")
                    for choice in chunk.get("choices", []):
                        for tid in choice.get("token_ids") or []:  # per token (a chunk's text may be
                            token_ids.append(tid)  # empty inside a multi-byte character)
                            yield "token", self.text(tid)
            results = self.client.collect_hook_results()
            saved = results.get(request_id, {}).get("0", {})
            self.client.clear_hook_results()
        yield "readout", self.readout(saved, token_ids)

    def readout(self, saved: dict, token_ids: list[int]) -> list[dict]:
        """Per generated token: its text and, per layer, the top-k at the position that predicted it."""
        per_layer = []
        for layer in self.layers:
            steps = saved.get(str(layer), [])
            rows = sorted(
                (int(p), i, pr) for pos, ids, probs in steps for p, i, pr in zip(_list(pos), _list(ids), _list(probs))
            )
            per_layer.append(rows[-len(token_ids) :] if token_ids else [])
        tokens = []
        for j, tid in enumerate(token_ids):
            layers = []
            for layer, rows in zip(self.layers, per_layer):
                if j < len(rows):
                    _, ids, probs = rows[j]
                    layers.append(
                        {"layer": layer, "top": [[self.text(int(i)), round(float(p), 4)] for i, p in zip(ids, probs)]}
                    )
            tokens.append(
                {
                    "text": self.text(tid),
                    "id": tid,
                    "position": rows[j][0] if j < len(rows) else None,
                    "readout": layers,
                }
            )
        return tokens


def _list(x: Any) -> list:
    """A hook-result field as a list (the client gives tensors back as tensors)."""
    import torch

    if isinstance(x, torch.Tensor):
        return x.tolist()
    return list(x)


PAGE = r"""<!doctype html>
<html><head><meta charset="utf-8"><title>Jacobian lens chat</title><link rel="icon" href="data:,">
<style>
body{font-family:system-ui,sans-serif;margin:0;display:flex;height:100vh;color:#222}
#left{flex:2;display:flex;flex-direction:column;border-right:1px solid #ddd}
#log{flex:1;overflow:auto;padding:12px}
.msg{margin:8px 0;padding:8px 10px;border-radius:8px;white-space:pre-wrap}
.msg .role{font-size:11px;color:#888;display:block;margin-bottom:3px}
.user{background:#eef4ff}.assistant{background:#f6f6f6}
.body{outline:none;min-height:1em}
.tok{cursor:pointer;border-radius:3px}
.tok:hover{background:#ffe08a}.tok.pinned{background:#ffb703}
#bar{display:flex;gap:8px;padding:10px;border-top:1px solid #ddd;align-items:center}
#input{flex:1;padding:6px}
#right{flex:3;overflow:auto;padding:12px;font-size:12px}
table{border-collapse:collapse}td{padding:2px 5px;border-bottom:1px solid #eee;font-family:monospace;white-space:nowrap}
.bar{display:inline-block;height:8px;background:#5b8def;margin-right:4px;vertical-align:middle}
#status{font-size:12px;color:#888}
</style></head><body>
<div id="left">
 <div id="log"></div>
 <div id="bar">
  <input id="input" placeholder="Say something" />
  <button id="send">Send</button><button id="regen" title="reply again to the conversation as edited">Regenerate</button>
  <label>top-k <input id="topk" type="number" min="1" max="__MAX_K__" value="5" style="width:3em"></label>
  <label>length <input id="len" type="number" min="1" max="512" value="__LEN__" style="width:4em"></label>
  <span id="status"></span>
 </div>
</div>
<div id="right"><h3 id="rtitle">Hover a generated token</h3><div id="readout"></div></div>
<script>
const msgs = [];  // {role, content, tokens (assistant, with readouts)}
let pinned = null, pinnedTok = null;
const $ = (id) => document.getElementById(id);
function esc(s){return s.replace(/[&<>]/g, c => ({"&":"&amp;","<":"&lt;",">":"&gt;"}[c]));}
function show(tok){
  const k = Math.max(1, Math.min(__MAX_K__, parseInt($("topk").value) || 5));
  $("rtitle").textContent = "token " + JSON.stringify(tok.text) + " (position " + tok.position + ")";
  let html = "<table><tr><td>layer</td><td colspan=" + k + ">top-" + k + " next tokens</td></tr>";
  for (const L of tok.readout){
    html += "<tr><td>" + L.layer + "</td>" + L.top.slice(0, k).map(([t, p]) =>
      "<td><span class=bar style='width:" + Math.round(40 * p) + "px'></span>" + esc(JSON.stringify(t)) + " " + p.toFixed(2) + "</td>").join("") + "</tr>";
  }
  $("readout").innerHTML = html + "</table>";
}
function render(){
  const log = $("log"); log.innerHTML = "";
  msgs.forEach((m, idx) => {
    const div = document.createElement("div"); div.className = "msg " + m.role;
    div.innerHTML = "<span class=role>" + m.role + "</span>";
    const body = document.createElement("div"); body.className = "body"; body.contentEditable = "true";
    if (m.tokens){
      m.tokens.forEach((t, j) => {
        const s = document.createElement("span"); s.className = "tok"; s.textContent = t.text;
        s.onmouseenter = () => { if (!pinned) show(t); };
        s.onclick = () => { if (pinned === s){ s.classList.remove("pinned"); pinned = pinnedTok = null; }
          else { if (pinned) pinned.classList.remove("pinned"); pinned = s; pinnedTok = t; s.classList.add("pinned"); show(t); } };
        body.appendChild(s);
      });
    } else body.textContent = m.content;
    body.oninput = () => { m.content = body.textContent; delete m.tokens; };
    div.appendChild(body); log.appendChild(div);
  });
  log.scrollTop = log.scrollHeight;
}
async function reply(){
  const history = msgs.map(m => ({role: m.role, content: m.content}));
  const m = {role: "assistant", content: ""}; msgs.push(m); render();
  const body = $("log").lastChild.querySelector(".body");
  $("status").textContent = "generating";
  const resp = await fetch("/api/chat", {method: "POST", headers: {"content-type": "application/json"},
    body: JSON.stringify({messages: history, max_tokens: parseInt($("len").value) || 32})});
  const reader = resp.body.getReader(); const dec = new TextDecoder(); let buf = "";
  for (;;){
    const {done, value} = await reader.read(); if (done) break;
    buf += dec.decode(value, {stream: true});
    let i; while ((i = buf.indexOf("\n\n")) >= 0){
      const ev = buf.slice(0, i); buf = buf.slice(i + 2);
      const kind = (ev.match(/^event: (.*)$/m) || [])[1]; const data = JSON.parse((ev.match(/^data: (.*)$/m) || [])[1]);
      if (kind === "token"){ m.content += data; body.textContent = m.content; }
      else if (kind === "readout"){ m.tokens = data; m.content = data.map(t => t.text).join(""); render(); }
      else if (kind === "error"){ $("status").textContent = "error: " + data; return; }
    }
  }
  $("status").textContent = "";
}
$("send").onclick = async () => {
  const text = $("input").value; if (!text) return; $("input").value = "";
  msgs.push({role: "user", content: text}); render(); await reply();
};
$("input").addEventListener("keydown", e => { if (e.key === "Enter") $("send").click(); });
$("regen").onclick = async () => {
  while (msgs.length && msgs[msgs.length - 1].role === "assistant") msgs.pop();
  if (msgs.length) await reply();
};
$("topk").oninput = () => { if (pinnedTok) show(pinnedTok); };
</script></body></html>
"""


def page(max_tokens: int) -> str:
    return PAGE.replace("__MAX_K__", str(MAX_K)).replace("__LEN__", str(max_tokens))


def make_server(relay: Relay, port: int, html: str) -> ThreadingHTTPServer:
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args: Any) -> None:
            pass

        def do_GET(self) -> None:
            if self.path not in ("/", "/index.html"):
                self.send_error(404)
                return
            data = html.encode()
            self.send_response(200)
            self.send_header("content-type", "text/html; charset=utf-8")
            self.send_header("content-length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_POST(self) -> None:
            if self.path != "/api/chat":
                self.send_error(404)
                return
            req = json.loads(self.rfile.read(int(self.headers.get("content-length", 0))))
            self.send_response(200)
            self.send_header("content-type", "text/event-stream")
            self.send_header("cache-control", "no-cache")
            self.end_headers()

            def send(kind: str, data: Any) -> None:
                self.wfile.write(f"event: {kind}\ndata: {json.dumps(data)}\n\n".encode())
                self.wfile.flush()

            try:
                for kind, data in relay.chat(req["messages"], int(req.get("max_tokens", 32))):
                    send(kind, data)
            except Exception as e:  # shown in the page
                send("error", str(e))

    return ThreadingHTTPServer(("127.0.0.1", port), Handler)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lens", default=None, help="lens.pt from jacobian_lens_fit.py")
    ap.add_argument("--baseline", action="store_true", help="plain logit lens (J = identity) instead")
    ap.add_argument("--base-url", default="http://127.0.0.1:8000")
    ap.add_argument("--api-key", default=None)
    ap.add_argument("--port", type=int, default=8765)
    ap.add_argument("--max-tokens", type=int, default=32, help="the page's initial reply length")
    ap.add_argument("--out", default="jacobian_lens_chat.html", help="where the page is written")
    args = ap.parse_args()
    if args.lens is None and not args.baseline:
        ap.error("needs --lens (or --baseline for the plain logit lens)")
    relay = Relay(args.base_url, args.api_key, [])
    J, relay.layers = load_lens(args.lens, relay.client.info()["n_layers"], args.baseline)
    layers = relay.layers
    html = page(args.max_tokens)
    Path(args.out).write_text(html)
    relay.client.register_hooks([Hook(readout_hook(J, MAX_K, last_row_only=True), layers)])
    server = make_server(relay, args.port, html)
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    # Ctrl-C stops it even when started from a non-interactive shell's background job (which starts
    # children with SIGINT ignored: the hook would then never be removed)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    print(
        f"wrote {args.out}; serving http://127.0.0.1:{server.server_address[1]}/ (Ctrl-C stops and removes the hook)",
        flush=True,
    )
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        relay.client.clear_hooks()


if __name__ == "__main__":
    main()
