"""W9 / W10's result tail without an engine, split as the engine runs it and counted: the worker's assembly
(`fetch.assemble_all`), the reply's encoding and decoding by vLLM's msgpack serializer (as an engine core
returns a utility call's result: `UtilityResult` in `EngineCoreOutputs`), and the frontend's decoding
(`frontend.fetch._apply`). Per part: thread CPU ms (min and median of `repeats`: a busy VM's waits are not
counted), Python calls (cProfile, one more pass) and the reply's bytes. Filed as `result_tail.py` files
them (its `RESULT_TAIL_STEPS` / `RESULT_TAIL_CHUNKS`); one torch thread; the heap frozen after set-up.
Prints one JSON line.

    python bench/probes/tail_split.py [requests] [probes] [repeats]   (probes 1: W9's shape; 8: W10's)
"""

from __future__ import annotations

import cProfile
import gc
import json
import pstats
import sys
import time
from typing import Any, Callable

import torch
from result_tail import PROMPT, STEPS, _filed, _outputs  # (bench/probes: beside this script)
from vllm.v1.engine import EngineCoreOutputs, UtilityOutput
from vllm.v1.serial_utils import MsgpackDecoder, MsgpackEncoder, UtilityResult

from vllm_worker.frontend import fetch as frontend_fetch
from vllm_worker.worker import fetch

PARTS = ("assemble", "encode", "decode", "apply")


def main(n_req: int, n_probes: int, repeats: int) -> dict:
    torch.set_num_threads(1)
    reqs = _filed(n_req, n_probes)
    todo = [(None, None, r.store, PROMPT + STEPS) for r in reqs]
    enc, dec = MsgpackEncoder(), MsgpackDecoder(EngineCoreOutputs)
    wanted = {f"m8_{j}": {"aggregate": ["mean", "max", "last"], "positions": "generated"} for j in range(n_probes)}
    gc.collect()
    gc.freeze()
    cpu: dict[str, list[float]] = {k: [] for k in PARTS}

    def one(prof: dict[str, cProfile.Profile] | None = None) -> int:
        def timed(k: str, fn: Callable[[], Any]) -> Any:
            p = (prof or {}).get(k)
            if p is not None:
                p.enable()
            t = time.thread_time()
            got = fn()
            cpu[k].append((time.thread_time() - t) * 1e3)
            if p is not None:
                p.disable()
            return got

        parts = timed("assemble", lambda: fetch.assemble_all(todo, [], None, None))
        reply = {f"r{i}": {0: part} for i, part in enumerate(parts)}
        msg = EngineCoreOutputs(utility_output=UtilityOutput(call_id=1, result=UtilityResult([reply])))
        bufs = timed("encode", lambda: enc.encode(msg))
        got = timed("decode", lambda: dec.decode(bufs))
        merged: dict = {}
        frontend_fetch.merge_fetched(merged, got.utility_output.result.result)
        outs = _outputs(n_req, wanted)
        timed("apply", lambda: frontend_fetch._apply(outs, merged))
        return sum(len(b) for b in bufs)

    for _ in range(2):
        one()
    for v in cpu.values():
        v.clear()
    nbytes = 0
    for _ in range(repeats):
        nbytes = one()
    prof = {k: cProfile.Profile() for k in PARTS}
    one(prof)
    out: dict[str, Any] = {"requests": n_req, "probes": n_probes, "positions": PROMPT + STEPS, "reply_bytes": nbytes}
    for k in PARTS:
        v = sorted(cpu[k][:repeats])
        out[f"{k}_cpu_ms"] = [round(v[0], 2), round(v[len(v) // 2], 2)]
        out[f"{k}_py_calls"] = pstats.Stats(prof[k]).total_calls
    out["aggregates"] = ["mean", "max", "last"]
    return out


if __name__ == "__main__":
    args = [int(a) for a in sys.argv[1:4]]
    print(json.dumps(main(*(args + [256, 8, 15][len(args) :]))))
