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

On CUDA the kernel is Triton (one program per row; a row with nothing to do returns at once, so a layer
nobody uses costs one small launch inside the graph). Elsewhere (CPU) the same semantics run as torch ops.
Steps this path cannot serve (Python hooks, a ring or entry table too small) run the Python path of
`runtime.LensRuntime.on_tap` in a step without CUDA graphs.
"""

from __future__ import annotations

import collections
import logging
from typing import Any

import numpy as np
import torch

from vllm_worker import envs
from vllm_worker.transport.result_pool import host_array
from vllm_worker.worker import faults

logger = logging.getLogger("vllm_worker")

STAGE_MB = envs.get("VLLM_LENS_STAGE_MB")
STEER_MB = envs.get("VLLM_LENS_STEER_MB")
# programs of the direct-write kernel (`transport.early`): the host link bounds it (measured on the H200: a
# program per row reached 52 GB/s, as much as a DMA copy, and slowed matmuls beside it by as much again)
SCATTER_PROGRAMS = 64


def upload(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Host tensor `t` on `device`. On CUDA from pinned memory, asynchronously in the stream's order (a copy
    from pageable memory waits for the stream); torch's caching host allocator keeps the pinned buffer
    until the copy is done."""
    if device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


def enabled() -> bool:
    return bool(envs.get("VLLM_LENS_GRAPH_PATH"))


