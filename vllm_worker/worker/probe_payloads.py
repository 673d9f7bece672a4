"""The probe payloads of a fetch's requests computed together: requests whose probe's spans have the same
shape (the same records, as many rows and columns in each — a batch composition's requests) are one
group, and the group's positions and scores are gathered from the records' host copies by a few array
operations for all of them, not a few per request and probe. What this does not cover (a probe over
several layers, column indices, a preempted request's recompute) is left to `probes.payload`, whose
results these equal bit for bit (tests/unit/test_probe_payloads.py). A request's group key is kept as its
spans are filed (`ProbeScores.key`, once per composition, while the device runs the step) rather than
walked here: the walk was the fetch's largest Python cost, and the fetch is on the result's critical path."""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
import torch

from vllm_worker.protocol import probe_wire
from vllm_worker.worker.probes import ProbeScores
from vllm_worker.worker.step_records import Span

logger = logging.getLogger("vllm_worker")

Member = tuple[int, str, ProbeScores, list[Span], tuple | list]  # (request index, probe name, its scores, spans read,
# each span's first row and column: r0, c0, r0, c0, ...)


def payloads(
    requests: list[dict[str, ProbeScores]], cache: dict, starts: list[int] | None = None
) -> list[dict[str, dict[str, Any]] | None]:
    """Each request's `probes.payload(got, cache=cache)`, or None where `probes.payload` must make it (some
    probe not covered here). `starts`: running requests (a progress RPC): request i's positions from
    `starts[i]` on, as `probes.payload(got, starts[i], running=True, cache=cache)`."""
    groups: dict[tuple, list[Member]] = {}
    left: set[int] = set()
    filed: dict[int, bool] = {}  # records with something filed, by id
    for i, got in enumerate(requests):
        for name, slot in got.items():
            sites = slot.probe.sites
            if len(sites) != 1:
                left.add(i)
                break
            spans = slot.spans.get(sites[0])
            index = slot.key  # the index kept as the spans were filed (`ProbeScores.index`): usually all of them
            if spans and len(index) == len(spans):
                groups.setdefault(tuple(index), []).append((i, name, slot, spans, slot.firsts))
                continue
            if not _file_walked(groups, left, (i, name, slot), cache, filed):
                break
    # an index counts every span, `_walk` only those of records with something filed (a group's records are
    # its key's: one member's tell)
    unfiled = [k for k, m in groups.items() if not all(_filed(sp, cache, filed) for sp in m[0][3])]
    for key in unfiled:
        _rewalk(groups, key, cache, filed, left)
    regrouped = bool(unfiled)
    done: list[dict[str, dict[str, Any]]] = [{} for _ in requests]  # each request's payloads by probe
    for key, members in groups.items():
        members = [m for m in members if m[0] not in left] if left else members
        if members:
            left |= _group(key, members, cache, done, starts)
    if len(groups) > 1 or regrouped:  # each request's probes in its own order (one group: filed in that order)
        done = [{name: d[name] for name in got} if len(d) == len(got) else d for d, got in zip(done, requests)]
    return [None if i in left else d for i, d in enumerate(done)]


def _walk(slot: ProbeScores, cache: dict, filed: dict[int, bool]) -> tuple[tuple, list[Span], tuple] | None:
    """(shape, spans, their first rows and columns) of the spans `probes.payload` reads (those of records
    with something filed): the shape is (record, rows, columns) per span, columns `slice(c0, c1)` as the
    filing makes them; None when not covered here (no spans: a probe over several sites, or nothing scored
    — `probes.payload` says which). For slots whose index does not cover their spans (`ProbeScores.key`)."""
    key: list[tuple[int, int, int]] = []
    spans: list[Span] = []
    firsts: list[int] = []
    for sp in slot.spans.get(slot.probe.sites[0], ()):
        if not _filed(sp, cache, filed):
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


def _filed(sp: Span, cache: dict, filed: dict[int, bool]) -> bool:
    """Whether `sp`'s record has something filed (read once per record and fetch)."""
    got = filed.get(id(sp.record))
    if got is None:
        got = filed[id(sp.record)] = sp.filed(cache)
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


