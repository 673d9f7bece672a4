"""A matrix of bad requests to a real `vllm-lens serve` across capture, steering, hooks and the /v1/hooks/*,
/v1/lens/* routes: each is a 4xx JSON error naming the field, and a good request sent at the same time gets
the capture of a clean run; hook payloads are never unpickled without the operator's opt-in."""

from __future__ import annotations

import base64
import json
import os
import pickle
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
import torch

from support.lens_http import PROMPT, model_name
from support.servers import KEY
from vllm_worker.api.client import LensClient
from vllm_worker.protocol.wire import tensor_to_json

SMUGGLED = Path(os.environ.get("TMPDIR", "/tmp")) / "inspect-lens-smuggled-pickle-ran"


class _Smuggle:
    """Unpickling this would create a file: a server that unpickled a steering payload would be caught."""

    def __reduce__(self):
        return (open, (str(SMUGGLED), "w"))


def _pickled_hook_by_reference() -> str:
    """A function pickled by reference to a module the server cannot import."""
    blob = pickle.dumps(len)  # a reference to builtins.len ...
    return base64.b64encode(blob.replace(b"builtins", b"nosuchmodx")).decode()  # ... made unresolvable


def _cases() -> list[tuple]:
    """(id, route, body or xargs, status, field the error must name)."""
    vec = tensor_to_json(torch.ones(1, 128))
    sv = lambda **kw: json.dumps([{"activations": vec, "layer_indices": [0], **kw}])  # noqa: E731
    acts = lambda a, **kw: json.dumps([{"activations": a, "layer_indices": [0], **kw}])  # noqa: E731

    def hook(**kw):
        return json.dumps([{"fn": base64.b64encode(b"\x80\x05garbage").decode(), "layer_indices": [0], **kw}])

    import cloudpickle

    good_fn = base64.b64encode(cloudpickle.dumps(lambda ctx, h: None)).decode()
    smuggle = base64.b64encode(pickle.dumps(_Smuggle())).decode()
    CAP, STEER, HOOK = (
        "vllm_xargs.output_residual_stream",
        "vllm_xargs.apply_steering_vectors",
        "vllm_xargs.apply_hooks",
    )
    G = "/v1/completions"
    return [
        # capture
        ("capture layer out of range", G, {"output_residual_stream": [42]}, 400, CAP),
        ("capture negative out of range", G, {"output_residual_stream": [-9]}, 400, CAP),
        ("capture booleans", G, {"output_residual_stream": [True, False]}, 400, CAP),
        ("capture false", G, {"output_residual_stream": False}, 400, CAP),
        ("capture 2**70", G, {"output_residual_stream": [2**70]}, 400, CAP),
        ("capture float layer", G, {"output_residual_stream": [0.5]}, 400, CAP),
        ("capture nested list", G, {"output_residual_stream": [[0]]}, 400, CAP),
        ("capture empty list", G, {"output_residual_stream": []}, 400, CAP),
        ("capture word", G, {"output_residual_stream": "everything"}, 400, CAP),
        ("capture broken JSON string", G, {"output_residual_stream": "[0, "}, 400, CAP),
        ("capture object", G, {"output_residual_stream": {"layers": [0]}}, 400, CAP),
        ("unknown lens key", G, {"output_residual_streams": [0]}, 400, "vllm_xargs.extra_args.output_residual_streams"),
        # steering
        ("steer broken JSON", G, {"apply_steering_vectors": "[{not json"}, 400, STEER),
        ("steer not a list", G, {"apply_steering_vectors": "5"}, 400, STEER),
        ("steer base64", G, {"apply_steering_vectors": acts(dict(vec, b64="@@@"))}, 400, STEER + "[0].activations"),
        (
            "steer d_model",
            G,
            {"apply_steering_vectors": acts(tensor_to_json(torch.ones(1, 64)))},
            400,
            STEER + "[0].activations",
        ),
        (
            "steer dtype",
            G,
            {"apply_steering_vectors": acts(dict(vec, dtype="complex7"))},
            400,
            STEER + "[0].activations",
        ),
        (
            "steer int dtype",
            G,
            {"apply_steering_vectors": acts(tensor_to_json(torch.ones(1, 128, dtype=torch.int32)))},
            400,
            STEER + "[0].activations",
        ),
        (
            "steer NaN values",
            G,
            {"apply_steering_vectors": acts(tensor_to_json(torch.full((1, 128), float("nan"))))},
            400,
            STEER + "[0].activations",
        ),
        (
            "steer inf values",
            G,
            {"apply_steering_vectors": acts(tensor_to_json(torch.full((1, 128), float("inf"))))},
            400,
            STEER + "[0].activations",
        ),
        (
            "steer bytes do not fit shape",
            G,
            {"apply_steering_vectors": acts(dict(vec, shape=[1, 129]))},
            400,
            STEER + "[0].activations",
        ),
        (
            "steer bool in shape",
            G,
            {"apply_steering_vectors": acts(dict(vec, shape=[1, True, 128]))},
            400,
            STEER + "[0].activations",
        ),
        (
            "steer negative shape",
            G,
            {"apply_steering_vectors": acts(dict(vec, shape=[-1, 128]))},
            400,
            STEER + "[0].activations",
        ),
        ("steer missing activations", G, {"apply_steering_vectors": json.dumps([{"layer_indices": [0]}])}, 400, STEER),
        ("steer missing layers", G, {"apply_steering_vectors": json.dumps([{"activations": vec}])}, 400, STEER),
        (
            "steer layer out of range",
            G,
            {"apply_steering_vectors": json.dumps([{"activations": vec, "layer_indices": [99]}])},
            400,
            STEER + "[0].layer_indices",
        ),
        (
            "steer scale 1e400",
            G,
            {
                "apply_steering_vectors": '[{"activations": '
                + json.dumps(vec)
                + ', "layer_indices": [0], "scale": 1'
                + "0" * 400
                + "}]"
            },
            400,
            STEER + "[0].scale",
        ),
        ("steer scale NaN", G, {"apply_steering_vectors": sv(scale=float("nan"))}, 400, STEER + "[0].scale"),
        ("steer scale string", G, {"apply_steering_vectors": sv(scale="big")}, 400, STEER + "[0].scale"),
        ("steer norm_match string", G, {"apply_steering_vectors": sv(norm_match="yes")}, 400, STEER + "[0].norm_match"),
        (
            "steer positions on 2-D",
            G,
            {"apply_steering_vectors": sv(position_indices=[0])},
            400,
            STEER + "[0].position_indices",
        ),
        (
            "steer positions past prompt",
            G,
            {"apply_steering_vectors": acts(tensor_to_json(torch.ones(1, 1, 128)), position_indices=[500])},
            400,
            STEER + "[0].position_indices",
        ),
        ("steer unknown field", G, {"apply_steering_vectors": sv(strength=2)}, 400, STEER + "[0]"),
        (
            "steer payload over limit",
            G,
            {"apply_steering_vectors": acts(tensor_to_json(torch.ones(1, 3000, 128)))},
            400,
            STEER,
        ),
        (
            "steer pickle smuggled as tensor",
            G,
            {"apply_steering_vectors": acts({"__type__": "pickle", "data": smuggle})},
            400,
            STEER + "[0].activations",
        ),
        (
            "steer pickle as object dtype",
            G,
            {"apply_steering_vectors": acts({"dtype": "object", "shape": [1, 128], "b64": smuggle})},
            400,
            STEER + "[0].activations",
        ),
        # hooks (this server opted in to remote hooks)
        ("hook base64", G, {"apply_hooks": json.dumps([{"fn": "%%%", "layer_indices": [0]}])}, 400, HOOK + "[0].fn"),
        ("hook garbage pickle", G, {"apply_hooks": hook()}, 400, HOOK + "[0].fn"),
        (
            "hook pickled by reference to a missing module",
            G,
            {"apply_hooks": json.dumps([{"fn": _pickled_hook_by_reference(), "layer_indices": [0]}])},
            400,
            HOOK + "[0].fn",
        ),
        (
            "hook not callable",
            G,
            {"apply_hooks": json.dumps([{"fn": base64.b64encode(pickle.dumps(7)).decode(), "layer_indices": [0]}])},
            400,
            HOOK + "[0].fn",
        ),
        (
            "hook layer out of range",
            G,
            {"apply_hooks": json.dumps([{"fn": good_fn, "layer_indices": [7]}])},
            400,
            HOOK + "[0].layer_indices",
        ),
        (
            "hook pre not a bool",
            G,
            {"apply_hooks": json.dumps([{"fn": good_fn, "layer_indices": [0], "pre": "no"}])},
            400,
            HOOK + "[0].pre",
        ),
        ("hook missing fn", G, {"apply_hooks": json.dumps([{"layer_indices": [0]}])}, 400, HOOK + "[0].fn"),
        # request-level fields combined with ours
        ("n not a number", G, {"output_residual_stream": [0], "_body": {"n": "abc"}}, 400, "n"),
        ("n zero", G, {"output_residual_stream": [0], "_body": {"n": 0}}, 400, "n"),
        (
            "beam search with capture",
            G,
            {"output_residual_stream": [0], "_body": {"use_beam_search": True, "n": 2}},
            400,
            "use_beam_search",
        ),
        # persistent hooks and lens routes
        ("register hooks not a list", "/v1/hooks/register", {"hooks": "x"}, 400, "hooks"),
        (
            "register garbage pickle",
            "/v1/hooks/register",
            {"hooks": [{"fn": base64.b64encode(b"\x80\x05garbage").decode(), "layer_indices": [0]}]},
            400,
            "hooks[0].fn",
        ),
        (
            "register layer out of range",
            "/v1/hooks/register",
            {"hooks": [{"fn": good_fn, "layer_indices": [9]}]},
            400,
            "hooks[0].layer_indices",
        ),
        (
            "register unknown parameter",
            "/v1/hooks/register",
            {"hooks": [{"fn": good_fn, "layer_indices": [0]}], "prefetch_params": ["no.such"]},
            400,
            "prefetch_params",
        ),
        ("register body not JSON", "/v1/hooks/register", b"{nope", 400, "body"),
        ("register body a list", "/v1/hooks/register", [1, 2], 400, "body"),
        ("prefetch unknown parameter", "/v1/hooks/prefetch", {"names": ["no.such.weight"]}, 400, "names"),
        ("prefetch names not a list", "/v1/hooks/prefetch", {"names": "lm_head.weight"}, 400, "names"),
        ("collect wrong API key", "/v1/hooks/collect", {"_key": "wrong"}, 401, None),
        ("lens info without API key", "/v1/lens/info", {"_key": None}, 401, None),
    ]


