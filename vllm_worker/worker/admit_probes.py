"""Admission of a request that asks for probe scores and nothing else — no capture, steering, hooks, SAEs or
actions: a monitored batch's usual request. What it needs is its result store and its probes' uses; the
uses are worked out once per list of probes (names and hashes) while no probe is loaded or deleted in this
worker, and shared by the requests naming that list (they are only read: `plan`, `probes`,
`probe_payloads`). The general path (`Admission._new`) decodes the payload, derives its steering, checks
its sites and looks each probe up again for every request; for such a request it ends in the same state.
Anything else — another field, a malformed entry, a probe not loaded here, a site this worker does not tap,
persistent hooks to attach — is left to the general path, which says why it fails."""

from __future__ import annotations

from typing import Any

from vllm_worker import compat
from vllm_worker.worker.plan import RequestState
from vllm_worker.worker.probes import WorkerProbes
from vllm_worker.worker.request_results import RequestResults

FIELDS = frozenset({"v", "key", "capture", "probes", "n", "fetch", "shm", "release"})  # what such a payload holds
KEPT = 16  # lists of probes remembered (then the memo starts over)
# the graph-safe entries of a request that steers nothing: one object for all of them, so the plan's parts
# memo (`plan._entry_parts`, by object) finds them at once; never written (a request's own entries are new
# dicts: `Admission._grouped`)
NO_ENTRIES: dict = {}
COUNTS = {"admitted": 0}  # requests admitted here, by every worker of this process (tests, benchmarks)


class ProbeOnly:
    """The memo of probe uses by a payload's list of probes (`uses`)."""

    def __init__(self, probes: Any, local: frozenset) -> None:
        self.probes = probes if isinstance(probes, WorkerProbes) else None
        self.local = local
        self._memo: dict[tuple, tuple[list, tuple]] = {}  # -> (uses, `RequestState.probe_sites`)
        self._version = -1  # `WorkerProbes.version` the memo was made under

    def covers(self, payload: Any) -> bool:
        return (
            self.probes is not None
            and type(payload) is dict
            and payload.keys() <= FIELDS
            and payload.get("v") == 1
            and not payload.get("capture")
            and bool(payload.get("probes"))
        )

    def uses(self, entries: Any) -> tuple[list, tuple] | None:
        """The `DeviceProbe`s of `entries` held here (shared, never written) and the plan's sites of them
        (`plan._probe_sites`, worked out once for all the requests naming them), or None: not covered."""
        probes = self.probes
        assert probes is not None
        if probes.version != self._version:
            self._memo.clear()
            self._version = probes.version
        try:
            key = tuple((u["probe"], u["uid"]) for u in entries)
        except (TypeError, KeyError):
            return None
        got = self._memo.get(key)
        if got is None:
            try:
                uses = probes.uses(entries)
            except (ValueError, TypeError, KeyError):  # (the general path fails the request, saying why)
                return None
            sites = tuple(dict.fromkeys(s for u in uses for s in u.weights))
            if not self.local.issuperset(sites):
                return None  # (a site this worker does not tap: the general path fails the request)
            if len(self._memo) >= KEPT:
                self._memo.clear()
            got = self._memo[key] = (uses, (uses, self.local, sites))
        return got


def admit(memo: ProbeOnly, store: Any, graph_path: bool, req_id: str, payload: dict) -> RequestState | None:
    """The state of a probe-only request (`ProbeOnly.covers`), its results registered in `store`; None: left
    to the general path. `graph_path`: the worker has the graph-safe taps (the request then has no entries)."""
    got = memo.uses(payload["probes"])
    if got is None:
        return None
    n = int(payload.get("n", 1))
    child = compat.child_index(req_id, n)
    store.release(payload.get("release"))
    results = RequestResults([])
    store.add(payload["key"], child, results)
    COUNTS["admitted"] += 1
    entries = NO_ENTRIES if graph_path else None
    return RequestState([], {}, child, [], [], results, {}, entries, [], probes=got[0], probe_sites=got[1])
