"""Does a change to the tap kernel change its arithmetic? Compiles it for sm_90 without a GPU and counts the
float instructions of its PTX (bf16 rows, fp32 entries, with and without a residual; WIDE: the variant of
mlp_post taps, which also serves whole rows), and — where Triton ships a ptxas that reads its PTX — the
registers and spills ptxas assigns (registers bound how many programs an SM holds at once).

    PYTHONPATH=. .venv/bin/python bench/probes/tap_kernel_ptx.py

Run it with PYTHONPATH on two trees: equal counts (and the interpreter's equality in
tests/unit/test_tap_kernel_*.py) are the CPU evidence that a pure speed change leaves the numbers alone;
bench/results/2026-12-04-vm-points.md.
"""

from __future__ import annotations

import collections
import json
import os
import re
import subprocess
import tempfile

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
        counts: dict = dict(sorted(collections.Counter(m.group(1) for m in FLOAT_OP.finditer(ptx)).items()))
        counts.update(_registers(ptx))
        out[f"HAS_R={has_r}" + (" WIDE" if wide else "")] = counts
    print(json.dumps(out))


def _registers(ptx: str) -> dict:
    """ptxas's registers and spill bytes for sm_90a (the newest ptxas Triton ships; none: {})."""
    here = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    for name in ("ptxas-blackwell", "ptxas"):
        exe = os.path.join(here, name)
        if not os.path.exists(exe):
            continue
        with tempfile.TemporaryDirectory() as d:
            src = os.path.join(d, "k.ptx")
            with open(src, "w") as f:
                f.write(ptx)
            got = subprocess.run(
                [exe, "-arch=sm_90a", "-v", src, "-o", os.path.join(d, "k.cubin")], capture_output=True, text=True
            )
        regs = re.search(r"Used (\d+) registers", got.stdout + got.stderr)
        spill = re.search(r"(\d+) bytes spill stores", got.stdout + got.stderr)
        if regs:
            return {"registers": int(regs.group(1)), "spill_stores": int(spill.group(1)) if spill else -1}
    return {}


if __name__ == "__main__":
    main()
