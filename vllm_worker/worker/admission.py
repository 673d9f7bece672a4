"""Admission: what a request asked for (its payload from the frontend) turned into the worker's per-request
state — steering on the device (moved for all of a step's new requests at once, `flush`), hooks loaded, a
result store, persistent hooks attached, steering entries in the graph-safe table — once, when the request
first shows up in a batch.

A failure of our own code here fails that request only (it then runs plain and its results say why).
"""

from __future__ import annotations

import functools
import hashlib
import types
import weakref
from typing import Any, Callable

import torch

from vllm_worker import compat, counters
from vllm_worker.api.hooks import HookContext
from vllm_worker.protocol import errors
from vllm_worker.protocol.points import describe, site_layer, site_point
from vllm_worker.protocol.recent import recall, remember
from vllm_worker.protocol.spec import RequestSpec, decode
from vllm_worker.worker import admit_probes, admit_templates, faults, graph, graph_entries, seams, vector_refs
from vllm_worker.worker.actions import ActionRefused, OutcomeLater
from vllm_worker.worker.content_digests import RecentDigests
from vllm_worker.worker.device_copy import to_device
from vllm_worker.worker.persistent_hooks import PersistentHooks
from vllm_worker.worker.plan import DeviceSteer, HookRun, RequestState, hook_at, split_steers
from vllm_worker.worker.request_results import RequestResults
from vllm_worker.worker.store import CaptureStore

HOST_VECTORS_KEPT = 8  # host copies of recent steering vectors in the model's dtype, by content ...
HOST_VECTOR_MAX_BYTES = 16 << 20  # ... each at most this large


