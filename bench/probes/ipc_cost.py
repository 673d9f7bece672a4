"""A steering request's IPC as vLLM does it, in two processes: the frontend process clones the params,
runs our frontend, encodes the `EngineCoreRequest` (`MsgpackEncoder`) and sends it over a zmq socket
(`send_multipart(copy=False)`, as `core_client`); the engine-core process receives it (`recv_multipart(
copy=False)`), decodes it (`MsgpackDecoder(EngineCoreRequest)`, as its input thread) and admits it (the
worker's `Admission.admit`), keeping every decoded request alive until the batch ends (as 256 requests in
flight do). `request_path_cost.py` times the same stages in one process, where one side's memory
(frames kept alive by views) changes the other side's allocation costs; here each process has its own.
Prints ms per request (least of `PATH_REPEATS` batches); `PATH_VIEW=0`: rows sent as `bytes`; `PATH_SHARE=0`: the clone copies tensors.
Run: `python bench/probes/ipc_cost.py [n_requests] [workloads]`."""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import sys
import time

import torch
import zmq
from vllm import SamplingParams
from vllm.v1.engine import EngineCoreRequest
from vllm.v1.serial_utils import MsgpackDecoder, MsgpackEncoder

from bench.probes.admit_cost import admission
from bench.probes.request_path_cost import LAYERS, REPEATS, SHARE, D, core_request, extra, processor
from vllm_worker import compat
from vllm_worker.frontend.requests import on_new_request
from vllm_worker.frontend.state import engine_state
from vllm_worker.protocol.clone_scope import sharing_tensors
from vllm_worker.protocol.points import OUT, site
from vllm_worker.protocol.spec import PAYLOAD_KEY
from vllm_worker.worker import graph


def engine_core(n: int, batches: int, conn, addr: str) -> None:
    """The receiving side: per batch, ms per request for recv, decode, admit; it starts once the whole batch
    was sent (zmq's I/O thread has received it), so no stage includes waiting for the sender."""
    compat.pp_last_stage()
    sock = zmq.Context().socket(zmq.PULL)
    sock.bind(addr)
    conn.send("ready")
    dec = MsgpackDecoder(EngineCoreRequest)
    g = graph.GraphTaps([site(l, OUT) for l in range(LAYERS)], D, torch.bfloat16, torch.device("cpu"), 256, None)
    for _ in range(batches):
        adm = admission(g, n)
        t = [0.0, 0.0, 0.0]
        kept, states = [], []
        assert conn.recv() == "sent"
        for i in range(n):
            a = time.perf_counter()
            frames = sock.recv_multipart(copy=False)
            b = time.perf_counter()
            req = dec.decode(frames)
            c = time.perf_counter()
            states.append(adm.admit(req.request_id, req.sampling_params.extra_args[PAYLOAD_KEY]))
            d = time.perf_counter()
            kept.append(req)
            t[0] += b - a
            t[1] += c - b
            t[2] += d - c
        adm.flush()
        failed = [s.store.error for s in states if s.store is not None and s.store.error is not None]
        assert not failed, failed[0]
        for s in states:
            g.free_entries(s.entry_ids)
        conn.send([x / n * 1e3 for x in t])
        del kept, states, frames, req


def frontend(workload: str, n: int, unit: torch.Tensor, proc, sock, enc) -> list[float]:
    sps = [SamplingParams(max_tokens=16, temperature=0, extra_args=extra(workload, unit)) for _ in range(n)]
    t = [0.0, 0.0, 0.0, 0.0]
    for i, sp in enumerate(sps):
        a = time.perf_counter()
        with sharing_tensors() if SHARE else contextlib.nullcontext():
            c = sp.clone()
        b = time.perf_counter()
        r = on_new_request(proc, f"r{i}", core_request(i, c))
        d = time.perf_counter()
        msg = enc.encode(r)
        e = time.perf_counter()
        sock.send_multipart(msg, copy=False)
        f = time.perf_counter()
        t = [t[0] + b - a, t[1] + d - b, t[2] + e - d, t[3] + f - e]
    for i in range(n):
        engine_state(proc).pending.pop(f"r{i}", None)
    return [x / n * 1e3 for x in t]


def main() -> None:
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 256
    workloads = sys.argv[2].split(",") if len(sys.argv) > 2 else ["W12", "W13"]
    os.environ.setdefault("VLLM_LENS_STEER_MB", "64")
    unit = torch.nn.functional.normalize(torch.randn(D, generator=torch.Generator().manual_seed(0)), dim=0)
    compat.pp_last_stage()
    print("ms/request: frontend side: clone | frontend | encode | send ; engine-core side: recv | decode | admit")
    for workload in workloads:
        here, there = mp.Pipe()
        addr = f"ipc:///tmp/lens-ipc-cost-{os.getpid()}-{workload}"
        core = mp.get_context("fork").Process(target=engine_core, args=(n, REPEATS, there, addr))
        core.start()
        assert here.recv() == "ready"
        sock = zmq.Context().socket(zmq.PUSH)
        sock.connect(addr)
        proc, enc = processor(unit, refs=True), MsgpackEncoder()
        best_f: list[float] = []
        best_c: list[float] = []
        for _ in range(REPEATS):
            f = frontend(workload, n, unit, proc, sock, enc)
            here.send("sent")
            c = here.recv()
            best_f = f if not best_f else [min(x, y) for x, y in zip(best_f, f)]
            best_c = c if not best_c else [min(x, y) for x, y in zip(best_c, c)]
        core.join()
        sock.close(linger=0)
        cols = " | ".join(f"{x:.3f}" for x in best_f) + " ; " + " | ".join(f"{x:.3f}" for x in best_c)
        print(f"{workload}: {cols} ; total {sum(best_f) + sum(best_c):.3f}")


if __name__ == "__main__":
    main()
