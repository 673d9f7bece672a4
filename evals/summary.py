"""Print the headline of a deception-probe eval log: metrics, score means per label, probe file, log path.

python evals/summary.py LOG_DIR_OR_FILE      (newest .eval in a directory)
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

from inspect_ai.log import read_eval_log


def main(target: str) -> None:
    p = Path(target)
    if p.is_dir():
        logs = sorted(p.glob("*.eval"), key=lambda f: f.stat().st_mtime)
        if not logs:
            sys.exit(f"no .eval logs in {p}")
        p = logs[-1]
    log = read_eval_log(str(p))
    if log.status != "success":
        sys.exit(f"eval {log.status}: {log.error.message if log.error else ''} ({p})")
    print(f"model: {log.eval.model}   samples: {len(log.samples or [])}")
    for score in log.results.scores if log.results else []:
        for name, m in score.metrics.items():
            print(f"{name:>16}: {m.value:.3f}")
    by_label: dict[str, list[float]] = {}
    probe = provenance = None
    for s in log.samples or []:
        sc = next(iter(s.scores.values()))
        by_label.setdefault(sc.metadata["label"], []).append(float(sc.value))
        probe = probe or sc.metadata.get("probe")
        provenance = provenance or sc.metadata.get("provenance")
    for label, vals in sorted(by_label.items()):
        print(f"{'mean score ' + label:>24}: {statistics.mean(vals):+.2f} (n={len(vals)})")
    print(f"probe: {probe}")
    if provenance:  # what the scores depend on besides the probe
        print("served: " + ", ".join(f"{k}={v}" for k, v in provenance.items()))
    print(f"log:   {p}")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "logs")
