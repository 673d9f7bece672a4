"""W15: streaming with the scores of 1 probe against plain streaming, on one `vllm-lens serve` (#42 §6: >= 0.95x).

N concurrent streamed completions (token-id prompts, greedy, `ignore_eos`, `max_tokens` new tokens each),
the two legs interleaved `--repeats` times after a warm-up of each; out tok/s = N * new / wall (the best
wall of the repeats; the medians' ratio beside it). The scored leg
asks `output_probe_scores: ["m1"]` (a random probe at the middle layer, written into the server's probe folder
and loaded over HTTP); its first stream is checked chunk by chunk (`monitor_workloads.check_stream`: each
chunk's scores up to its last token, all of them equal to the final chunk's). The server's
`/v1/lens/info` `stream_progress` gives the progress RPCs per chunk.

    .venv/bin/python bench/stream_scores.py [--streams 32] [--new 32] [--repeats 3] [--out F.json]
        (CPU: the tiny test model through tests/support/servers)
    python3 bench/stream_scores.py --model .gpu/model --streams 256 --new 128 --prompt-len 30 \
        --serve-args "--load-format dummy --dtype bfloat16 --gpu-memory-utilization 0.5" --out $OUT/w15.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "bench"))

import monitor_workloads  # noqa: E402

KEY = "bench-key"
AUTH = {"Authorization": f"Bearer {KEY}"}


def _launch(model: str, folder: Path, serve_args: list[str], port: int) -> tuple[str, subprocess.Popen]:
    """`vllm-lens serve` through its module (no console script needed on the device)."""
    import httpx

    cmd = [
        sys.executable,
        "-c",
        "import sys; from vllm_worker.plugin.cli import main; sys.argv[0] = 'vllm-lens'; sys.exit(main())",
        "serve",
        model,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--api-key",
        KEY,
        "--lens-probe-dir",
        str(folder),
        *serve_args,
    ]
    env = dict(os.environ, PYTHONPATH=f"{ROOT}:{os.environ.get('PYTHONPATH', '')}".rstrip(":"))
    log = open(Path(tempfile.gettempdir()) / f"stream-scores-{port}.log", "w")
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 900
    while time.time() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"server exited with {proc.returncode}; see {log.name}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return url, proc
        except httpx.HTTPError:
            pass
        time.sleep(2)
    proc.terminate()
    raise SystemExit(f"server did not start; see {log.name}")


def _progress(url: str) -> dict:
    """The server's progress RPCs and the chunks' asks so far (builds before the batching: none)."""
    import httpx

    info = httpx.get(url + "/v1/lens/info", headers=AUTH, timeout=60).json()
    return info.get("stream_progress") or {"rpcs": 0, "asks": 0}


def _load_probe(url: str, folder: Path) -> None:
    import httpx
    import torch

    from vllm_worker.probes import save_probe

    info = httpx.get(url + "/v1/lens/info", headers=AUTH, timeout=60).json()
    g = torch.Generator().manual_seed(1)
    save_probe(folder / "m1", torch.randn(1, info["d_model"], generator=g), torch.zeros(1), [info["n_layers"] // 2])
    r = httpx.post(url + "/v1/lens/probes", json={"name": "m1", "path": "m1"}, headers=AUTH, timeout=120)
    r.raise_for_status()


async def _leg(url: str, model: str, prompts: list[list[int]], new: int, scored: bool) -> tuple[float, list[dict]]:
    """Wall seconds of one leg; the first stream's chunks (the others are read, not parsed: the client must not
    be what is measured)."""
    import aiohttp

    first: list[dict] = []

    async def one(session: aiohttp.ClientSession, i: int) -> None:
        body = monitor_workloads.stream_body(model, prompts[i], new, scored)
        async with session.post(url + "/v1/completions", json=body, headers=AUTH) as resp:
            assert resp.status == 200, await resp.text()
            buf = b""
            async for data in resp.content.iter_any():
                if i == 0:
                    buf += data
            if i == 0:
                for event in buf.split(b"\n\n"):
                    if event.startswith(b"data: {"):
                        first.append(json.loads(event[6:]))

    conn = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=3600)) as session:
        t0 = time.perf_counter()
        await asyncio.gather(*(one(session, i) for i in range(len(prompts))))
        return time.perf_counter() - t0, first


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", help="served model (default: the tests' tiny Llama, started as the tests do)")
    ap.add_argument("--serve-args", default="", help="more `vllm serve` flags (with --model)")
    ap.add_argument("--port", type=int, default=8131)
    ap.add_argument("--streams", type=int, default=32)
    ap.add_argument("--new", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out")
    args = ap.parse_args()

    import torch

    folder = Path(tempfile.mkdtemp(prefix="stream-scores-"))
    if args.model:
        model = args.model
        url, proc = _launch(model, folder, shlex.split(args.serve_args), args.port)
    else:
        from support import servers
        from support.engines import model_path

        model = str(model_path("llama"))
        url = servers._serve("--api-key", KEY, "--lens-probe-dir", str(folder))
        proc = servers._SERVERS[-1]
    try:
        _load_probe(url, folder)
        g = torch.Generator().manual_seed(0)
        prompts = [torch.randint(10, 500, (args.prompt_len,), generator=g).tolist() for _ in range(args.streams)]
        for scored in (False, True):  # warm-up
            asyncio.run(_leg(url, model, prompts[:4], 4, scored))
        walls: dict[str, list[float]] = {"plain": [], "scores": []}
        before = _progress(url)
        for _ in range(args.repeats):
            for leg in ("plain", "scores"):
                wall, first = asyncio.run(_leg(url, model, prompts, args.new, leg == "scores"))
                if leg == "scores":
                    monitor_workloads.check_stream(first, "m1", args.new)
                walls[leg].append(wall)
        after = _progress(url)
    finally:
        proc.terminate()
        proc.wait(60)
    tok = args.streams * args.new
    # the best of the repeats: on a shared machine the other load only ever adds time
    rate = {leg: tok / min(w) for leg, w in walls.items()}
    median = {leg: tok / statistics.median(w) for leg, w in walls.items()}
    report = {
        "workload": "W15",
        "name": monitor_workloads.NAMES["W15"],
        "model": model,
        "streams": args.streams,
        "new": args.new,
        "prompt_len": args.prompt_len,
        "walls": walls,
        "tok_s": rate,
        "ratio": rate["scores"] / rate["plain"],
        "ratio_median": median["scores"] / median["plain"],
        "progress_rpcs": after["rpcs"] - before["rpcs"],
        # the RPCs' round trips and the pauses between them (builds before the pacing: absent)
        "progress_rpc_s": after.get("rpc_s", 0.0) - before.get("rpc_s", 0.0),
        "progress_pause_s": after.get("pause_s", 0.0) - before.get("pause_s", 0.0),
        "progress_asks": after["asks"] - before["asks"],
    }
    print(json.dumps(report, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
