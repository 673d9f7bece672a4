"""The CUDA projection kernel (`worker/projection_kernel`, through `projection._kernel_project`) in Triton's
interpreter (`TRITON_INTERPRET=1`, a process of its own: the flag is read when kernels are made): W9's and
W10's shapes, one site and several, bf16 / fp16 / fp32 rows, widths that are not a multiple of its block —
float32 sums within float32 rounding of a float64 reference, a row's scores the same bits alone as among
others; layouts it does not take (too many columns, a strided output) are left to the torch ops."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

from support import pythonpath

SCRIPT = textwrap.dedent(
    """
    import torch
    from vllm_worker.worker import projection

    torch.manual_seed(0)
    cases = [(4, 64, 2, 4096, torch.bfloat16), (1, 37, 1, 128, torch.bfloat16), (3, 50, 7, 200, torch.float16),
             (2, 17, 64, 96, torch.float32)]
    for s, m, n, d, dt in cases:
        x, w = torch.randn(s, m, d).to(dt), torch.randn(s, n, d)
        out = torch.full((s, m, n), float("nan"))
        one = s == 1  # one site: the (m, d) / (n, d) / (m, n) form
        assert projection._kernel_project(*((x[0], w[0], out[0]) if one else (x, w, out)))
        ref = torch.einsum("smd,snd->smn", x.double(), w.double())
        bound = 1e-6 * d * (x.double().abs().unsqueeze(2) * w.double().abs().unsqueeze(1)).amax()
        assert (out.double() - ref).abs().max() <= bound, (s, m, n, d, dt)
        alone = torch.full((s, 1, n), float("nan"))
        assert projection._kernel_project(x[:, 5:6], w, alone)
        assert torch.equal(alone[:, 0], out[:, 5]), (s, m, n, d, dt)
    x, w = torch.randn(8, 64).bfloat16(), torch.randn(65, 64)
    assert not projection._kernel_project(x, w, torch.empty(8, 65))  # more columns than it takes
    assert not projection._kernel_project(x, w[:3], torch.empty(3, 8).T)  # a strided output
    print("OK")
    """
)


def test_projection_kernel_in_the_interpreter():
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=pythonpath(os.environ.get("PYTHONPATH")))
    got = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=600)
    assert got.returncode == 0 and got.stdout.strip().endswith("OK"), got.stderr[-3000:]
