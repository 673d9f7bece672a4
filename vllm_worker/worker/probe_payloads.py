"""The probe payloads of a fetch's requests computed together: requests whose probe's spans have the same
shape (the same records, as many rows and columns in each — a batch composition's requests) are one
group, and the group's positions and scores are gathered from the records' host copies by a few array
operations for all of them, not a few per request and probe. What this does not cover (a probe over
several layers, column indices, a preempted request's recompute) is left to `probes.payload`, whose
results these equal bit for bit (tests/unit/test_probe_payloads.py). A request is read from its filed
entries (`probe_filing`: one per composition and site) while none of its `ProbeScores` were made — requests
filed in the same places grouped by those places, their rows read as one array — or else from its
`ProbeScores`' index (`ProbeScores.key`): neither walks spans, the fetch's largest Python cost once, on
the result's critical path."""

from __future__ import annotations

import logging
from itertools import chain
from operator import itemgetter
from typing import Any

import numpy as np
import torch

from vllm_worker import envs
from vllm_worker.protocol import probe_wire
from vllm_worker.protocol.host_threads import one_thread
from vllm_worker.worker.probes import ProbeScores
from vllm_worker.worker.step_records import Span

logger = logging.getLogger("vllm_worker")

Member = tuple[int, str, ProbeScores, list[Span], Any]  # (request index, probe name, its scores, spans read (a
# member's; the group's records), each span's first row and column r0, c0, r0, c0, ... (None: read from entries))


Payload = dict[str, dict[str, Any]] | tuple[dict[str, int], dict[str, Any]]  # items by probe, or a block


def payloads(
    requests: list[Any], cache: dict, starts: list[int] | None = None, blocks: bool = False
) -> list[Payload | None]:
    """Each request's `probes.payload(got, cache=cache)`, or None where `probes.payload` must make it (some
    probe not covered here). A request is its `RequestResults` (read from its filed entries while none of its
    `ProbeScores` were made: `_entry_groups`) or its probe name -> `ProbeScores` dict. `starts`: running
    requests (a progress RPC): request i's positions from `starts[i]` on, as
    `probes.payload(got, starts[i], running=True, cache=cache)`. `blocks` (a fetch): a request of several
    probes, all in one group's usual case, gets them as one block (`probe_wire.pack_block`: the same bytes as
    its items, `probe_wire.items_of`)."""
    groups: dict[tuple, list[Member]] = {}
    left: set[int] = set()
    filed: dict[int, bool] = {}  # records with something filed, by id
    last_index: list | None = None
    bucket: list[Member] = []
    order: list[Any] = [None] * len(requests)  # each request's probe names in its own order
    by_entries: dict[tuple, list[int]] = {}  # requests read from their entries, by what they were filed in
    entries: dict[int, list] = {}  # their entries
    for i, req in enumerate(requests):
        if type(req) is not dict:
            ents = req.probe_filed[:]  # (as they are now: a step may file more meanwhile)
            if req._expanded == 0 and ents and all(e[3] is ents[0][3] for e in ents):
                sig = (tuple([e[0] for e in ents]), tuple([e[2] for e in ents]), tuple(ents[0][3]))
                by_entries.setdefault(sig, []).append(i)
                entries[i] = ents
                continue
            req = req.probes
        order[i] = req
        for name, slot in req.items():
            sites = slot.probe.sites
            if len(sites) != 1:
                left.add(i)
                break
            spans = slot.spans.get(sites[0])
            index = slot.key  # the index kept as the spans were filed (`ProbeScores.index`): usually all of them
            if spans and len(index) == len(spans):
                if index != last_index:  # (a composition's slots have equal ones: the last slot's group)
                    last_index, bucket = index, groups.setdefault(tuple(index), [])
                bucket.append((i, name, slot, spans, slot.firsts))
                continue
            if not _file_walked(groups, left, (i, name, slot), cache, filed):
                break
    # an index counts every span, `_walk` only those of records with something filed (a group's records are
    # its key's: one member's tell)
    unfiled = [k for k, m in groups.items() if not all(_filed(sp.record, cache, filed) for sp in m[0][3])]
    for key in unfiled:
        _rewalk(groups, key, cache, filed, left)
    regrouped = bool(unfiled)
    done: list[Any] = [{} for _ in requests]  # each request's payloads by probe (or its block)
    todo = [(key, members, _firsts(members, len(key))) for key, members in groups.items()]
    for sig, who in by_entries.items():
        todo += _entry_groups(sig, [entries[i] for i in who], who, cache, filed, order, left)
    for key, members, firsts in todo:
        keep = [k for k, m in enumerate(members) if m[0] not in left] if left else None
        if keep is not None and len(keep) < len(members):
            members, firsts = [members[k] for k in keep], firsts[keep]
        if members:
            left |= _group(key, members, firsts, cache, done, starts, order if blocks else None)
    if len(todo) > 1 or regrouped:  # each request's probes in its own order (one group: filed in that order)
        done = [
            {name: d[name] for name in got} if type(d) is dict and got is not None and len(d) == len(got) else d
            for d, got in zip(done, order)
        ]
    return [None if i in left else d for i, d in enumerate(done)]


