"""ON A LENT GPU: probe results made while the device still runs the engine's last step (`ready_probes`,
early) are the ones a fetch makes. A multiprocess engine (the idle steps come while an `LLM` call's frontend
works; the switch below reaches its worker by `collective_rpc`) runs W10's probes (8 at 4 layers) over a batch whose requests finish at four different steps, with
`VLLM_LENS_IDLE_PROBES` on and then off, the same batch each time: tokens, every probe's scores and
aggregates must be equal bit for bit, and the counters must show results made early and used by the fetch.
Prints `PASS|FAIL <item> <numbers>` and one JSON line `CHECK {...}`.

    python3 bench/probes/ready_check.py MODEL [--device cuda] [--n 128] [--new 24]
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1"
os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # (`switch`, a function sent to the worker)
os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path[:0] = [str(Path(__file__).resolve().parent)]

import torch  # noqa: E402
from step_host import bench_args, bench_engine  # noqa: E402

COUNTERS = ("ready_made", "ready_early", "ready_used")


def counters(llm: Any) -> dict[str, int]:
    got = llm.collective_rpc("lens_status")[0]["fetch_timings"]
    return {k: int(got.get(k, 0)) for k in COUNTERS}


def switch(_worker: Any, on: bool) -> bool:
    """In the worker: results of finished requests made at idle steps, or only by the fetch."""
    os.environ["VLLM_LENS_IDLE_PROBES"] = "1" if on else "0"
    return on


def run(llm: Any, prompts: list, extra: dict, new: int, on: bool) -> tuple[list, dict[str, int]]:
    """One generate of the batch, requests finishing at four steps (`new` .. `new` + 3 tokens)."""
    from vllm import SamplingParams

    llm.collective_rpc(switch, args=(on,))
    sps = [
        SamplingParams(max_tokens=new + i % 4, temperature=0, ignore_eos=True, extra_args=dict(extra))
        for i in range(len(prompts))
    ]
    before = counters(llm)
    outs = llm.generate(prompts, sps, use_tqdm=False)
    after = counters(llm)
    return outs, {k: after[k] - before[k] for k in COUNTERS}


def differences(a: list, b: list) -> list[str]:
    """Where two runs' outputs differ (tokens, scores, aggregates); [] when equal bit for bit."""
    bad: list[str] = []
    for i, (x, y) in enumerate(zip(a, b)):
        if list(x.outputs[0].token_ids) != list(y.outputs[0].token_ids):
            bad.append(f"request {i}: tokens")
        sx, sy = x.activations["probe_scores"], y.activations["probe_scores"]
        ax, ay = x.activations["probe_aggregates"], y.activations["probe_aggregates"]
        if list(sx) != list(sy) or list(ax) != list(ay):
            bad.append(f"request {i}: probe names")
            continue
        for name in sx:
            if not torch.equal(sx[name], sy[name]):
                bad.append(f"request {i} {name}: scores")
            for agg in ax[name]:
                if not torch.equal(ax[name][agg], ay[name][agg]):
                    bad.append(f"request {i} {name}: {agg}")
    return bad


def main() -> None:
    ap = bench_args("W10", rounds=2, top=0)
    ap.set_defaults(n=128, new=24)
    args = ap.parse_args()
    llm, extra_of, prompts = bench_engine(args.model, args.device, args.n)
    extra = extra_of(args.workloads)
    run(llm, prompts, extra, args.new, True)  # warm-up (graphs, the probes' stacks)
    result: dict[str, Any] = {"workload": args.workloads, "requests": args.n, "new": args.new, "rounds": []}
    ok = True
    for r in range(args.rounds):
        on, got_on = run(llm, prompts, extra, args.new, True)
        off, got_off = run(llm, prompts, extra, args.new, False)
        bad = differences(on, off)
        early = got_on["ready_early"] > 0 and got_on["ready_used"] == args.n and got_off["ready_made"] == 0
        ok = ok and not bad and early
        print(f"{'PASS' if not bad else 'FAIL'} round {r} equal on / off: {len(bad)} differences {bad[:4]}")
        print(f"{'PASS' if early else 'FAIL'} round {r} made early: on {got_on}, off {got_off}")
        result["rounds"].append({"on": got_on, "off": got_off, "differences": len(bad)})
    result["ok"] = ok
    print("CHECK " + json.dumps(result))


if __name__ == "__main__":
    main()
