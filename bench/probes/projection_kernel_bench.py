"""The probe projection of a decode step on the device: the Triton kernel (`worker/projection_kernel`) against
the torch ops it replaces (a float32 copy of the rows, cuBLAS's `bmm(w, x^T)` / `mm`, a transposing copy), at
W9's and W10's shapes: device µs a call (CUDA events over many calls, after a warm-up), the largest error of
each against a float64 reference, and whether a row's scores are the same alone. Needs torch and Triton
only (no vLLM): `python bench/probes/projection_kernel_bench.py` prints one JSON line per shape."""

from __future__ import annotations

import importlib.util
import json
import pathlib

import torch

ROOT = pathlib.Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("pk", ROOT / "vllm_worker" / "worker" / "projection_kernel.py")
pk = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(pk)  # type: ignore[union-attr]


def kernel(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor) -> None:
    s, m, d = x.shape
    n = w.shape[1]
    bn = 1 << max(0, (n - 1).bit_length())
    bk = max(16, min(512, 8192 // (16 * bn)))
    pk.project_kernel[(s, (m + 15) // 16)](
        x, w, out, m, n, d, x.stride(0), x.stride(1), w.stride(0), w.stride(1), out.stride(0), out.stride(1),
        BM=16, BN=bn, BK=bk,
    )  # fmt: skip


def torch_ops(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor) -> None:
    xf = x.to(torch.float32)
    if x.shape[0] == 1:
        torch.mm(xf[0], w[0].T, out=out[0])
    else:
        out.copy_(torch.bmm(w, xf.transpose(1, 2)).transpose(1, 2))


def timed(fn, *args, iters: int = 300) -> float:
    for _ in range(20):
        fn(*args)
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(iters):
        fn(*args)
    b.record()
    torch.cuda.synchronize()
    return a.elapsed_time(b) * 1e3 / iters


def main() -> None:
    g = torch.Generator(device="cuda").manual_seed(0)
    for name, s, m, n in (
        ("W9", 1, 256, 1),
        ("W10", 4, 256, 2),
        ("8 probes at one site", 1, 256, 8),
        ("16 outputs x 4 sites", 4, 256, 16),
    ):
        d = 4096
        x = torch.randn(s, m, d, device="cuda", generator=g).to(torch.bfloat16)
        w = torch.randn(s, n, d, device="cuda", generator=g) / d**0.5
        ref = torch.einsum("smd,snd->smn", x.double(), w.double())
        row = {"shape": name, "sites": s, "rows": m, "columns": n, "d": d}
        for label, fn in (("kernel", kernel), ("torch", torch_ops)):
            out = torch.empty(s, m, n, device="cuda")
            fn(x, w, out)
            one = torch.empty(s, 1, n, device="cuda")
            fn(x[:, 7:8].contiguous(), w, one)
            row[label] = {
                "us": round(timed(fn, x, w, out), 2),
                "max_err": float((out.double() - ref).abs().max()),
                "row_alone_equal": bool(torch.equal(one[:, 0], out[:, 7])),
            }
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
