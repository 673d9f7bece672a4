"""`probe_actions` in a worker: each action's score and running aggregate on the device, the firing flag
it sets there, and what the flag does (docs/probes.md, "Acting on a score").

Why on the device: a steer that switches on when a probe fires must not cost a host round trip per step
(nor break CUDA graphs). Each action owns a slot of `ActionTable`'s device buffers (its weight row, bias,
threshold, aggregate state, `fired`, the position it fired at, and `gate`, the float the steering reads).
After each forward pass the rows the step staged for actions are scored and folded into the aggregates
by a few batched torch ops (`fold`, driven by the composition's device indices in `action_step`); the
flags change only there, so a gated vector applies from the
step after the firing one on. Stops are the one thing the host must learn: the flags of stop actions are
copied back without waiting, and read when the step's output is built (`stops`, through
`compat.patch_runner_stops`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np
import torch

from vllm_worker.protocol.recent import by_bytes
from vllm_worker.protocol.wire import tensor_from_bytes
from vllm_worker.worker import faults
from vllm_worker.worker.device_copy import distinct_rows, to_device
from vllm_worker.worker.stream_rows import stream_rows

TOKEN, EMA, ROLLING = 0, 1, 2  # as `frontend.actions`
MAX_WINDOW = 256  # rolling_max:W's largest W (`frontend.actions.MAX_WINDOW`)
N_SLOTS = 1024  # actions live at once in one worker
NO_END = 1 << 62  # the end of an open range of positions watched
MAX_RANGES = 16  # ranges / single positions an action watches (`frontend.actions.MAX_RANGES`)
WEIGHTS_KEPT = 8  # decoded weight rows remembered by their payload bytes (`ActionTable._weights`) ...
WEIGHTS_MAX_BYTES = 4 << 20  # ... each at most this large


@dataclass(eq=False)
class ActionUse:
    """One action of one request on this worker (the stage holding its layer)."""

    index: int  # in the request's `probe_actions`
    name: str
    req_id: str
    sites: dict[int, int]  # site -> its weight row in `ActionTable.W` (a multi-layer probe: one per layer)
    slot: int
    stop: bool
    first_watched: int  # the last prompt position (it produces generated token 0)
    every_row: bool = False  # it watches prompt positions: every row of a prefill chunk is staged
    rows: int = 1  # else a request's last rows staged per step: its next token's, and drafts' (`staged_rows_of`)
    kind: int = TOKEN  # its aggregate (a step computes only the aggregates its actions use)
    sigmoid: bool = False
    entries: list[int] | None = None  # graph-path steering entries this action gates
    freed: bool = False  # its slot went back
    final: bool = False  # a "token" action that fired: its outcome, gate and stop flag stay (`action_step`)


@dataclass(eq=False)
class Prepared:
    """A template's actions as `ActionTable.uses` derives them (`ActionTable.prepare`; read-only once made)."""

    local: frozenset  # the sites it was prepared for
    acts: list  # per action here: `ActionTable._derive`'s tuple
    n_rows: int


@dataclass
class Round:
    """One fold round of a batch composition: its pairs (None: all), their actions' slots, and what of
    their actions' state stays put while they live (range watched, threshold, aggregate parameter)."""

    pairs: torch.Tensor | None
    slots: torch.Tensor
    first: torch.Tensor
    until: torch.Tensor
    thr: torch.Tensor
    a: torch.Tensor  # EMA's alpha
    wlen: torch.Tensor  # rolling_max's window
    kind: torch.Tensor
    ema: bool  # some action of the round aggregates by EMA
    rolling: bool


class OutcomeLater:
    """A live request's action outcome, read from the device when its results are fetched: a fetch reads all
    of its requests' in one go (`read_together`), since every read waits for the device; called alone, it
    reads this request's only."""

    __slots__ = ("table", "uses")

    def __init__(self, table: ActionTable, uses: list[ActionUse]) -> None:
        self.table, self.uses = table, uses

    def __call__(self) -> list[dict[str, Any]]:
        return self.table.outcome(self.uses)


