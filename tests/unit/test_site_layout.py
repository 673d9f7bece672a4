"""The per-layer site layout (`protocol.points`): site ids are baked into compiled graphs, staged tables and
every request's capture list, so a drift must fail here, loudly, before it reaches an engine."""

from __future__ import annotations

from vllm_worker.plugin.bootstrap import _compile_marker
from vllm_worker.protocol import points as pts


def test_codes_are_pinned():
    assert pts.SITES_PER_LAYER == 32
    assert pts.MLP_PIECES == 16 and pts.MAX_MLP_CHUNKS == 16
    assert pts.CODE == {
        "resid_pre": 0,
        "resid_post": 1,
        "attn_out": 2,
        "resid_mid": 3,
        "mlp_out": 4,
        "z": 5,
        "router_logits": 6,
        "q": 7,
        "k": 8,
        "mlp_in": 9,
        "mlp_post": 10,
    }
    assert set(pts.CODE) == set(pts.POINTS)


def test_single_site_codes_stay_below_the_pieces():
    """Every point with one site per layer has a code of its own below mlp_post's pieces (k is q's code + 1:
    one tap reads both)."""
    codes = list(pts.CODE.values())
    assert len(set(codes)) == len(codes)
    assert max(codes) < pts.MLP_PIECES
    assert pts.CODE["k"] == pts.CODE["q"] + 1


def test_sites_round_trip_and_pieces_fill_the_layer():
    for layer in (0, 1, 7, 127):
        for point, code in pts.CODE.items():
            s = pts.site(layer, code)
            assert pts.split_site(s) == (layer, code) and pts.site_layer(s) == layer
            assert pts.site_point(s) == point
        pieces = pts.mlp_piece_sites(layer, pts.MAX_MLP_CHUNKS)
        assert pieces == list(range(layer * 32 + 16, layer * 32 + 32))
        assert pieces == pts.point_sites("mlp_post", layer, pts.MAX_MLP_CHUNKS)
        assert all(pts.site_point(s) == "mlp_post" for s in pieces)
        assert pts.describe(pieces[3]) == f"mlp_post[{layer}] piece 3"
        assert pts.site_layer(pieces[-1]) == layer and pts.site_layer(pieces[-1] + 1) == layer + 1
    assert pts.point_sites("resid_pre", 3) == [pts.site(2, pts.OUT)]  # the previous layer's output


def test_the_compile_marker_names_the_layout():
    """Compiled graphs hold site ids: the marker vLLM's compile cache keys on changes with the layout."""
    assert "taps v4, 32 sites/layer" in _compile_marker()