def _firsts(members: list[Member], spans: int) -> np.ndarray:
    """(members, spans, 2): each member's spans' first row and column (from its flat r0, c0, r0, c0 list)."""
    flat = list(chain.from_iterable([m[4] for m in members]))  # (one flat list for numpy: a call per member else)
    return np.array(flat, dtype=np.int64).reshape(len(members), spans, 2)


def _entry_groups(
    sig: tuple, ents: list[list], who: list[int], cache: dict, filed: dict[int, bool], order: list, left: set[int]
) -> list[tuple[tuple, list[Member], np.ndarray]]:
    """The groups of requests `who`, filed in the same records with as many rows each (`sig`: their entries'
    places and rows, and their probes; `ents`: each one's entries), read from their entries: per probe its
    spans' shape (the group key, as `ProbeScores.key`) and first rows and columns as arrays for all the
    requests at once. Members are request-major (a request's probes one after another, in the order its
    `ProbeScores` would have). Probes over several sites, and records with nothing filed, are left to
    `probes.payload`."""
    wheres, ns, uses = sig
    rows_at: dict[int, list[int]] = {}  # site -> its entries, in filing order
    for j, w in enumerate(wheres):
        rows_at.setdefault(w.site, []).append(j)
    if any(len(u.sites) != 1 for u in uses) or not all(_filed(w.record, cache, filed) for w in wheres):
        left.update(who)
        return []
    scored = []  # (probe, its entries) of the probes scored here, in the order `expand` makes their slots:
    for u in uses:  # by their first entry, then as the request lists them
        site = u.sites[0]
        js = rows_at.get(site) if site in u.weights else None
        if js:  # (a probe never scored here has no `ProbeScores` either)
            scored.append((u, js))
    scored.sort(key=lambda p: p[1][0])
    if len({u.name for u, _ in scored}) < len(scored):  # two probes of one name share a slot: not here
        left.update(who)
        return []
    names = [u.name for u, _ in scored]
    for i in who:
        order[i] = names
    shapes: dict[tuple, list] = {}  # key -> [(probe, its entries, their first columns)]
    for u, js in scored:
        cols = [wheres[j].cols[(u.name, u.uid)] for j in js]
        key = tuple((id(wheres[j].record), ns[j], c1 - c0) for j, (c0, c1) in zip(js, cols))
        shapes.setdefault(key, []).append((u, js, [c0 for c0, _ in cols]))
    offs = np.array([[e[1] for e in mine] for mine in ents], dtype=np.int64)  # (requests, entries): first rows
    out: list[tuple[tuple, list[Member], np.ndarray]] = []
    for key, probes in shapes.items():
        at = np.array([p[1] for p in probes], dtype=np.int64)  # (probes, spans): the entries read
        firsts = np.empty((len(who), len(probes), len(key), 2), dtype=np.int64)
        firsts[..., 0] = offs[:, at]
        firsts[..., 1] = np.array([p[2] for p in probes], dtype=np.int64)
        _, js0, c00 = probes[0]
        spans0 = [
            Span(wheres[j].record, int(offs[0, j]), int(offs[0, j]) + ns[j], "scores", slice(c0, c0 + k[2]))
            for j, c0, k in zip(js0, c00, key)
        ]
        slots = [ProbeScores(p[0]) for p in probes]  # (what `_group` reads of a slot: its probe)
        members: list[Member] = [(i, p[0].name, slot, spans0, None) for i in who for p, slot in zip(probes, slots)]
        out.append((key, members, firsts.reshape(len(who) * len(probes), len(key), 2)))
    return out


