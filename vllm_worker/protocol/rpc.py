"""The workers' RPC contract: every `lens_*` method the frontend calls by name through vLLM's
`collective_rpc`, with its typed signature, stated once (as vLLM's `plugins/*/interface.py` states a
plugin's contract). Callers name a method by its constant here, never by a string of their own;
`worker.extension.LensWorkerExtension` implements exactly this protocol (tests/unit/test_rpc_contract.py).

Arguments and answers cross processes (msgpack or pickle, per vLLM's executor): plain lists, dicts,
strings, numbers and bytes only."""

from __future__ import annotations

from typing import Protocol


class LensWorkerRpc(Protocol):
    """What each worker answers; `collective_rpc` returns one answer per worker, in rank order."""

    def lens_fetch(self, wanted: list, shm_host: str | None = None, released: list | None = None) -> dict:
        """Finished requests' results: `wanted` = [(key, {choice: positions})]; `shm_host`: the caller's
        machine (results then come back in shared memory); `released`: result memory given back."""
        ...

    def lens_release(self, released: list) -> int:
        """Result memory the frontend let go of, back to the pool; how many regions were freed."""
        ...

    def lens_drop(self, keys: list) -> int:
        """Aborted requests: drop their stored results; how many were stored."""
        ...

    def lens_host_id(self) -> str | None:
        """This worker's machine (None: no shared memory with anyone)."""
        ...

    def lens_status(self) -> dict:
        """Diagnostics: stored requests, points, ranks, the result pool, timings."""
        ...

    def lens_runner(self) -> str:
        """The model runner class vLLM built for this worker."""
        ...

    def lens_forward_clock(self) -> list:
        """(start, end, thread CPU at start) of the latest forward passes (benchmarks)."""
        ...

    def lens_replan_clock(self) -> list:
        """(start, seconds, batch requests) of the latest re-plans (benchmarks)."""
        ...

    def lens_rusage(self) -> dict:
        """Cumulative CPU use of this worker (benchmarks)."""
        ...

    def lens_register_hooks(self, hooks: list) -> int:
        """Append persistent hooks (`HookSpec.rpc()` tuples); how many are registered now."""
        ...

    def lens_collect_hook_results(self) -> bytes | None:
        """What persistent hooks saved, pickled (None: nothing)."""
        ...

    def lens_pop_persistent_errors(self, request_ids: list) -> dict:
        """Persistent-hook failures of these requests, removed as they are read."""
        ...

    def lens_clear_hook_results(self) -> None: ...

    def lens_clear_hooks(self) -> None: ...

    def lens_load_sae(self, name: str, path: str, uid: str) -> dict:
        """Load (or replace) SAE `name` from `path`; `uid` tells the frontend's load from a stale one."""
        ...

    def lens_load_probe(self, name: str, uid: str, probe: dict) -> dict:
        """Load (or replace) probe `name` (`frontend.probes.LoadedProbe.wire`); {"name", "local_layers"}: the
        probe's layers this worker holds."""
        ...

    def lens_delete_probe(self, name: str) -> bool:
        """Forget probe `name` (requests admitted with it keep their copy); whether it was loaded."""
        ...

    def lens_probe_progress(self, wanted: list) -> list:
        """Running requests' probe scores so far: `wanted` = [(key, child, first position)]; [key, child,
        {probe: {"positions", "scores"}}] for those this worker scores (streaming: `server/streaming`)."""
        ...

    def lens_prefetch(self, names: list, report: bool = False) -> list | dict:
        """Keep these parameters on the host for hooks to read; the names now prefetched. `report`:
        {"prefetched": names, "error": None} or {"error": Failure} (the HTTP route tells the caller's failure
        from ours by its kind)."""
        ...

    def lens_clear_prefetched(self) -> None: ...

    def lens_vectors(self, put: list, drop: list) -> int:
        """Named vectors' rows to hold (`[vid, rows, unit rows | None, shape]`: requests name them by
        reference) and registrations to forget; how many are held now."""
        ...


FETCH = "lens_fetch"
RELEASE = "lens_release"
DROP = "lens_drop"
HOST_ID = "lens_host_id"
STATUS = "lens_status"
RUNNER = "lens_runner"
FORWARD_CLOCK = "lens_forward_clock"
REPLAN_CLOCK = "lens_replan_clock"
RUSAGE = "lens_rusage"
REGISTER_HOOKS = "lens_register_hooks"
COLLECT_HOOK_RESULTS = "lens_collect_hook_results"
POP_PERSISTENT_ERRORS = "lens_pop_persistent_errors"
CLEAR_HOOK_RESULTS = "lens_clear_hook_results"
CLEAR_HOOKS = "lens_clear_hooks"
LOAD_SAE = "lens_load_sae"
LOAD_PROBE = "lens_load_probe"
DELETE_PROBE = "lens_delete_probe"
PROBE_PROGRESS = "lens_probe_progress"
PREFETCH = "lens_prefetch"
CLEAR_PREFETCHED = "lens_clear_prefetched"
VECTORS = "lens_vectors"

# every method of the contract (the constants above name exactly these: the contract test checks both)
METHODS: frozenset[str] = frozenset(n for n in vars(LensWorkerRpc) if n.startswith("lens_"))
