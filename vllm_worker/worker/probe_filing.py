"""A request's probe scores as filed: one entry per batch composition and site it was scored at (where: the
composition's record and that site's columns; its first row; its rows; the request's probes then). Its
per-probe `ProbeScores` (spans of the records, and the fetch's index of them) are made from the entries only
when something reads them (`RequestResults.probes`), and a fetch of many requests reads the entries
themselves (`probe_payloads`). Filing a composition is then one append per request and site, not objects per
request and probe touched while the device waits (docs/decisions.md)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from vllm_worker.worker.step_records import Span, StepRecord


@dataclass(eq=False)
class Filed:
    """One site's part of a batch composition's record, shared by the entries of its requests."""

    record: StepRecord
    site: int
    cols: dict[tuple[str, str], tuple[int, int]]  # (probe name, uid) -> its columns [c0, c1)


Entry = tuple[Filed, int, int, list]  # (where, first row in the record, rows, the request's `DeviceProbe`s)


@dataclass
class ProbeScores:
    """A request's scores of one probe on this worker: per site, its spans of the records of the batch
    compositions it was scored in, in order."""

    probe: Any  # `probes.DeviceProbe`
    spans: dict[int, list[Span]] = field(default_factory=dict)
    # `probe_payloads`' index of the spans at the probe's first site: per span (record id, rows, columns), and
    # its first row and column; as many as there are spans when every one is indexed (else the fetch walks them)
    key: list[tuple[int, int, int]] = field(default_factory=list)
    firsts: list[int] = field(default_factory=list)

    def index(self, filed: int, record: int, rows: int, cols: int, r0: int, c0: int) -> None:
        """Index the span just filed at the probe's first site (the `filed`-th there: record id, rows, columns
        `[c0, c0 + cols)`, first row `r0`) — only while every earlier one is indexed, so that an index is
        either all of the spans or, once one was filed without it, never used again for this slot."""
        if len(self.key) == filed - 1:
            self.key.append((record, rows, cols))
            self.firsts += (r0, c0)  # (a list: extended in place)


def expand(entries: list[Entry], start: int, slots: dict[str, ProbeScores]) -> int:
    """Entries from `start` on into `slots` (probe name -> `ProbeScores`, made at a probe's first entry), in
    filing order; returns how many entries are now in (those read: a step may file more meanwhile). Each
    entry's site gives a span of its record to every probe of the request read there."""
    todo = entries[start:]
    for where, r0, n, uses in todo:
        site, rid, cols = where.site, id(where.record), where.cols
        for u in uses:
            if site not in u.weights:
                continue
            c0, c1 = cols[(u.name, u.uid)]
            slot = slots.get(u.name)
            if slot is None:
                slot = slots[u.name] = ProbeScores(u)
            spans = slot.spans.get(site)
            if spans is None:
                spans = slot.spans[site] = []
            spans.append(Span(where.record, r0, r0 + n, "scores", slice(c0, c1)))
            if u.sites[0] == site:
                slot.index(len(spans), rid, n, c1 - c0, r0, c0)
    return start + len(todo)