def _walk(slot: ProbeScores, cache: dict, filed: dict[int, bool]) -> tuple[tuple, list[Span], tuple] | None:
    """(shape, spans, their first rows and columns) of the spans `probes.payload` reads (those of records
    with something filed): the shape is (record, rows, columns) per span, columns `slice(c0, c1)` as the
    filing makes them; None when not covered here (no spans: a probe over several sites, or nothing scored
    — `probes.payload` says which). For slots whose index does not cover their spans (`ProbeScores.key`)."""
    key: list[tuple[int, int, int]] = []
    spans: list[Span] = []
    firsts: list[int] = []
    for sp in slot.spans.get(slot.probe.sites[0], ()):
        if not _filed(sp.record, cache, filed):
            continue
        c = sp.cols
        if type(c) is not slice or c.step is not None:
            return None
        c0, c1 = c.start, c.stop
        if type(c0) is not int or type(c1) is not int or not 0 <= c0 <= c1:
            return None
        key.append((id(sp.record), sp.r1 - sp.r0, c1 - c0))
        spans.append(sp)
        firsts += (sp.r0, c0)
    return (tuple(key), spans, tuple(firsts)) if key else None


def _filed(record: Any, cache: dict, filed: dict[int, bool]) -> bool:
    """Whether `record` has probe scores filed (read once per record and fetch: `Span.filed`)."""
    got = filed.get(id(record))
    if got is None:
        got = filed[id(record)] = Span(record, 0, 0, "scores", slice(0, 0)).filed(cache)
    return got


def _rewalk(groups: dict[tuple, list[Member]], key: tuple, cache: dict, filed: dict[int, bool], left: set[int]) -> None:
    """The members of an indexed group one of whose records has nothing filed, walked as `_walk` reads them
    (regrouped by the spans it keeps; a member with none left to `probes.payload`)."""
    for i, name, slot, _, _ in groups.pop(key):
        _file_walked(groups, left, (i, name, slot), cache, filed)


def _file_walked(
    groups: dict[tuple, list[Member]], left: set[int], who: tuple[int, str, ProbeScores], cache: dict, filed: dict
) -> bool:
    """File the (request index, probe name, slot) `who` in its group as `_walk` reads its spans; False (its
    request left to `probes.payload`) when the walk does not cover it."""
    found = _walk(who[2], cache, filed)
    if found is None:
        left.add(who[0])
        return False
    key, spans, firsts = found
    groups.setdefault(key, []).append((*who, spans, firsts))
    return True


