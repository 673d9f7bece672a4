"""The steering-entry table of the graph-safe path: `A[entry]`, `B[entry]` on the device, an entry adding
`A + B * |stream|` to a row (B: norm-matched vectors, already scaled and unit-normed; `bflag` says whether
B is used). Entries beyond addition (`op`: ablate, cap with `lo` / `hi`, set) and chains of entries applied
in order (`nxt`: the next entry, -1 none) are made by `interventions.chain_entries`. A request's entries
are written once, when it arrives, and given back when it leaves.

Identical chains are shared: a chain made from the same content (`item_key`: the vectors' bytes, op,
scale, range...) is stored once and counted per user, so 256 requests ablating one direction at 32 layers
hold 32 entries, not 8,192. Whole chains are the unit of sharing, so a shared entry's `nxt` is the same for
every user. Gated entries (a probe action's gate is per request) are never shared.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import math
from typing import Any, Callable, Hashable, Sequence

import numpy as np
import torch

from vllm_worker.protocol.ops import ADD
from vllm_worker.protocol.recent import recall, remember
from vllm_worker.worker.device_copy import distinct_rows, to_device
from vllm_worker.worker.interventions import TAIL, WHOLE, chain_entries

logger = logging.getLogger("vllm_worker")

Step = tuple[int, torch.Tensor, torch.Tensor, float, float]  # (op, A row, B row, lo, hi): one entry
# a chain's entries as stored: A's and B's k rows in the table's dtype (views of one (k, d) tensor each, made
# once: a memo's rows queued for many requests cost no op each), B's flags, (op, next of these k, lo, hi) each
Rows = tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...], list[bool], list[tuple[int, int, float, float]]]
ROWS_KEPT = 64  # chains' rows remembered by content (`SteeringEntries._chain_rows`) ...
ROWS_MAX_BYTES = 256 << 10  # ... each at most this large


class SteeringEntries:
    """The device table, its free list and the entries not yet on the device."""

    def __init__(self, n_entries: int, d: int, dtype: torch.dtype, device: torch.device) -> None:
        self.d, self.dtype, self.device = d, dtype, device
        self.A = torch.zeros((n_entries, d), dtype=dtype, device=device)
        self.B = torch.zeros((n_entries, d), dtype=dtype, device=device)
        self.bflag = torch.zeros((n_entries,), dtype=torch.int32, device=device)
        # per entry: op code (`protocol.ops`), the next entry of its chain (-1: none), cap's range
        self.op = torch.zeros((n_entries,), dtype=torch.int32, device=device)
        self.nxt = torch.full((n_entries,), -1, dtype=torch.int32, device=device)
        self.lo = torch.full((n_entries,), -math.inf, dtype=torch.float32, device=device)
        self.hi = torch.full((n_entries,), math.inf, dtype=torch.float32, device=device)
        # what an entry's add is multiplied by: 1, or a probe action's gate (0 until it fires: `actions`)
        self.gate = torch.ones((n_entries,), dtype=torch.float32, device=device)
        self._free = list(range(n_entries - 1, -1, -1))
        self._refs = [0] * n_entries  # users of each entry (a shared chain's entries: one per user)
        self._chains: dict[Hashable, list[int]] = {}  # content key -> its chain's entries, head first
        self._key_at: dict[int, Hashable] = {}  # a shared chain's head -> its key
        self.shared_hits = 0  # chains found already stored (`lens_status`)
        self.dropped = 0  # counts chains that left `_chains`: a `share` recorded before one may be stale
        self.full = 0  # requests refused because the table was full (`lens_status`)
        self.layouts: dict = {}  # request layouts by content (`interventions.chain_entries`; no tensors)
        self._rows_memo: dict[Hashable, Rows] = {}  # chains' rows by content (`_chain_rows`)
        self._warned = False
        # entries stored since the last `flush`: index -> (A row, B row, B's flag, (op, next, lo, hi), gated) on the host
        self._new: dict[int, tuple[torch.Tensor, torch.Tensor, bool, tuple, bool]] = {}

    def add(
        self,
        a: torch.Tensor,
        b: torch.Tensor,
        ops: list[int] | None = None,
        lo: list[float] | None = None,
        hi: list[float] | None = None,
        nxt: list[int] | None = None,
        gated: bool = False,
    ) -> list[int] | None:
        """Store k entries (`a`, `b`: (k, d) float32 on the host; `ops`, `lo`, `hi` per entry, `nxt` the
        next entry of each as an index into these k, -1 none — default: additions, no chains); None when
        the table is full. They reach the device with the next `flush` (`Admission.flush`: one copy for a
        step's new requests). `gated`: their gate starts at 0 (a probe action sets it)."""
        if a.shape[0] > len(self._free):
            return None
        return self._put(self._rows(a, b, ops, lo, hi, nxt), gated)

    def _rows(
        self,
        a: torch.Tensor,
        b: torch.Tensor,
        ops: list[int] | None,
        lo: list[float] | None,
        hi: list[float] | None,
        nxt: list[int] | None,
    ) -> Rows:
        """k entries as the table stores them: A and B in its dtype, B's flags, (op, next as an index into
        these k or -1, lo, hi) each."""
        flags = (b.abs().amax(dim=1) > 0).tolist()
        extras = [
            (
                0 if ops is None else ops[i],
                -1 if nxt is None else nxt[i],
                -math.inf if lo is None else lo[i],
                math.inf if hi is None else hi[i],
            )
            for i in range(a.shape[0])
        ]
        return a.to(self.dtype).unbind(0), b.to(self.dtype).unbind(0), flags, extras

    def _put(self, rows: Rows, gated: bool, idx: list[int] | None = None) -> list[int]:
        """Take free entries for `rows` (room checked by the caller; `idx`: taken already, `_take`), queued
        for the next `flush`."""
        a, b, flags, extras = rows
        if idx is None:
            idx = [self._free.pop() for _ in extras]
        for j in idx:
            self._refs[j] = 1
        for i, j in enumerate(idx):  # (a later entry at the same index replaces an earlier one)
            op, nx, lo, hi = extras[i]
            self._new[j] = (a[i], b[i], flags[i], (op, -1 if nx < 0 else idx[nx], lo, hi), gated)
        return idx

    def _take(self, rows: Rows) -> list[int] | None:
        """Free entries for `rows`: a whole row's chain (`interventions.WHOLE`) takes consecutive ones (the
        kernel finds piece j of a step at its head + j); None: no such run is free."""
        k = len(rows[3])
        if k > len(self._free):
            return None
        if not any(x[0] & WHOLE for x in rows[3]):
            return [self._free.pop() for _ in range(k)]
        free = sorted(self._free)
        for i in range(len(free) - k + 1):
            if free[i + k - 1] - free[i] == k - 1:
                run = free[i : i + k]
                taken = set(run)
                self._free = [j for j in self._free if j not in taken]
                return run
        return None

    def _give_back(self, idx: list[int]) -> None:
        """Entries `_take` handed out that were never used (a later chain of the call found no room)."""
        self._free.extend(reversed(idx))

    def flush(self) -> None:
        """The entries stored since the last flush, to the device (before any step reads them). They leave
        the queue only once copied: a failed copy leaves them queued for the caller to fail their requests
        (`Admission.abandon`), as `admission.ToDevice` does."""
        if not self._new:
            return
        pending = self._new
        # A, B, ... of each entry; rows equal requests share (`_chain_rows`' memo) cross once
        sent, which = distinct_rows([r for a, b, *_ in pending.values() for r in (a, b)])
        spread = len(sent) < len(which)
        idx = to_device(torch.tensor([*pending, *(which if spread else ())], dtype=torch.long), self.device)
        rows = to_device(torch.stack(sent), self.device)
        if spread:
            rows = rows.index_select(0, idx[len(pending) :])
        idx = idx[: len(pending)]
        ints = [(f, x[0], x[1]) for _, _, f, x, _ in pending.values()]
        ints_d = to_device(torch.tensor(ints, dtype=torch.int32), self.device)  # flag, op, next
        bounds = to_device(
            torch.tensor([x[2:] for _, _, _, x, _ in pending.values()], dtype=torch.float32), self.device
        )
        gates = to_device(torch.tensor([0.0 if g else 1.0 for *_, g in pending.values()]), self.device)
        self.A.index_copy_(0, idx, rows[0::2])
        self.B.index_copy_(0, idx, rows[1::2])
        self.bflag.index_copy_(0, idx, ints_d[:, 0].contiguous())
        self.op.index_copy_(0, idx, ints_d[:, 1].contiguous())
        self.nxt.index_copy_(0, idx, ints_d[:, 2].contiguous())
        self.lo.index_copy_(0, idx, bounds[:, 0].contiguous())
        self.hi.index_copy_(0, idx, bounds[:, 1].contiguous())
        self.gate.index_copy_(0, idx, gates)
        self._new = {}

    def add_chains(
        self, chains: Sequence[tuple[Hashable | None, Any]], gated: bool = False
    ) -> tuple[list[int], list[int]] | None:
        """Chains of entries, each `(key, steps)`: `steps` a list of `Step`s, or a function making them
        (called only when no chain with that key is stored); `key` None: never shared. Returns each
        chain's head and every entry taken (one per use: what `free` gives back), or None when the table
        is full (nothing taken)."""
        keys = [None if gated else k for k, _ in chains]
        made: set[Hashable] = set()
        fresh: list[tuple[int, Rows | None]] = []  # (chain index, its rows; None: no steps) stored anew
        for i, (key, steps) in enumerate(chains):
            if keys[i] is not None and (key in self._chains or key in made):
                continue
            if keys[i] is not None:
                made.add(key)
            fresh.append((i, self._chain_rows(key, steps)))
        if sum(len(r[3]) for _, r in fresh if r is not None) > len(self._free):
            self.refused()
            return None
        got: list[list[int]] = []
        for _, rows in fresh:
            ids = [] if rows is None else self._take(rows)
            if ids is None:  # (a whole row's run of consecutive entries: none free)
                for done in reversed(got):
                    self._give_back(done)
                self.refused()
                return None
            got.append(ids)
        stored: dict[int, list[int]] = {}
        for (i, rows), ids in zip(fresh, got):
            if rows is None:
                stored[i] = []
                continue
            stored[i] = self._put(rows, gated, ids)
            if keys[i] is not None:  # (found by later requests until its last user leaves)
                self._chains[keys[i]] = stored[i]
                self._key_at[stored[i][0]] = keys[i]
        heads: list[int] = []
        taken: list[int] = []
        for i, key in enumerate(keys):
            ids = stored.get(i)
            if ids is None:  # stored before (or earlier in this call): one more user
                ids = self._chains.get(key, [])  # (a chain without steps is never stored)
                for j in ids:
                    self._refs[j] += 1
                self.shared_hits += bool(ids)
            heads.append(ids[0] if ids else -1)
            taken += ids
        return heads, taken

    def share(self, ids: list[int], hits: int) -> None:
        """One more user of stored chains' entries `ids` (as `add_chains` returned them for a request that
        found all its chains stored, `hits` of them; valid while `dropped` has not moved since): what
        `add_chains` does for such a request, without building its keys (`admit_templates`)."""
        refs = self._refs
        for j in ids:
            refs[j] += 1
        self.shared_hits += hits

    def _chain_rows(self, key: Hashable | None, steps: Any) -> Rows | None:
        """A chain's rows as the table stores them (`steps`: its `Step`s or a function making them; None:
        no steps), remembered by content (`key`; LRU, `ROWS_KEPT`): requests whose chains are never shared
        (a probe action's, gated per request) or stored again after their last holder left skip building
        them. The memo holds rows made here (stacked anew), never a view of a request's vectors."""
        got = None if key is None else recall(self._rows_memo, key)
        if got is None:
            steps = steps() if callable(steps) else steps
            if not steps:
                return None
            # each entry's next step: the one after it, or — whole rows — the next step's first piece
            heads = [j for j, s in enumerate(steps) if not s[0] & TAIL] + [-1]
            nxt = [-1] * len(steps)
            for h, h2 in zip(heads, heads[1:]):
                nxt[h] = h2
            got = self._rows(
                torch.stack([s[1] for s in steps]),
                torch.stack([s[2] for s in steps]),
                [s[0] for s in steps],
                [s[3] for s in steps],
                [s[4] for s in steps],
                nxt,
            )
            flags = got[2]
            for h, h2 in zip(heads, heads[1:]):  # a whole step's B: used when any of its pieces is
                flags[h] = any(flags[h : h2 if h2 >= 0 else len(flags)])
            row = got[0][0]  # (A and B: as many rows, each d wide)
            if key is not None and 2 * len(got[0]) * row.numel() * row.element_size() <= ROWS_MAX_BYTES:
                remember(self._rows_memo, key, got, ROWS_KEPT)
        return got

    def refused(self) -> None:
        """A request's entries did not fit: it takes the Python path (slow under CUDA graphs). Counted
        for `lens_status` and said once in the log, naming the setting that sizes the table."""
        self.full += 1
        if not self._warned:
            self._warned = True
            logger.warning(
                "inspect-lens: the steering-entry table is full (%d entries of d=%d, %d in use): requests "
                "that do not fit take the Python path, much slower under CUDA graphs; raise "
                "VLLM_LENS_STEER_MB (counted as steer_table_full in lens_status)",
                self.A.shape[0],
                self.d,
                self.in_use(),
            )

    def in_use(self) -> int:
        """Entries held by live requests (`lens_status`)."""
        return self.A.shape[0] - len(self._free)

    def shared_chains(self) -> int:
        """Chains stored under a content key (`lens_status`)."""
        return len(self._chains)

    def free(self, idx: list[int]) -> None:
        """Give back entries taken by `add` / `add_chains` (each listed once per use): an entry returns to
        the free list when its last user leaves, and a shared chain's key goes with its head."""
        for j in idx:
            r = self._refs[j] - 1
            if r < 0:  # (a bug of ours: never hand the entry out twice, never stop the engine's step)
                logger.error("inspect-lens: steering entry %d given back more often than taken", j)
                continue
            self._refs[j] = r
            if r == 0:
                self._free.append(j)
                key = self._key_at.pop(j, None)
                if key is not None:
                    self._chains.pop(key, None)
                    self.dropped += 1

    def clear(self) -> None:
        """Drop the queued entries (their requests failed: `Admission.abandon`, which frees them next): no
        later request may find a chain whose entries never reached the device."""
        for j in self._new:
            key = self._key_at.pop(j, None)
            if key is not None:
                self._chains.pop(key, None)
                self.dropped += 1
        self._new = {}


def _hasher() -> Callable[[], Any]:
    """BLAKE3 (vLLM depends on it; several times faster than hashlib's BLAKE2 over a request's vectors, which
    every request with steering pays at admission), else BLAKE2b: both collision-resistant, so a request
    can never be given another one's entries by a crafted vector."""
    try:
        from blake3 import blake3
    except ImportError:
        return lambda: hashlib.blake2b(digest_size=16)
    return blake3


_HASHER = _hasher()


def digest(t: torch.Tensor) -> bytes:
    """A content digest of a host tensor's bytes (its dtype and shape included)."""
    h = _HASHER()
    h.update(f"{t.dtype}{tuple(t.shape)}".encode())
    if t.numel():
        h.update(t.contiguous().view(torch.uint8).numpy())
    return h.digest()[:16]


def item_key(st: Any, row: int, k: int = -1) -> tuple:
    """What one steering row contributes to a chain, as a key: its vector's content (`DeviceSteer.digest`),
    which row (and position row `k` of a 3-D vector), and every field the arithmetic reads."""
    if st.digest is None:
        st.digest = digest(st.vectors)
    keep = None if st.keep is None else digest(st.keep)
    return (st.digest, row, k, st.op, float(st.scale), bool(st.norm_match), st.lo, st.hi, keep)


def entries_for(
    table: SteeringEntries,
    sites: dict[int, int],
    steers: list[Any],
    gated: bool = False,
    wide: dict[int, list[int]] | None = None,
) -> tuple[dict, list[int]] | None:
    """A request's steering (`plan.DeviceSteer`s) as entries of `table`: per site this stage holds (`sites`:
    site -> column), one default entry (its position-independent vectors) and one per position its 3-D
    vectors name (the default plus those). None when the table is full (the request then takes the Python
    path). Steering beyond plain addition, and whole rows at an mlp_post tap's own site (`wide`: tap ->
    its pieces' sites; ungated only): `interventions.chain_entries`. Entries with the same content as
    stored ones are shared (`SteeringEntries.add_chains`)."""
    whole = wide is not None and not gated and any(l in wide for st in steers for l in st.layers)
    if whole or not all(st.plain for st in steers):
        if gated:  # (validation keeps a probe action's steering to plain additions)
            raise ValueError("a probe action's steering is a plain addition")
        return chain_entries(table, sites, steers, item_key, wide if whole else None)
    chains: list[tuple[Hashable, Any]] = []
    layout: list[tuple[int, bool, list[int]]] = []
    for layer in sorted({l for st in steers for l in st.layers if l in sites}):  # `layer`: a site
        mine = [(st, st.layers[layer]) for st in steers if layer in st.layers]
        defaults = [(st, row) for st, row in mine if st.positions is None]
        named: dict[int, list[tuple[Any, int, int]]] = {}
        for st, row in mine:
            if st.positions is not None:
                last = {p: k for k, p in enumerate(st.positions)}  # a repeated position: the last row wins
                for p, k in last.items():
                    named.setdefault(p, []).append((st, row, k))
        positions = sorted(named)
        base = tuple(item_key(st, row) for st, row in defaults)
        if defaults:
            chains.append((("add", base, ()), functools.partial(_plain_step, table.d, defaults, [])))
        for p in positions:
            key = ("add", base, tuple(item_key(st, row, k) for st, row, k in named[p]))
            chains.append((key, functools.partial(_plain_step, table.d, defaults, named[p])))
        layout.append((layer, bool(defaults), positions))
    if not chains:
        return {}, []
    got = table.add_chains(chains, gated)
    if got is None:
        return None
    heads, ids = got
    out: dict[int, tuple[int, np.ndarray, np.ndarray, int, int]] = {}
    k = 0
    for layer, has_default, positions in layout:
        default = -1
        if has_default:
            default, k = heads[k], k + 1
        ents = np.array(heads[k : k + len(positions)], dtype=np.int32)
        k += len(positions)
        out[layer] = (default, np.array(positions, dtype=np.int64), ents, -1, -1)  # (no phase: `interventions`)
    return out, ids


_NONE_NAMED = np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int32)  # (read-only: no named positions)
for _a in _NONE_NAMED:
    _a.flags.writeable = False


