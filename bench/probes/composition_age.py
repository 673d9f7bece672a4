"""The host cost of opening a batch composition (its first filing: every live request's probe spans made,
`StagedProbes._open`) as the requests in it grow old: the requests' results are kept across compositions, as
in a long generation whose batch changes every few steps, so each (request, probe) slot's spans and index
grow by one per composition. A cost that grows with a request's age (not just its batch) shows here, not in
`filing_micro.py` (one composition) nor tail4's composition-open figure (slots made afresh each time).
Prints one JSON line: the composition-open thread time at the 1st, 1/4, 1/2 and last composition.

    python bench/probes/composition_age.py [requests] [probes] [compositions]   (default 64 8 600)"""

import json
import sys
import time

import numpy as np
import torch

sys.path.insert(0, "bench/probes")
from filing_micro import D, empty_plan, probe_requests  # noqa: E402

from vllm_worker.worker import probes  # noqa: E402


def main(n_req: int, n_probes: int, n_comp: int) -> dict:
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(1)
    reqs, sites = probe_requests(n_req, n_probes, g)
    col = {s: i for i, s in enumerate(sites)}
    items = [(r, i, i + 1) for i, r in enumerate(reqs)]
    pos = np.full(n_req, 30, dtype=np.int64)
    marks = {1, n_comp // 4, n_comp // 2, n_comp}
    stage, out, total = None, {}, 0.0
    for k in range(1, n_comp + 1):
        gp = empty_plan(n_req)
        probes.stage_probes(
            gp, {s: list(items) for s in sites}, col, lambda it: np.concatenate([np.arange(a, b) for _, a, b in it])
        )
        gp.total = len(gp.cap_rows)
        if stage is None:
            stage = torch.randn(gp.total, D, generator=g)
        t = time.thread_time()
        probes.scores_from_stage(gp, stage, 0, pos)
        dt = time.thread_time() - t
        total += dt
        if k in marks:
            out[k] = round(dt * 1e3, 3)
    return {"requests": n_req, "probes": n_probes, "open_ms_at_composition": out, "sum_s": round(total, 2)}


if __name__ == "__main__":
    a = [int(x) for x in sys.argv[1:4]]
    print(json.dumps(main(*(a + [64, 8, 600][len(a) :]))))