def _group(key: tuple, members: list[Member], cache: dict, done: list[dict], starts: list[int] | None) -> set[int]:
    """The payloads of one group's members into `done`; returns the requests left to `probes.payload` (a
    position filed twice, or not rising). `starts`: each request's first position wanted (rising positions:
    a suffix of its rows)."""
    pos_parts, val_parts = [], []  # positions as gathered (steps, members, rows): never member-major
    n = len(members)
    firsts = np.array([m[4] for m in members], dtype=np.int64).reshape(n, len(key), 2)
    for j, (_, rows, width) in enumerate(key):
        all_pos, all_vals = members[0][3][j].host_copy(cache)
        c = firsts[:, j, 1]
        if int(c.max()) + width > all_vals.shape[-1]:
            raise IndexError("a span's columns reach past its record's")
        r = firsts[:, j, 0][:, None] + np.arange(rows)  # (members, rows)
        steps, n_rows, n_cols = all_vals.shape
        at = (r[:, :, None] * n_cols + (c[:, None] + np.arange(width))[:, None, :]).reshape(-1)
        # (flat `take`s: the same elements as fancy indexing over (rows, columns), several times faster)
        if steps * rows:
            pos_parts.append(np.take(all_pos.reshape(steps, n_rows), r.reshape(-1), axis=1).reshape(steps, n, rows))
        vals = np.take(all_vals.reshape(steps, n_rows * n_cols), at, axis=1).reshape(steps, n, rows, width)
        val_parts.append(vals.transpose(1, 0, 2, 3).reshape(n, steps * rows, width))
    vals = np.concatenate(val_parts, axis=1) if len(val_parts) > 1 else np.ascontiguousarray(val_parts[0])
    rising, same = _rising_same(pos_parts, n)
    which: dict[int, int] = {}  # each probe's row of `bias`, by id
    at = [which.setdefault(id(m[2].probe), len(which)) for m in members]
    by_row = {v: m[2].probe for m, v in zip(members, at)}
    bias = np.stack([by_row[v].bias.numpy() for v in range(len(which))])
    vals += bias[at][:, None, :]  # (as payload: bias after the sum)
    k_out = int(vals.shape[2])
    row_vals = vals.shape[1] * k_out * 4  # bytes of a member's scores
    flat = vals.tobytes()  # (one copy; each member's bytes a slice of it, not an array and a copy each)
    p0 = _member_positions(pos_parts, 0)
    # positions: one bytes object for the members with the same ones (a composition's requests often have)
    suffix: dict[int, bytes] = {0: p0.tobytes()}  # the shared positions' bytes from a row on
    if starts is None and all(rising) and all(same) and not any(p.sigmoid for p in by_row.values()):
        for m, item in zip(members, probe_wire.pack_rows(suffix[0], flat, n, k_out)):  # (a fetch's usual case)
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


def _rising_same(parts: list[np.ndarray], n: int) -> tuple[list[bool], list[bool]]:
    """Per member: whether its positions (each part's (steps, members, rows) in turn, steps then rows) rise,
    and whether they equal member 0's — read in the gathered layout, not from a member-major copy of them
    (that transposed copy was the group's largest cost, and only member 0's and odd members' are needed)."""
    rising = np.ones(n, dtype=bool)
    same = np.ones(n, dtype=bool)
    last = None
    for p in parts:
        if p.shape[2] > 1:  # within a step
            rising &= (p[:, :, 1:] > p[:, :, :-1]).all(axis=(0, 2))
        if p.shape[0] > 1:  # from a step's last row to the next step's first
            rising &= (p[1:, :, 0] > p[:-1, :, -1]).all(axis=0)
        if last is not None:  # from the previous part's last position
            rising &= p[0, :, 0] > last
        last = p[-1, :, -1]
        same &= (p == p[:, :1]).all(axis=(0, 2))
    return rising.tolist(), same.tolist()


def _member_positions(parts: list[np.ndarray], k: int) -> np.ndarray:
    """Member k's positions in order (steps then rows, part after part)."""
    if not parts:
        return np.zeros(0, dtype=np.int64)
    got = [p[:, k].reshape(-1) for p in parts]
    return np.concatenate(got) if len(got) > 1 else np.ascontiguousarray(got[0])


def together(
    requests: list[dict[str, ProbeScores]], cache: dict, starts: list[int] | None = None
) -> list[dict[str, dict[str, Any]] | None]:
    """`payloads` for a fetch's requests or a progress RPC's asks (`starts`), or None for each where
    `probes.payload` makes it: a lone request, or all of them when this pass fails (logged; there a failure
    is that request's own)."""
    if len(requests) < 2:
        return [None] * len(requests)
    try:
        return payloads(requests, cache, starts)
    except Exception as e:  # noqa: BLE001 - our own failure: the per-request path decides each request's fate
        logger.warning("inspect-lens: probe payloads together failed (%s: %s)", type(e).__name__, e)
        return [None] * len(requests)