def read_together(stores: list[Any]) -> None:
    """The outcomes still to read (`OutcomeLater`) of a fetch's request results, one device read per table;
    each result's `actions` becomes its outcome. If the read fails, they stay to read one by one, where a
    failure is that request's error (never an outcome silently missing)."""
    later: dict[int, list[Any]] = {}
    for st in stores:
        if type(st.actions) is OutcomeLater:
            later.setdefault(id(st.actions.table), []).append(st)
    for sts in later.values():
        try:
            outs = sts[0].actions.table.outcomes([st.actions.uses for st in sts])
        except Exception:  # noqa: BLE001 - read again one by one (`_prelude`): each request told there
            continue
        for st, out in zip(sts, outs):
            st.actions = out


class ActionRefused(ValueError):
    """A request's probe actions cannot run on this worker (`kind`: a `protocol.errors` kind: the action
    table is full, a layer on another pipeline stage): its failure is the caller's 400, not our bug."""

    def __init__(self, kind: Any, message: str) -> None:
        super().__init__(message)
        self.kind = kind


class ActionTable:
    """The device state of every live action of one worker."""

    def __init__(self, d: int, device: torch.device, n_slots: int = N_SLOTS) -> None:
        self.d, self.device = d, device
        f32 = dict(dtype=torch.float32, device=device)
        self.W = torch.zeros((2 * n_slots, d), **f32)  # weight rows, one per (action, site)
        self.B = torch.zeros(n_slots, **f32)
        self.thr = torch.zeros(n_slots, **f32)
        self.kind = torch.zeros(n_slots, dtype=torch.long, device=device)
        self.sigmoid = torch.zeros(n_slots, dtype=torch.bool, device=device)  # the probe's output is sigmoid(score)
        self.param = torch.zeros(n_slots, **f32)
        self.count = torch.zeros(n_slots, dtype=torch.long, device=device)
        self.ema = torch.zeros(n_slots, **f32)
        self.window = torch.zeros((n_slots, MAX_WINDOW), **f32)
        self.fired = torch.zeros(n_slots, dtype=torch.bool, device=device)
        self.fire_pos = torch.full((n_slots,), -1, dtype=torch.long, device=device)
        self.fire_value = torch.zeros(n_slots, **f32)
        self.gate = torch.zeros(n_slots, **f32)  # 1.0 once fired: what gated steering multiplies by
        self.gates = self.gate.split(1)  # each slot's gate as a (1,) view, made once (`Admission._gate`)
        # positions watched: any of MAX_RANGES ranges [first, until) (unused ones empty)
        self.first = torch.zeros((n_slots, MAX_RANGES), dtype=torch.long, device=device)
        self.until = torch.zeros((n_slots, MAX_RANGES), dtype=torch.long, device=device)
        self.last_seen = torch.full((n_slots,), -1, dtype=torch.long, device=device)  # (a recomputed one: not again)
        self.rows_per_step = 1  # 1 + the runner's draft tokens (`compat.draft_tokens`)
        self.generation = 0  # counts frees: a step's cached indices (`action_step`) made before one are stale
        self.never = torch.zeros(1, **f32)  # the gate of a vector with no layer on this pipeline stage
        self.last_step: Any = None  # the latest composition's `action_step.ActionStep` (its flag read at the next)
        self.open = 0  # live actions not final: at 0 every composition is settled (`action_step.current`)
        self._free = list(range(n_slots - 1, -1, -1))
        self._wfree = list(range(2 * n_slots - 1, -1, -1))
        self._arange = torch.arange(MAX_WINDOW, device=device)
        self._stop_reads: list[tuple[list[ActionUse], torch.Tensor, Any]] = []
        self.stopping: dict[str, str] = {}  # request id -> stop reason, until the request leaves
        self._by_req: dict[str, list[ActionUse]] = {}  # request id -> its actions (slots held)
        # slots / weight rows taken since the last `flush`, on the host: slot -> ((b, threshold, param),
        # [kind, sigmoid, firsts..., untils...]); weight row -> its (d,) row (a slot taken again: the last wins)
        self._new: dict[int, tuple[tuple[float, float, float], Sequence[int]]] = {}
        self._new_w: dict[int, torch.Tensor] = {}
        self._decoded: dict[tuple, tuple[bytes, torch.Tensor]] = {}  # recent weights by payload bytes (`_weights`)

    # ------------------------------------------------------------ per request

    def uses(self, req_id: str, actions: list[dict], local: frozenset, first_watched: int) -> list[ActionUse]:
        """Slots for a request's actions at this stage's sites: `ActionRefused` when an action's layers lie on
        several stages, then when the table is full (before any action is read: that is the refusal whatever
        else is wrong), then `ValueError` for the first malformed action; a refused request takes nothing."""
        mine = _mine(actions, local)
        n_rows = sum(len(a["sites"]) for _, a in mine)
        if len(mine) > len(self._free) or n_rows > len(self._wfree):
            raise _full()
        return self.uses_prepared(req_id, Prepared(local, [self._derive(i, a) for i, a in mine], n_rows), first_watched)

    def prepare(self, actions: list[dict], local: frozenset) -> Prepared:
        """What `uses` derives from `actions` alone (slots aside), once for an admission template's content:
        its requests then only take slots and copy constants (`uses_prepared`). Raises for anything `uses`
        would refuse; the caller then admits through `uses`, which fails the request (in `uses`' order)."""
        acts = [self._derive(i, a) for i, a in _mine(actions, local)]
        return Prepared(local, acts, sum(len(p[2]) for p in acts))

    def _derive(self, i: int, a: dict) -> tuple:
        """What action `a` (`probe_actions[i]`) puts in its slot but the request's prompt end: (index, name,
        sites, weight rows as (d,) views, (b, threshold, param), ints: kind, sigmoid, the ranges' firsts (an
        open one -1) then untils, the open firsts' places in ints, the lowest fixed first (None: all open),
        stop, number of sites)."""
        w = self._weights(a["w"], f"probe_actions[{i}].w").reshape(len(a["sites"]), -1)
        if w.shape[1] != self.d:  # (checked here: a bad row must fail its request, not the step's flush)
            raise ValueError(f"probe_actions[{i}].w: {w.shape[1]} columns, the model's width is {self.d}")
        ranges = a["ranges"]
        if not 0 < len(ranges) <= MAX_RANGES:  # (`frontend.actions.watched` sends 1..MAX_RANGES)
            raise ValueError(f"probe_actions[{i}].ranges: {len(ranges)} ranges, expected 1 to {MAX_RANGES}")
        ints = [int(a["kind"]), int(bool(a.get("sigmoid", False)))] + [0] * (2 * MAX_RANGES)
        opens, fixed = [], []  # (the open firsts' places in ints: set to first_watched; the fixed firsts)
        for j, (lo, hi) in enumerate(ranges):  # (`frontend.actions.watched`; -1: generated / open)
            ints[2 + j], ints[2 + MAX_RANGES + j] = lo, NO_END if hi < 0 else hi
            if lo < 0:
                opens.append(2 + j)
            else:
                fixed.append(lo)
        floats = (float(a["b"]), float(a["threshold"]), float(a["param"]))
        sites = tuple([int(x) for x in a["sites"]])
        rows = tuple([w[k] for k in range(len(sites))])  # (indexing: iterating a tensor unbinds it, slower)
        fixed_lo = min(fixed) if fixed else None
        consts, stop = tuple(ints), bool(a["stop"])
        return (i, str(a["name"]), sites, rows, floats, consts, tuple(opens), fixed_lo, stop, len(sites))

    def uses_prepared(self, req_id: str, prep: Prepared, first_watched: int) -> list[ActionUse]:
        """`uses` for actions `prepare`d once (`uses` itself ends here): slots and weight rows taken in order,
        open ranges given the request's prompt end, the constants queued for `flush`."""
        acts = prep.acts
        if len(acts) > len(self._free) or prep.n_rows > len(self._wfree):
            raise _full()
        out: list[ActionUse] = []
        self._by_req[req_id] = out  # (filled as slots are taken, as in `uses`)
        free, wfree, new_w = self._free, self._wfree, self._new_w
        for i, name, sites, rows, floats, ints, opens, fixed_lo, stop, n in acts:
            slot = free.pop()
            taken = wfree[-n:][::-1]  # (as n pops; n >= 1: an action here has a site here)
            del wfree[-n:]
            for r, row in zip(taken, rows):
                new_w[r] = row
            if opens:
                ints = list(ints)
                for j in opens:
                    ints[j] = first_watched
                lo = first_watched if fixed_lo is None else min(first_watched, fixed_lo)
            else:
                lo = fixed_lo
            self._new[slot] = (floats, ints)  # (a tuple shared by the template's requests: `flush` only reads it)
            use = ActionUse(i, name, req_id, dict(zip(sites, taken)), slot, stop, first_watched, lo < first_watched)
            use.kind, use.sigmoid, use.rows = ints[0], bool(ints[1]), self.rows_per_step
            out.append(use)
            self.open += 1
        return out

    def _weights(self, obj: Any, field: str) -> torch.Tensor:
        """A payload's weight rows as float32 on the host, decoded once for the last few byte strings
        (`WEIGHTS_KEPT`; compared byte for byte, so only equal bytes share): 256 requests acting on one
        probe decode it once, and `flush` uploads its rows once. Never written (`flush` copies them)."""
        raw = obj.get("data") if isinstance(obj, dict) else None
        if not isinstance(raw, bytes) or len(raw) > WEIGHTS_MAX_BYTES:
            return tensor_from_bytes(obj, field).to(torch.float32)
        tag = (obj.get("dtype"), repr(obj.get("shape")))
        return by_bytes(self._decoded, tag, raw, lambda: tensor_from_bytes(obj, field).to(torch.float32), WEIGHTS_KEPT)

    def flush(self) -> None:
        """The slots taken since the last flush reach the device: their constants and fresh state, for all
        of a step's admissions at once (two host-to-device copies and one indexed write per buffer, never
        per request). Weight rows that are one host row (requests of one probe: `_weights`) cross once
        and are spread on the device. Called after a step's admissions (`Admission.flush`) and before any
        read of the table."""
        if not self._new and not self._new_w:
            return
        new, self._new = self._new, {}
        new_w, self._new_w = self._new_w, {}
        k, m = len(new), len(new_w)
        sent, which = distinct_rows(list(new_w.values()))
        consts = np.array([ls for _, ls in new.values()], dtype=np.int64).reshape(-1)  # (numpy: no per-value Python)
        order = np.fromiter((*new, *new_w, *which), dtype=np.int64, count=k + 2 * m)
        longs = torch.from_numpy(np.concatenate([order, consts]))
        fvals = torch.from_numpy(np.array([fs for fs, _ in new.values()], dtype=np.float32).reshape(-1))
        floats = torch.cat([fvals, torch.stack(sent).reshape(-1)]) if m else fvals
        dl, df = to_device(longs, self.device), to_device(floats, self.device)
        if m:
            rows = df[3 * k :].view(len(sent), self.d)
            if len(sent) < m:  # (some rows are one: spread on the device)
                rows = rows.index_select(0, dl[k + m : k + 2 * m])
            self.W.index_copy_(0, dl[k : k + m], rows)
        if not k:
            return
        sl = dl[:k]
        f = df[: 3 * k].view(k, 3)
        ls = dl[k + 2 * m :].view(k, 2 + 2 * MAX_RANGES)
        for buf, col in ((self.B, f[:, 0]), (self.thr, f[:, 1]), (self.param, f[:, 2]), (self.kind, ls[:, 0])):
            buf.index_copy_(0, sl, col)
        self.sigmoid.index_copy_(0, sl, ls[:, 1].bool())
        self.first.index_copy_(0, sl, ls[:, 2 : 2 + MAX_RANGES])
        self.until.index_copy_(0, sl, ls[:, 2 + MAX_RANGES :])
        for buf, v in ((self.count, 0), (self.ema, 0.0), (self.fired, False), (self.fire_pos, -1)):
            buf.index_fill_(0, sl, v)
        for buf, v in ((self.fire_value, 0.0), (self.gate, 0.0), (self.last_seen, -1)):
            buf.index_fill_(0, sl, v)

    def drop(self, req_id: str) -> None:
        """Admission failed after the request's slots were taken: give them back."""
        self.free(self._by_req.pop(req_id, []))

    def free(self, uses: list[ActionUse]) -> None:
        for u in uses:
            if not u.freed:  # (a failed request's uses may be given back twice)
                u.freed = True
                self.open -= not u.final
                self.generation += 1
                self._free.append(u.slot)
                self._wfree.extend(u.sites.values())
            self._by_req.pop(u.req_id, None)
            self.stopping.pop(u.req_id, None)

    def finalize(self, u: ActionUse) -> None:
        """`u` fired for good (a "token" action: `action_step.settled`): no step changes it any more."""
        if not u.final:
            u.final = True
            self.open -= not u.freed

    def outcome(self, uses: list[ActionUse]) -> list[dict[str, Any]]:
        """What each action did (read from the device: when the request leaves, or at its fetch)."""
        return self.outcomes([uses])[0]

    def outcomes(self, groups: list[list[ActionUse]]) -> list[list[dict[str, Any]]]:
        """`outcome` of each group (the requests leaving in one step) in one read: every read of a device
        value waits for the device, and it was three reads (and a pageable write) per request. Positions
        (< 2**53) and float32 values are exact in float64, so one float64 block carries all three."""
        uses = [u for g in groups for u in g]
        if not uses:
            return [[] for _ in groups]
        faults.check("outcomes")
        self.flush()
        slots = to_device(torch.tensor([u.slot for u in uses], dtype=torch.long), self.device)
        got = torch.stack([buf.index_select(0, slots).double() for buf in (self.fired, self.fire_pos, self.fire_value)])
        fired, pos, val = got.tolist()
        out = [
            {
                "action": u.index,
                "name": u.name,
                "fired": bool(f),
                "position": int(p),
                "token_index": int(p) - u.first_watched if f and p >= u.first_watched else -1,
                "value": float(v) if f else None,
            }
            for u, f, p, v in zip(uses, fired, pos, val)
        ]
        split, k = [], 0
        for g in groups:
            split.append(out[k : k + len(g)])
            k += len(g)
        return split

    # ------------------------------------------------------------ per step

    def round(self, pairs: torch.Tensor | None, uses: list[ActionUse]) -> Round:
        """A fold round's constants, read once per batch composition (`action_step.make`)."""
        sl = to_device(torch.tensor([u.slot for u in uses], dtype=torch.long), self.device)
        kinds = {u.kind for u in uses}
        a = self.param.index_select(0, sl)
        return Round(
            pairs,
            sl,
            self.first.index_select(0, sl),
            self.until.index_select(0, sl),
            self.thr.index_select(0, sl),
            a,
            a.long().clamp(1, MAX_WINDOW),
            self.kind.index_select(0, sl),
            EMA in kinds,
            ROLLING in kinds,
        )

    def fold(self, s: torch.Tensor, pos: torch.Tensor, rounds: list[Round]) -> None:
        """Fold a step's scores in: per pair (an action and one of its request's staged rows) its score `s`
        (bias and sigmoid applied) and the row's position `pos`; round j folds the j-th staged row of every
        action, in position order (one round unless drafts or a watched prompt chunk staged several rows).
        Positions not watched (out of the action's range, or already folded: recomputed after a preemption)
        are masked out on the device."""
        for rd in rounds:
            if rd.pairs is None:
                self._update(rd, s, pos)
            else:
                self._update(rd, s.index_select(0, rd.pairs), pos.index_select(0, rd.pairs))

    def fold_tokens(
        self, rd: Round, local: torch.Tensor, slots: torch.Tensor, s: torch.Tensor, pos: torch.Tensor
    ) -> None:
        """`fold` for a step whose actions all aggregate by "token" and that holds several rows of one
        request (drafts, a watched prompt chunk): all rows at once, whatever their number — an action's
        first crossing is its smallest crossing position. `rd`: per pair; `local`: each pair's action in
        `slots` (the step's actions)."""
        valid = _in_ranges(rd, pos) & (pos > self.last_seen[rd.slots])
        hit = valid & (s > rd.thr)
        p = pos.long()
        m = slots.shape[0]
        first = torch.full((m,), NO_END, dtype=torch.long, device=self.device)
        first.scatter_reduce_(0, local, torch.where(hit, p, NO_END), "amin")
        at_first = hit & (p == first.index_select(0, local))
        value = torch.zeros(m, dtype=torch.float32, device=self.device).index_add_(
            0, local, torch.where(at_first, s, 0.0)
        )
        seen = torch.full((m,), -1, dtype=torch.long, device=self.device)
        seen.scatter_reduce_(0, local, torch.where(valid, p, -1), "amax")
        was = self.fired.index_select(0, slots)
        new = (first < NO_END) & ~was
        self.fire_pos.index_copy_(0, slots, torch.where(new, first, self.fire_pos.index_select(0, slots)))
        self.fire_value.index_copy_(0, slots, torch.where(new, value, self.fire_value.index_select(0, slots)))
        fired = was | new
        self.fired.index_copy_(0, slots, fired)
        self.gate.index_copy_(0, slots, fired.float())
        self.last_seen.index_copy_(0, slots, torch.maximum(self.last_seen.index_select(0, slots), seen))

    def _update(self, rd: Round, s: torch.Tensor, pos: torch.Tensor) -> None:
        sl = rd.slots
        last = self.last_seen.index_select(0, sl)
        valid = _in_ranges(rd, pos) & (pos > last)
        agg = s
        if rd.ema or rd.rolling:
            cnt = self.count.index_select(0, sl)
            if rd.ema:
                old = self.ema.index_select(0, sl)
                ema = torch.where(cnt == 0, s, rd.a * old + (1 - rd.a) * s)
                self.ema.index_copy_(0, sl, torch.where(valid, ema, old))
                agg = torch.where(rd.kind == EMA, ema, agg)
            if rd.rolling:
                at = cnt % rd.wlen
                self.window[sl, at] = torch.where(valid, s, self.window[sl, at])
                n = torch.minimum(cnt + 1, rd.wlen)
                win = self.window[sl] * (self._arange.unsqueeze(0) < n.unsqueeze(1))
                agg = torch.where(rd.kind == ROLLING, win.sum(-1) / n, agg)
            self.count.index_copy_(0, sl, cnt + valid.long())
        hit = valid & (agg > rd.thr)  # "exceeds", as calibrated thresholds are meant (`threshold_at_fpr`)
        was = self.fired.index_select(0, sl)
        new = hit & ~was
        self.fire_pos.index_copy_(0, sl, torch.where(new, pos, self.fire_pos.index_select(0, sl)))
        self.fire_value.index_copy_(0, sl, torch.where(new, agg, self.fire_value.index_select(0, sl)))
        fired = was | hit
        self.fired.index_copy_(0, sl, fired)
        self.gate.index_copy_(0, sl, fired.float())
        self.last_seen.index_copy_(0, sl, torch.where(valid, pos, last))

    def after_step(
        self,
        entries: tuple[torch.Tensor, torch.Tensor] | None,
        entries_gate: torch.Tensor | None,
        stops: tuple[list[ActionUse], torch.Tensor] | None,
    ) -> None:
        """After `fold`: gated graph-path entries (`entries`: their ids, their actions' slots) take their
        actions' gate, and the flags of stop actions (`stops`: the uses, their slots) start their way to the
        host (read in `stops`)."""
        if entries is not None and entries_gate is not None:
            ent, slots = entries
            entries_gate.index_copy_(0, ent, self.gate.index_select(0, slots).to(entries_gate.dtype))
        if stops is None:
            return
        uses, slots = stops
        flags = self.fired.index_select(0, slots)
        if self.device.type == "cuda":
            host = torch.empty(flags.shape, dtype=torch.bool, pin_memory=True)
            host.copy_(flags, non_blocking=True)
            ev = torch.cuda.Event()
            ev.record()
            self._stop_reads.append((uses, host, ev))
        else:
            self._stop_reads.append((uses, flags, None))

    def status(self) -> dict[str, int]:
        """What the table holds for live requests (each returns to 0 once they leave: `lens_status`)."""
        return {
            "action_slots": len(self.fired) - len(self._free),
            "action_requests": len(self._by_req),
            "action_stops": len(self.stopping),
        }

    def stops(self) -> dict[str, str]:
        """Requests whose stop action has fired: {request id: "probe:<name>"} (repeated until they leave;
        the scheduler ignores a request it already finished)."""
        reads, self._stop_reads = self._stop_reads, []
        for uses, flags, ev in reads:
            if ev is not None:
                ev.synchronize()
            for i in np.flatnonzero(flags.numpy()).tolist():  # (Python for the fired ones only)
                u = uses[i]
                if not u.freed:  # (it left before its flag was read)
                    self.stopping.setdefault(u.req_id, f"probe:{u.name}")
        return dict(self.stopping)


