"""Does a change to the tap kernel change its arithmetic? Compiles it for sm_90 without a GPU and counts the
float instructions of its PTX (bf16 rows, fp32 entries, with and without a residual).

    PYTHONPATH=. .venv/bin/python bench/probes/tap_kernel_ptx.py

Run it with PYTHONPATH on two trees: equal counts (and the interpreter's equality in
tests/unit/test_tap_kernel_*.py) are the CPU evidence that a pure speed change leaves the numbers alone;
bench/results/2026-12-04-vm-points.md.
"""

from __future__ import annotations

import collections
import json
import re

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from vllm_worker.worker.graph_kernels import make_tap_kernel

SIG = {
    **{p: "*bf16" for p in ("h_ptr", "r_ptr", "stage_ptr")},
    **{p: "*i32" for p in ("ctl_ptr", "base_ptr", "nxt_ptr")},
    **{p: "*fp32" for p in ("a_ptr", "b_ptr", "gate_ptr", "lo_ptr", "hi_ptr")},
    **{p: "*i8" for p in ("bflag_ptr", "op_ptr")},
    **{p: "i32" for p in ("col", "max_rows", "d", "w", "stride_h", "stride_r")},
    "HAS_R": "constexpr",
    "WIDE": "constexpr",
    "BLOCK": "constexpr",
}
FLOAT_OP = re.compile(r"^\s+((?:fma|add|mul|sub|sqrt|min|max|div|cvt)\.[\w.]*f(?:32|16)[\w.]*)", re.M)


def main() -> None:
    k = make_tap_kernel()
    out = {}
    # (WIDE: the variant of mlp_post taps, whose programs also serve whole rows: `interventions.WHOLE`)
    for has_r, wide in ((False, False), (True, False), (False, True)):
        src = ASTSource(fn=k, signature=dict(SIG), constexprs={"HAS_R": has_r, "WIDE": wide, "BLOCK": 4096})
        ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32)).asm["ptx"]
        counts = collections.Counter(m.group(1) for m in FLOAT_OP.finditer(ptx))
        out[f"HAS_R={has_r}" + (" WIDE" if wide else "")] = dict(sorted(counts.items()))
    print(json.dumps(out))


if __name__ == "__main__":
    main()