class ToDevice:
    """Host tensors bound for the device, moved together at `flush`: one copy per dtype (`device_copy.to_device`);
    each tensor's device view goes to its setter."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._items: list[tuple[torch.Tensor, Callable[[torch.Tensor], Any]]] = []

    def add(self, t: torch.Tensor, put: Callable[[torch.Tensor], Any]) -> None:
        self._items.append((t, put))

    def flush(self) -> None:
        """The queue is emptied only once every tensor is on the device and handed over: after a failure the
        caller fails the requests these tensors belong to (`Admission.abandon`), never a silent half copy."""
        by_dtype: dict[torch.dtype, list] = {}
        for t, put in self._items:
            by_dtype.setdefault(t.dtype, []).append((t, put))
        for group in by_dtype.values():
            dev = to_device(torch.cat([t.reshape(-1) for t, _ in group]), self.device)
            o = 0
            for t, put in group:
                put(dev[o : o + t.numel()].view(t.shape))
                o += t.numel()
        self._items = []

    def clear(self) -> None:
        self._items = []


class Admission:
    def __init__(
        self,
        runner: Any,
        device: torch.device,
        dtype: torch.dtype,
        d_model: int,
        local: frozenset,
        local_layers: frozenset,
        missing: dict[str, str],
        capturing_rank: bool,
        shm_host: str | None,
        store: CaptureStore,
        graph_taps: Any,
        persistent: PersistentHooks,
        ctx: Callable[[dict, str], HookContext],
        saes: Any = None,
        actions: Any = None,
        probes: Any = None,
    ) -> None:
        self.runner, self.device, self.dtype, self.d_model = runner, device, dtype, d_model
        self.local, self.capturing_rank, self.shm_host = local, capturing_rank, shm_host  # local: sites
        self.local_layers, self.missing = local_layers, missing
        self.store, self.graph, self.persistent, self.ctx = store, graph_taps, persistent, ctx
        self.saes = saes  # `saes.WorkerSaes`
        self.actions = actions  # `actions.ActionTable`
        self.probes = probes  # `probes.WorkerProbes`
        self.esize = torch.empty((), dtype=dtype).element_size()
        self._moves = ToDevice(device)
        self._pending: list[RequestState] = []  # admitted since the last flush, with steering / action slots to move
        # steering vectors on the device by content (`DeviceSteer.digest`): requests sending the same vector
        # share one device copy, held while one of them lives; and those queued for the next flush
        self._on_device: weakref.WeakValueDictionary[bytes, torch.Tensor] = weakref.WeakValueDictionary()
        self._queued: dict[bytes, list[Callable[[torch.Tensor], Any]]] = {}
        self._converted: dict[bytes, torch.Tensor] = {}  # content -> host copy in the model's dtype (LRU)
        self._digests = RecentDigests()  # contents of recent payloads' vectors
        self._since = 0  # requests admitted since the last flush (`counters.STEP_TIMINGS["admit_steps"]`)
        self.templates = admit_templates.Templates()  # recent payloads' derived admission (`admit_templates`)
        self.probe_only = admit_probes.ProbeOnly(probes, local)  # requests asking for probe scores alone

    def flush(self) -> None:
        """After a step's admissions, before it is planned: their steering reaches the device, one copy per
        dtype for all of them, and so do the graph-safe table's new entries (no device work or stream sync
        per request; what admission still costs is host Python: docs/decisions.md). On failure the caller fails `abandon()`'s
        requests (inside its per-request failure handling: never vLLM's step)."""
        if self._since:  # (counted first: a failed flush still admitted them)
            counters.STEP_TIMINGS["admit_steps"] += 1
            counters.STEP_TIMINGS["admitted"] += self._since
            self._since = 0
        faults.check("flush")
        self._moves.flush()
        if self.graph is not None:
            self.graph.flush_entries()
        if self.actions is not None:
            self.actions.flush()  # the action slots taken, for all of the step's admissions at once
        self._pending = []

    def abandon(self) -> list[RequestState]:
        """After a failed `flush`: the requests whose steering it was moving (to be failed), queue emptied."""
        failed, self._pending = self._pending, []
        self._moves.clear()
        self._queued = {}
        if self.graph is not None:
            self.graph.drop_new_entries()
        return failed

    def admit(self, req_id: str, payload: Any) -> RequestState:
        self._since += 1
        try:
            faults.check("admission")
            return self._new(req_id, payload)
        except ActionRefused as e:  # the caller's actions cannot run here (placement, table full): 400
            self.actions.drop(req_id)
            return self._failed(req_id, payload, e, errors.failure(e.kind, str(e), "admission"))
        except Exception as e:  # noqa: BLE001 - our bug fails this request, never the engine
            if self.actions is not None:
                self.actions.drop(req_id)
            return self._failed(req_id, payload, e)

    def _failed(self, req_id: str, payload: Any, e: Exception, why: errors.Failure | None = None) -> RequestState:
        store = RequestResults([])
        store.error = why or errors.internal("admission", e)
        n = int(payload.get("n", 1)) if isinstance(payload, dict) else 1
        child = compat.child_index(req_id, n) if n > 1 else 0
        key = payload.get("key") if isinstance(payload, dict) else None
        if key is not None:
            self.store.add(key, child, store)
        return RequestState([], {}, child, [], [], store)

    def _new(self, req_id: str, payload: Any) -> RequestState:
        import cloudpickle

        payload = vector_refs.HELD.resolve(payload)  # (named vectors sent by reference: their bytes)
        if not self.persistent and self.probe_only.covers(payload):
            quick = admit_probes.admit(self.probe_only, self.store, self.graph is not None, req_id, payload)
            if quick is not None:
                return quick
        tmpl = None if payload is None else self._template(payload)  # (equal content: decoded once)
        spec: RequestSpec | None
        if tmpl is not None:
            capture = list(payload.get("capture") or ())
            spec = RequestSpec(payload["key"], capture, steers=list(tmpl.steers), actions=list(tmpl.actions))
        else:
            spec = None if payload is None else decode(payload, view=True)  # (vectors: `_host_vectors` copies)
        n = 1 if payload is None else int(payload.get("n", 1))
        child = compat.child_index(req_id, n)
        external = compat.external_request_id(req_id, n)
        steers = []  # on the host until `flush` (the graph path's entries are made there: `request_entries`)
        hooks: list[HookRun] = []
        store = None
        sae_uses: list = []
        act_uses: list = []
        probe_uses: list = []
        if spec is not None:
            if spec.sae:
                sae_uses = self.saes.uses(spec.sae)
            if spec.probes:
                probe_uses = self.probes.uses(spec.probes)
            if spec.actions:
                act_uses = self._action_uses(req_id, spec, tmpl)
                if not act_uses:  # (no action at this stage's layers: nothing held here, nothing to give back)
                    self.actions.drop(req_id)
            derived = tmpl if tmpl is not None else self._derive(spec, payload)
            for i, s in enumerate(spec.steers):
                content, lut, keep = derived.contents[i], derived.luts[i], derived.keeps[i]
                steers.append(
                    DeviceSteer(
                        dict(derived.layers[i]),
                        derived.host[i],
                        lut,
                        s.scale,
                        s.norm_match,
                        None if s.positions is None else list(s.positions),
                        s.mul,
                        self._gate(s.gate, act_uses, s.layers),
                        s.op,
                        s.lo,
                        s.hi,
                        s.span,
                        keep,
                        content,
                    )
                )
            # result memory the frontend let go of: free before this request's result is announced
            self.store.release(payload.get("release"))
            if spec.wants_results or payload.get("fetch"):
                store = RequestResults(spec.capture)
                self._announce_result(req_id, payload, spec.capture, store)
                self.store.add(spec.key, child, store)
            for i, h in enumerate(spec.hooks):
                assert store is not None  # a request with hooks wants results (`spec.wants_results`)
                saved: dict = {}
                store.saved.append(saved)
                try:
                    fn = cloudpickle.loads(h.fn)
                except Exception as e:  # fail this request, never the engine (the frontend checks first)
                    store.fail(
                        errors.failure(
                            "hook",
                            f"hook {i}: cannot be loaded in the worker ({type(e).__name__}: {e})",
                            "loading hooks",
                        )
                    )
                    continue
                at = hook_at(h.layers, h.point, self.local_layers)
                # requests whose batched hooks are the same function (same bytes), point and layers share a call
                key = (
                    (hashlib.blake2b(h.fn, digest_size=16).digest(), h.point, tuple(h.layers), h.read_only)
                    if h.batched
                    else None
                )
                hooks.append(HookRun(fn, at, h.point, self.ctx(saved, external), i, False, h.batched, key, h.read_only))
            if tmpl is None or not (self.local.issuperset(tmpl.sites) and self.local.issuperset(spec.capture)):
                self._check_sites(spec, hooks, store, probe_uses)
        if self.persistent:
            if store is None:
                store = RequestResults([])
            self.persistent.attach(hooks, store, external, self.ctx)
        simple: dict[int, torch.Tensor]
        if tmpl is not None and tmpl.all_per_request:  # (what `split_steers` gives its content: known)
            per_request, simple = steers, {}
        else:
            per_request, simple = split_steers(steers)
            if tmpl is not None and tmpl.all_per_request is None:
                tmpl.all_per_request = not simple and len(per_request) == len(steers)
        capture = [] if spec is None else spec.capture
        entries = None
        entry_ids: list[int] = []
        # hooks: on the graph path too when their steps can run them at seams (`plan.RequestState.seam_ok`)
        graph_ok = not hooks or seams.enabled()
        if self.graph is not None and graph_ok and not any(st.mul for st in steers):  # multiplications: Python path
            got = self._entries(steers, act_uses, tmpl) if steers else ({}, [])
            if got is not None:
                entries, entry_ids = got
        try:
            for st in per_request:  # what the Python path steers with, to the device with the step's others
                self._move_vectors(st)
                if st.lut is not None:
                    self._moves.add(st.lut, functools.partial(setattr, st, "lut"))
                if st.keep is not None:
                    self._moves.add(st.keep, functools.partial(setattr, st, "keep"))
            for layer, v in simple.items():
                self._moves.add(v, functools.partial(simple.__setitem__, layer))
            state = RequestState(
                capture,
                {l: i for i, l in enumerate(capture)},
                child,
                per_request,
                hooks,
                store,
                simple,
                entries,
                entry_ids,
                sae=sae_uses,
                acts=act_uses,
                probes=probe_uses,
            )
            if act_uses and store is not None and self.capturing_rank:  # read at fetch unless it left first
                store.actions = OutcomeLater(self.actions, act_uses)
            if per_request or simple or entry_ids or act_uses:
                self._pending.append(state)
            return state
        except BaseException:  # the request fails (`admit`): its uses of shared entries go back, none left counted
            if entry_ids:
                self.graph.free_entries(entry_ids)
            raise

    def _template(self, payload: Any) -> admit_templates.Template | None:
        """The template of a payload whose steering and actions equal a recent one's byte for byte (made
        and filled now if none is remembered); None: a payload templates do not cover (`admit_templates`)."""
        if self.templates.kept <= 0:
            return None
        got = admit_templates.split(payload)
        if got is None:
            return None
        mark = admit_templates.mark(*got)
        blobs = got[1]
        tmpl = self.templates.find(mark, blobs)
        if tmpl is None and not self.templates.seen(mark):  # (a first sighting: admitted as before)
            return None
        if tmpl is None:  # (a failure here fails this request: nothing is remembered)
            tmpl = admit_templates.make(payload, blobs)
            spec = decode(tmpl.payload, view=True)
            tmpl.steers, tmpl.actions = spec.steers, spec.actions
            d = self._derive(spec, tmpl.payload)
            tmpl.contents, tmpl.host, tmpl.luts, tmpl.keeps, tmpl.layers = d.contents, d.host, d.luts, d.keeps, d.layers
            tmpl.sites = frozenset(l for s in spec.steers for l in s.layers)
            self.templates.keep(mark, tmpl)
        return tmpl

    def _derive(self, spec: Any, payload: dict) -> Any:
        """Per steer, what admission makes of its content: digest, vectors in the model's dtype, position
        table, kept columns, site -> row (a template keeps them for requests of equal content)."""
        out = types.SimpleNamespace(contents=[], host=[], luts=[], keeps=[], layers=[])
        for s, sent in zip(spec.steers, payload.get("steer") or ()):
            # (entries shared by content; the bytes as sent: `content_digests`)
            content = None if self.graph is None else self._digests.of(sent["vec"].get("data"), s.vectors)
            lut = keep = None
            if s.cols is not None:
                keep = torch.ones(s.vectors.shape[-1], dtype=self.dtype)
                keep[torch.tensor(s.cols, dtype=torch.long)] = 0
            if s.positions is not None:
                lut = torch.full((max(s.positions) + 1,), -1, dtype=torch.long)
                lut[torch.tensor(s.positions)] = torch.arange(len(s.positions))
            out.contents.append(content)
            out.host.append(self._host_vectors(content, s.vectors))
            out.luts.append(lut)
            out.keeps.append(keep)
            out.layers.append({l: i for i, l in enumerate(s.layers)})
        return out

    def _host_vectors(self, key: bytes | None, t: torch.Tensor) -> torch.Tensor:
        """`t` in the model's dtype, converted once for the last few contents (`HOST_VECTORS_KEPT`): a batch
        of requests sending one vector converts it once. Always a copy of `t` (a view of the payload's
        bytes: `decode`), never written: entries and device copies are made from it."""
        if key is None:
            return t.to(dtype=self.dtype, copy=True)
        got = recall(self._converted, key)
        if got is None:
            got = t.to(dtype=self.dtype, copy=True)
            if got.numel() * got.element_size() <= HOST_VECTOR_MAX_BYTES:  # (a large 3-D patch: not kept)
                remember(self._converted, key, got, HOST_VECTORS_KEPT)
        return got

    def _move_vectors(self, st: DeviceSteer) -> None:
        """`st.vectors` to the device at the next flush, or the copy already there (or queued) of the same
        content: 256 requests steering with one vector move it once."""
        put = functools.partial(setattr, st, "vectors")
        key = st.digest
        if key is None:
            self._moves.add(st.vectors, put)
            return
        got = self._on_device.get(key)
        if got is not None:
            put(got)
        elif key in self._queued:
            self._queued[key].append(put)
        else:
            self._queued[key] = [put]
            self._moves.add(st.vectors, functools.partial(self._moved, key))

    def _moved(self, key: bytes, t: torch.Tensor) -> None:
        self._on_device[key] = t
        for put in self._queued.pop(key):
            put(t)

    def _action_uses(self, req_id: str, spec: Any, tmpl: admit_templates.Template | None = None) -> list:
        """Slots for the request's probe actions at this stage's layers (`actions.ActionTable`); a template's
        actions are prepared once (`ActionTable.prepare`), its requests only take slots."""
        if self.actions is None:
            raise ValueError("probe_actions: this worker has no action table")
        if tmpl is not None:
            if tmpl.prepared is None:
                tmpl.stops = any(a["stop"] for a in spec.actions)
                try:
                    tmpl.prepared = self.actions.prepare(spec.actions, self.local)
                except Exception:  # noqa: BLE001 - (what `uses` refuses: it fails the request, in its order)
                    tmpl.prepared = False
            if tmpl.prepared is not False and not tmpl.stops and tmpl.prepared.local is self.local:
                first = compat.runner_prompt_len(self.runner, req_id) - 1
                return self.actions.uses_prepared(req_id, tmpl.prepared, first)
        if any(a["stop"] for a in spec.actions) and not compat.runner_stops_installed(self.runner):
            raise ActionRefused(
                "unsupported", "probe_actions: a stop is not supported on this model runner (vLLM's V2)"
            )
        if compat.pp_last_stage():  # the stage whose output reaches the scheduler must hold a stop's layer
            for i, a in enumerate(spec.actions):
                if a["stop"] and not self.local.issuperset(a["sites"]):
                    raise ActionRefused(
                        "unsupported", f"probe_actions[{i}]: a stop needs its probe's layer on the last pipeline stage"
                    )
        first = compat.runner_prompt_len(self.runner, req_id) - 1
        return self.actions.uses(req_id, spec.actions, self.local, first)

    def _gate(self, index: int, uses: list, sites: list[int]) -> torch.Tensor | None:
        """The device gate a probe action's vector is multiplied by (None: not gated). A vector with no
        layer on this stage is never applied here: it gets a gate that stays 0."""
        if index < 0:
            return None
        if not self.local.intersection(sites):
            return self.actions.never
        for u in uses:
            if u.index == index:
                return self.actions.gates[u.slot]
        raise ActionRefused(
            "unsupported", f"probe_actions[{index}]: its steering needs the probe's layer on the same pipeline stage"
        )

    def _entries(
        self, steers: list[DeviceSteer], uses: list, tmpl: admit_templates.Template | None = None
    ) -> tuple[dict, list[int]] | None:
        """Graph-path entries: one group for the plain vectors, one per gating action (its entries' gate
        follows the action). A row has one entry per site, so groups sharing a site take the Python path.
        Ungated entries of a template's content, all found stored by an earlier request: shared again
        (`SteeringEntries.share`) while no chain has left the table since."""
        table = self.graph.entries
        if tmpl is None:
            return self._grouped(steers, uses)
        if tmpl.gate_index is None:  # (its steers' action: one with layers here, none, or several)
            tmpl.gate_index = _gate_index(tmpl.steers, self.local)
        if tmpl.gate_index >= 0:
            return self._gated(steers, uses, tmpl)
        if tmpl.gate_index == -2:  # (several actions' gates, some vectors ungated or without a layer here)
            return self._grouped(steers, uses)
        if tmpl.shared is not None and tmpl.shared[0] == table.dropped:
            _, entries, ids, hits = tmpl.shared
            table.share(ids, hits)
            return entries, list(ids)
        in_use, hits = table.in_use(), table.shared_hits
        got = self._grouped(steers, uses)
        if got is not None and table.in_use() == in_use:  # (every chain found stored: nothing new to record)
            tmpl.shared = (table.dropped, got[0], list(got[1]), table.shared_hits - hits)
        return got

    def _gated(
        self, steers: list[DeviceSteer], uses: list, tmpl: admit_templates.Template
    ) -> tuple[dict, list[int]] | None:
        """A template's steering, every vector gated by the one probe action `tmpl.gate_index`: its rows made
        once (`graph_entries.gated_rows`), fresh entries per request (`put_gated`), which that action's use
        gates; steering those rows do not cover: `_grouped`."""
        if tmpl.gated is None:
            tmpl.gated = graph_entries.gated_rows(self.graph.entries, self.graph.col, steers) or False
        if tmpl.gated is False:
            return self._grouped(steers, uses)
        got = graph_entries.put_gated(self.graph.entries, tmpl.gated)
        if got is None:
            return None
        for u in uses:
            if u.index == tmpl.gate_index:
                u.entries = got[1]
        return got[0], list(got[1])

    def _grouped(self, steers: list[DeviceSteer], uses: list) -> tuple[dict, list[int]] | None:
        groups: dict[int, list[DeviceSteer]] = {}  # gate's address (-1: not gated) -> vectors
        for st in steers:
            groups.setdefault(-1 if st.gate is None else st.gate.data_ptr(), []).append(st)
        sites = [{l for st in g for l in st.layers} for g in groups.values()]
        if sum(len(x) for x in sites) != len(set().union(*sites)):
            return None
        by_gate = {} if self.actions is None else {self.actions.gates[u.slot].data_ptr(): u for u in uses}
        entries: dict = {}
        ids: list[int] = []
        gates: list[tuple[Any, list[int]]] = []  # (an action, the entries it gates): set once every group fits
        for key, group in groups.items():
            try:
                got = graph.request_entries(self.graph, group, gated=key != -1)
            except BaseException:  # (the groups before it give their entries back, as when one does not fit)
                self.graph.free_entries(ids)
                raise
            if got is None:  # (an action must never gate entries given back: another request takes them next)
                self.graph.free_entries(ids)
                return None
            entries.update(got[0])
            ids += got[1]
            if key in by_gate:  # (the gate of a vector with no layer here belongs to no action)
                gates.append((by_gate[key], got[1]))
        for u, got_ids in gates:
            u.entries = got_ids
        return entries, ids

    def _check_sites(self, spec: Any, hooks: list[HookRun], store: RequestResults | None, probes: list) -> None:
        """A point this worker has no tap for (its layout could not be resolved here) fails the request with
        the reason — never a capture, steer or hook that silently does nothing."""
        if not spec.steers and not hooks and not spec.sae and not probes and self.local.issuperset(spec.capture):
            return  # a capture of sites this worker taps (the common case, checked for every request)
        wanted = set(spec.capture) | {s for st in spec.steers for s in st.layers} | {s for h in hooks for s, _ in h.at}
        wanted |= {int(u[k]) for u in spec.sae for k in ("site", "out_site") if u.get(k) is not None}
        wanted |= {s for u in probes for s in u.weights}
        if self.local.issuperset(wanted):  # (every site tapped here: W12 names 32 per request)
            return
        lacking = sorted(s for s in wanted if site_layer(s) in self.local_layers and s not in self.local)
        if not lacking:
            return
        names = ", ".join(describe(s) for s in lacking)
        why = "; ".join(
            dict.fromkeys(
                self.missing.get(site_point(s), "that layer has no such block, e.g. a dense layer of an MoE model")
                for s in lacking
            )
        )
        err = errors.failure("unsupported", f"{names}: not available on this model ({why})", "admission")
        if store is None:
            raise ValueError(err["message"])
        store.fail(err)

    def _announce_result(self, req_id: str, payload: dict, capture: list[int], store: RequestResults) -> None:
        """A frontend on this machine gets captures through the shared-memory result pool: announce the
        request's largest result now, so the pool can grow while it runs (`ResultPool.expect`)."""
        if not capture or not self.capturing_rank or self.shm_host is None or payload.get("shm") != self.shm_host:
            return
        pool = self.store.pool
        local = [l for l in capture if l in self.local]
        n_pos = compat.request_max_positions(self.runner, req_id)
        if pool is not None and local and n_pos:
            store.expected = pool.expect(len(local) * n_pos * self.d_model * self.esize)
            store.mine, store.max_pos = local, n_pos  # early assembly's region shape (`transport.early`)


def _gate_index(steers: list, local: frozenset) -> int:
    """A template's gating (`Admission._entries`): the action index every steer is gated by when each has a
    layer here (its gate is that action's: `Admission._gate`); -1: none is gated; -2: anything else."""
    gates = {s.gate for s in steers}
    if not steers or max(gates) < 0:
        return -1
    if len(gates) == 1 and min(gates) >= 0 and all(local.intersection(s.layers) for s in steers):
        return gates.pop()
    return -2