def _group(
    key: tuple,
    members: list[Member],
    firsts: np.ndarray,
    cache: dict,
    done: list,
    starts: list[int] | None,
    order: list | None = None,
) -> set[int]:
    """The payloads of one group's members into `done`; returns the requests left to `probes.payload` (a
    position filed twice, or not rising). `firsts`: (members, spans, 2), each member's spans' first row and
    column. `starts`: each request's first position wanted (rising positions: a suffix of its rows). `order`
    (a fetch's, for blocks: each request's probe names in its order): a request of several probes, all
    members here, one after another in its order, gets one block in the usual case (`_blocks`)."""
    pos_parts: list[Part] = []  # positions per span: never member-major (`_rising_same`)
    val_parts = []
    n = len(members)
    for j, (_, rows, width) in enumerate(key):
        all_pos, all_vals = members[0][3][j].host_copy(cache)
        c = firsts[:, j, 1]
        if int(c.max()) + width > all_vals.shape[-1]:
            raise IndexError("a span's columns reach past its record's")
        r = firsts[:, j, 0][:, None] + np.arange(rows)  # (members, rows)
        steps, n_rows, n_cols = all_vals.shape
        at = (r[:, :, None] * n_cols + (c[:, None] + np.arange(width))[:, None, :]).reshape(-1)
        # (flat `take`s: the same elements as fancy indexing over (rows, columns), several times faster)
        if steps * rows:  # (an empty span adds no positions)
            if rows == 1 and n_rows <= n:  # read by record row, not gathered per member (`_rising_same`)
                pos_parts.append((all_pos.reshape(steps, n_rows), r[:, 0]))
            else:
                pos_parts.append(np.take(all_pos.reshape(steps, n_rows), r.reshape(-1), axis=1).reshape(steps, n, rows))
        vals = np.take(all_vals.reshape(steps, n_rows * n_cols), at, axis=1).reshape(steps, n, rows, width)
        if rows * width == 1 and steps > 1:  # (steps, members) member-major by torch's blocked 2-D transpose:
            # numpy's strided copy of it was ~5x slower (a decode span of one output: W9's, W10's)
            t = torch.from_numpy(vals.reshape(steps, n)).t().contiguous()
            val_parts.append(t.numpy().reshape(n, steps, 1))
        else:
            val_parts.append(vals.transpose(1, 0, 2, 3).reshape(n, steps * rows, width))
    vals = np.concatenate(val_parts, axis=1) if len(val_parts) > 1 else np.ascontiguousarray(val_parts[0])
    rising, same = _rising_same(pos_parts, n)
    slot_ids = list(map(id, map(itemgetter(2), members)))
    row_of: dict[int, int] = {}  # each slot's row of `bias` (its probe's), by id: slots first (requests filed
    probe_row: dict[int, int] = {}  # together share theirs), then probes
    by_row: list = []  # the probes, by row
    for sid, slot in dict(zip(slot_ids, map(itemgetter(2), members))).items():
        row = probe_row.get(id(slot.probe))
        if row is None:
            row = probe_row[id(slot.probe)] = len(by_row)
            by_row.append(slot.probe)
        row_of[sid] = row
    bias = np.stack([p.bias.numpy() for p in by_row])
    vals += bias[list(map(row_of.__getitem__, slot_ids))][:, None, :]  # (as payload: bias after the sum)
    k_out = int(vals.shape[2])
    row_vals = vals.shape[1] * k_out * 4  # bytes of a member's scores
    flat = vals.tobytes()  # (one copy; each member's bytes a slice of it, not an array and a copy each)
    p0 = _member_positions(pos_parts, 0)
    # positions: one bytes object for the members with the same ones (a composition's requests often have)
    suffix: dict[int, bytes] = {0: p0.tobytes()}  # the shared positions' bytes from a row on
    if starts is None and all(rising) and all(same) and not any(p.sigmoid for p in by_row):
        if order is not None and len(order[members[0][0]]) > 1:  # (a fetch's usual case, W10's)
            _blocks(members, order, suffix[0], flat, row_vals, k_out, done)
            return set()
        for m, item in zip(members, probe_wire.pack_rows(suffix[0], flat, n, k_out)):
            done[m[0]][m[1]] = item
        return set()
    left = set()
    for k, (i, name, slot, _, _) in enumerate(members):
        if not rising[k]:
            left.add(i)
            continue
        mine = p0 if same[k] else _member_positions(pos_parts, k)
        lo = int(np.searchsorted(mine, starts[i])) if starts is not None and starts[i] > 0 else 0
        if slot.probe.sigmoid:  # one sample's own call, as payload makes it (the same elementwise loop)
            got_vals = torch.sigmoid(torch.from_numpy(vals[k, lo:])).numpy().tobytes()
        else:
            got_vals = flat[k * row_vals + lo * k_out * 4 : (k + 1) * row_vals]
        if same[k]:
            got = suffix.get(lo)
            if got is None:
                got = suffix[lo] = p0[lo:].tobytes()
        else:
            got = mine[lo:].tobytes()
        done[i][name] = probe_wire.pack(got, got_vals, k_out)
    return left


