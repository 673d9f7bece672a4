"""Is the CPU engines' torch twin of the tap kernel (`interventions.apply_entries`) bit-identical to another
commit's? Random entry tables (float32 / bfloat16, chains of 1-4 steps of every op, whole rows of 3 pieces
and single pieces, a residual or not, gated entries, chains entered mid-way) through both, `torch.equal`.

    PYTHONPATH=. .venv/bin/python bench/probes/twin_bitwise.py COMMIT [--single]

`--single`: single pieces only (a commit from before whole rows, whose twin has no `pieces` argument).
"""

from __future__ import annotations

import argparse
import importlib.util
import random
import subprocess
import tempfile

import torch

from vllm_worker.worker import interventions as new
from vllm_worker.worker.graph_entries import SteeringEntries


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("commit")
    ap.add_argument("--single", action="store_true")
    ap.add_argument("--trials", type=int, default=200)
    args = ap.parse_args()
    src = subprocess.run(
        ["git", "show", f"{args.commit}:vllm_worker/worker/interventions.py"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as f:
        f.write(src)
    spec = importlib.util.spec_from_file_location("interventions_then", f.name)
    assert spec is not None and spec.loader is not None
    old = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(old)
    random.seed(0)
    torch.manual_seed(0)
    n = 0
    for dtype in (torch.float32, torch.bfloat16):
        for _ in range(args.trials):
            d, pieces = random.choice([8, 32]), 1 if args.single else random.choice([1, 1, 3])
            t = SteeringEntries(64, d, dtype, torch.device("cpu"))
            k = random.randint(1, 4)
            ops = [random.choice([0, 1, 2, 3]) for _ in range(k)]
            m = k * pieces
            a, b = torch.randn(m, d), torch.randn(m, d) * (torch.rand(m, 1) > 0.5)
            if pieces == 1:
                codes, nxt = ops, [j + 1 if j + 1 < k else -1 for j in range(k)]
            else:
                codes = [o | new.WHOLE | (new.TAIL if j else 0) for o in ops for j in range(pieces)]
                nxt = [(i + pieces if i % pieces == 0 and i // pieces + 1 < k else -1) for i in range(m)]
            ids = t.add(a, b, ops=codes, lo=[-0.3] * m, hi=[0.2] * m, nxt=nxt)
            assert ids is not None
            if random.random() < 0.3:
                t.add(a[:1], b[:1], gated=True)
            t.flush()
            w = d * pieces - (random.choice([0, 3]) if pieces > 1 else 0)
            rows_n = random.randint(1, 9)
            h = (torch.randn(rows_n, w) * 2).to(dtype)
            r = None if pieces > 1 or random.random() < 0.5 else torch.randn(rows_n, w).to(dtype)
            rows = torch.tensor(sorted(random.sample(range(rows_n), random.randint(1, rows_n))))
            heads = [ids[j * pieces] for j in range(k)]
            ent = torch.tensor([random.choice(heads) for _ in rows], dtype=torch.int32)
            h1, h2 = h.clone(), h.clone()
            if pieces == 1:
                old.apply_entries(h1, r, rows, ent, t)
            else:
                old.apply_entries(h1, r, rows, ent, t, pieces)
            new.apply_entries(h2, r, rows, ent, t, pieces)
            assert torch.equal(h1, h2), (dtype, ops, pieces)
            n += 1
    print("BITWISE_EQUAL", n)


if __name__ == "__main__":
    main()
