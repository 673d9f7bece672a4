"""Steering rows as views of the engine core's received message (`compat.ipc`): the payload's form, vLLM's
IPC decoding it without a copy (fails loudly if vLLM changes how `extra_args` are serialised), the worker
reading it as the same bits as `bytes`, never keeping the view, and the prefix-cache salt unchanged."""

import time
import types

import msgspec
import numpy as np
import pytest
import torch
from vllm import SamplingParams
from vllm.config import ParallelConfig
from vllm.v1.engine import EngineCoreRequest
from vllm.v1.serial_utils import CUSTOM_TYPE_RAW_VIEW

from support.engine_ipc import through_zmq
from vllm_worker import compat
from vllm_worker.api.steering import SteeringVector
from vllm_worker.frontend.requests import on_new_request
from vllm_worker.frontend.state import STATE_ATTR, FrontendState
from vllm_worker.protocol.spec import PAYLOAD_KEY, ModelShape, decode
from vllm_worker.worker.content_digests import RecentDigests
from vllm_worker.worker.graph_entries import digest

D, L = 1024, 4


def _processor(by_view: bool) -> types.SimpleNamespace:
    proc = types.SimpleNamespace()
    state = FrontendState(shape=ModelShape(n_layers=L, d_model=D), engines_fed=1)
    state.rows_by_view = by_view
    setattr(proc, STATE_ATTR, state)
    return proc


def _request(acts: torch.Tensor, by_view: bool, op: str = "ablate") -> EngineCoreRequest:
    sv = SteeringVector(activations=acts, layer_indices=list(range(acts.shape[0])), op=op)
    sp = SamplingParams(max_tokens=4, extra_args={"apply_steering_vectors": [sv]})
    req = EngineCoreRequest(
        request_id="r0", prompt_token_ids=list(range(12)), mm_features=None, sampling_params=sp.clone(),
        pooling_params=None, arrival_time=time.time(), lora_request=None, cache_salt=None, data_parallel_rank=None,
    )  # fmt: skip
    return on_new_request(_processor(by_view), "r0", req)


def _rows() -> torch.Tensor:
    return torch.randn(L, D, generator=torch.Generator().manual_seed(3))


def test_payload_form_view_and_bytes():
    v = _rows()
    pv = _request(v.clone(), by_view=True).sampling_params.extra_args[PAYLOAD_KEY]
    pb = _request(v.clone(), by_view=False).sampling_params.extra_args[PAYLOAD_KEY]
    viewed, plain = pv["steer"][0]["vec"], pb["steer"][0]["vec"]
    assert isinstance(viewed["data"], msgspec.msgpack.Ext) and viewed["data"].code == CUSTOM_TYPE_RAW_VIEW
    assert isinstance(plain["data"], bytes) and viewed["data"].data == plain["data"]
    assert (
        {k: viewed[k] for k in ("dtype", "shape")}
        == {k: plain[k] for k in ("dtype", "shape")}
        == {
            "dtype": "float32",
            "shape": [L, D],
        }
    )
    assert {k: x for k, x in pv.items() if k not in ("steer", "key")} == {
        k: x for k, x in pb.items() if k not in ("steer", "key")
    }
    a, b = decode(pv).steers[0].vectors, decode(pb).steers[0].vectors
    assert torch.equal(a, b) and torch.allclose(a, v / v.norm(dim=-1, keepdim=True), atol=1e-6)


def test_salt_unchanged_by_the_view():
    v = _rows()
    a, b = _request(v.clone(), by_view=True), _request(v.clone(), by_view=False)
    assert a.cache_salt is not None and a.cache_salt == b.cache_salt


def test_vllm_decodes_the_rows_as_a_view_of_the_received_frame():
    """If this fails, vLLM changed how `extra_args` cross its IPC: `compat.ipc` must follow."""
    assert compat.raw_view_code() == CUSTOM_TYPE_RAW_VIEW
    sent = _request(_rows(), by_view=True)
    got, frames = through_zmq(sent)
    data = got.sampling_params.extra_args[PAYLOAD_KEY]["steer"][0]["vec"]["data"]
    assert isinstance(data, memoryview)  # (writable: a zmq frame's memory; the worker never writes it)
    want = sent.sampling_params.extra_args[PAYLOAD_KEY]["steer"][0]["vec"]["data"].data
    assert data.tobytes() == want
    frame = np.frombuffer(frames[0].buffer, np.uint8)
    assert np.shares_memory(np.frombuffer(data, np.uint8), frame)  # no copy: the frame's own memory
    del frames, frame
    assert data.tobytes() == want  # (the view keeps the message alive)
    # as `bytes` the same field is copied into a new object (what the view saves)
    got_plain, _ = through_zmq(_request(_rows(), by_view=False))
    assert isinstance(got_plain.sampling_params.extra_args[PAYLOAD_KEY]["steer"][0]["vec"]["data"], bytes)


@pytest.mark.parametrize("view", [True, False])
def test_worker_reads_the_view_as_bytes_and_copies_on_request(view):
    sent = _request(_rows(), by_view=True)
    got, _ = through_zmq(sent)
    payload = got.sampling_params.extra_args[PAYLOAD_KEY]
    want = sent.sampling_params.extra_args[PAYLOAD_KEY]["steer"][0]["vec"]["data"].data
    rows = decode(payload, view=view).steers[0].vectors
    assert rows.numpy().tobytes() == want
    src = np.frombuffer(payload["steer"][0]["vec"]["data"], np.uint8)
    assert np.shares_memory(rows.numpy().view(np.uint8), src) == view  # view=False: its own copy
    # in-process (VLLM_ENABLE_V1_MULTIPROCESSING=0) the worker gets the `Ext` itself
    inproc = decode(sent.sampling_params.extra_args[PAYLOAD_KEY], view=view).steers[0].vectors
    assert inproc.numpy().tobytes() == want


def test_digests_of_a_view_equal_and_never_kept():
    got, _ = through_zmq(_request(_rows(), by_view=True))
    mv = got.sampling_params.extra_args[PAYLOAD_KEY]["steer"][0]["vec"]["data"]
    t = decode(got.sampling_params.extra_args[PAYLOAD_KEY], view=True).steers[0].vectors
    memo = RecentDigests()
    assert memo.of(mv, t) == memo.of(mv.tobytes(), t) == memo.of(mv, t) == digest(t)
    kept = [entry[0] for entry in memo._memo.values()]
    assert kept and all(type(k) is bytes for k in kept)  # a copy: a view would pin the received message
    other = bytearray(mv.tobytes())
    other[len(other) // 2] ^= 1  # same ends, different middle: not the remembered digest
    t2 = torch.frombuffer(other, dtype=torch.float32).view(L, D)
    assert memo.of(memoryview(bytes(other)), t2) == digest(t2) != digest(t)


@pytest.mark.parametrize(
    "kw, want",
    [
        ({}, True),
        ({"distributed_executor_backend": "mp"}, False),
        ({"tensor_parallel_size": 2, "distributed_executor_backend": "mp"}, False),
    ],
)
def test_views_only_for_one_in_process_worker(kw, want):
    """A multiprocess executor pickles the scheduler output: a memoryview does not pickle (bytes there)."""
    proc = types.SimpleNamespace(vllm_config=types.SimpleNamespace(parallel_config=ParallelConfig(**kw)))
    assert compat.rows_by_view(proc) is want
    with pytest.raises(TypeError):
        import pickle

        pickle.dumps(memoryview(b"x"))
