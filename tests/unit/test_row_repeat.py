"""A steer whose rows are all equal (one vector at several layers) crosses the IPC as its one row and the
count (`steer_rows` decides it on the rows as sent, `spec.encode` / `spec.decode` carry it): the engine core
admits it to exactly the entries and rows of the dense form, the prefix-cache salt is the dense form's, no
memo confuses the two forms, it survives vLLM's msgpack IPC and pickle, and a count or row that does not fit
is refused naming the field."""

import copy
import pickle
import time
import types

import pytest
import torch
from vllm import SamplingParams
from vllm.v1.engine import EngineCoreRequest

from support.engine_ipc import through_zmq
from vllm_worker.api.steering import SteeringVector
from vllm_worker.frontend import steer_rows
from vllm_worker.frontend.requests import on_new_request
from vllm_worker.frontend.state import STATE_ATTR, FrontendState
from vllm_worker.frontend.validation import parse_request
from vllm_worker.protocol.points import OUT, site
from vllm_worker.protocol.spec import PAYLOAD_KEY, ModelShape, cache_salt, decode, encode
from vllm_worker.worker import graph
from vllm_worker.worker.admission import Admission
from vllm_worker.worker.content_digests import RecentDigests
from vllm_worker.worker.graph_entries import digest
from vllm_worker.worker.store import CaptureStore

D, L = 1024, 8
SHAPE = ModelShape(n_layers=L, d_model=D)
SITES = [site(l, OUT) for l in range(L)]


def _vec(seed: int = 0) -> torch.Tensor:
    return torch.randn(D, generator=torch.Generator().manual_seed(seed))


def _spec(acts: torch.Tensor, op: str = "ablate", layers: list[int] | None = None):
    layers = list(range(L)) if layers is None else layers
    if acts.ndim == 1:  # (one vector at every layer, as a registered name resolves: `frontend.vectors`)
        acts = acts.expand(len(layers), D)
    sv = SteeringVector(activations=acts, layer_indices=layers, op=op)
    spec = parse_request({"apply_steering_vectors": [sv]}, SHAPE, 7)
    assert spec is not None
    return spec


@pytest.fixture(autouse=True)
def _fresh_memo():
    steer_rows._memo.clear()
    yield
    steer_rows._memo.clear()


@pytest.mark.parametrize("op", ["add", "ablate"])
@pytest.mark.parametrize("form", ["expanded", "dense"])
def test_equal_rows_cross_as_one_row_and_decode_to_the_dense_bits(op, form):
    """A vector expanded over every layer (stride 0) and dense equal rows both send one row (16 KB for
    512 KB at d 4096); decoded, the rows are bit for bit those of the dense encoding."""
    v = _vec()
    acts = {"expanded": v.expand(L, D), "dense": v.expand(L, D).clone()}[form]
    for _ in range(2):  # (a miss, then the memo's hit)
        spec = _spec(acts, op)
        vec = encode(spec)["steer"][0]["vec"]
        assert vec["repeat"] == L and vec["shape"] == [L, D] and len(vec["data"]) == D * 4
        dense = copy.copy(spec.steers[0])
        dense.raw = None  # (the dense wire form, as `tensor_to_bytes` writes it)
        want = decode(encode(type(spec)(key="k", steers=[dense])))
        assert "repeat" not in encode(type(spec)(key="k", steers=[dense]))["steer"][0]["vec"]
        for view in (True, False):
            got = decode(encode(spec), view=view).steers[0].vectors
            assert torch.equal(got, want.steers[0].vectors) and got.shape == (L, D)
            assert got.stride(0) == (0 if view else D)  # (a view: expanded, never written; else dense rows)
        assert cache_salt(spec) == cache_salt(type(spec)(key="k", steers=[dense]))


