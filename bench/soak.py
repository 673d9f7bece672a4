"""Server memory over a long run, per kind of request, against the plugin disabled: rounds of 1,000
requests at 32 concurrent to a real `vllm-lens serve` on the tiny test model; RSS of every server process
after each round. Tells our growth from vLLM's own (tests/http/test_reliability.py holds the pass/fail soak).

    .venv/bin/python bench/soak.py [--rounds 8] [--kinds disabled,plain,capture,steer] [--out F.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--requests", type=int, default=1000)
    ap.add_argument("--kinds", default="disabled,plain,capture,steer")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    import conftest  # noqa: F401  (test model paths, KV size)
    import httpx
    import psutil
    import servers
    import torch

    from vllm_worker.protocol.wire import tensor_to_json

    model = str(conftest.model_path("llama"))
    steer = json.dumps(
        [
            {
                "activations": tensor_to_json(torch.randn(1, 128, generator=torch.Generator().manual_seed(0)) * 2),
                "layer_indices": [1],
            }
        ]
    )
    xargs = {"capture": {"output_residual_stream": [0, 3]}, "steer": {"apply_steering_vectors": steer}}
    prompts = [
        "the water of people will come down to the side",
        "what some we can out other were all",
        "there when up use your how said an each",
        "she which do their time if will way about",
    ]
    report = {}
    for kind in args.kinds.split(","):
        url = servers._serve(**({"VLLM_LENS_DISABLE": "1"} if kind == "disabled" else {}))

        async def run(n: int) -> None:
            sem = asyncio.Semaphore(32)
            async with httpx.AsyncClient(timeout=300) as h:

                async def one(i: int) -> None:
                    b = {
                        "model": model,
                        "prompt": prompts[i % 4],
                        "max_tokens": 6,
                        "temperature": 0,
                        "ignore_eos": True,
                    }
                    if kind in xargs:
                        b["vllm_xargs"] = xargs[kind]
                    async with sem:
                        r = await h.post(url + "/v1/completions", json=b)
                    assert r.status_code == 200, r.text

                await asyncio.gather(*(one(i) for i in range(n)))

        proc = psutil.Process(servers.server_pid(url))
        rows = []
        for r in range(args.rounds):
            asyncio.run(run(args.requests))
            rows.append([round(p.memory_info().rss / 2**20) for p in [proc, *proc.children(recursive=True)]])
            print(kind, r, rows[-1], flush=True)
        report[kind] = rows
        for p in servers._SERVERS:
            p.terminate()
            p.wait(30)
        servers._SERVERS.clear()
    for kind, rows in report.items():
        tot = [sum(r) for r in rows]
        late = (tot[-1] - tot[len(tot) // 2]) / max(1, len(tot) - 1 - len(tot) // 2)
        print(f"{kind}: total RSS {tot[0]} -> {tot[-1]} MB; second half {late:+.1f} MB per {args.requests} requests")
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
