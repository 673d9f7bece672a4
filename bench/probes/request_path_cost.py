"""Per-request host cost of a steering request on its way to the device, stage by stage, on CPU at the
8B shape (d = 4096, 32 layers): vLLM's `SamplingParams.clone` (what `llm.generate` does to each request),
our frontend (`on_new_request`: names resolved, validation, encode), vLLM's IPC of the real
`EngineCoreRequest` (`MsgpackEncoder` / `MsgpackDecoder` from `vllm.v1.serial_utils`: what crosses to the
engine-core process) and the worker's admission (`Admission.admit`, then the step's flush).
W12: ablate one direction at every layer, a fresh (32, 4096) tensor per request; W12n: the same ablation
naming a registered (4096,) vector (by reference; `PATH_REFS=0`: as without a consumer, by bytes;
`PATH_VIEW=0`: rows as `bytes`, as a multiprocess executor gets them, instead of `compat.raw_view`); W13: cap at one layer (a (1, 4096) vector): the difference is what scales with bytes.
Prints ms per request (least of `PATH_REPEATS` batches, default 3) and the payload bytes per request.
Run: `python bench/probes/request_path_cost.py [n_requests] [workloads]`."""

from __future__ import annotations

import contextlib
import os
import sys
import time
import types

import torch
from vllm import SamplingParams
from vllm.v1.engine import EngineCoreRequest
from vllm.v1.serial_utils import MsgpackDecoder, MsgpackEncoder

from bench.probes.admit_cost import admission
from vllm_worker import compat
from vllm_worker.api.steering import SteeringVector
from vllm_worker.frontend import vector_refs
from vllm_worker.frontend.requests import on_new_request
from vllm_worker.frontend.state import STATE_ATTR, FrontendState, engine_state
from vllm_worker.frontend.vectors import registry_of
from vllm_worker.protocol.clone_scope import sharing_tensors
from vllm_worker.protocol.points import OUT, site
from vllm_worker.protocol.spec import PAYLOAD_KEY, ModelShape
from vllm_worker.worker import graph
from vllm_worker.worker import vector_refs as worker_refs

D, LAYERS = 4096, 32
REPEATS = int(os.environ.get("PATH_REPEATS", "3"))
SHARE = os.environ.get("PATH_SHARE", "1") == "1"  # vLLM's clone inside `process_inputs` (0: a copying clone)


def extra(workload: str, unit: torch.Tensor) -> dict:
    if workload == "W12":
        sv = SteeringVector(activations=unit.expand(LAYERS, D).clone(), layer_indices=list(range(LAYERS)), op="ablate")
    elif workload == "W12n":
        sv = SteeringVector(name="dir", layer_indices=list(range(LAYERS)), op="ablate")
    else:
        sv = SteeringVector(activations=unit.view(1, D).clone(), layer_indices=[LAYERS // 2], op="cap", lo=-1.0, hi=1.0)
    return {"apply_steering_vectors": [sv]}


def processor(unit: torch.Tensor, refs: bool) -> types.SimpleNamespace:
    """An input processor as `on_new_request` reads it: the engine's state, its shape fixed, one engine;
    `refs`: with a consumer (every request fetched) and "dir" held by the workers, as `llm.register_vector`
    leaves it (its push: `vector_refs.forms` to the worker's `HeldVectors`), so W12n goes by reference."""
    proc = types.SimpleNamespace()
    state = FrontendState(shape=ModelShape(n_layers=LAYERS, d_model=D), engines_fed=1)
    state.rows_by_view = os.environ.get("PATH_VIEW", "1") == "1"  # (as `compat.rows_by_view` finds one uni worker)
    setattr(proc, STATE_ATTR, state)
    registry = registry_of(proc)
    registry.register("", "dir", unit.clone())
    if refs:
        state.consumer = "offline"
        entry = registry.entry("", "dir", "name")
        held = vector_refs.forms(entry)
        worker_refs.HELD.put([held.wire(entry.vid)], [])
        registry.held(entry, held)
    return proc


def core_request(i: int, sp: SamplingParams) -> EngineCoreRequest:
    return EngineCoreRequest(
        request_id=f"r{i}", prompt_token_ids=list(range(30)), mm_features=None, sampling_params=sp,
        pooling_params=None, arrival_time=time.time(), lora_request=None, cache_salt=None, data_parallel_rank=None,
    )  # fmt: skip


def one_run(workload: str, n: int, unit: torch.Tensor, proc: types.SimpleNamespace) -> tuple[list[float], int]:
    sps = [SamplingParams(max_tokens=16, temperature=0, extra_args=extra(workload, unit)) for _ in range(n)]
    enc, dec = MsgpackEncoder(), MsgpackDecoder(EngineCoreRequest)
    g = graph.GraphTaps([site(l, OUT) for l in range(LAYERS)], D, torch.bfloat16, torch.device("cpu"), 256, None)
    adm = admission(g, n)
    t = [time.perf_counter()]
    with sharing_tensors() if SHARE else contextlib.nullcontext():  # (as `compat.patch_process_inputs`)
        clones = [sp.clone() for sp in sps]
    t.append(time.perf_counter())
    reqs = [on_new_request(proc, f"r{i}", core_request(i, c)) for i, c in enumerate(clones)]
    t.append(time.perf_counter())
    frames = [enc.encode(r) for r in reqs]
    t.append(time.perf_counter())
    got = [dec.decode(f) for f in frames]
    t.append(time.perf_counter())
    states = [adm.admit(f"r{i}", r.sampling_params.extra_args[PAYLOAD_KEY]) for i, r in enumerate(got)]
    t.append(time.perf_counter())
    adm.flush()
    t.append(time.perf_counter())
    failed = [s.store.error for s in states if s.store is not None and s.store.error is not None]
    assert not failed, failed[0]
    for i in range(n):  # (what a fetch does: the request's pending entry goes, its vectors are unpinned)
        engine_state(proc).pending.pop(f"r{i}", None)
    for s in states:
        g.free_entries(s.entry_ids)
    nbytes = sum(len(memoryview(b)) for b in frames[0])
    return [(b - a) / n * 1e3 for a, b in zip(t, t[1:])], nbytes


def main() -> None:
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 256
    workloads = sys.argv[2].split(",") if len(sys.argv) > 2 else ["W12", "W12n", "W13"]
    os.environ.setdefault("VLLM_LENS_STEER_MB", "64")
    unit = torch.nn.functional.normalize(torch.randn(D, generator=torch.Generator().manual_seed(0)), dim=0)
    compat.pp_last_stage()
    print("ms/request: clone | frontend | ipc encode | ipc decode | admit | flush | total ; bytes/request")
    for workload in workloads:
        proc = processor(unit, refs=os.environ.get("PATH_REFS", "1") == "1")
        best: list[float] = []
        for _ in range(REPEATS):
            ms, nbytes = one_run(workload, n, unit, proc)
            best = ms if not best else [min(x, y) for x, y in zip(best, ms)]
        cols = " | ".join(f"{x:.3f}" for x in best)
        print(f"{workload}: {cols} | {sum(best):.3f} ; {nbytes}")


if __name__ == "__main__":
    main()