def test_unequal_rows_stay_dense_and_one_different_bit_is_seen():
    rows = _vec().expand(L, D).clone()
    rows.view(torch.int32)[L - 1, D - 1] ^= 1  # (the last row's last element, one bit)
    vec = encode(_spec(rows, "add"))["steer"][0]["vec"]
    assert "repeat" not in vec and len(vec["data"]) == L * D * 4
    assert torch.equal(decode(encode(_spec(rows, "add"))).steers[0].vectors, rows)
    assert encode(_spec(_vec(), "add", [2]))["steer"][0]["vec"].get("repeat") is None  # (one layer: one row)


def test_salt_same_content_same_salt_different_content_different():
    v = _vec()
    salts = {cache_salt(_spec(a)) for a in (v, v.expand(L, D), v.expand(L, D).clone())}
    assert len(salts) == 1
    assert cache_salt(_spec(_vec(1))) not in salts
    # a dense steer whose rows differ in one row is another content
    rows = v.expand(L, D).clone()
    rows[3] = _vec(2)
    assert cache_salt(_spec(rows)) not in salts


@pytest.mark.parametrize(
    "change, field",
    [
        ({"repeat": L - 1}, "steer.vec.repeat"),  # a count that is not the rows' first dimension
        ({"repeat": True}, "steer.vec.repeat"),
        ({"repeat": 0}, "steer.vec.repeat"),
        ({"repeat": L // 2, "shape": [L // 2, D]}, "steer.vec.repeat"),  # not the steer's layers
        ({"shape": [L]}, "steer.vec.repeat"),
        ({"data": b"\0" * (D * 4 - 4)}, "steer.vec.data"),  # a row of the wrong width
        ({"data": b"\0" * (D * 8)}, "steer.vec.data"),  # two rows' bytes for one
    ],
)
def test_a_count_or_row_that_does_not_fit_is_refused_naming_the_field(change, field):
    payload = encode(_spec(_vec()))
    payload["steer"][0]["vec"] = {**payload["steer"][0]["vec"], **change}
    for view in (True, False):
        with pytest.raises(ValueError, match=field.replace(".", r"\.")):
            decode(payload, view=view)


def _admission() -> Admission:
    g = graph.GraphTaps(SITES, D, torch.bfloat16, torch.device("cpu"), 64, None)
    runner = types.SimpleNamespace(requests={f"r{i}": types.SimpleNamespace(num_prompt_tokens=7) for i in range(64)})
    args = (runner, torch.device("cpu"), torch.bfloat16, D, frozenset(SITES), frozenset(range(L)), {}, True)
    return Admission(*args, None, CaptureStore(torch.device("cpu")), g, None, None)  # type: ignore[arg-type]


def _state(s) -> list:
    return [
        (dict(st.layers), st.vectors.contiguous().view(torch.int16).tolist(), st.digest, st.op, st.vectors.stride())
        for st in s.steers
    ] + [sorted((k, v[1].tolist(), v[2].tolist(), v[3], v[4]) for k, v in (s.entries or {}).items())]


def test_repeated_and_dense_forms_admit_to_identical_entries_and_rows():
    """Both forms, each admitted alone, then mixed in one admission (templates and digests memos live):
    identical rows, digests and entries; a different content never takes the other's."""
    v, w = _vec(), _vec(5)
    rep = encode(_spec(v))
    assert rep["steer"][0]["vec"]["repeat"] == L
    spec = _spec(v)
    spec.steers[0].raw = None
    dense = encode(spec)
    other = encode(_spec(w))
    assert "repeat" not in dense["steer"][0]["vec"]

    def admit(adm: Admission, payloads: list[dict]) -> list:
        states = [adm.admit(f"r{i}", copy.deepcopy(p)) for i, p in enumerate(payloads)]
        adm.flush()
        assert all(s.store is None or s.store.error is None for s in states)
        return [_state(s) for s in states]

    alone_rep = admit(_admission(), [rep])[0]
    alone_dense = admit(_admission(), [dense])[0]
    assert alone_rep == alone_dense
    mixed = _admission()
    got = admit(mixed, [dense, dense, rep, rep, other, rep, dense, other])
    assert got[0] == got[1] == got[2] == got[3] == got[5] == got[6] == alone_dense
    assert got[4] == got[7] != got[0]
    assert got[4][0][2] != got[0][0][2]  # (other content, other digest)
    # templates (made at a content's second sighting) were used; the forms have different keys (the count is
    # a field), and the other content its own (templates are kept by fields and tensors' edges: `mark`),
    # made at its second sighting and told apart from the repeated form's by its bytes
    assert mixed.templates.hits == 2 and len(mixed.templates._memo) == 3


def test_content_digest_memo_keeps_the_forms_apart():
    """Equal rows sent in two forms get the same digest (the same content) from separate memo entries."""
    d = RecentDigests()
    row = _vec()
    dense = row.expand(L, D).clone()
    expanded = row.unsqueeze(0).expand(L, D)
    a = d.of(dense.numpy().tobytes(), dense)
    b = d.of(row.numpy().tobytes(), expanded)
    assert a == b == digest(dense) and len(d._memo) == 2
    assert d.of(row.numpy().tobytes(), expanded) == a and len(d._memo) == 2


def test_the_repeated_form_survives_vllm_ipc_and_pickle():
    """Through vLLM's msgpack encoder / decoder over zmq (the multiprocess engine core) and through pickle
    (a multiprocess executor's scheduler output): the same rows as the dense form."""
    proc = types.SimpleNamespace()
    state = FrontendState(shape=SHAPE, engines_fed=1)
    state.rows_by_view = True
    setattr(proc, STATE_ATTR, state)
    sv = SteeringVector(activations=_vec().expand(L, D).clone(), layer_indices=list(range(L)), op="ablate")
    sp = SamplingParams(max_tokens=4, extra_args={"apply_steering_vectors": [sv]})
    req = EngineCoreRequest(
        request_id="r0", prompt_token_ids=list(range(12)), mm_features=None, sampling_params=sp.clone(),
        pooling_params=None, arrival_time=time.time(), lora_request=None, cache_salt=None, data_parallel_rank=None,
    )  # fmt: skip
    sent = on_new_request(proc, "r0", req)
    got, frames = through_zmq(sent)
    assert sum(len(f.buffer) for f in frames) < 2 * D * 4  # (one row crossed, not L)
    payload = got.sampling_params.extra_args[PAYLOAD_KEY]
    assert payload["steer"][0]["vec"]["repeat"] == L and isinstance(payload["steer"][0]["vec"]["data"], memoryview)
    want = _vec() / _vec().norm()
    got = decode(payload, view=True).steers[0].vectors
    assert torch.equal(got, want.expand(L, D).contiguous()) or torch.allclose(got, want.expand(L, D), atol=1e-6)
    dense = _spec(_vec())
    dense.steers[0].raw = None
    assert torch.equal(got, decode(encode(dense)).steers[0].vectors)
    plain = {**payload, "steer": [{**payload["steer"][0], "vec": {**payload["steer"][0]["vec"]}}]}
    plain["steer"][0]["vec"]["data"] = bytes(plain["steer"][0]["vec"]["data"])  # (bytes where it pickles)
    again = pickle.loads(pickle.dumps(plain))
    assert torch.equal(decode(again, view=True).steers[0].vectors, got)


def test_a_3d_patch_repeated_over_layers_sends_one_block():
    """(layers, positions, d) with equal blocks per layer: one (positions, d) block crosses, the same rows."""
    block = torch.randn(3, D, generator=torch.Generator().manual_seed(4))
    sv = SteeringVector(activations=block.expand(2, 3, D).clone(), layer_indices=[1, 2], position_indices=[0, 1, 2])
    spec = parse_request({"apply_steering_vectors": [sv]}, SHAPE, 30)
    assert spec is not None
    vec = encode(spec)["steer"][0]["vec"]
    assert vec["repeat"] == 2 and vec["shape"] == [2, 3, D] and len(vec["data"]) == 3 * D * 4
    for view in (True, False):
        assert torch.equal(decode(encode(spec), view=view).steers[0].vectors, block.expand(2, 3, D))