def _blocks(
    members: list[Member],
    order: list,
    positions: bytes,
    flat: bytes,
    row_vals: int,
    k_out: int,
    done: list,
) -> None:
    """The usual case's payloads into `done`: a request of several probes all members here, one after another
    in its own order, as one block (its rows of `flat`, one slice); any other member as its item (a lone
    probe's block would save nothing: `_group` gives a group of such requests `pack_rows`)."""
    who = list(map(itemgetter(0), members))
    names = list(map(itemgetter(1), members))
    n, a = len(members), 0
    got = order[who[0]]  # (a request's names: a list, or its name -> slot dict)
    first = list(got)
    m = len(first)
    if m > 1 and n % m == 0 and names == first * (n // m):  # every request these probes in this order:
        reqs = who[::m]  # one slice of `flat` each (checked: each request's members together, its own order)
        same = all(order[i] is got or list(order[i]) == first for i in reqs)
        if same and (np.array(who).reshape(-1, m) == np.array(reqs)[:, None]).all():
            for i, block in zip(reqs, probe_wire.pack_blocks(positions, flat, first, k_out, len(reqs))):
                done[i] = block
            return
    while a < n:
        i = who[a]
        got = order[i]  # the request's probe names, in its order
        b = a + len(got)
        if b - a > 1 and b <= n and who[b - 1] == i and who[a:b].count(i) == b - a and names[a:b] == list(got):
            done[i] = probe_wire.pack_block(positions, flat[a * row_vals : b * row_vals], names[a:b], k_out)
            a = b
            continue
        done[i][names[a]] = probe_wire.pack(positions, flat[a * row_vals : (a + 1) * row_vals], k_out)
        a += 1


# a span's positions for `_rising_same`: as gathered, (steps, members, rows); or, for one-row spans of a
# record with no more rows than members, the record's (steps, record rows) and each member's row
Part = np.ndarray | tuple[np.ndarray, np.ndarray]


def _rising_same(parts: list[Part], n: int) -> tuple[list[bool], list[bool]]:
    """Per member: whether its positions (each part in turn, steps then rows) rise, and whether they equal
    member 0's — read in the gathered layout or by record row, never from a member-major copy (that
    transposed copy was the group's largest cost, and only member 0's and odd members' are needed). By
    record row, each check is one pass over the record's rows, read per member by its row: a request's
    probes at a site share its row, so the record has fewer rows than the group has members (W10: half)."""
    rising = np.ones(n, dtype=bool)
    same = np.ones(n, dtype=bool)
    last = None
    for p in parts:
        if isinstance(p, tuple):
            rec, r0 = p
            if rec.shape[0] > 1:  # from a step to the next
                up = np.asarray((rec[1:] > rec[:-1]).all(axis=0))
                rising &= up[r0]
            if last is not None:
                rising &= rec[0, r0] > last
            last = rec[-1, r0]
            eq: np.ndarray = (rec == rec[:, r0[0] : r0[0] + 1]).all(axis=0)
            same &= eq[r0]
            continue
        if p.shape[2] > 1:  # within a step
            rising &= (p[:, :, 1:] > p[:, :, :-1]).all(axis=(0, 2))
        if p.shape[0] > 1:  # from a step's last row to the next step's first
            rising &= (p[1:, :, 0] > p[:-1, :, -1]).all(axis=0)
        if last is not None:  # from the previous part's last position
            rising &= p[0, :, 0] > last
        last = p[-1, :, -1]
        same &= (p == p[:, :1]).all(axis=(0, 2))
    return rising.tolist(), same.tolist()


def _member_positions(parts: list[Part], k: int) -> np.ndarray:
    """Member k's positions in order (steps then rows, part after part)."""
    if not parts:
        return np.zeros(0, dtype=np.int64)
    got = [p[0][:, p[1][k]] if isinstance(p, tuple) else p[:, k].reshape(-1) for p in parts]
    return np.concatenate(got) if len(got) > 1 else np.ascontiguousarray(got[0])


def together(
    requests: list[Any], cache: dict, starts: list[int] | None = None, blocks: bool = False
) -> list[Payload | None]:
    """`payloads` for a fetch's requests (`blocks`: as `payloads`) or a progress RPC's asks (`starts`), or
    None for each where `probes.payload` makes it: a lone request, or all of them when this pass fails
    (logged; there a failure is that request's own)."""
    if len(requests) < 2:
        return [None] * len(requests)
    try:  # (in one torch thread: its transposes and conversions would wake the pool, `host_threads`)
        with one_thread(envs.get("VLLM_LENS_WORKER_ONE_THREAD")):
            return payloads(requests, cache, starts, blocks)
    except Exception as e:  # noqa: BLE001 - our own failure: the per-request path decides each request's fate
        logger.warning("inspect-lens: probe payloads together failed (%s: %s)", type(e).__name__, e)
        return [None] * len(requests)
