"""How the frontend sends mlp_post steering (`frontend/mlp_post.split_steers`): per-value edits cut into the
row's d_model-wide pieces (each piece's columns, the last zero-padded); a request that also edits the whole
row there keeps every mlp_post entry whole at the tap's site, in the order given."""

from __future__ import annotations

import pytest
import torch

from vllm_worker.frontend.mlp_post import split_steers
from vllm_worker.protocol import ops
from vllm_worker.protocol import points as pts
from vllm_worker.protocol.spec import ModelShape, Steer

SHAPE = ModelShape(n_layers=4, d_model=128, d_mlp=320)  # three pieces: 128 + 128 + 64
TAP1, TAP2 = pts.site(1, pts.MLPPOST), pts.site(2, pts.MLPPOST)


def _steer(layers: list[int], op: int = ops.ADD, **kw) -> Steer:
    v = torch.arange(len(layers) * 320, dtype=torch.float32).reshape(len(layers), 320)
    return Steer(layers, v, None, 1.0, False, op=op, **kw)


def test_additions_are_cut_into_the_pieces():
    st = _steer([TAP1, TAP2])
    resid = Steer([pts.site(0, pts.OUT)], torch.ones(1, 128), None, 1.0, False)
    out = split_steers([resid, st], SHAPE, "f")
    assert out[0] is resid and len(out) == 4
    for j, piece in enumerate(out[1:]):
        assert piece.layers == [pts.mlp_piece_sites(1, 3)[j], pts.mlp_piece_sites(2, 3)[j]]
        width = min(128, 320 - j * 128)
        assert torch.equal(piece.vectors[:, :width], st.vectors[:, j * 128 : j * 128 + width])
        assert (piece.vectors[:, width:] == 0).all() and piece.vectors.shape[-1] == 128


@pytest.mark.parametrize("whole", [dict(op=ops.ABLATE), dict(op=ops.CAP, hi=0.5), dict(norm_match=True)])
def test_a_whole_row_edit_keeps_every_mlp_post_entry_whole_in_order(whole):
    norm_match = whole.pop("norm_match", False)
    first = _steer([TAP1])
    second = _steer([TAP1, TAP2], **whole)
    second.norm_match = norm_match
    out = split_steers([first, second], SHAPE, "f")
    assert len(out) == 2 and out[0] is first and out[1] is second


def test_a_multiplication_at_mlp_post_is_refused_naming_the_field():
    with pytest.raises(ValueError, match=r"f\[0\]: at point 'mlp_post'"):
        split_steers([_steer([TAP1], mul=True)], SHAPE, "f")
