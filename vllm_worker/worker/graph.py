"""The graph-safe path: capture and steering as one kernel per layer that reads device buffers.

Why: a CUDA graph replays recorded kernels and never calls Python. So the tap op, when recorded into a
graph, must do its work from buffers whose addresses never change and whose *contents* the per-step plan
fills before the forward runs:

- `ctl[col, row] = (slot, entry)` for every tap site (`taps`: a point of a layer) this stage holds and
  every row of the batch: `slot` is where the row's stream goes in the staging ring (capture), counted
  from `base` (the step's first ring row, one device scalar), `entry` which steering entry is added to
  it; -1 = nothing. Relative slots make a decode step of an unchanged batch find its table already on
  the device: only `base` moves (`reuse`), so an all-layer step uploads one scalar, not 32 columns.
  Rows beyond the step's tokens (a graph's padding) are always -1. Column-major, so a step resets and
  uploads only the columns it or the step before used: the host work per step follows
  what is requested, not how many sites are tapped (every inner point of every layer is ~10 per layer).
- `stage`: the staging ring the captured rows are written to; after the step they are copied to pinned
  host memory on a side stream (no synchronisation in the step).
- `A[entry]`, `B[entry]`: a steering entry adds `A + B * |stream|` (B: the norm-matched vectors, already
  scaled and unit-normed; `bflag` says whether B is used). One entry per (request, layer) and, for
  position-indexed vectors, per (request, layer, position); written once when the request arrives.
  Ops beyond addition (ablate, cap, set) and several of them in order are chains of entries (`op`,
  `nxt`, `lo`, `hi`; `interventions`); phases are one more entry per (request, layer) for the rows of
  generated positions, chosen by the plan from the step's positions.

On CUDA the kernel is Triton (one program per row, and per piece of an mlp_post row: one launch per tap;
a row with nothing to do returns at once, so a tap nobody uses costs one small launch inside the graph; a
whole-row edit of an mlp_post row is served by its first piece's program: `interventions.WHOLE`).
Elsewhere (CPU) the same semantics run as torch ops.
Steps this path cannot serve (Python hooks, a ring or entry table too small) run the Python path of
`python_path.PythonPath.on_tap` in a step without CUDA graphs.

Rooms: the table in `graph_table`, the entries in `graph_entries`, the ring in `graph_ring`, the Triton
kernels in `graph_kernels`; this module holds the tap op that reads them and the step's state.
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
import torch

from vllm_worker import envs
from vllm_worker.compat.version import direct_writes_on
from vllm_worker.worker import faults
from vllm_worker.worker.graph_entries import SteeringEntries, entries_for
from vllm_worker.worker.graph_kernels import make_tap_kernel
from vllm_worker.worker.graph_ring import StagingRing
from vllm_worker.worker.graph_table import ControlTable
from vllm_worker.worker.interventions import WHOLE, apply_entries

logger = logging.getLogger("vllm_worker")
_NONE: frozenset = frozenset()


def enabled() -> bool:
    return bool(envs.get("VLLM_LENS_GRAPH_PATH"))


class GraphTaps:
    """Device buffers + kernel of one model runner (one per process): the control table (`table`), the
    steering entries (`entries`) and the staging ring (`ring`), and the tap op that reads them."""

    def __init__(
        self,
        sites: list[int],
        d: int,
        dtype: torch.dtype,
        device: torch.device,
        max_rows: int,
        side: "torch.cuda.Stream | None",
    ) -> None:
        self.col = {s: i for i, s in enumerate(sites)}
        self.n_cols = len(sites)
        self.d, self.dtype, self.device = d, dtype, device
        self.max_rows = max_rows
        esize = torch.empty((), dtype=dtype).element_size()
        self.stage_rows = max(
            1, min(int(envs.get("VLLM_LENS_STAGE_MB") * (1 << 20)) // (d * esize), max_rows * self.n_cols)
        )
        n_entries = max(1, int(envs.get("VLLM_LENS_STEER_MB") * (1 << 20)) // (2 * d * esize))
        cuda = device.type == "cuda"
        self._block = 1 << (d - 1).bit_length()
        self.table = ControlTable(self.n_cols, max_rows, device)
        self.entries = SteeringEntries(n_entries, d, dtype, device)
        self.ring = StagingRing(self.stage_rows, d, dtype, device, side, self._block, cuda and direct_writes_on())
        # the tensors the kernel reads (never replaced: a recorded graph holds their addresses)
        self.ctl, self.base, self.stage = self.table.ctl, self.table.base, self.ring.stage
        self.A, self.B, self.bflag, self.gate = self.entries.A, self.entries.B, self.entries.bflag, self.entries.gate
        self.op, self.nxt, self.lo, self.hi = self.entries.op, self.entries.nxt, self.entries.lo, self.entries.hi
        self._wide: dict[int, list[tuple[int, int, int]]] = {}
        self._merged: dict[int, tuple[int, int, frozenset]] = {}  # (set through `wide`)
        # mlp_post taps served in one launch -> their pieces' sites: whole-row edits on this path (`whole`)
        self.whole: dict[int, list[int]] = {}
        self.parts_memo: dict = {}  # requests' entry parts by entries object (`plan._entry_parts`)
        self.active = False  # a step planned for this path is running (the op acts outside graphs)
        self.fired = 0  # kernel calls outside graph capture during the running step
        self.launches_in_capture = 0  # kernel calls recorded into CUDA graphs
        self.live_cols: frozenset = frozenset()  # site columns the running step uses
        self.error: str | None = None  # the kernel raised during the running step (its requests fail)
        self.broken: str | None = None  # it raised while vLLM captured a graph: the path is off for good
        self._kernel = make_tap_kernel() if cuda else None
        if cuda and self._kernel is None:
            raise RuntimeError("triton is not importable")
        if cuda:  # compile now: never for the first time while vLLM captures a graph
            for has_r in (True, False):
                z = torch.zeros((1, d), dtype=dtype, device=device)
                self._launch(z, z if has_r else None, 0)
            if self.n_cols > 1:  # (the variant of mlp_post taps: whole rows over several pieces)
                self._launch(torch.zeros((1, 2 * d), dtype=dtype, device=device), None, 0, 2)
            torch.cuda.synchronize(device)
        logger.info(
            "inspect-lens: graph-safe taps: %d rows x %d sites, staging ring %d rows (%.0f MB), %d steering entries",
            max_rows,
            self.n_cols,
            self.stage_rows,
            self.stage_rows * d * esize / (1 << 20),
            n_entries,
        )

    @property
    def direct_ok(self) -> bool:
        """The direct-write kernel is ready (CUDA, `VLLM_LENS_DIRECT_POOL`)."""
        return self.ring.direct_ok

    # ------------------------------------------------------------ inside the forward (the tap op)

    @property
    def wide(self) -> dict[int, list[tuple[int, int, int]]]:
        """mlp_post: tap site -> its pieces' (site, first column, end column) in the row."""
        return self._wide

    @wide.setter
    def wide(self, wide: dict[int, list[tuple[int, int, int]]]) -> None:
        self._wide = wide
        # tap site -> the pieces' table columns, when one launch can serve them all: consecutive columns,
        # piece j at values [j*d, j*d + d) (else a launch per piece)
        self._merged = {}
        for s, pieces in wide.items():
            cols = [self.col.get(p) for p, _, _ in pieces]
            if cols and cols[0] is not None and cols == list(range(cols[0], cols[0] + len(cols))):
                if all(lo == j * self.d for j, (_, lo, _) in enumerate(pieces)):
                    self._merged[s] = (cols[0], len(cols), frozenset(cols))
        self.whole = {s: [p for p, _, _ in wide[s]] for s in self._merged}

    def apply(self, hidden: torch.Tensor, residual: torch.Tensor | None, site: int) -> None:
        merged = self._merged.get(site)
        if merged is not None:  # mlp_post: every piece in one launch
            first, n_pieces, cols = merged
            if self._acts(hidden, cols, None):
                if self._kernel is not None:
                    self._launch(hidden, None, first, n_pieces)
                else:
                    self._apply_torch_wide(hidden, first, n_pieces)
            return
        pieces = self._wide.get(site)
        if pieces is not None:  # mlp_post: each d_model-wide piece of the row is a site of its own
            if self.active or hidden.is_cuda:  # (outside a step the CPU path does nothing: no views made)
                for s, lo, hi in pieces:
                    self._apply_site(hidden[:, lo:hi], None, s)
            return
        self._apply_site(hidden, residual, site)

    def _acts(self, hidden: torch.Tensor, cols: frozenset, col: int | None) -> bool:
        """Whether the kernel runs now at `cols` (or the one `col`): recorded into a CUDA graph, or a step of
        this path that uses one of them; counts the call."""
        if hidden.is_cuda and torch.cuda.is_current_stream_capturing():
            self.launches_in_capture += 1
            return True
        if not self.active:
            return False
        self.fired += 1
        live = self.live_cols
        if (col not in live) if col is not None else cols.isdisjoint(live):
            return False  # called from Python: sites nobody uses this step cost nothing
        faults.check("kernel")
        return True

    def _apply_site(self, hidden: torch.Tensor, residual: torch.Tensor | None, site: int) -> None:
        col = self.col.get(site)
        if col is None or not self._acts(hidden, _NONE, col):
            return
        if self._kernel is not None:
            self._launch(hidden, residual, col)
        else:
            self._apply_torch(hidden, residual, col)

    def fail(self, e: BaseException, site: int) -> None:
        """The kernel raised (`taps` caught it): fail the running step's requests, or — while vLLM records
        a graph — turn the path off for good (a graph without the kernel would silently do nothing)."""
        msg = f"graph-safe tap at site {site} failed: {type(e).__name__}: {e}"
        logger.error("inspect-lens: %s", msg)
        if self.active:
            self.error = self.error or msg
        else:
            self.broken = self.broken or msg

    def _launch(self, hidden: torch.Tensor, residual: torch.Tensor | None, col: int, pieces: int = 1) -> None:
        """The kernel over `hidden`'s rows; `pieces` > 1: a row of that many d-wide sites (columns from col)."""
        n = hidden.shape[0]
        if n == 0:
            return
        r = residual if residual is not None else hidden
        assert self._kernel is not None  # CUDA only: the torch version runs elsewhere
        self._kernel[(n, pieces)](
            hidden,
            r,
            self.ctl,
            self.base,
            self.stage,
            self.A,
            self.B,
            self.bflag,
            self.gate,
            self.op,
            self.nxt,
            self.lo,
            self.hi,
            col,
            self.max_rows,
            self.d,
            hidden.shape[1],
            hidden.stride(0),
            r.stride(0),
            HAS_R=residual is not None,
            WIDE=pieces > 1,
            BLOCK=self._block,
        )

    def _apply_torch_wide(self, hidden: torch.Tensor, first: int, pieces: int) -> None:
        """The kernel's launch over an mlp_post row's pieces (columns from `first`), as torch ops: rows
        whose chain is a whole row's (`interventions.WHOLE`) edited over the whole row, then each piece."""
        n, d = hidden.shape[0], self.d
        ent = self.ctl[first, :n, 1]
        whole = (ent >= 0) & ((self.op[ent.clamp(min=0).long()] & WHOLE) != 0)
        rows = torch.nonzero(whole).squeeze(1)
        if rows.numel():
            apply_entries(hidden, None, rows, ent[rows], self.entries, pieces)
        for j in range(pieces):
            self._apply_torch(hidden[:, j * d : (j + 1) * d], None, first + j, ~whole)

    def _apply_torch(
        self, hidden: torch.Tensor, residual: torch.Tensor | None, col: int, own: torch.Tensor | None = None
    ) -> None:
        """`own`: rows whose chain is this piece's (the others' whole row was steered: `_apply_torch_wide`)."""
        n = hidden.shape[0]
        c = self.ctl[col, :n]
        ent = c[:, 1]
        rows = torch.nonzero(ent >= 0 if own is None else (ent >= 0) & own).squeeze(1)
        if rows.numel():
            apply_entries(hidden, residual, rows, ent[rows], self.entries)
        slot = c[:, 0]
        rows = torch.nonzero(slot >= 0).squeeze(1)
        if rows.numel():
            v = hidden[rows] if residual is None else hidden[rows] + residual[rows]
            self.stage[slot[rows].long() + self.base.long(), : v.shape[1]] = v.to(self.dtype)

    # ------------------------------------------------------------ steering entries (per request)

    def add_entries(self, a: torch.Tensor, b: torch.Tensor) -> list[int] | None:
        return self.entries.add(a, b)

    def flush_entries(self) -> None:
        self.entries.flush()

    def free_entries(self, idx: list[int]) -> None:
        self.entries.free(idx)

    def drop_new_entries(self) -> None:
        self.entries.clear()

    # ------------------------------------------------------------ per step

    def ring_alloc(self, n: int, copied: bool = True) -> int | None:
        return self.ring.alloc(n, copied)

    def host_ctl(self, n: int, live_cols: frozenset) -> np.ndarray:
        return self.table.host(n, live_cols)

    def upload(self, n: int, live_cols: frozenset = frozenset(), owner: Any = None) -> None:
        """Send the table `host_ctl` handed out and start the step; `owner`: the plan it is the table of
        (`reuse` then serves that plan's next steps without an upload)."""
        self.table.upload(n, live_cols, owner)
        self._start(live_cols)

    def reuse(self, owner: Any) -> bool:
        """The next step of `owner`, whose table `ctl` still holds (nothing uploaded; its columns are the
        ones that upload used); False: it does not."""
        if owner is None or self.table.holds is not owner:
            return False
        self._start(self.table.dirty_cols)
        return True

    def set_base(self, base: int) -> None:
        self.table.set_base(base)

    def _start(self, live_cols: frozenset) -> None:
        self.active = True
        self.fired = 0
        self.error = None
        self.live_cols = live_cols

    def clear(self) -> None:
        """Before a step that does not use this path: no row may still point anywhere."""
        self.table.clear()
        self.active = False

    def copy_out(self, base: int, n: int, dst: torch.Tensor | None, direct: tuple | None = None) -> None:
        self.ring.copy_out(base, n, dst, direct)


def request_entries(g: GraphTaps, steers: list, gated: bool = False) -> tuple[dict, list[int]] | None:
    """A request's steering as entries of `g` (`graph_entries.entries_for`); None when the table is full.
    `gated`: the entries' gate starts at 0 (a probe action's steering)."""
    return entries_for(g.entries, g.col, steers, gated, g.whole)
