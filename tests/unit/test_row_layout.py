"""A result region's row layout (`transport.row_layout`): outputs' positions are consecutive rows except an
mlp_post row's pieces, which interleave in their own block (position p's pieces adjacent); compaction to fewer
positions moves whole blocks and keeps every (output, position) where the smaller layout puts it."""

from __future__ import annotations

import numpy as np

from vllm_worker.protocol import points
from vllm_worker.transport import row_layout

# resid_post[0], mlp_post[1] in 3 pieces, resid_post[1], mlp_post[2] in 3 pieces
MINE = [points.site(0, points.OUT), *points.mlp_piece_sites(1, 3), points.site(1, points.OUT)]
MINE += points.mlp_piece_sites(2, 3)


def test_groups_and_layout():
    assert row_layout.mlp_groups(MINE) == [(1, 3), (5, 3)]
    assert not row_layout.interleaved([points.site(0, points.OUT), points.mlp_piece_sites(1, 1)[0]])  # one piece
    r0, stride = row_layout.layout(MINE, 4)
    assert r0.tolist() == [0, 4, 5, 6, 16, 20, 21, 22] and stride.tolist() == [1, 3, 3, 3, 1, 3, 3, 3]
    at = row_layout.rows(MINE, 4, 4)
    assert sorted(at.ravel().tolist()) == list(range(32))  # every row of the region once
    assert at[1:4, 2].tolist() == [10, 11, 12]  # position 2's three pieces: adjacent rows of mlp_post[1]'s block


def test_compaction_keeps_every_value_where_the_smaller_layout_wants_it():
    n, n_pos = 6, 4
    region = np.full((len(MINE) * n, 2), -1)
    at = row_layout.rows(MINE, n, n_pos)
    for i in range(len(MINE)):
        for p in range(n_pos):
            region[at[i, p]] = (i, p)
    for src, dst, m in row_layout.compaction(MINE, n, n_pos):
        region[dst : dst + m] = region[src : src + m].copy()
    small = row_layout.rows(MINE, n_pos, n_pos)
    for i in range(len(MINE)):
        for p in range(n_pos):
            assert region[small[i, p]].tolist() == [i, p]