def _send(url: str, route: str, payload, key=KEY) -> httpx.Response:
    if route == "/v1/lens/info":
        return httpx.get(url + route, timeout=60, headers={"Authorization": f"Bearer {key}"} if key else {})
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    if isinstance(payload, bytes):
        return httpx.post(
            url + route, content=payload, timeout=60, headers={**headers, "content-type": "application/json"}
        )
    if route == "/v1/completions":
        xargs = dict(payload)
        body = {"model": model_name(), "prompt": PROMPT, "max_tokens": 2, **xargs.pop("_body", {}), "vllm_xargs": xargs}
        return httpx.post(url + route, json=body, timeout=60, headers=headers)
    return httpx.post(url + route, json=payload, timeout=60, headers=headers)


@pytest.fixture(scope="module")
def clean_capture(server):
    r = LensClient(server, api_key=KEY).generate(
        PROMPT, max_tokens=4, temperature=0, ignore_eos=True, capture_layers=[0, 2]
    )
    return r.token_ids, r.activations["residual_stream"]


CASES = _cases()


def test_the_matrix_is_big_enough():
    assert len(CASES) >= 40 and len({c[0] for c in CASES}) == len(CASES)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c[0])
def test_bad_input_is_a_4xx_naming_the_field_while_batch_mates_keep_their_numbers(server, clean_capture, case):
    _, route, payload, status, field = case
    key = KEY
    if isinstance(payload, dict) and "_key" in payload:
        payload = dict(payload)
        key = payload.pop("_key")
    SMUGGLED.unlink(missing_ok=True)
    with ThreadPoolExecutor(2) as ex:  # a good request in flight at the same time as the bad one
        good = ex.submit(
            LensClient(server, api_key=KEY).generate,
            PROMPT,
            max_tokens=4,
            temperature=0,
            ignore_eos=True,
            capture_layers=[0, 2],
        )
        r = _send(server, route, payload, key)
        ok = good.result()
    assert r.status_code == status, r.text
    err = r.json()["error"] if "error" in r.json() else r.json()
    if field is not None:
        assert (err.get("param") or "").startswith(field), err
        assert field.split(".")[-1].split("[")[0] in err["message"] or field == "body", err
    assert not SMUGGLED.exists(), "a steering payload was unpickled"
    assert ok.token_ids == clean_capture[0]
    assert torch.equal(ok.activations["residual_stream"], clean_capture[1])


