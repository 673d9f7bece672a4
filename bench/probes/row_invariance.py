"""Does a probe projection's result for one row depend on the other rows it runs with? Candidates for
`x (m, d) -> x @ W.T (m, n_out)` in float32 (inputs float32, or bf16 cast to float32 as the ring's rows
are), each checked for row-invariance over many row counts m, offsets and shapes (d 64..4096, n_out
1..16): the rows of `f(X[j:j+m])` against the same rows of `f(X)` and of each row alone, bit for bit; then
their cost at W10's shape (256 decode rows, 8 probes: 2 a site at 4 sites) and a prefill shape (7680 rows).
Torch only (no vLLM), so the same file runs on a lent GPU:

    PYTHONPATH=. python bench/probes/row_invariance.py [--device cpu|cuda] [--quick] [--threads N]
        [--only mm,mulsum_chunked,...] [--no-check] [--no-cost] [--rounds N] [--vllm-batch-invariant]

On a GPU (`--device cuda`): does `torch.mm`'s row depend on the row count there (what the worker runs on
CUDA), does the CPU method (`mulsum_chunked`: `projection.project` with `rowwise=True`) or another candidate
fix it, and what each costs (synchronised walls). It imports `vllm_worker.worker.projection`, which needs
torch only (not vLLM). Each check also gives the largest error against a float64 matmul (relative to the
largest score): TF32 shows there.

`--vllm-batch-invariant` (needs vLLM importable; on a GPU): turns vLLM's batch-invariant mode on in this
process first, as its worker does (`compat.enable_batch_invariant_mode`: aten overrides, cuBLAS settings),
so every candidate runs under it, and adds the worker's own `project` / `rowdot` as the worker calls them
with the mode read on (`project`, `rowdot`) and a single `bmm` (`bmm_one`: the mode's Triton bmm there).

Prints one JSON line per (candidate, check) and per (candidate, cost shape).
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable

import torch

Fn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (x (m, d) float32, w (n, d) float32) -> (m, n)


def mm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return torch.mm(x, w.T)


def mm_fp64(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return torch.mm(x.double(), w.double().T).float()


def mulsum(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """What the worker runs on CPU (`probes.project`): per row a fixed-order reduction over d, rows in chunks."""
    from vllm_worker.worker.projection import project  # (the project's own: run from the repo)

    out = torch.empty(x.shape[0], w.shape[0], dtype=torch.float32, device=x.device)
    project(x, w, out, rowwise=True)
    return out


def mulsum_whole(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return (x.unsqueeze(1) * w).sum(-1)


def vecdot(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return torch.linalg.vecdot(x.unsqueeze(1), w)


def bmm_rows(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """A batch of one-row matmuls (every batch item the same shape)."""
    return torch.bmm(x.unsqueeze(1), w.T.unsqueeze(0).expand(x.shape[0], -1, -1)).squeeze(1)


def bmm_one(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """One batched matmul of one item (vLLM's batch-invariant mode replaces `bmm` on every GPU)."""
    return torch.bmm(x.unsqueeze(0), w.T.unsqueeze(0))[0]


def project(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """The worker's projection as it calls it (`projection.project`, its default path for the device)."""
    from vllm_worker.worker.projection import project as worker_project

    out = torch.empty(x.shape[0], w.shape[0], dtype=torch.float32, device=x.device)
    worker_project(x, w, out)
    return out


def rowdot(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Probe actions' per-row scores as the worker computes them (`projection.rowdot`), one column a call."""
    from vllm_worker.worker.projection import rowdot as worker_rowdot

    return torch.stack([worker_rowdot(x, w[j].expand_as(x)) for j in range(w.shape[0])], dim=1)


def mv_cols(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return torch.stack([torch.mv(x, w[j]) for j in range(w.shape[0])], dim=1)


def mm_blocks(x: torch.Tensor, w: torch.Tensor, b: int = 64) -> torch.Tensor:
    """torch.mm always on exactly `b` rows (the last block padded with zeros)."""
    m = x.shape[0]
    pad = (-m) % b
    xp = torch.cat([x, x.new_zeros(pad, x.shape[1])]) if pad else x
    return torch.cat([torch.mm(xp[i : i + b], w.T) for i in range(0, m + pad, b)])[:m]


CANDIDATES: dict[str, Fn] = {
    "mm": mm,
    "mm_fp64": mm_fp64,
    "mulsum_chunked": mulsum,
    "mulsum_whole": mulsum_whole,
    "vecdot": vecdot,
    "bmm_rows": bmm_rows,
    "mv_cols": mv_cols,
    "mm_blocks64": mm_blocks,
    "bmm_one": bmm_one,
    "project": project,
    "rowdot": rowdot,
}
MODE_CANDIDATES = ("bmm_one", "project", "rowdot")  # checked by default with --vllm-batch-invariant


def invariance(fn: Fn, device: str, quick: bool) -> dict:
    """Rows of `fn` on row subsets (prefixes of many lengths, windows at offsets, rows alone) against the
    same rows of `fn` on all rows: how many rows differ (bitwise) and by how much at most."""
    ds = [64, 128, 200, 576, 1024, 4096] if not quick else [64, 576, 4096]
    ns = [1, 2, 3, 8, 16] if not quick else [1, 8]
    ms = [1, 2, 3, 4, 7, 8, 15, 16, 17, 31, 33, 63, 64, 65, 127, 129, 255, 256, 257, 511, 1000]
    big = 2048
    g = torch.Generator().manual_seed(0)
    checked = differ = 0
    worst = err = 0.0
    shapes_differ: list[str] = []
    for d in ds:
        for n in ns:
            for cast in ("float32", "bf16"):
                x = torch.randn(big, d, generator=g)
                if cast == "bf16":
                    x = x.bfloat16().float()
                w = torch.randn(n, d, generator=g) / d**0.5
                x, w = x.to(device), w.to(device)
                full = fn(x, w)
                ref = x.double().cpu() @ w.double().cpu().T  # (on the host: out of the mode's reach)
                err = max(err, float((full.double().cpu() - ref).abs().max() / ref.abs().max()))
                bad = 0
                subsets = [(0, m) for m in ms] + [(j, m) for j in (1, 5, 300) for m in (1, 7, 255)]
                subsets += [(i, 1) for i in (0, 17, 1023, big - 1)]
                for j, m in subsets:
                    got = fn(x[j : j + m], w)
                    ref = full[j : j + m]
                    eq = (got == ref).all(dim=1)
                    checked += m
                    k = int((~eq).sum())
                    if k:
                        bad += k
                        worst = max(worst, float((got - ref).abs().max()))
                differ += bad
                if bad:
                    shapes_differ.append(f"d{d}n{n}{cast[0]}")
    return {
        "rows_checked": checked,
        "rows_differ": differ,
        "max_abs_diff": worst,
        "shapes_differ": shapes_differ[:12],
        "max_rel_err_vs_fp64": err,
    }


def sites_invariance(device: str, rowwise: bool | None = True) -> dict:
    """The CPU projection (`rowwise=None`: the worker's default for the device) over several sites at once
    ((sites, m, d) x (sites, n, d)) against each site alone and each row alone."""
    from vllm_worker.worker.projection import project

    g = torch.Generator().manual_seed(1)
    s, d, n, big = 4, 576, 2, 700
    x = torch.randn(s, big, d, generator=g).bfloat16().float().to(device)
    w = (torch.randn(s, n, d, generator=g) / d**0.5).to(device)
    full = torch.empty(s, big, n, device=device)
    project(x, w, full, rowwise=rowwise)
    differ = 0
    for k in range(s):
        for j, m in ((0, big), (0, 1), (3, 7), (100, 255), (699, 1)):
            out = torch.empty(m, n, device=device)
            project(x[k, j : j + m], w[k], out, rowwise=rowwise)
            differ += int((out != full[k, j : j + m]).any(dim=1).sum())
    return {"sites": s, "rows_differ": differ}


def long_row(fn: Fn, device: str) -> dict:
    """One row and one column with d past torch's parallel grain (32768): a sum with a single output is then
    split across threads, in another order than the same row among others."""
    g = torch.Generator().manual_seed(3)
    differ = 0
    for d in (32768, 40000, 65536, 100000):
        x, w = torch.randn(9, d, generator=g).to(device), torch.randn(1, d, generator=g).to(device)
        differ += int(not torch.equal(fn(x[:1], w), fn(x, w)[:1]))
    return {"check": "long rows (d 32768..100000, one row alone)", "shapes_differ": differ}


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def cost(fn: Fn, rows: int, d: int, device: str, reps: int) -> dict:
    """ms for the projections of one step: 4 sites, 2 probes each, `rows` rows a site (bf16 rows cast)."""
    g = torch.Generator().manual_seed(2)
    xs = [torch.randn(rows, d, generator=g).bfloat16().to(device) for _ in range(4)]
    ws = [(torch.randn(2, d, generator=g) / d**0.5).to(device) for _ in range(4)]
    times = []
    for _ in range(reps + 1):
        _sync(device)
        t0 = time.perf_counter()
        for x, w in zip(xs, ws):
            fn(x.float(), w)
        _sync(device)
        times.append(time.perf_counter() - t0)
    times = sorted(times[1:])
    return {
        "rows": rows,
        "d": d,
        "best_ms": round(1e3 * times[0], 3),
        "median_ms": round(1e3 * times[len(times) // 2], 3),
    }


def _vllm_mode() -> dict:
    """vLLM's batch-invariant mode on in this process (before any matmul), and the worker told so as its
    `WorkerProbes` tells it (`projection.use_batch_invariant`)."""
    import vllm

    from vllm_worker import compat
    from vllm_worker.worker import projection

    compat.enable_batch_invariant_mode()
    on = compat.batch_invariant_mode()
    projection.use_batch_invariant(on)
    return {
        "vllm": vllm.__version__,
        "vllm_batch_invariant": on,
        "mode_module": compat.batch_invariance.bi_module().__name__,
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--only", default="", help="comma list of candidates")
    ap.add_argument("--no-cost", action="store_true")
    ap.add_argument("--no-check", action="store_true")
    ap.add_argument("--rounds", type=int, default=1, help="cost rounds, candidates interleaved")
    ap.add_argument("--vllm-batch-invariant", action="store_true", help="vLLM's batch-invariant mode on first")
    a = ap.parse_args()
    if a.vllm_batch_invariant and a.device != "cuda":
        ap.error(
            "--vllm-batch-invariant: GPU only (the mode's kernels are Triton; on CPU they replace ops they cannot run)"
        )
    mode = _vllm_mode() if a.vllm_batch_invariant else None
    if a.threads:
        torch.set_num_threads(a.threads)
    names = a.only.split(",") if a.only else [n for n in CANDIDATES if n not in MODE_CANDIDATES]
    if mode and not a.only:
        names = ["mm", "mm_fp64", "mulsum_chunked", "vecdot", *MODE_CANDIDATES]
    info = {"torch": torch.__version__, "device": a.device, "threads": torch.get_num_threads(), **(mode or {})}
    if a.device == "cuda":
        info["gpu"] = torch.cuda.get_device_name()
    print(json.dumps(info), flush=True)
    if not a.no_check:
        for name in names:
            print(json.dumps({"candidate": name, **invariance(CANDIDATES[name], a.device, a.quick)}), flush=True)
        print(json.dumps({"candidate": "mulsum_chunked", "check": "sites", **sites_invariance(a.device)}), flush=True)
        if mode:
            print(
                json.dumps({"candidate": "project", "check": "sites", **sites_invariance(a.device, None)}), flush=True
            )
        for name in ("mulsum_chunked", "mulsum_whole", "vecdot", *(("project", "rowdot") if mode else ())):
            print(json.dumps({"candidate": name, **long_row(CANDIDATES[name], a.device)}), flush=True)
    if a.no_cost:
        return
    shapes = ((256, 128, 200), (256, 576, 100), (256, 4096, 20), (7680, 576, 5), (7680, 4096, 3))
    for rnd in range(a.rounds):
        for rows, d, reps in shapes:
            for name in names:
                if name in ("mm_fp64", "mv_cols", "mm_blocks64") and rows > 1000 and a.device == "cpu":
                    continue
                r = cost(CANDIDATES[name], rows, d, a.device, reps)
                print(json.dumps({"candidate": name, "round": rnd, "cost": "4 sites x 2 probes", **r}), flush=True)


if __name__ == "__main__":
    main()
