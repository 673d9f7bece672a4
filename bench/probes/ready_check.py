"""ON A LENT GPU: probe results made while the device still runs the engine's last step (`ready_probes`,
early) are the ones a fetch makes. A multiprocess engine (the idle steps come while an `LLM` call's frontend
works; the switch below reaches its worker by `collective_rpc`) runs W10's probes (8 at 4 layers) over a batch whose requests finish at four different steps. In the worker, each
fetch makes again every payload it hands out ready-made (every record has run by then) and counts those that
differ: one read from a record a running step still wrote would (`verify`). The counters must show results
made early, every one used and none differing. The same batch then runs with `VLLM_LENS_IDLE_PROBES` off,
for the record: its scores equal the first run's only where the batch's steps were composed alike (requests
reach a multiprocess engine's first steps as they arrive; vLLM's GEMMs differ with the rows). Prints `PASS|FAIL <item> <numbers>` and one JSON line `CHECK {...}`.

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


def verify(_worker: Any) -> bool:
    """In the worker: every fetch makes again the payloads it hands out ready-made, from the same records,
    and counts those that differ (`fetch._ready_verify`)."""
    from vllm_worker.worker import fetch, probe_payloads, probes, step_records

    counts = fetch.__dict__.setdefault("_ready_verify", {"compared": 0, "differ": 0})
    orig = fetch._probes_together

    def checked(todo: list, records: dict | None) -> dict:
        out = orig(todo, records)
        sts = [st for _, _, st, _ in todo if st.ready is not None and out.get(id(st)) is st.ready]
        if sts:
            cache = {step_records.WHOLE_RECORDS: True}
            fresh = probe_payloads.together(sts, cache, blocks=True)
            for st, p in zip(sts, fresh):
                p = p if p is not None else probes.payload(st.probes, cache=cache)
                counts["compared"] += 1
                counts["differ"] += int(p != st.ready)
        return out

    fetch._probes_together = checked
    return True


def verified(_worker: Any) -> dict:
    from vllm_worker.worker import fetch

    return dict(fetch.__dict__.get("_ready_verify", {}))


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


def differences(a: list, b: list) -> tuple[list[str], float]:
    """Where two runs' outputs differ (tokens, scores, aggregates; [] when equal bit for bit) and the
    largest difference of a score."""
    bad: list[str] = []
    top = 0.0
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
                top = max(top, float((sx[name] - sy[name]).abs().max()))
            for agg in ax[name]:
                if not torch.equal(ax[name][agg], ay[name][agg]):
                    bad.append(f"request {i} {name}: {agg}")
    return bad, top


def main() -> None:
    ap = bench_args("W10", rounds=2, top=0)
    ap.set_defaults(n=128, new=24)
    args = ap.parse_args()
    llm, extra_of, prompts = bench_engine(args.model, args.device, args.n)
    extra = extra_of(args.workloads)
    run(llm, prompts, extra, args.new, True)  # warm-up (graphs, the probes' stacks)
    llm.collective_rpc(verify)
    result: dict[str, Any] = {"workload": args.workloads, "requests": args.n, "new": args.new, "rounds": []}
    ok = True
    for r in range(args.rounds):
        seen = llm.collective_rpc(verified)[0]
        on, got_on = run(llm, prompts, extra, args.new, True)
        now = llm.collective_rpc(verified)[0]
        compared, differ = now["compared"] - seen.get("compared", 0), now["differ"] - seen.get("differ", 0)
        off, got_off = run(llm, prompts, extra, args.new, False)
        bad, top = differences(on, off)
        good = got_on["ready_early"] > 0 and got_on["ready_used"] == args.n == compared and differ == 0
        ok = ok and good
        print(
            f"{'PASS' if good else 'FAIL'} round {r} made early, used, the same made again: on {got_on}, "
            f"compared {compared}, differ {differ}"
        )
        print(f"INFO round {r} on / off: {len(bad)} differences, scores at most {top:.3g} apart {bad[:3]}")
        result["rounds"].append(
            {"on": got_on, "off": got_off, "compared": compared, "differ": differ, "on_off": len(bad), "top": top}
        )
    result["ok"] = ok
    print("CHECK " + json.dumps(result))


if __name__ == "__main__":
    main()
