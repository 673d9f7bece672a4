"""`mlp_post` under tensor parallelism: the whole d_mlp row from each rank's slice.

vLLM shards a dense MLP's first projection by output columns and its down projection by input columns, so
the tap on the down projection sees `(tokens, d_mlp / tp)` on each rank: rank r holds the contiguous columns
`[r * w, (r + 1) * w)` of HF's row. When a step asks for mlp_post at a layer (capture, steering, hooks), every
rank gathers the row at that tap, acts on the whole row exactly as with TP=1 (the same pieces and sites, so
the frontend cannot tell), and writes its own slice back. Steps that ask for nothing there gather nothing.

The gather is a collective: every rank must call it at the same taps, or the ranks wait for each other for
ever. So which taps gather is decided from what requests *asked for* (identical on every rank), recorded when
a request is admitted and never cleared by a rank-local failure; a rank whose plan broke still gathers.
Such steps run on the Python path (the graph-safe kernel has no collective), like steps with Python hooks.
"""

from __future__ import annotations

from typing import Any

import torch

from vllm_worker import compat


class WideGather:
    """This rank's view of the mlp_post taps: which requests need a gather, the gather and the write-back."""

    def __init__(self, rank: int, wide: dict[int, list[tuple[int, int, int]]]) -> None:
        self.rank = rank
        # every site of an mlp_post row (the tap's own, where hooks act, and its pieces') -> the tap
        self.tap = {s: tap for tap, pieces in wide.items() for s, _, _ in pieces}
        self.tap.update({tap: tap for tap in wide})
        self._asked: dict[str, frozenset[int]] = {}  # request id -> the taps it asked for, at admission

    def admitted(self, req_id: str, state: Any) -> None:
        """Record the mlp_post taps a newly admitted request acts at (before anything can fail it)."""
        self._asked[req_id] = self.taps_of(state)

    def forget(self, req_id: str) -> None:
        self._asked.pop(req_id, None)

    def taps_of(self, r: Any) -> frozenset[int]:
        """The mlp_post taps a `plan.RequestState` captures, steers or hooks at."""
        own = set(r.capture) | set(r.simple_add) | {s for st in r.steers for s in st.layers}
        own |= {s for h in r.hooks for s, _ in h.at}
        return frozenset(self.tap[s] for s in own if s in self.tap)

    def step_taps(self, req_ids: list, states: list) -> frozenset[int]:
        """The taps every rank gathers at in a step of these requests: what each asked for when admitted,
        and what it carries now (persistent hooks registered since)."""
        out: set[int] = set()
        for rid in req_ids:
            if rid is not None:
                out |= self._asked.get(rid, frozenset())
        for st in states:
            if st is not None:
                out |= self.taps_of(st)
        return frozenset(out)

    def gather(self, hidden: torch.Tensor) -> torch.Tensor:
        """`(tokens, d_mlp)`: every rank's `(tokens, d_mlp / tp)` slice in rank order (HF's column order)."""
        return compat.tp_all_gather(hidden.contiguous())

    def write_back(self, full: torch.Tensor, hidden: torch.Tensor) -> None:
        """This rank's slice of the (steered, hooked) whole row, into the tensor its down projection reads."""
        w = hidden.shape[1]
        hidden.copy_(full[:, self.rank * w : (self.rank + 1) * w])