def gated_rows(table: SteeringEntries, sites: dict[int, int], steers: list[Any]) -> list[tuple[int, Rows]] | None:
    """The rows of a probe action's steering (`steers`: plain, 2-D, one gate) per site, as `entries_for`
    stores them for it (`put_gated`), made from content only: a template keeps them for equal requests
    (`admit_templates`). None: steering this shortcut does not cover (then `entries_for`)."""
    if not all(st.plain and st.positions is None for st in steers):
        return None
    out: list[tuple[int, Rows]] = []
    for layer in sorted({l for st in steers for l in st.layers if l in sites}):
        defaults = [(st, st.layers[layer]) for st in steers if layer in st.layers]
        key = ("add", tuple(item_key(st, row) for st, row in defaults), ())
        rows = table._chain_rows(key, functools.partial(_plain_step, table.d, defaults, []))
        assert rows is not None  # (a plain step is one entry)
        out.append((layer, rows))
    return out


def put_gated(table: SteeringEntries, rows: list[tuple[int, Rows]]) -> tuple[dict, list[int]] | None:
    """`gated_rows`' entries for one request (gated entries are never shared: fresh ones, gate 0), as
    `entries_for(..., gated=True)` takes them; None when the table is full (nothing taken)."""
    if not rows:
        return {}, []
    if sum(len(r[3]) for _, r in rows) > len(table._free):
        table.refused()
        return None
    out: dict[int, tuple[int, np.ndarray, np.ndarray, int, int]] = {}
    ids: list[int] = []
    for layer, r in rows:
        got = table._put(r, True)
        out[layer] = (got[0], *_NONE_NAMED, -1, -1)
        ids += got
    return out, ids


def _plain_step(d: int, defaults: list, named: list) -> list[Step]:
    """One entry adding the position-independent rows (`defaults`: (steer, row)) and a position's rows
    (`named`: (steer, row, k)): `A` the plain sum, `B` the norm-matched one."""
    da, db = torch.zeros(d), torch.zeros(d)  # (on the host: `add` takes host rows)
    for st, row in defaults:
        v = _scaled(st, st.vectors[row].float())
        if st.norm_match:
            db += v
        else:
            da += v
    if not named:
        return [(ADD, da, db, -math.inf, math.inf)]
    pa: torch.Tensor | None = None
    pb: torch.Tensor | None = None
    for st, row, k in named:
        v = _scaled(st, st.vectors[row][k].float())
        if st.norm_match:
            pb = v if pb is None else pb + v
        else:
            pa = v if pa is None else pa + v
    return [(ADD, da if pa is None else da + pa, db if pb is None else db + pb, -math.inf, math.inf)]


def _scaled(st: Any, v: torch.Tensor) -> torch.Tensor:
    if st.norm_match:
        v = v / v.norm(dim=-1, keepdim=True).clamp_min(1e-12)
    return v * st.scale
