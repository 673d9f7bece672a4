"""ON THE LENT H200: plain `vllm serve MODEL` (vLLM's own CLI, nothing of ours on the command line, no
VLLM_PLUGINS) with this package installed exposes every feature: capture, steering, /v1/lens/info, and
(with the operator's opt-in flag) hooks. Prints one JSON line `SERVE {...}`.

    python3 bench/gpu_serve_check.py MODEL [PORT]
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import httpx
import torch

from vllm_worker import Hook, LensClient, SteeringVector


def last_norm(ctx, h):
    ctx.saved.setdefault("norm", []).append(float(h[-1].float().norm()))


def main() -> None:
    model, port = sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 8123
    env = dict(os.environ)
    env.pop("VLLM_PLUGINS", None)
    cmd = [
        sys.executable,
        "-c",
        "import sys; from vllm.entrypoints.cli.main import main; sys.argv[0] = 'vllm'; main()",
        "serve",
        model,
        "--load-format",
        "dummy",
        "--dtype",
        "bfloat16",
        "--gpu-memory-utilization",
        "0.3",
        "--max-model-len",
        "1024",
        "--port",
        str(port),
        "--seed",
        "0",
    ]
    t0 = time.time()
    log = open("/tmp/plain_serve.log", "w")
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
    url, out = f"http://127.0.0.1:{port}", {"cmd": "vllm serve MODEL --load-format dummy ..."}
    try:
        while True:
            if proc.poll() is not None:
                raise RuntimeError("server exited: " + open("/tmp/plain_serve.log").read()[-3000:])
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(1)
        out["startup_s"] = round(time.time() - t0, 1)
        c = LensClient(url)
        info = c.info()
        out["info"] = info
        d = info["d_model"]
        r = c.generate(list(range(100, 130)), max_tokens=8, temperature=0, capture_layers=[0, 16])
        out["capture_shape"] = list(r.activations["residual_stream"].shape)
        plain = c.generate(list(range(100, 130)), max_tokens=8, temperature=0)
        v = torch.randn(1, d, generator=torch.Generator().manual_seed(0)) * 50
        steered = c.generate(
            list(range(100, 130)), max_tokens=8, temperature=0, steering_vectors=[SteeringVector(v, [16])]
        )
        out["steering_changes_tokens"] = steered.token_ids != plain.token_ids
        out["capture_tokens_equal_plain"] = r.token_ids == plain.token_ids
        try:
            c.generate(list(range(100, 130)), max_tokens=2, hooks=[Hook(last_norm, [3])])
            out["hooks_without_opt_in"] = "accepted (wrong)"
        except Exception as e:  # 403: the operator did not allow remote hooks
            out["hooks_without_opt_in"] = type(e).__name__
        t = time.time()
        n = 64
        with httpx.Client(timeout=600) as h:
            body = {
                "model": c._model(),
                "prompt": list(range(100, 130)),
                "max_tokens": 64,
                "temperature": 0,
                "ignore_eos": True,
                "vllm_xargs": {"output_residual_stream": [16]},
            }
            import concurrent.futures as cf

            with cf.ThreadPoolExecutor(32) as pool:
                codes = list(pool.map(lambda _: h.post(url + "/v1/completions", json=body).status_code, range(n)))
        out["concurrent_capture"] = {"n": n, "ok": codes.count(200), "wall_s": round(time.time() - t, 2)}
        out["ok"] = (
            out["capture_shape"] == [2, 37, d]
            and out["steering_changes_tokens"]
            and out["capture_tokens_equal_plain"]
            and out["hooks_without_opt_in"] == "LensForbidden"
            and codes.count(200) == n
        )
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    print("SERVE " + json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
