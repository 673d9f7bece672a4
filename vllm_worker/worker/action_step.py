"""A batch composition's probe-action bookkeeping as device index tensors, made once per plan and used by
every step of it (`observe`): which staged row and weight row each score part reads, which action slot
each score folds into, which steering entries take which action's gate, which stop flags go to the host.

Why: vLLM reuses a plan for every decode step of an unchanged batch, so per-request Python per step (and
host-to-device index uploads) would cost time proportional to the batch on every step; with the indices
cached a step is a fixed number of launches per site and per round, no upload and no host sync. Whether
a row is watched depends on the step's positions: that test runs on the device (`ActionTable.fold`).
A "token" action that fired is final (its outcome, gate and stop flag stay): compositions made after the
host learnt it leave it out, so requests joining a batch over several steps do not rebuild and fold the
earlier ones' actions again."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from vllm_worker.worker.actions import TOKEN, ActionTable, ActionUse, Round
from vllm_worker.worker.device_copy import to_device
from vllm_worker.worker.projection import rowdot


@dataclass
class SiteParts:
    """One site's score parts: part i is staged row `xrow[i]` · weight row `w[i]`, added to pair `pair[i]`
    (None: part i is pair i, the common case of one site)."""

    site: int
    xrow: torch.Tensor | None  # None: the site's staged rows in order
    w: torch.Tensor  # (parts, d) the weight rows, gathered once (they stay put while the actions live)
    pair: torch.Tensor | None
    offs: torch.Tensor | None  # graph path: each part's staged row in the ring, from the step's base


@dataclass
class ActionStep:
    generation: int  # `ActionTable.generation` when made: a slot freed since makes it stale
    n_pairs: int  # (action, staged row) pairs
    sites: list[SiteParts]
    brow: torch.Tensor | None  # per pair: its batch row (for the step's position)
    bias: torch.Tensor | None  # per pair: its action's bias
    sigmoid: torch.Tensor | None  # per pair: its action's score is sigmoid(score) (None: no action's is)
    rounds: list[Round]
    tokens: tuple[Round, torch.Tensor, torch.Tensor] | None  # all rows at once (`ActionTable.fold_tokens`)
    entries: tuple[torch.Tensor, torch.Tensor] | None  # (gated graph-path entries, their actions' slots)
    stops: tuple[list[ActionUse], torch.Tensor] | None  # (stop actions, their slots)
    settled_slots: torch.Tensor | None = None  # all "token" actions: once all fired, nothing a step does changes
    settled_read: tuple[torch.Tensor, Any] | None = None  # (host flags, their copy's event): last step's "fired"
    settled: bool = False  # every action of the composition fired: its steps skip the fold (`observe`)
    uses: list[ActionUse] | None = None  # its actions, in `settled_slots` order (each `final` once it fired)
    flags: tuple[torch.Tensor, Any] | None = None  # CUDA: the pinned host flags and event its steps reuse


def make(table: ActionTable, per_site: dict[int, tuple[Any, np.ndarray, list]], graph: bool) -> ActionStep:
    """`per_site`: site -> (graph path: stage offsets; Python path: unused, batch rows, requests) as the
    plan staged them (`actions.stage` / `plan.act_rows`)."""
    table.flush()  # (the step's admissions flushed already: `Admission.flush`; a no-op then)
    dev = table.device
    pairs: dict[tuple[int, int], int] = {}
    p_use: list[ActionUse] = []
    p_j: list[int] = []
    p_row: list[int] = []
    sites: list[SiteParts] = []
    for site, (offs, rows, items) in per_site.items():
        xr: list[int] = []
        wr: list[int] = []
        pr: list[int] = []
        k = 0
        # each request's rows as staged (its actions may have failed since), counted at once
        ranked = np.sort(rows)
        ends = np.searchsorted(ranked, [(s, e) for _, s, e in items]) if items else np.zeros((0, 2), np.int64)
        for (r, _, _), (lo, hi) in zip(items, ends.tolist()):
            n = hi - lo
            for u in r.acts:
                w = u.sites.get(site)
                if w is None or u.freed or u.final:  # (a final action: nothing a step does changes it)
                    continue
                for j in range(n):
                    g = pairs.setdefault((id(u), j), len(p_use))
                    if g == len(p_use):
                        p_use.append(u)
                        p_j.append(j)
                        p_row.append(int(rows[k + j]))
                    xr.append(k + j)
                    wr.append(w)
                    pr.append(g)
            k += n
        if xr:
            ident = pr == list(range(len(pairs))) and not sites
            w = table.W.index_select(0, _t(wr, dev))
            off_t = _t(np.asarray(offs, dtype=np.int64)[xr].tolist(), dev) if graph else None
            xrow = None if graph or xr == list(range(len(rows))) else _t(xr, dev)
            sites.append(SiteParts(site, xrow, w, None if ident else _t(pr, dev), off_t))
    if sites and sites[0].pair is None and len(pairs) != len(sites[0].w):
        sites[0].pair = torch.arange(len(sites[0].w), device=dev)  # (later sites added pairs)
    uses = list({id(u): u for r in _requests(per_site) for u in r.acts if not (u.freed or u.final)}.values())
    rounds: list[Round] = []
    js = np.asarray(p_j, dtype=np.int64)
    for j in range(int(js.max()) + 1 if len(js) else 0):
        idx = np.flatnonzero(js == j)
        pairs_j = None if len(idx) == len(js) else to_device(torch.from_numpy(idx), dev)
        rounds.append(table.round(pairs_j, [p_use[g] for g in idx.tolist()]))
    pslot = _t([u.slot for u in p_use], dev) if p_use else None
    tokens = None
    if len(rounds) > 1 and all(u.kind == TOKEN for u in p_use):  # several rows, no running state: at once
        order = list({id(u): u for u in p_use}.values())
        local = {id(u): i for i, u in enumerate(order)}
        tokens = (table.round(None, p_use), _t([local[id(u)] for u in p_use], dev), _t([u.slot for u in order], dev))
        rounds = []
    ents = [(e, u.slot) for u in uses if u.entries for e in u.entries]
    stops = [u for u in uses if u.stop]
    step = ActionStep(
        table.generation,
        len(p_use),
        sites,
        _t(p_row, dev) if p_use else None,
        None if pslot is None else table.B.index_select(0, pslot),
        None if pslot is None or not any(u.sigmoid for u in p_use) else table.sigmoid.index_select(0, pslot),
        rounds,
        tokens,
        (_t([e for e, _ in ents], dev), _t([s for _, s in ents], dev)) if ents else None,
        (stops, _t([u.slot for u in stops], dev)) if stops else None,
    )
    if p_use and all(u.kind == TOKEN for u in uses):  # (a fired "token" action's outcome is final)
        step.settled_slots = _t([u.slot for u in uses], dev)
        step.uses = uses
    step.settled = not uses  # every action of the composition is final already: its steps do nothing
    return step


def current(table: ActionTable, plan: Any) -> ActionStep:
    """The plan's step indices, made on its first step (again after a slot of the table was freed), for its
    actions not yet final."""
    step = plan.act_step
    if step is None or step.generation != table.generation:
        # the composition before: each of its actions that fired is final, and left out of this one
        for before in {id(s): s for s in (step, table.last_step) if s is not None}.values():
            settled(before, table)
        if table.open == 0:  # every live action is final: nothing to index (W11's requests leaving, step by step)
            step = ActionStep(table.generation, 0, [], None, None, None, [], None, None, None, settled=True)
        else:
            gp = plan.graph
            step = make(table, gp.act if gp is not None else plan.act_rows, gp is not None)
        plan.act_step = table.last_step = step
    return step


def observe(
    table: ActionTable,
    step: ActionStep,
    xs: dict[int, torch.Tensor],
    positions: torch.Tensor,
    entries_gate: torch.Tensor | None,
) -> None:
    """A step's staged rows (`xs`: site -> rows, as the plan staged them) scored and folded into the
    actions' aggregates; gates and stop flags follow. `positions`: the step's positions on the device.
    A composition whose actions all aggregate by "token" and have all fired does nothing more: its outcome,
    gates and stop flags are final (learnt from the previous step's flag without waiting for the device)."""
    if settled(step, table):
        return
    if step.n_pairs:
        assert step.brow is not None and step.bias is not None
        scores: torch.Tensor | None = None
        for sp in step.sites:
            x = xs.get(sp.site)
            if x is None:  # never a silent skip: the requests acting here fail (`runtime._observe`)
                raise RuntimeError(f"probe actions: no rows were staged at site {sp.site} this step")
            if sp.xrow is not None:
                x = x.index_select(0, sp.xrow)
            part = rowdot(x, sp.w)
            if sp.pair is None:
                scores = part
            else:
                if scores is None:
                    scores = torch.zeros(step.n_pairs, dtype=torch.float32, device=table.device)
                scores.index_add_(0, sp.pair, part)
        assert scores is not None
        s = scores + step.bias
        if step.sigmoid is not None:
            s = torch.where(step.sigmoid, torch.sigmoid(s), s)
        pos = positions.index_select(0, step.brow)
        if step.tokens is not None:
            table.fold_tokens(*step.tokens, s, pos)
        else:
            table.fold(s, pos, step.rounds)
    table.after_step(step.entries, entries_gate, step.stops)
    if step.settled_slots is not None:  # each action's "fired" on its way to the host (`settled`)
        flags = table.fired.index_select(0, step.settled_slots)
        if flags.device.type == "cuda":  # (one pinned buffer and event a composition: read only once landed)
            if step.flags is None:
                step.flags = (torch.empty(flags.shape, dtype=torch.bool, pin_memory=True), torch.cuda.Event())
            host, ev = step.flags
            host.copy_(flags, non_blocking=True)
            ev.record()
            step.settled_read = (host, ev)
        else:
            step.settled_read = (flags, None)


def settled(step: ActionStep, table: ActionTable | None = None) -> bool:
    """Whether every action of the composition has fired for good, as the previous step's flags say (never
    waits for them: flags still on their way read as not yet). Each action that fired is final from then on:
    later compositions leave it out (`make`); `table` counts it (`ActionTable.finalize`; None: not counted,
    so `current` keeps making compositions)."""
    if step.settled:
        return True
    read = step.settled_read
    if read is None:
        return False
    host, ev = read
    if ev is not None and not ev.query():
        return False
    step.settled_read = None
    fired = host.numpy()
    uses = step.uses or []
    for i in np.flatnonzero(fired).tolist():  # (only those that fired: no pass over every request a step)
        if table is None:
            uses[i].final = True
        else:
            table.finalize(uses[i])
    step.settled = bool(fired.all())
    return step.settled


def graph_rows(step: ActionStep, stage_buf: torch.Tensor, base: int) -> dict[int, torch.Tensor]:
    """Graph path, after the step: each site's staged rows, read from the ring at the step's base."""
    return {sp.site: stage_buf.index_select(0, sp.offs + base) for sp in step.sites if sp.offs is not None}


def python_rows(plan: Any) -> dict[int, torch.Tensor]:
    """Python path, after the forward: the rows `actions.rows_at` kept at each site."""
    return {site: x for site, x, _, _ in plan.act_got}


def device_positions(dev_pos: torch.Tensor | None, host_pos: np.ndarray, device: torch.device) -> torch.Tensor:
    """The step's positions on the device: vLLM's own (the forward's `positions`), or the host's copied
    once where those are not one position per row (M-RoPE's three rows)."""
    n = len(host_pos)
    if (
        dev_pos is not None
        and dev_pos.ndim == 1
        and dev_pos.device.type == device.type
        and not dev_pos.is_floating_point()
    ):
        return dev_pos[:n]
    t = torch.from_numpy(np.ascontiguousarray(host_pos, dtype=np.int64))
    if device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


def _requests(per_site: dict[int, tuple[Any, np.ndarray, list]]) -> list:
    return list({id(r): r for _, _, items in per_site.values() for r, _, _ in items}.values())


def _t(values: list[int], dev: torch.device) -> torch.Tensor:
    """Indices on the device, copied in the stream's order (`device_copy`: no wait for the running step)."""
    return to_device(torch.tensor(values, dtype=torch.long), dev)
