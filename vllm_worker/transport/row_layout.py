"""Where a request's captured rows go in its result region: output `i`'s position `p` is row
`r0[i] + p * stride[i]` of the region's `len(mine) * n` rows (`n`: the positions it has room for). An
output's positions are consecutive rows (`i * n + p`), except the pieces of an mlp_post row: its `c`
d_model-wide pieces (consecutive outputs, pieces 0..c-1 of one layer) interleave within their block of
`c * n` rows, position `p`'s piece `j` at row `k * n + p * c + j`, so that position `p`'s whole d_mlp row is
`c` adjacent rows and the frontend hands the row out as a view, not a copy of every request's rows. The block
is where the pieces' rows were before, so every other output keeps its rows."""

from __future__ import annotations

import numpy as np

from vllm_worker.protocol import points


def mlp_groups(mine: list[int]) -> list[tuple[int, int]]:
    """(first output, pieces) of each mlp_post row of more than one piece among the outputs `mine` (sites)."""
    out: list[tuple[int, int]] = []
    i = 0
    while i < len(mine):
        layer, code = points.split_site(mine[i])
        c = 1
        if code == points.MLP_PIECES:
            while i + c < len(mine) and mine[i + c] == points.site(layer, points.MLP_PIECES + c):
                c += 1
            if c > 1:
                out.append((i, c))
        i += c
    return out


def interleaved(mine: list[int]) -> bool:
    """Whether some output's rows interleave (the payload says so: `INTERLEAVED`)."""
    return bool(mlp_groups(mine))


def layout(mine: list[int], n: int) -> tuple[np.ndarray, np.ndarray]:
    """(row of position 0, rows between positions) of each output in a region with room for `n` positions."""
    r0 = np.arange(len(mine), dtype=np.int64) * n
    stride = np.ones(len(mine), dtype=np.int64)
    for k, c in mlp_groups(mine):
        r0[k : k + c] = k * n + np.arange(c)
        stride[k : k + c] = c
    return r0, stride


def rows(mine: list[int], n: int, n_pos: int) -> np.ndarray:
    """(outputs, n_pos): the row of each output's positions 0..n_pos-1 in a region with room for `n`."""
    r0, stride = layout(mine, n)
    return r0[:, None] + np.arange(n_pos, dtype=np.int64)[None, :] * stride[:, None]


def compaction(mine: list[int], n: int, n_pos: int) -> list[tuple[int, int, int]]:
    """(source row, destination row, rows) that turn a region with room for `n` positions into one of
    `n_pos` (< n) positions, in order (each destination at or before its source)."""
    groups = dict(mlp_groups(mine))
    moves = []
    i = 0
    while i < len(mine):
        c = groups.get(i, 1)
        moves.append((i * n, i * n_pos, c * n_pos))
        i += c
    return moves


# the payload key of a pool result laid out so (its absence: every output's positions consecutive)
INTERLEAVED = "interleaved"