def _mine(actions: list[dict], local: frozenset) -> list[tuple[int, dict]]:
    """(index, action) of the actions with a layer at this stage's sites; `ActionRefused` for one whose
    layers lie on several stages."""
    mine = [(i, a) for i, a in enumerate(actions) if local.intersection(a["sites"])]
    for i, a in mine:
        if not local.issuperset(a["sites"]):
            raise ActionRefused("unsupported", f"probe_actions[{i}].probe: its layers lie on several pipeline stages")
    return mine


def _full() -> ActionRefused:
    return ActionRefused("limit", f"probe_actions: the worker's action table is full ({N_SLOTS} live actions)")


def staged_rows_of(items: list) -> np.ndarray:
    """The batch rows staged for the actions of each (request, start, end) item, in order: a request's last
    row (the one that produces its next token) and drafts' rows — all of its rows when an action watches
    prompt positions. No more: in a prefill chunk only the last row can be a generated position not yet
    folded (a recompute after preemption folds again nothing but its last row). One pass of numpy; each
    request's count of last rows (-1: all) worked out once (`RequestState.staged`, for its `acts` list)."""
    if not items:
        return np.zeros(0, dtype=np.int64)
    spans = []
    for r, s, e in items:
        got = r.staged
        if got is None or got[0] is not r.acts:
            every = any(u.every_row for u in r.acts)
            got = r.staged = (r.acts, -1 if every else max((u.rows for u in r.acts), default=1))
        spans.append((s, e, got[1]))
    s, e, k = np.array(spans, dtype=np.int64).reshape(-1, 3).T
    lo = np.where(k < 0, s, np.maximum(s, e - k))
    lens = e - lo
    return np.repeat(lo - (np.cumsum(lens) - lens), lens) + np.arange(int(lens.sum()), dtype=np.int64)


