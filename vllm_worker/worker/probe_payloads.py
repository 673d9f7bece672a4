"""The probe payloads of a fetch's requests computed together: requests whose probe's spans have the same
shape (the same records, as many rows and columns in each — a batch composition's requests) are one
group, and the group's positions and scores are gathered from the records' host copies by a few array
operations for all of them, not a few per request and probe. What this does not cover (a probe over
several layers, column indices, a preempted request's recompute) is left to `probes.payload`, whose
results these equal bit for bit (tests/unit/test_probe_payloads.py)."""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
import torch

from vllm_worker.protocol import probe_wire
from vllm_worker.worker.probes import ProbeScores
from vllm_worker.worker.step_records import Span

logger = logging.getLogger("vllm_worker")

Member = tuple[int, str, ProbeScores, list[Span]]  # (request index, probe name, its scores, spans read)


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
            spans = _spans(slot, cache, filed) if len(slot.probe.sites) == 1 else []
            key = _key(spans)
            if key is None:
                left.add(i)
                break
            groups.setdefault(key, []).append((i, name, slot, spans))
    done: dict[tuple[int, str], dict[str, Any]] = {}
    for key, members in groups.items():
        members = [m for m in members if m[0] not in left]
        if members:
            left |= _group(key, members, cache, done, starts)
    out: list[dict[str, dict[str, Any]] | None] = []
    for i, got in enumerate(requests):
        out.append(None if i in left else {name: done[(i, name)] for name in got})
    return out


def _spans(slot: ProbeScores, cache: dict, filed: dict[int, bool]) -> list[Span]:
    """The spans `probes.payload` reads: those of records with something filed."""
    out = []
    for sp in slot.spans.get(slot.probe.sites[0], ()):
        got = filed.get(id(sp.record))
        if got is None:
            got = filed[id(sp.record)] = sp.filed(cache)
        if got:
            out.append(sp)
    return out


def _key(spans: list[Span]) -> tuple | None:
    """The shape of a one-site probe's spans (records, rows, columns: `slice(c0, c1)` as the filing makes
    them), or None when it is not covered here (no spans: a probe over several sites, or nothing scored —
    `probes.payload` says which)."""
    if not spans:
        return None
    key = []
    for sp in spans:
        c = sp.cols
        if type(c) is not slice or c.step is not None or type(c.start) is not int or type(c.stop) is not int:
            return None
        if not 0 <= c.start <= c.stop:
            return None
        key.append((id(sp.record), sp.r1 - sp.r0, c.stop - c.start))
    return tuple(key)


def _group(key: tuple, members: list[Member], cache: dict, done: dict, starts: list[int] | None) -> set[int]:
    """The payloads of one group's members into `done`; returns the requests left to `probes.payload` (a
    position filed twice, or not rising). `starts`: each request's first position wanted (rising positions:
    a suffix of its rows)."""
    pos_parts, val_parts = [], []
    n = len(members)
    for j, (_, rows, width) in enumerate(key):
        spans = [m[3][j] for m in members]
        all_pos, all_vals = spans[0].host_copy(cache)
        c = np.array([sp.cols.start for sp in spans], dtype=np.int64)  # type: ignore[union-attr]
        if int(c.max()) + width > all_vals.shape[-1]:
            raise IndexError("a span's columns reach past its record's")
        r = np.array([sp.r0 for sp in spans], dtype=np.int64)[:, None] + np.arange(rows)  # (members, rows)
        cols = c[:, None] + np.arange(width)  # (members, width)
        steps = all_pos.shape[0]
        pos_parts.append(all_pos[:, r].transpose(1, 0, 2).reshape(n, steps * rows))
        vals = all_vals[:, r[:, :, None], cols[:, None, :]]  # (steps, members, rows, width)
        val_parts.append(vals.transpose(1, 0, 2, 3).reshape(n, steps * rows, width))
    pos = np.concatenate(pos_parts, axis=1) if len(pos_parts) > 1 else np.ascontiguousarray(pos_parts[0])
    vals = np.concatenate(val_parts, axis=1) if len(val_parts) > 1 else np.ascontiguousarray(val_parts[0])
    rising: np.ndarray = np.ones(n, dtype=bool)
    if pos.shape[1] > 1:
        rising = np.asarray((pos[:, 1:] > pos[:, :-1]).all(axis=1))
    biases: dict[int, np.ndarray] = {}
    for m in members:
        if id(m[2].probe) not in biases:
            biases[id(m[2].probe)] = m[2].probe.bias.numpy()
    vals += np.stack([biases[id(m[2].probe)] for m in members])[:, None, :]  # (as payload: bias after the sum)
    # positions: one bytes object for the members with the same ones (a composition's requests often have)
    same = (pos == pos[0]).all(axis=1) if n > 1 else np.ones(n, dtype=bool)
    first = pos[0].tobytes()
    left = set()
    suffix: dict[int, bytes] = {0: first}  # the shared positions' bytes from a row on
    for k, (i, name, slot, _) in enumerate(members):
        if not rising[k]:
            left.add(i)
            continue
        lo = int(np.searchsorted(pos[k], starts[i])) if starts is not None and starts[i] > 0 else 0
        total = vals[k, lo:]
        if slot.probe.sigmoid:  # one sample's own call, as payload makes it (the same elementwise loop)
            total = torch.sigmoid(torch.from_numpy(total)).numpy()
        if same[k]:
            got = suffix.get(lo)
            if got is None:
                got = suffix[lo] = pos[0, lo:].tobytes()
        else:
            got = pos[k, lo:].tobytes()
        done[(i, name)] = probe_wire.pack(got, total.tobytes(), int(vals.shape[2]))
    return left


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
