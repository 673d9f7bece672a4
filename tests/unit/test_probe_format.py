"""The served probe format and the score aggregates (no engine): a written probe reads back equal, folding
mean / std into per-layer weights gives the same scores, every refused field is named, and each aggregate
equals its definition written out by hand."""

from __future__ import annotations

import json
import math

import pytest
import torch

from vllm_worker.probes import aggregate, aggregates, check_probe, load_probe_files, save_probe, series
from vllm_worker.probes import aggregation as agg_mod


def _probe_parts(seed=0, n_out=2, layers=(1, 3), d=16):
    g = torch.Generator().manual_seed(seed)
    k = len(layers) * d
    return dict(
        weight=torch.randn(n_out, k, generator=g),
        bias=torch.randn(n_out, generator=g),
        layers=list(layers),
        mean=torch.randn(k, generator=g),
        std=torch.rand(k, generator=g) + 0.5,
    )


def test_round_trip_and_folding(tmp_path):
    parts = _probe_parts()
    path = save_probe(
        tmp_path / "p", **parts, output="sigmoid", threshold=0.7, aggregate=["mean", "ema:0.9"], model="tiny"
    )
    cfg = json.loads((path / "probe.json").read_text())
    assert cfg["layers"] == [1, 3] and cfg["d_model"] == 16 and cfg["output"] == "sigmoid"
    p = load_probe_files(path)
    assert torch.equal(p.weight, parts["weight"]) and torch.equal(p.bias, parts["bias"])
    assert torch.equal(p.mean, parts["mean"]) and torch.equal(p.std, parts["std"])
    assert (p.threshold, p.aggregate, p.model, p.point, p.n_out, p.d_model) == (
        0.7,
        ["mean", "ema:0.9"],
        "tiny",
        "resid_post",
        2,
        16,
    )
    x = torch.randn(5, 32)
    ws, b = p.folded()
    assert [w.shape for w in ws] == [(2, 16), (2, 16)]
    folded = x[:, :16] @ ws[0].T + x[:, 16:] @ ws[1].T + b
    by_hand = ((x - parts["mean"]) / parts["std"]) @ parts["weight"].T + parts["bias"]
    assert (folded - by_hand).abs().max() < 1e-4
    assert (p.score(x) - torch.sigmoid(by_hand)).abs().max() < 1e-5


def test_defaults_one_dimensional_weight_and_no_bias(tmp_path):
    p = load_probe_files(save_probe(tmp_path / "q", torch.ones(8), layers=2))
    assert p.weight.shape == (1, 8) and torch.equal(p.bias, torch.zeros(1))
    assert (p.output, p.threshold, p.aggregate, p.mean, p.std) == ("logit", None, [], None, None)


@pytest.mark.parametrize(
    "change, field",
    [
        (dict(weight=torch.full((2, 32), math.nan)), "weight"),
        (dict(weight=torch.ones(2, 33)), "weight"),
        (dict(bias=torch.ones(3)), "bias"),
        (dict(bias=torch.tensor([1.0, math.inf])), "bias"),
        (dict(std=torch.zeros(32)), "std"),
        (dict(mean=torch.ones(16)), "mean"),
        (dict(layers=[]), "layers"),
        (dict(layers=[1, 1]), "layers"),
        (dict(layers=[-1, 2]), "layers"),
        (dict(point="resid_pots"), "point"),
        (dict(output="probability"), "output"),
        (dict(threshold=math.nan), "threshold"),
        (dict(aggregate=["rolling_max:0"]), "aggregate[0]"),
        (dict(aggregate=["median"]), "aggregate[0]"),
        (dict(d_model=15), "d_model"),
    ],
)
def test_bad_fields_are_named(change, field):
    parts = {**_probe_parts(), **change}
    with pytest.raises(ValueError) as e:
        check_probe(**parts)
    assert str(e.value).startswith(field + ":")


def test_bad_files_are_named(tmp_path):
    path = save_probe(tmp_path / "p", **_probe_parts())
    cfg = json.loads((path / "probe.json").read_text())
    (path / "probe.json").write_text(json.dumps({**cfg, "layer": 3}))
    with pytest.raises(ValueError, match=r"^probe.json: unknown fields \['layer'\]"):
        load_probe_files(path)
    (path / "probe.json").write_text(json.dumps({k: v for k, v in cfg.items() if k != "layers"}))
    with pytest.raises(ValueError, match="^layers:"):
        load_probe_files(path)
    (path / "probe.json").unlink()
    with pytest.raises(ValueError, match="^path:.*probe.json"):
        load_probe_files(path)


def test_aggregates_by_hand():
    s = torch.tensor([0.0, 4.0, -2.0, 1.0, 3.0, 3.0])
    assert aggregate(s, "mean").item() == pytest.approx(s.mean().item())
    assert aggregate(s, "max").item() == 4.0 and aggregate(s, "last").item() == 3.0
    # rolling means of 2: 0 (first position: itself), 2, 1, -0.5, 2, 3
    assert series(s, "rolling_max:2").tolist() == pytest.approx([0.0, 2.0, 1.0, -0.5, 2.0, 3.0])
    assert aggregate(s, "rolling_max:2").item() == pytest.approx(3.0)
    assert aggregate(s[:3], "rolling_max:3").item() == pytest.approx(2 / 3)  # one full window
    assert aggregate(torch.tensor([5.0, 0.0, 0.0, 0.0]), "rolling_max:3").item() == pytest.approx(5 / 3)
    assert aggregate(s, "rolling_max:100").item() == pytest.approx(s.mean().item())
    e, ema = [], 0.0
    for t, v in enumerate(s.tolist()):
        ema = v if t == 0 else 0.5 * ema + 0.5 * v
        e.append(ema)
    assert series(s, "ema:0.5").tolist() == pytest.approx(e)
    assert aggregate(s, "ema:0.5").item() == pytest.approx(max(e))
    two = torch.stack([s, -s], 1)  # several outputs: one value each
    got = aggregates(two, ["mean", "max", "ema:0.5"])
    assert got["max"].tolist() == [4.0, 2.0] and got["ema:0.5"].shape == (2,)
    assert math.isnan(aggregate(torch.zeros(0), "mean").item())


@pytest.mark.parametrize("name", ["ema:1", "ema:-0.1", "ema:x", "rolling_max:", "rolling_max:1.5", "sum", 3])
def test_bad_aggregate_names(name):
    with pytest.raises(ValueError, match="^aggregate"):
        agg_mod.parse(name)
