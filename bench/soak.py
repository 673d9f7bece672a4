"""Server memory over a long run against a real `vllm-lens serve` on the tiny test model (or `--model`).

Two modes:

- rounds (default): per kind of request, against the plugin disabled: rounds of 1,000 requests at 32
  concurrent, RSS of every server process and the plugin's live objects after each round. Tells our growth
  from vLLM's own.
- `--long N` (e.g. 10000): one server, N requests mixing plain / capture / steer / probe / action at 32
  concurrent; every `--every` requests the RSS of each server process and the plugin's live objects
  (`/v1/lens/info`: pending results, stored requests, result regions, capture bytes in flight, and what the
  workers keep per running request: request states, steering entries, probe scores, probe-action slots).
  Ends with the growth per 1,000 requests over the second half (least squares) and whether memory is flat:
  under `--flat-mb` MB per 1,000 requests, with every live-object count back at 0 and every probe / action
  request answered with what it asked for.

Kinds: `probe` asks `output_probe_scores` for a probe written into the server's `--lens-probe-dir`;
`action` asks `probe_actions` on it with a threshold that fires on half the requests, `then: "stop"` and
`then: {"steer": ...}` in turn (bench/soak_probes.py). A worker sees a request leave at its next step, so
before reading the live objects the soak sends one plain request after the batch.

    .venv/bin/python bench/soak.py [--rounds 8] [--kinds disabled,plain,capture,steer,probe,action] [--out F.json]
    .venv/bin/python bench/soak.py --long 10000 [--every 500] [--disabled] [--out F.json]

(tests/http/test_load_and_hangups.py holds the pass/fail soak.)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import soak_probes  # noqa: E402

KEY = "soak-key"
LIVE = (
    "pending_results",
    "stored_requests",
    "result_regions",
    "capture_bytes_in_flight",
    "request_states",
    "steering_entries",
    "probe_score_chunks",
    "action_slots",
    "action_requests",
    "action_stops",
)
PROMPTS = [
    "the water of people will come down to the side",
    "what some we can out other were all",
    "there when up use your how said an each",
    "she which do their time if will way about",
]


def _xargs() -> dict:
    import torch

    from vllm_worker.protocol.wire import tensor_to_json

    steer = json.dumps(
        [
            {
                "activations": tensor_to_json(torch.randn(1, 128, generator=torch.Generator().manual_seed(0)) * 2),
                "layer_indices": [1],
            }
        ]
    )
    return {"capture": {"output_residual_stream": [0, 3]}, "steer": {"apply_steering_vectors": steer}}


def _rss(pid: int) -> list[float]:
    import psutil

    proc = psutil.Process(pid)
    return [p.memory_info().rss / 2**20 for p in [proc, *proc.children(recursive=True)]]


def _names(pid: int) -> list[str]:
    """The processes `_rss` reads, in its order (vLLM titles its engine core `VLLM::EngineCore`)."""
    import psutil

    proc = psutil.Process(pid)
    return [" ".join(p.cmdline()[:2])[-60:] or p.name() for p in [proc, *proc.children(recursive=True)]]


async def _requests(
    url: str, model: str, kinds: list[str], start: int, n: int, xargs: dict, auth: dict, seen: dict[str, int]
) -> int:
    """n requests at 32 concurrent, kind by index; returns how many failed (or lacked what they asked for);
    `seen` counts what the probe / action requests did."""
    import httpx

    sem = asyncio.Semaphore(32)
    failed = 0
    async with httpx.AsyncClient(timeout=300, headers=auth, limits=httpx.Limits(max_connections=32)) as h:

        async def one(i: int) -> None:
            nonlocal failed
            kind = kinds[i % len(kinds)]
            b = {"model": model, "prompt": PROMPTS[i % 4], "max_tokens": 6, "temperature": 0, "ignore_eos": True}
            if kind in xargs:
                b["vllm_xargs"] = soak_probes.pick(xargs[kind], i)
            async with sem:
                try:
                    r = await h.post(url + "/v1/completions", json=b)
                except httpx.HTTPError:
                    failed += 1
                    return
            if r.status_code != 200 or not soak_probes.tally(kind, b, r.json(), seen):
                failed += 1

        await asyncio.gather(*(one(i) for i in range(start, start + n)))
    return failed


def _info(url: str, model: str, auth: dict, disabled: bool = False) -> dict:
    """The live objects, after one more plain request: its step is where the workers see the batch leave."""
    import httpx

    body = {"model": model, "prompt": PROMPTS[0], "max_tokens": 1, "temperature": 0}
    httpx.post(url + "/v1/completions", json=body, headers=auth, timeout=300).raise_for_status()
    if disabled:  # (no lens routes)
        return dict.fromkeys(LIVE, 0)
    info = httpx.get(url + "/v1/lens/info", headers=auth, timeout=30).json()
    return {k: info[k] for k in LIVE}


def _serve(servers: object, model: str, disabled: bool, probes: bool, auth: dict, *flags: str) -> tuple[str, dict]:
    """A server (with a probe folder, the probe loaded and the actions calibrated when `probes`) and the
    `vllm_xargs` of every kind."""
    if disabled:
        url = servers._serve(*flags, VLLM_LENS_DISABLE="1")  # type: ignore[attr-defined]
        return url, {}
    folder = Path(tempfile.mkdtemp(prefix="soak-probes-"))
    soak_probes.write_probe(folder)
    url = servers._serve(*flags, "--lens-probe-dir", str(folder))  # type: ignore[attr-defined]
    xargs = _xargs()
    if probes:
        soak_probes.load_probe(url, auth)
        xargs.update(soak_probes.xargs(soak_probes.calibrate(url, model, PROMPTS, auth)))
    return url, xargs


def _stop(servers: object) -> None:
    for p in servers._SERVERS:  # type: ignore[attr-defined]
        p.terminate()
        p.wait(30)
    servers._SERVERS.clear()  # type: ignore[attr-defined]


def _slope(xs: list[float], ys: list[float]) -> float:
    """Least-squares slope of ys over xs."""
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    den = sum((x - mx) ** 2 for x in xs)
    return 0.0 if not den else sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / den


def long_run(args: argparse.Namespace, model: str, servers: object) -> dict:
    auth = {"Authorization": f"Bearer {KEY}"}
    kinds = ["plain"] if args.disabled else args.mix.split(",")
    probes = any(k in ("probe", "action") for k in kinds)
    url, xargs = _serve(servers, model, args.disabled, probes, auth, "--api-key", KEY)
    pid = servers.server_pid(url)  # type: ignore[attr-defined]
    names = _names(pid)
    rows = []
    seen: dict[str, int] = {}
    done, failed, t0 = 0, 0, time.time()
    while done < args.long:
        n = min(args.every, args.long - done)
        failed += asyncio.run(_requests(url, model, kinds, done, n, xargs, auth, seen))
        done += n
        rss = _rss(pid)
        row = {"requests": done, "s": round(time.time() - t0, 1), "rss_mb": [round(x, 1) for x in rss]}
        row.update(_info(url, model, auth, args.disabled))
        row.update(seen)
        rows.append(row)
        print(json.dumps(row), flush=True)
    half = rows[len(rows) // 2 :]
    xs = [r["requests"] / 1000 for r in half]
    per_process = [_slope(xs, [r["rss_mb"][i] for r in half]) for i in range(len(rows[-1]["rss_mb"]))]
    total = _slope(xs, [sum(r["rss_mb"]) for r in half])
    live = {k: rows[-1][k] for k in LIVE}
    flat = abs(total) < args.flat_mb and not any(live.values()) and failed == 0
    summary = {
        "kinds": kinds,
        "processes": names,
        "requests": done,
        "failed": failed,
        "probe_and_action_outcomes": seen,
        "seconds": round(time.time() - t0, 1),
        "rss_first_mb": round(sum(rows[0]["rss_mb"]), 1),
        "rss_last_mb": round(sum(rows[-1]["rss_mb"]), 1),
        "second_half_mb_per_1000": round(total, 2),
        "second_half_mb_per_1000_per_process": [round(s, 2) for s in per_process],
        "live_objects_at_end": live,
        "flat": flat,
    }
    print(json.dumps(summary), flush=True)
    _stop(servers)
    return {"rows": rows, "summary": summary}


def rounds(args: argparse.Namespace, model: str, servers: object) -> dict:
    report, details = {}, {}
    for kind in args.kinds.split(","):
        off = kind == "disabled"
        url, xargs = _serve(servers, model, off, kind in ("probe", "action"), {})
        pid = servers.server_pid(url)  # type: ignore[attr-defined]
        rows, live, failed = [], [], 0
        seen: dict[str, int] = {}
        for r in range(args.rounds):
            failed += asyncio.run(_requests(url, model, ["plain" if off else kind], 0, args.requests, xargs, {}, seen))
            rows.append([round(x) for x in _rss(pid)])
            live.append(_info(url, model, {}, off))
            print(kind, r, rows[-1], json.dumps({**{k: v for k, v in live[-1].items() if v}, **seen}), flush=True)
        report[kind] = rows
        details[kind] = {"failed": failed, "live_objects": live, "probe_and_action_outcomes": seen}
        _stop(servers)
    for kind, rows in report.items():
        tot = [sum(r) for r in rows]
        late = (tot[-1] - tot[len(tot) // 2]) / max(1, len(tot) - 1 - len(tot) // 2)
        d = details[kind]
        print(
            f"{kind}: total RSS {tot[0]} -> {tot[-1]} MB; second half {late:+.1f} MB per {args.requests} requests;"
            f" failed {d['failed']}; live objects at the end {sum(d['live_objects'][-1].values())};"
            f" {json.dumps(d['probe_and_action_outcomes'])}"
        )
    return {**report, "details": details}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--requests", type=int, default=1000)
    ap.add_argument("--kinds", default="disabled,plain,capture,steer,probe,action")
    ap.add_argument("--mix", default="plain,capture,steer,probe,action", help="(--long) the kinds, in turn")
    ap.add_argument("--long", type=int, default=0, help="one run of this many mixed requests")
    ap.add_argument("--every", type=int, default=500, help="(--long) sample every this many requests")
    ap.add_argument("--flat-mb", type=float, default=2.0, help="(--long) flat: growth under this per 1,000")
    ap.add_argument("--disabled", action="store_true", help="(--long) the plugin off: vLLM's own growth")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    from support import servers
    from support.engines import model_path

    model = str(model_path("llama"))
    report = long_run(args, model, servers) if args.long else rounds(args, model, servers)
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