def _triton_kernel() -> Any:
    try:
        import triton
        import triton.language as tl
    except ImportError:
        return None

    @triton.jit
    def tap_kernel(
        h_ptr,
        r_ptr,
        ctl_ptr,
        base_ptr,
        stage_ptr,
        a_ptr,
        b_ptr,
        bflag_ptr,
        col,
        max_rows,
        d,
        w,
        stride_h,
        stride_r,
        HAS_R: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        i = tl.program_id(0)
        c = (col * max_rows + i) * 2
        slot = tl.load(ctl_ptr + c)
        ent = tl.load(ctl_ptr + c + 1)
        if (slot >= 0) | (ent >= 0):
            offs = tl.arange(0, BLOCK)
            m = offs < w  # the site's width: d, or fewer values (router logits) in a d-wide staging row
            hp = h_ptr + i.to(tl.int64) * stride_h + offs
            h = tl.load(hp, mask=m, other=0.0)
            if HAS_R:
                r = tl.load(r_ptr + i.to(tl.int64) * stride_r + offs, mask=m, other=0.0).to(tl.float32)
            else:
                r = tl.zeros([BLOCK], dtype=tl.float32)
            if ent >= 0:
                e = ent.to(tl.int64) * d
                add = tl.load(a_ptr + e + offs, mask=m, other=0.0).to(tl.float32)
                if tl.load(bflag_ptr + ent) != 0:
                    s = h.to(tl.float32) + r
                    nrm = tl.sqrt(tl.sum(s * s, axis=0))
                    add += tl.load(b_ptr + e + offs, mask=m, other=0.0).to(tl.float32) * nrm
                h = (h.to(tl.float32) + add).to(h.dtype)
                tl.store(hp, h, mask=m)
            if slot >= 0:
                out = (h.to(tl.float32) + r).to(stage_ptr.dtype.element_ty)
                at = slot.to(tl.int64) + tl.load(base_ptr).to(tl.int64)
                tl.store(stage_ptr + at * d + offs, out, mask=m)

    return tap_kernel


def _triton_scatter() -> Any:
    import triton
    import triton.language as tl

    @triton.jit(do_not_specialize=["first", "n"])
    def scatter_kernel(stage_ptr, dst_ptr, off_ptr, first, n, d, BLOCK: tl.constexpr):
        """Staging rows `first + i` (i < n) to element `off[i]` from `dst_ptr` (host memory the GPU can
        write; -1: not written), each program every `num_programs`-th row: the writes are bound by the
        host link, and a few programs keep it busy without taking the SMs from the forward."""
        offs = tl.arange(0, BLOCK)
        m = offs < d
        for i in range(tl.program_id(0), n, tl.num_programs(0)):
            o = tl.load(off_ptr + i)
            if o >= 0:
                v = tl.load(stage_ptr + (first + i).to(tl.int64) * d + offs, mask=m)
                tl.store(dst_ptr + o + offs, v, mask=m)

    return scatter_kernel


class _Address:
    """An address as a kernel argument (Triton asks an argument for `data_ptr()` and `dtype`): the start of
    registered host memory, which has no tensor of its own."""

    __slots__ = ("ptr", "dtype")

    def __init__(self, ptr: int, dtype: torch.dtype) -> None:
        self.ptr, self.dtype = ptr, dtype

    def data_ptr(self) -> int:
        return self.ptr


def _host_scatter(src: np.ndarray, origin: int, span: int, offs: np.ndarray) -> None:
    """What the scatter kernel does, on the host (CPU engines): the same offsets, the same memory."""
    import ctypes

    flat = np.frombuffer(memoryview((ctypes.c_byte * span).from_address(origin)), dtype=src.dtype)
    keep = offs >= 0
    flat[offs[keep][:, None] + np.arange(src.shape[1])] = src[keep]


class GraphTaps:
    """Device buffers + kernel of one model runner (one per process)."""

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
        self.stage_rows = max(1, min(int(STAGE_MB * (1 << 20)) // (d * esize), max_rows * self.n_cols))
        n_entries = max(1, int(STEER_MB * (1 << 20)) // (2 * d * esize))
        cuda = device.type == "cuda"
        self.ctl = torch.full((self.n_cols, max_rows, 2), -1, dtype=torch.int32, device=device)
        self.base = torch.zeros(1, dtype=torch.int32, device=device)  # the running step's first ring row
        self._base = 0  # ... as last set from the host
        self.stage = torch.empty((self.stage_rows, d), dtype=dtype, device=device)
        self.A = torch.zeros((n_entries, d), dtype=dtype, device=device)
        self.B = torch.zeros((n_entries, d), dtype=dtype, device=device)
        self.bflag = torch.zeros((n_entries,), dtype=torch.int32, device=device)
        self._free = list(range(n_entries - 1, -1, -1))
        # entries stored since the last `flush_entries`: index -> (A row, B row, B's flag) on the host
        self._new_entries: dict[int, tuple[torch.Tensor, torch.Tensor, bool]] = {}
        # double-buffered host copies of ctl (pinned on CUDA: the upload is asynchronous)
        self._host = [torch.full((self.n_cols, max_rows, 2), -1, dtype=torch.int32, pin_memory=cuda) for _ in range(2)]
        self._host_ev: list[Any] = [None, None]
        # a step using several columns uploads them as one block (gathered from the host table, one copy,
        # one scatter into `ctl` on the device) instead of one copy per column
        self._blk = [torch.empty(self.n_cols * max_rows * 2, dtype=torch.int32, pin_memory=cuda) for _ in range(2)]
        self._blk_dev = torch.empty(self.n_cols * max_rows * 2, dtype=torch.int32, device=device)
        self._col_index: dict[tuple[int, ...], torch.Tensor] = {}
        self._turn = 0
        self.dirty = 0  # rows of ctl that may hold something other than -1 ...
        self.dirty_cols: frozenset = frozenset()  # ... in these columns
        self._fill_cols: list[int] = []  # columns the step being prepared resets and uploads
        self.active = False  # a step planned for this path is running (the op acts outside graphs)
        self.fired = 0  # kernel calls outside graph capture during the running step
        self.launches_in_capture = 0  # kernel calls recorded into CUDA graphs
        self.live_cols: frozenset = frozenset()  # site columns the running step uses
        self.holds: Any = None  # the plan (`plan.GraphPlan`) whose table `ctl` holds now, if any
        self.error: str | None = None  # the kernel raised during the running step (its requests fail)
        self.broken: str | None = None  # it raised while vLLM captured a graph: the path is off for good
        self._side = side
        self._ring_pos = 0
        self._pending: collections.deque = collections.deque()  # (start, end, event) copies in flight
        self._kernel = _triton_kernel() if cuda else None
        if cuda and self._kernel is None:
            raise RuntimeError("triton is not importable")
        self._block = 1 << (d - 1).bit_length()
        # direct mode (`transport.early`): per step, the rows' offsets into the result pool (pinned, two
        # turns: a step's offsets are not overwritten before their upload ran) and their device copy
        self._scatter: Any = None
        self._offs_host: list[torch.Tensor] = []
        self._offs_ev: list[Any] = [None, None]
        self._offs_dev: torch.Tensor | None = None
        self._offs_turn = 0
        self.direct_ok = False  # the direct-write kernel is ready (CUDA, `VLLM_LENS_DIRECT_POOL`)
        if cuda and envs.get("VLLM_LENS_DIRECT_POOL"):
            try:
                self._scatter = _triton_scatter()
                self._offs_host = [torch.empty(self.stage_rows, dtype=torch.int64, pin_memory=True) for _ in range(2)]
                self._offs_dev = torch.full((self.stage_rows,), -1, dtype=torch.int64, device=device)
                probe = torch.zeros(d, dtype=dtype, pin_memory=True)  # compile now, not in a step
                self.stage[0].normal_()
                self._offs_dev[0] = 0
                self._scatter[(1,)](
                    self.stage, _Address(probe.data_ptr(), dtype), self._offs_dev, 0, 1, d, BLOCK=self._block
                )
                torch.cuda.synchronize(device)
                if not torch.equal(probe, self.stage[0].cpu()):
                    raise RuntimeError("the kernel's write to host memory did not land")
                self.direct_ok = True
            except Exception as e:  # noqa: BLE001 - captures are copied on the host instead
                logger.error("inspect-lens: direct writes into the result pool are off (%s: %s)", type(e).__name__, e)
        if cuda:  # compile now: never for the first time while vLLM captures a graph
            for has_r in (True, False):
                z = torch.zeros((1, d), dtype=dtype, device=device)
                self._launch(z, z if has_r else None, 0)
            torch.cuda.synchronize(device)
        logger.info(
            "inspect-lens: graph-safe taps: %d rows x %d sites, staging ring %d rows (%.0f MB), %d steering entries",
            max_rows,
            self.n_cols,
            self.stage_rows,
            self.stage_rows * d * esize / (1 << 20),
            n_entries,
        )

    # ------------------------------------------------------------ inside the forward (the tap op)

    def apply(self, hidden: torch.Tensor, residual: torch.Tensor | None, site: int) -> None:
        col = self.col.get(site)
        if col is None:
            return
        if hidden.is_cuda and torch.cuda.is_current_stream_capturing():
            self.launches_in_capture += 1
        elif not self.active:
            return
        else:
            self.fired += 1
            if col not in self.live_cols:  # called from Python: sites nobody uses this step cost nothing
                return
            faults.check("kernel")
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

    def _launch(self, hidden: torch.Tensor, residual: torch.Tensor | None, col: int) -> None:
        n = hidden.shape[0]
        if n == 0:
            return
        r = residual if residual is not None else hidden
        assert self._kernel is not None  # CUDA only: the torch version runs elsewhere
        self._kernel[(n,)](
            hidden,
            r,
            self.ctl,
            self.base,
            self.stage,
            self.A,
            self.B,
            self.bflag,
            col,
            self.max_rows,
            self.d,
            hidden.shape[1],
            hidden.stride(0),
            r.stride(0),
            HAS_R=residual is not None,
            BLOCK=self._block,
        )

    def _apply_torch(self, hidden: torch.Tensor, residual: torch.Tensor | None, col: int) -> None:
        n = hidden.shape[0]
        c = self.ctl[col, :n]
        ent = c[:, 1]
        rows = torch.nonzero(ent >= 0).squeeze(1)
        if rows.numel():
            e = ent[rows].long()
            h = hidden[rows].float()
            add = self.A[e].float()
            bf = self.bflag[e] != 0
            if bool(bf.any()):
                s = h if residual is None else h + residual[rows].float()
                add = add + self.B[e].float() * (s.norm(dim=-1, keepdim=True) * bf.unsqueeze(1))
            hidden[rows] = (h + add).to(hidden.dtype)
        slot = c[:, 0]
        rows = torch.nonzero(slot >= 0).squeeze(1)
        if rows.numel():
            v = hidden[rows] if residual is None else hidden[rows] + residual[rows]
            self.stage[slot[rows].long() + self.base.long(), : v.shape[1]] = v.to(self.dtype)

    # ------------------------------------------------------------ steering entries (per request)

    def add_entries(self, a: torch.Tensor, b: torch.Tensor) -> list[int] | None:
        """Store k entries (`a`, `b`: (k, d) float32 on the host); None when the table is full. They reach
        the device with the next `flush_entries` (`Admission.flush`: one copy for a step's new requests)."""
        k = a.shape[0]
        if k > len(self._free):
            return None
        idx = [self._free.pop() for _ in range(k)]
        flags = (b.abs().amax(dim=1) > 0).tolist()
        a, b = a.to(self.dtype), b.to(self.dtype)
        for i, j in enumerate(idx):  # (a later entry at the same index replaces an earlier one)
            self._new_entries[j] = (a[i], b[i], flags[i])
        return idx

    def flush_entries(self) -> None:
        """The entries stored since the last flush, to the device (before any step reads them)."""
        if not self._new_entries:
            return
        pending, self._new_entries = self._new_entries, {}
        idx = upload(torch.tensor(list(pending), dtype=torch.long), self.device)
        rows = upload(torch.stack([r for a, b, _ in pending.values() for r in (a, b)]), self.device)  # A, B, A, ...
        flags = upload(torch.tensor([f for _, _, f in pending.values()], dtype=torch.int32), self.device)
        self.A.index_copy_(0, idx, rows[0::2])
        self.B.index_copy_(0, idx, rows[1::2])
        self.bflag.index_copy_(0, idx, flags)

    def free_entries(self, idx: list[int]) -> None:
        self._free.extend(idx)

    # ------------------------------------------------------------ per step

    def ring_alloc(self, n: int) -> int | None:
        """First slot of `n` consecutive staging rows for this step (waits for old copies of them)."""
        if n > self.stage_rows:
            return None
        base = self._ring_pos if self._ring_pos + n <= self.stage_rows else 0
        end = base + n
        for item in list(self._pending):
            s, e, ev = item
            if ev is None or ev.query():
                self._pending.remove(item)
            elif s < end and base < e:
                ev.synchronize()
                self._pending.remove(item)
        self._ring_pos = end
        return base

    def host_ctl(self, n: int, live_cols: frozenset) -> np.ndarray:
        """The host table for this step (`[col, row]`): in the columns the step uses (`live_cols`) and those
        the last step left dirty, rows [0, max(n, dirty)) reset to -1; `upload` sends those columns."""
        k = self._turn
        ev = self._host_ev[k]
        if ev is not None:
            ev.synchronize()
        m = max(n, self.dirty)
        h = self._host[k].numpy()
        self._fill_cols = sorted(live_cols | self.dirty_cols)
        if self._fill_cols:
            h[self._fill_cols, :m] = -1
        self._fill_rows = m
        return h

    def upload(self, n: int, live_cols: frozenset = frozenset(), owner: Any = None) -> None:
        """Send the table `host_ctl` handed out (its columns to reset and fill); `owner`: the plan it is
        the table of (`reuse` then serves that plan's next steps without an upload)."""
        k = self._turn
        m = self._fill_rows
        cols = self._fill_cols
        if len(cols) > 1 and m:
            c = len(cols)
            blk = self._blk[k][: c * m * 2].view(c, m, 2)
            blk.numpy()[...] = self._host[k].numpy()[cols, :m]
            dev = self._blk_dev[: c * m * 2].view(c, m, 2)
            dev.copy_(blk, non_blocking=True)
            self.ctl[:, :m].index_copy_(0, self._cols_index(cols), dev)
        else:
            for c in cols:
                self.ctl[c, :m].copy_(self._host[k][c, :m], non_blocking=True)
        if self.device.type == "cuda":
            ev = torch.cuda.Event()
            ev.record()
            self._host_ev[k] = ev
        self._turn = 1 - k
        self.dirty = n
        self.dirty_cols = live_cols
        self.holds = owner
        self._start(live_cols)

    def reuse(self, owner: Any) -> bool:
        """The next step of `owner`, whose table `ctl` still holds (nothing uploaded; its columns are the
        ones that upload used); False: it does not."""
        if owner is None or self.holds is not owner:
            return False
        self._start(self.dirty_cols)
        return True

    def set_base(self, base: int) -> None:
        """The step's first staging row (a scalar written on the device's stream, in order with the steps)."""
        if base != self._base:
            self.base.fill_(base)
            self._base = base

    def _start(self, live_cols: frozenset) -> None:
        self.active = True
        self.fired = 0
        self.error = None
        self.live_cols = live_cols

    def _cols_index(self, cols: list[int]) -> torch.Tensor:
        """The columns as a device index (made once per set of columns: steps of a plan share it)."""
        key = tuple(cols)
        got = self._col_index.get(key)
        if got is None:
            if len(self._col_index) >= 256:
                self._col_index.clear()
            got = self._col_index[key] = torch.tensor(cols, dtype=torch.long, device=self.device)
        return got

    def clear(self) -> None:
        """Before a step that does not use this path: no row may still point anywhere."""
        if self.dirty:
            for c in self.dirty_cols:
                self.ctl[c, : self.dirty].fill_(-1)
            self.dirty = 0
            self.dirty_cols = frozenset()
        self.holds = None
        self.active = False

    def copy_out(self, base: int, n: int, dst: torch.Tensor | None, direct: tuple | None = None) -> None:
        """The step's captured rows into `dst` (pinned host memory on CUDA: asynchronously, on the side
        stream after the step's kernels; their staging rows are reused once the copy is done). `direct`:
        (origin, span, offsets, _) from `EarlyAssembler.direct_rows`: the rows are (also, or with `dst`
        None only) written there, by the GPU."""
        src = self.stage[base : base + n]
        if self._side is None:
            if dst is not None:
                dst.copy_(src)
            if direct is not None:
                _host_scatter(host_array(src), direct[0], direct[1], direct[2])
            return
        side = self._side
        side.wait_stream(torch.cuda.current_stream(self.device))
        if direct is not None:
            offs = self._offsets(direct[2])
        with torch.cuda.stream(side):
            if direct is not None:
                dev = self._offs_dev
                assert dev is not None  # made by `_offsets`
                dev[:n].copy_(offs, non_blocking=True)
                self._offs_ev[self._offs_turn] = torch.cuda.Event()
                self._offs_ev[self._offs_turn].record(side)
                self._offs_turn ^= 1
                self._scatter[(min(n, SCATTER_PROGRAMS),)](
                    self.stage, _Address(direct[0], self.dtype), dev, base, n, self.d, BLOCK=self._block
                )
            if dst is not None:
                dst.copy_(src, non_blocking=True)
            ev = torch.cuda.Event()
            ev.record(side)
        self._pending.append((base, base + n, ev))

    def _offsets(self, offs: np.ndarray) -> torch.Tensor:
        """`offs` in this turn's pinned buffer (waiting for the upload that last used it)."""
        n = len(offs)
        if self._scatter is None or n > self.stage_rows:
            raise RuntimeError("direct writes were not set up (VLLM_LENS_DIRECT_POOL at start-up)")
        k = self._offs_turn
        ev = self._offs_ev[k]
        if ev is not None:
            ev.synchronize()
        h = self._offs_host[k][:n]
        h.numpy()[:] = offs
        return h


def request_entries(g: GraphTaps, steers: list) -> tuple[dict, list[int]] | None:
    """A request's steering (`plan.DeviceSteer`s) as entries of `g`: per layer this stage holds, one
    default entry (its position-independent vectors) and one per position its 3-D vectors name (the
    default plus those). None when the table is full (the request then takes the Python path)."""
    rows_a: list[torch.Tensor] = []
    rows_b: list[torch.Tensor] = []
    layout: list[tuple[int, bool, list[int]]] = []
    zero = torch.zeros(g.d, dtype=torch.float32)  # (on the host: `add_entries` takes host rows)
    for layer in sorted({l for st in steers for l in st.layers if l in g.col}):  # `layer`: a site
        da, db, has_default = zero.clone(), zero.clone(), False
        pa: dict[int, torch.Tensor] = {}
        pb: dict[int, torch.Tensor] = {}
        for st in steers:
            row = st.layers.get(layer)
            if row is None:
                continue
            v = st.vectors[row].float()
            if st.norm_match:
                v = v / v.norm(dim=-1, keepdim=True).clamp_min(1e-12)
            v = v * st.scale
            if st.positions is None:
                if st.norm_match:
                    db += v
                else:
                    da += v
                has_default = True
            else:
                mine = {p: k for k, p in enumerate(st.positions)}  # a repeated position: the last row wins
                target = pb if st.norm_match else pa
                for p, k in mine.items():
                    target[p] = v[k] if p not in target else target[p] + v[k]
        positions = sorted(set(pa) | set(pb))
        layout.append((layer, has_default, positions))
        if has_default:
            rows_a.append(da)
            rows_b.append(db)
        for p in positions:
            rows_a.append(da + pa[p] if p in pa else da)
            rows_b.append(db + pb[p] if p in pb else db)
    if not rows_a:
        return {}, []
    ids = g.add_entries(torch.stack(rows_a), torch.stack(rows_b))
    if ids is None:
        return None
    out: dict[int, tuple[int, np.ndarray, np.ndarray]] = {}
    k = 0
    for layer, has_default, positions in layout:
        default = -1
        if has_default:
            default, k = ids[k], k + 1
        ents = np.array(ids[k : k + len(positions)], dtype=np.int32)
        k += len(positions)
        out[layer] = (default, np.array(positions, dtype=np.int64), ents)
    return out, ids