def stage(gp: Any, cap_rows: dict, act_rows: dict, col: dict[int, int]) -> None:
    """Graph-safe plan: the action rows are staged by the kernel like captures (a table cell holds one
    slot: a row the plan already stages at that site — a capture, SAE features — lends its slot; the others
    get slots after everything else, never copied to the host); `gp.act[site] = (stage offsets, batch
    rows, items)`."""
    if not act_rows:
        return
    n = max(gp.n, 1)
    have = gp.cap_cols * n + gp.cap_rows  # (column, row) cells staged so far, by slot
    order = np.argsort(have, kind="stable")
    off = len(gp.cap_rows)
    rows_all, cols_all = [gp.cap_rows], [gp.cap_cols]
    for site, items in act_rows.items():
        rows = staged_rows_of(items)
        keys = col[site] * n + rows
        i = np.minimum(np.searchsorted(have, keys, sorter=order), max(len(have) - 1, 0))
        found = (have[order[i]] == keys) if len(have) else np.zeros(len(rows), dtype=bool)
        offs = np.where(found, order[i] if len(have) else 0, -1)
        new = ~found
        offs[new] = np.arange(off, off + int(new.sum()))
        rows_all.append(rows[new])
        cols_all.append(np.full(int(new.sum()), col[site]))
        off += int(new.sum())
        gp.act[site] = (offs.astype(np.int64), rows, items)
    gp.n_extra += off - len(gp.cap_rows)
    gp.cap_rows = np.concatenate(rows_all).astype(np.int64)
    gp.cap_cols = np.concatenate(cols_all).astype(np.int64)


def rows_at(site: int, plan: Any, hidden: torch.Tensor, residual: torch.Tensor | None) -> None:
    """Python path, at a tap (after the site's edits): the action rows there, kept for after the forward."""
    got = plan.act_rows.get(site)
    if got is None:
        return
    idx, rows, items = got
    x = stream_rows(hidden, residual, idx)
    plan.act_got.append((site, x, rows, items))


def _in_ranges(rd: Round, pos: torch.Tensor) -> torch.Tensor:
    p = pos.unsqueeze(1)
    return ((p >= rd.first) & (p < rd.until)).any(1)
