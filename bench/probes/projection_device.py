"""What a probe step's projection costs on the device, without an engine: W9's shape (one site, 256 staged
bf16 rows of d 4096, one output) and W10's (4 sites scored together, 2 outputs each), the ops the worker
dispatches (`projection.project`: the rows to float32, then `mm` / `bmm` into the record's float32 view) and
candidates beside them, each timed by CUDA events over a loop and as a replayed CUDA graph (launches
excluded). Prints one JSON line per shape and method: device µs a step (median of 5 timings of 200 steps).

    PYTHONPATH=. python bench/probes/projection_device.py [--rows 256] [--d 4096]
"""

from __future__ import annotations

import argparse
import json
import statistics
from typing import Callable

import torch


def _time(fn: Callable[[], None], graph: bool) -> float:
    """Median device µs of one call over 5 timings of 200 calls (replayed as one CUDA graph if `graph`)."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    if graph:
        g = torch.cuda.CUDAGraph()
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            fn()
            with torch.cuda.graph(g, stream=s):
                for _ in range(200):
                    fn()
        torch.cuda.current_stream().wait_stream(s)
        torch.cuda.synchronize()
    got = []
    for _ in range(5):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        if graph:
            g.replay()
        else:
            for _ in range(200):
                fn()
        b.record()
        b.synchronize()
        got.append(a.elapsed_time(b) * 1e3 / 200)
    return statistics.median(got)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=256)
    ap.add_argument("--d", type=int, default=4096)
    a = ap.parse_args()
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    for name, sites, outs in (("W9", 1, 1), ("W10", 4, 2)):
        stage = torch.randn(sites * a.rows + 64, a.d, device=dev, dtype=torch.bfloat16, generator=g)
        x = stage.narrow(0, 0, sites * a.rows).view(sites, a.rows, a.d)
        w = torch.randn(sites, outs, a.d, device=dev, dtype=torch.float32, generator=g)
        wt = w.transpose(1, 2)
        wb = w.to(torch.bfloat16)
        out = torch.empty(sites, a.rows, outs, device=dev, dtype=torch.float32)
        methods: dict[str, Callable[[], None]] = {
            "worker: to(float32) + bmm": lambda: torch.bmm(x.to(torch.float32), wt, out=out),
            "bf16 bmm, then to float32": lambda: out.copy_(torch.bmm(x, wb.transpose(1, 2))),
            "float32 product + sum": lambda: torch.sum(x.to(torch.float32).unsqueeze(-2) * w.unsqueeze(1), -1, out=out),
            "einsum float32": lambda: out.copy_(torch.einsum("srd,sod->sro", x.to(torch.float32), w)),
        }
        xf = torch.empty(sites, a.rows, a.d, device=dev, dtype=torch.float32)
        wflat = w.reshape(sites * outs, a.d)

        def per_site() -> None:
            xf.copy_(x)
            for k in range(sites):
                torch.mm(xf[k], wt[k], out=out[k])

        def stacked() -> None:  # one mm against every site's weights, the diagonal blocks kept
            big = torch.mm(x.reshape(-1, a.d).to(torch.float32), wflat.T).view(sites, a.rows, sites, outs)
            out.copy_(torch.diagonal(big, dim1=0, dim2=2).permute(2, 0, 1))

        from vllm_worker.worker.projection import project, weight_views

        views = weight_views(w)
        methods["project() of this tree"] = lambda: project(x, w, out, rowwise=False, views=views)
        methods["per-site mm"] = per_site
        methods["one mm, stacked weights"] = stacked
        methods["bmm(w, x^T)"] = lambda: out.copy_(torch.bmm(w, x.to(torch.float32).transpose(1, 2)).transpose(1, 2))
        if sites == 1:
            x2, w2t, out2 = x[0], w[0].T, out[0]
            methods["worker (one site): to(float32) + mm"] = lambda: torch.mm(x2.to(torch.float32), w2t, out=out2)
        ref = torch.bmm(x.to(torch.float32), wt)
        for label, fn in methods.items():
            fn()
            err = float((out - ref).abs().max())
            row = {
                "shape": name,
                "method": label,
                "us_loop": round(_time(fn, False), 2),
                "us_graph": round(_time(fn, True), 2),
                "max_abs_diff_vs_worker": err,
            }
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