def test_hooks_without_opt_in_are_403_naming_the_field(locked_server):
    import cloudpickle

    fn = base64.b64encode(cloudpickle.dumps(lambda ctx, h: None)).decode()
    body = {
        "model": model_name(),
        "prompt": PROMPT,
        "max_tokens": 2,
        "vllm_xargs": {"apply_hooks": json.dumps([{"fn": fn, "layer_indices": [0]}])},
    }
    r = httpx.post(locked_server + "/v1/completions", json=body, timeout=60)
    assert r.status_code == 403 and r.json()["error"]["param"] == "vllm_xargs.apply_hooks", r.text
    r = httpx.post(locked_server + "/v1/hooks/register", json={"hooks": [{"fn": fn, "layer_indices": [0]}]}, timeout=60)
    assert r.status_code == 403 and "--allow-remote-hooks" in r.json()["error"]["message"], r.text
    # a hook payload is never unpickled without the opt-in, even a harmful one
    SMUGGLED.unlink(missing_ok=True)
    evil = base64.b64encode(pickle.dumps(_Smuggle())).decode()
    body["vllm_xargs"]["apply_hooks"] = json.dumps([{"fn": evil, "layer_indices": [0]}])
    assert httpx.post(locked_server + "/v1/completions", json=body, timeout=60).status_code == 403
    assert not SMUGGLED.exists()
