"""Run in a worker (`llm.collective_rpc(worker_probe_counts)`): the rows it scored for probes so far and the
projections it ran (importable by the worker processes of the parallel tests)."""

from __future__ import annotations


def worker_probe_counts(worker) -> dict[str, int]:
    from vllm_worker.worker.probes import PROBE_COUNTS

    return dict(PROBE_COUNTS)
