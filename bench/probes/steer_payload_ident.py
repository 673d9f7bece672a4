"""Bit identity of steering payloads: validates and encodes add / ablate / cap steers (float32, float64,
bfloat16 inputs; 2-D and 3-D) three times each (a memo hit after the first) and prints each wire tensor's
SHA-256 prefix, shape and dtype. Run it in two trees and diff the outputs (equal lines: equal bytes).
Run: `python bench/probes/steer_payload_ident.py`."""

import hashlib

import torch

from vllm_worker.api.steering import SteeringVector
from vllm_worker.frontend.validation import parse_request
from vllm_worker.protocol.spec import ModelShape, encode

D, L = 4096, 32
shape = ModelShape(n_layers=L, d_model=D)
g = torch.Generator().manual_seed(3)
u = torch.randn(D, generator=g)
cases = {
    "ablate32": lambda: SteeringVector(
        activations=u.expand(L, D).clone() * 3, layer_indices=list(range(L)), op="ablate"
    ),
    "ablate32_f64": lambda: SteeringVector(
        activations=(u.expand(L, D).clone() * 3).double(), layer_indices=list(range(L)), op="ablate"
    ),
    "cap1": lambda: SteeringVector(activations=u.view(1, D).clone(), layer_indices=[5], op="cap", lo=-1.0, hi=1.0),
    "add32": lambda: SteeringVector(
        activations=torch.randn(L, D, generator=torch.Generator().manual_seed(5)),
        layer_indices=list(range(L)),
        scale=2.0,
    ),
    "add_bf16": lambda: SteeringVector(
        activations=torch.randn(L, D, generator=torch.Generator().manual_seed(6)).bfloat16(),
        layer_indices=list(range(L)),
    ),
    "add3d": lambda: SteeringVector(
        activations=torch.randn(2, 3, D, generator=torch.Generator().manual_seed(7)),
        layer_indices=[1, 2],
        position_indices=[0, 1, 2],
    ),
}
for name, mk in cases.items():
    ds = []
    for rep in range(3):
        spec = parse_request({"apply_steering_vectors": [mk()]}, shape, 30)
        p = encode(spec)
        ds.append(
            hashlib.sha256(p["steer"][0]["vec"]["data"]).hexdigest()[:16]
            + str(p["steer"][0]["vec"]["shape"])
            + p["steer"][0]["vec"]["dtype"]
        )
    assert len(set(ds)) == 1, ds
    print(name, ds[0])
