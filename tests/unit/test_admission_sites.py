"""The worker refuses a request naming a point it has no tap for at one of its layers (the request fails
with the reason, naming the point), and admits one whose sites it all taps — also on the quick path that
skips the per-site walk when every site is tapped here."""

from __future__ import annotations

import torch

from vllm_worker.protocol.ops import ABLATE
from vllm_worker.protocol.points import MLP, OUT, site
from vllm_worker.protocol.spec import RequestSpec, Steer, encode
from vllm_worker.worker.admission import Admission
from vllm_worker.worker.store import CaptureStore

D = 8


def _admission() -> Admission:
    local = frozenset(site(l, OUT) for l in range(3))
    missing = {"mlp_out": "no mlp_out tap in this test"}
    store = CaptureStore(torch.device("cpu"))
    args = (None, torch.device("cpu"), torch.float32, D, local, frozenset(range(3)), missing, True, None, store)
    return Admission(*args, None, None, None)  # type: ignore[arg-type]


def _payload(sites: list[int]) -> dict:
    v = torch.nn.functional.normalize(torch.randn(len(sites), D), dim=-1)
    return encode(RequestSpec(key="k", steers=[Steer(sites, v, None, 1.0, False, op=ABLATE)]))


def test_a_point_without_a_tap_fails_the_request_naming_it() -> None:
    adm = _admission()
    ok = adm.admit("r0", _payload([site(l, OUT) for l in range(3)]))
    assert ok.store is None and len(ok.steers) == 1
    bad = adm.admit("r1", _payload([site(0, OUT), site(1, MLP)]))
    assert bad.store is not None and bad.store.error is not None
    assert "mlp_out" in bad.store.error["message"] and "no mlp_out tap in this test" in bad.store.error["message"]
