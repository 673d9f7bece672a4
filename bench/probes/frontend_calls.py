"""The frontend's per-request work for the monitor workloads on CPU at the 8B shape (d 4096, 32 layers), as
counts that do not depend on the VM's load: Python calls (and calls into C) a request in vLLM's
`SamplingParams.clone` (the deep copy of the caller's `SteeringVector`) and in `on_new_request`
(validation, rows, encode), aten ops a request, the IPC frame's bytes; then thread-time walls (least of
`FRONT_REPEATS` batches) and a SHA-256 over every request's encoded frame (the payload's random key and
the registrations' random ids blanked): equal digests = byte-identical payloads.
W11: a probe action `then: steer` (W11's own request, `bench/monitor_workloads.extra`); W12: ablate one
direction at every layer, a fresh (32, 4096) tensor a request; W12n: the same by a registered name; W13:
cap at one layer. Run: `python bench/probes/frontend_calls.py [n_requests] [workloads]`."""

from __future__ import annotations

import contextlib
import hashlib
import os
import sys
import time
import types

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from vllm import SamplingParams
from vllm.v1.engine import EngineCoreRequest
from vllm.v1.serial_utils import MsgpackEncoder

from bench import monitor_workloads
from bench.probes.request_path_cost import LAYERS, D, core_request, processor
from vllm_worker import compat
from vllm_worker.api.steering import SteeringVector
from vllm_worker.frontend.requests import on_new_request
from vllm_worker.frontend.state import engine_state
from vllm_worker.frontend.vectors import registry_of
from vllm_worker.protocol.clone_scope import sharing_tensors
from vllm_worker.protocol.spec import PAYLOAD_KEY

REPEATS = int(os.environ.get("FRONT_REPEATS", "5"))


class Ops(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        self.n += 1
        return func(*args, **(kwargs or {}))


def params(workload: str, n: int, unit: torch.Tensor) -> list[SamplingParams]:
    vec = unit.view(1, D)
    if workload == "W0":
        return [SamplingParams(max_tokens=16, temperature=0) for _ in range(n)]
    if workload == "W12n":
        args = [
            {"apply_steering_vectors": [SteeringVector(name="dir", layer_indices=list(range(LAYERS)), op="ablate")]}
        ]
    else:
        args = [monitor_workloads.extra(workload, LAYERS, D, vec, SteeringVector) for _ in range(n)]
    return [SamplingParams(max_tokens=16, temperature=0, extra_args=args[i % len(args)]) for i in range(n)]


def probe_state(proc: types.SimpleNamespace, unit: torch.Tensor) -> None:
    """W11's probe "m1" (the middle layer) as `llm.load_probe` leaves it in the frontend."""
    from vllm_worker.frontend import probes as probe_keys

    st = engine_state(proc)
    g = torch.Generator().manual_seed(1)
    parts = {"weight": torch.randn(1, D, generator=g), "bias": torch.zeros(1), "layers": [LAYERS // 2]}
    st.probes = {"m1": probe_keys.prepare("m1", None, st.shape, parts)}


def one_batch(workload: str, n: int, unit: torch.Tensor, proc: types.SimpleNamespace, profile=None):  # type: ignore[no-untyped-def]
    sps = params(workload, n, unit)
    sys.setprofile(profile)
    t0 = time.thread_time()
    with sharing_tensors():  # (as `compat.patch_process_inputs`)
        clones = [sp.clone() for sp in sps]
    t1 = time.thread_time()
    reqs = [on_new_request(proc, f"r{i}", core_request(i, c)) for i, c in enumerate(clones)]
    t2 = time.thread_time()
    sys.setprofile(None)
    for i in range(n):
        engine_state(proc).pending.pop(f"r{i}", None)
    return reqs, (t1 - t0) / n * 1e6, (t2 - t1) / n * 1e6


def frame_digest(reqs: list[EngineCoreRequest]) -> tuple[str, int]:
    enc = MsgpackEncoder()
    h = hashlib.sha256()
    nbytes = 0
    for r in reqs:
        p = (r.sampling_params.extra_args or {}).get(PAYLOAD_KEY, {})
        keep = {k: p[k] for k in ("key",) if k in p}
        p.update({k: "" for k in keep})
        refs = [s["vec"] for s in p.get("steer", ()) if isinstance(s.get("vec"), dict) and "ref" in s["vec"]]
        ids = [v["ref"] for v in refs]  # (a registration's random id)
        for v in refs:
            v["ref"] = ""
        r.arrival_time = 0.0
        frames = enc.encode(r)
        p.update(keep)
        for v, i in zip(refs, ids):
            v["ref"] = i
        nbytes = sum(len(memoryview(b)) for b in frames)
        for b in frames:
            h.update(bytes(b))
    return h.hexdigest()[:16], nbytes


def main() -> None:
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 256
    workloads = sys.argv[2].split(",") if len(sys.argv) > 2 else ["W0", "W11", "W12", "W12n", "W13"]
    os.environ.setdefault("VLLM_LENS_STEER_MB", "64")
    torch.set_num_threads(1)
    unit = torch.nn.functional.normalize(torch.randn(D, generator=torch.Generator().manual_seed(0)), dim=0)
    compat.pp_last_stage()
    print(
        "per request: clone calls | frontend calls | aten ops | frame bytes | clone us | frontend us (min) | payload digest"
    )
    for workload in workloads:
        proc = processor(unit, refs=True)
        if workload == "W11":
            probe_state(proc, unit)
        registry_of(proc)
        one_batch(workload, n, unit, proc)  # warm: the memos hold the contents (a steady round)
        calls = [0, 0]
        which = [0]

        def count(frame, event, arg):  # type: ignore[no-untyped-def]
            if event in ("call", "c_call"):
                calls[which[0]] += 1

        sps = params(workload, n, unit)
        sys.setprofile(count)
        with sharing_tensors():
            clones = [sp.clone() for sp in sps]
        which[0] = 1
        reqs = [on_new_request(proc, f"r{i}", core_request(i, c)) for i, c in enumerate(clones)]
        sys.setprofile(None)
        for i in range(n):
            engine_state(proc).pending.pop(f"r{i}", None)
        ops = Ops()
        with ops:
            one_batch(workload, n, unit, proc)
        walls = [one_batch(workload, n, unit, proc)[1:] for _ in range(REPEATS)]
        digest, nbytes = frame_digest(reqs)
        print(
            f"{workload}: {calls[0] / n:.0f} | {calls[1] / n:.0f} | {ops.n / n:.1f} | {nbytes} | "
            f"{min(w[0] for w in walls):.1f} | {min(w[1] for w in walls):.1f} | {digest}"
        )


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        main()
