"""What one request hands back, as the worker keeps it until the frontend fetches it: its captured rows
(segments of the host arenas its plans wrote step after step), its hooks' saved state, and its first
failure. Shared by the plan (which fills them) and the store (which fetches them)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch

from vllm_worker.counters import FETCH_TIMINGS
from vllm_worker.protocol import errors
from vllm_worker.transport.early_regions import EarlyRegion, State
from vllm_worker.worker.probe_filing import ProbeScores, expand


class StepArena:
    """Host memory for the captured rows of every step run with one plan (one batch composition): step
    after step in chunks of shape (steps, rows, d), so a request's rows at one layer across all decode
    steps are one strided slice — nothing to stack at fetch. Chunks double (1, 2, 4 … 64 steps); on CUDA
    they are pinned (device copies land in them asynchronously) and come from torch's caching host
    allocator, so a steady workload stops allocating."""

    __slots__ = (
        "rows",
        "pinned",
        "chunks",
        "users",
        "done",
        "early",
        "direct",
        "members",
        "skip",
        "seen",
        "direct_full",
        "direct_map",
        "direct_steps",
    )
    MAX_CHUNK_STEPS = 64

    def __init__(self, rows: int, pinned: bool) -> None:
        self.rows = rows
        self.pinned = pinned
        self.chunks: list[list] = []  # [data (steps, rows, d), positions (steps, rows), steps filled]
        # early assembly (`transport.early`): (first column, columns, RequestResults, slot) of every
        # segment, steps copied per chunk, and the cached column map
        self.users: list[tuple] = []
        self.done: list[int] = []
        self.early: tuple | None = None
        # direct mode: None until a step's rows are written into regions by the GPU, then True; False once
        # a step is filed without (its rows are copied on the host, also for direct regions)
        self.direct: bool | None = None
        self.members: frozenset | None = (
            None  # the requests (their `EarlyRegion`s) the GPU writes (set at its first step)
        )
        self.skip: frozenset = frozenset()  # ... of which those from its first step: the thread never copies them
        self.seen = -1  # `EarlyAssembler.dmade` when the members were last looked for
        self.direct_full = False  # ... and they are all of its requests: its steps need no host rows
        self.direct_map: tuple | None = None  # (generation, map) cached by `EarlyAssembler.direct_rows`
        self.direct_steps = 0  # steps written only directly (no chunk rows)

    def next(self, d: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """(rows, d) and (rows,) host views for the next step."""
        if not self.chunks or self.chunks[-1][2] == self.chunks[-1][0].shape[0]:
            t = time.perf_counter()
            c = min(self.MAX_CHUNK_STEPS, 1 << len(self.chunks))
            self.chunks.append(
                [
                    torch.empty((c, self.rows, d), dtype=dtype, pin_memory=self.pinned),
                    torch.empty((c, self.rows), dtype=torch.int64, pin_memory=self.pinned),
                    0,
                ]
            )
            FETCH_TIMINGS["arena_alloc_s"] += time.perf_counter() - t
        ch = self.chunks[-1]
        k = ch[2]
        ch[2] += 1
        return ch[0][k], ch[1][k]

    def parts(self, col: int, n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(positions (steps, n), rows (steps, n, d)) per chunk, for columns col:col+n."""
        return [(pos[:f, col : col + n], data[:f, col : col + n]) for data, pos, f in self.chunks if f]


class CaptureLog:
    """One layer's columns of a plan's arena: shared by the plan's requests, each reading its own row
    range (`ArenaSpan`). Filing a step is O(layers), not O(requests)."""

    __slots__ = ("arena", "col", "refs", "nbytes", "rows")

    def __init__(self, arena: StepArena, col: int) -> None:
        self.arena: StepArena | None = arena
        self.col = col  # first column of this layer in the arena's rows
        self.refs = 0  # segments still to be fetched or dropped
        self.nbytes = 0
        self.rows = 0  # columns (captured rows per step) of this layer: its requests' rows, summed


@dataclass
class ArenaSpan:
    """A request's rows of one layer in a plan's arena: `n` rows from `offset` in every block of `log`."""

    log: CaptureLog
    slot: int  # index of the layer in the request's capture list
    offset: int  # first row of the request inside each of the log's blocks
    n: int


@dataclass
class RequestResults:
    """Everything a request hands back: captures, hook state, and the first failure."""

    layers: list[int]
    segments: list[ArenaSpan] = field(default_factory=list)
    saved: list[dict] = field(default_factory=list)
    error: errors.Failure | None = None
    nonfinite: dict = field(default_factory=dict)  # hook -> device flag: it returned NaN/inf (not applied)
    expected: int = 0  # bytes announced to the result pool when the request arrived (`ResultPool.expect`)
    sae: dict = field(default_factory=dict)  # SAE name -> {"ids", "spans": [`step_records.Span`]}
    # probe actions' outcome (`actions.ActionTable.outcome`), or how to read it while the request is live
    actions: Any = None
    # probe scores as filed, one entry per batch composition and site (`probe_filing.Entry`); `probes` makes
    # the per-probe `ProbeScores` from them when read (`_slots`: those made, from `_expanded` entries)
    probe_filed: list = field(default_factory=list)
    _slots: dict = field(default_factory=dict)
    _expanded: int = 0
    # set with `expected` at admission: the sites this rank captures (in `layers` order) and the most
    # positions the request can reach (prompt + max_tokens - 1): the early-assembly region's shape
    mine: list[int] = field(default_factory=list)
    max_pos: int = 0
    # early assembly (`transport.early_regions`): the request's state, and its region while it holds one
    early: State = State.UNDECIDED
    dest: EarlyRegion | None = None
    # vLLM said the request finished (`ready_probes.note_finished`): nothing more is filed; then its probe payload
    # as a fetch makes it, made while the engine was idle (`ready_probes`), or None
    finished: bool = False
    ready: Any = None

    @property
    def probes(self) -> dict[str, ProbeScores]:
        """probe name -> its `ProbeScores` on this worker, made from the entries filed since the last read."""
        if self._expanded < len(self.probe_filed):
            self._expanded = expand(self.probe_filed, self._expanded, self._slots)
        return self._slots

    @property
    def has_probes(self) -> bool:
        """Whether any probe of the request was scored here (what `probes` being non-empty says, unmade: every
        slot is made from an entry)."""
        return bool(self.probe_filed)

    def fail(self, f: errors.Failure) -> None:
        """One rule for every failure of a request (its hooks', our own code's): the first one is reported;
        later ones are consequences or repeats of it."""
        if self.error is None:
            self.error = f
