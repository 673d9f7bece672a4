"""`LensClient`: capture, steering and hooks against a `vllm-lens serve` server, from Python.

    client = LensClient("http://127.0.0.1:8000", api_key=None)
    r = client.generate("The capital of France is", max_tokens=8, capture_layers=[0, 15])
    r.text, r.token_ids, r.activations["residual_stream"]   # tensor (2, n_prompt + n_gen - 1, d)

Tensors travel in the pickle-free wire format (`vllm_worker.protocol.wire`). Hooks are sent as cloudpickle and
run only on servers started with `--allow-remote-hooks`. Server errors raise `LensHTTPError`
subclasses carrying the server's message and the offending field.
"""

from __future__ import annotations

import base64
import json
from dataclasses import dataclass, field
from typing import Any, Sequence

import httpx

from vllm_worker.api.hooks import Hook
from vllm_worker.api.steering import SteeringVector
from vllm_worker.protocol.wire import from_jsonable, tensor_to_json

VECTORS_PATH = "/v1/lens/vectors"


class LensHTTPError(RuntimeError):
    def __init__(self, status: int, message: str, param: str | None = None, kind: str | None = None) -> None:
        super().__init__(f"HTTP {status}: {message}" + (f" (field: {param})" if param else ""))
        self.status, self.message, self.param, self.kind = status, message, param, kind


class LensBadRequest(LensHTTPError):
    """4xx: the request was invalid (the field is in `.param`)."""


class LensForbidden(LensHTTPError):
    """403: e.g. hooks on a server without --allow-remote-hooks."""


class LensUnauthorized(LensHTTPError):
    """401: missing or wrong API key."""


class LensServerError(LensHTTPError):
    """5xx."""


@dataclass
class LensResult:
    text: str
    token_ids: list[int]
    prompt_token_ids: list[int]
    activations: dict[str, Any] | None = None
    hook_results: dict[str, Any] | None = None
    finish_reason: str | None = None
    logprobs: Any = None  # the choice's `logprobs` object as the server sent it (when requested)
    choices: list["LensResult"] = field(default_factory=list)  # every sample (n > 1)
    raw: dict | None = field(default=None, repr=False)


def _raise_for(resp: httpx.Response) -> None:
    if resp.status_code < 400:
        return
    message, param, kind = resp.text, None, None
    try:
        err = resp.json().get("error")
    except (ValueError, AttributeError):
        err = None
    if isinstance(err, dict):
        message, param, kind = err.get("message", resp.text), err.get("param"), err.get("type")
    elif isinstance(err, str):  # vLLM's auth middleware answers {"error": "Unauthorized"}
        message = err
    cls = {401: LensUnauthorized, 403: LensForbidden}.get(resp.status_code)
    if cls is None:
        cls = LensServerError if resp.status_code >= 500 else LensBadRequest
    raise cls(resp.status_code, message, param, kind)


def encode_steering(vectors: Sequence[SteeringVector]) -> str:
    return json.dumps(
        [
            {
                # a registered vector's name, or the tensor itself
                **({"name": v.name} if v.name is not None else {"activations": _tensor(v.activations)}),
                "layer_indices": list(v.layer_indices),
                "scale": v.scale,
                "norm_match": v.norm_match,
                "position_indices": None if v.position_indices is None else list(v.position_indices),
                "point": v.point,
                **({} if v.heads is None else {"heads": list(v.heads)}),
                **intervention_fields(v),
            }
            for v in vectors
        ]
    )


def intervention_fields(v: SteeringVector) -> dict[str, Any]:
    """`op`, `phase`, `lo`, `hi` of an entry where they are not the defaults (a plain addition's JSON form
    stays as it always was)."""
    out: dict[str, Any] = {}
    if v.op != "add":
        out["op"] = v.op
    if v.phase != "all":
        out["phase"] = v.phase
    out.update({k: x for k, x in (("lo", v.lo), ("hi", v.hi)) if x is not None})
    return out


def _tensor(t: Any) -> dict | None:
    return None if t is None else tensor_to_json(t)


def encode_hooks(hooks: Sequence[Hook]) -> list[dict]:
    import cloudpickle

    return [
        {
            "fn": base64.b64encode(cloudpickle.dumps(h.fn)).decode(),
            "layer_indices": list(h.layer_indices),
            "pre": h.pre,
            **({} if h.point is None else {"point": h.point}),
            **({"batched": True} if h.batched else {}),
            **({"read_only": True} if h.read_only else {}),
        }
        for h in hooks
    ]


def build_request(
    model: str,
    prompt: Any,
    messages: Any,
    max_tokens: int,
    capture_layers: Any,
    steering_vectors: Any,
    hooks: Any,
    sampling: dict,
    capture: Any = None,
) -> tuple[str, dict]:
    if (prompt is None) == (messages is None):
        raise ValueError("give exactly one of prompt or messages")
    xargs: dict[str, Any] = dict(sampling.pop("vllm_xargs", None) or {})
    if capture_layers is not None:
        xargs["output_residual_stream"] = list(capture_layers)
    if capture is not None:
        if not isinstance(capture, dict):
            raise ValueError(f'capture: expected {{point: layer indices}}, e.g. {{"attn_out": [3]}}, got {capture!r}')
        xargs["output_activations"] = json.dumps(
            {p: v if isinstance(v, (str, bool)) else list(v) for p, v in capture.items()}
        )
    if steering_vectors:
        xargs["apply_steering_vectors"] = encode_steering(steering_vectors)
    if hooks:
        xargs["apply_hooks"] = json.dumps(encode_hooks(hooks))
    body: dict[str, Any] = {"model": model, "max_tokens": max_tokens, "return_token_ids": True, **sampling}
    if xargs:
        body["vllm_xargs"] = xargs
    if messages is not None:
        body["messages"] = messages
        return "/v1/chat/completions", body
    body["prompt"] = prompt
    return "/v1/completions", body


def decode_activations(response: dict) -> list[dict[str, Any] | None]:
    """Per choice of a raw `/v1/completions` or `/v1/chat/completions` JSON response (e.g. from `requests`
    or the `openai` client's `.model_dump()`): `{"residual_stream": Tensor (n_layers, n_pos, d), "layers":
    [...]}`, or None where the choice captured nothing. A response in the original vllm-lens's form (to
    a request in its forms) carries the first choice's results at the top level: read from there."""
    out = []
    for i, c in enumerate(sorted(response.get("choices", []), key=lambda c: c.get("index", 0))):
        acts = c.get("activations")
        if acts is None and i == 0:
            acts = response.get("activations")
        out.append(None if acts is None else _activations(acts))
    return out


def decode_stream_chunk(chunk: dict) -> dict[int, dict[str, Any]]:
    """Per choice index in one streamed chunk (`"stream": true`, the JSON after `data: `): `probe_scores` =
    {probe: {"positions": Tensor (m,) int64, "scores": Tensor (m, n_out)}} for the positions whose forward
    passes produced the chunk's tokens; `probe_scores_error` when the server could not read them for this
    chunk (the stream goes on, the final chunk holds every score); `activations` = `decode_activations`'s
    dict in the final chunk. Choices carrying none of these are left out."""
    out: dict[int, dict[str, Any]] = {}
    for c in chunk.get("choices") or []:
        got: dict[str, Any] = {}
        scores = c.get("probe_scores")
        if scores:
            got["probe_scores"] = {
                name: {"positions": from_jsonable(v["positions"]), "scores": from_jsonable(v["scores"])}
                for name, v in scores.items()
            }
        if c.get("probe_scores_error"):
            got["probe_scores_error"] = str(c["probe_scores_error"])
        if c.get("activations") is not None:
            got["activations"] = _activations(c["activations"])
        if got:
            out[int(c.get("index", 0))] = got
    return out


def _activations(acts: dict) -> dict[str, Any]:
    """The same dict as offline `RequestOutput.activations`: a tensor per point, `points`, and
    `residual_stream` / `layers` (= `resid_post`)."""
    out: dict[str, Any] = {}
    if "residual_stream" in acts:
        out["residual_stream"] = from_jsonable(acts["residual_stream"])
        out["layers"] = list(from_jsonable(acts["layers"]))
    points = acts.get("points") or ({"resid_post": out["layers"]} if "layers" in out else {})
    for point in points:
        out[point] = out["residual_stream"] if point == "resid_post" else from_jsonable(acts[point])
    out["points"] = {p: list(v) for p, v in points.items()}
    if "expert_ids" in acts:
        out["expert_ids"] = from_jsonable(acts["expert_ids"])
    if "sae_features" in acts:
        out["sae_features"] = from_jsonable(acts["sae_features"])
    if "probe_actions" in acts:
        out["probe_actions"] = list(acts["probe_actions"])
    for key in ("probe_scores", "probe_aggregates"):
        if key in acts:
            out[key] = from_jsonable(acts[key])
    return out


def parse_response(resp: dict) -> LensResult:
    results = []
    choices = sorted(resp.get("choices", []), key=lambda c: c["index"])
    for i, (c, acts) in enumerate(zip(choices, decode_activations(resp))):
        text = c["message"].get("content") or "" if "message" in c else c.get("text", "")
        if i == 0 and "hook_results" not in c and "hook_results" in resp:  # the original's form
            c = dict(c, hook_results=resp["hook_results"])
        results.append(
            LensResult(
                text=text,
                token_ids=list(c.get("token_ids") or []),
                prompt_token_ids=list(c.get("prompt_token_ids") or resp.get("prompt_token_ids") or []),
                activations=acts,
                hook_results=from_jsonable(c["hook_results"]) if "hook_results" in c else None,
                finish_reason=c.get("finish_reason"),
                logprobs=c.get("logprobs"),
                raw=c,
            )
        )
    first = results[0]
    first.choices = results
    first.raw = resp
    return first


class _Base:
    def __init__(self, base_url: str, api_key: str | None = None, model: str | None = None) -> None:
        self.base_url = base_url.rstrip("/")
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.model = model


class LensClient(_Base):
    """Synchronous client."""

    def __init__(
        self, base_url: str, api_key: str | None = None, model: str | None = None, timeout: float = 600.0
    ) -> None:
        super().__init__(base_url, api_key, model)
        self._http = httpx.Client(base_url=self.base_url, headers=self.headers, timeout=timeout)

    def _post(self, path: str, body: dict | None = None) -> dict:
        resp = self._http.post(path, json=body or {})
        _raise_for(resp)
        return resp.json()

    def _model(self) -> str:
        if self.model is None:
            resp = self._http.get("/v1/models")
            _raise_for(resp)
            self.model = resp.json()["data"][0]["id"]
        return self.model

    def generate(
        self,
        prompt: Any = None,
        *,
        messages: Any = None,
        max_tokens: int = 16,
        capture_layers: Sequence[int] | None = None,
        steering_vectors: Sequence[SteeringVector] | None = None,
        hooks: Sequence[Hook] | None = None,
        capture: dict[str, Any] | None = None,
        **sampling: Any,
    ) -> LensResult:
        """`capture_layers`: the residual stream (`resid_post`) at these layers; `capture`: any hook points,
        `{"attn_out": [3, 7], "resid_mid": [5]}` (docs/hook-points.md) — both land in `.activations`."""
        path, body = build_request(
            self._model(), prompt, messages, max_tokens, capture_layers, steering_vectors, hooks, sampling, capture
        )
        return parse_response(self._post(path, body))

    def chat(self, messages: Any, **kwargs: Any) -> LensResult:
        """`generate(messages=messages, ...)`: the served model's chat template applies."""
        return self.generate(messages=messages, **kwargs)

    def tokenize(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text` with the server's tokenizer (vLLM's /tokenize)."""
        body = {"model": self._model(), "prompt": text, "add_special_tokens": add_special_tokens}
        return list(self._post("/tokenize", body)["tokens"])

    def tokenize_chat(
        self, messages: Any, add_generation_prompt: bool = True, continue_final_message: bool = False
    ) -> list[int]:
        """Token ids of `messages` through the served model's chat template (what `chat` would send);
        `continue_final_message`: the last message's turn left open (its text is the prompt's tail)."""
        body = {
            "model": self._model(),
            "messages": messages,
            "add_generation_prompt": add_generation_prompt,
            "continue_final_message": continue_final_message,
        }
        return list(self._post("/tokenize", body)["tokens"])

    def detokenize(self, token_ids: Sequence[int]) -> str:
        """Text of `token_ids` with the server's tokenizer (vLLM's /detokenize)."""
        return self._post("/detokenize", {"model": self._model(), "tokens": list(token_ids)})["prompt"]

    def info(self) -> dict[str, Any]:
        """`{"n_layers", "d_model", "vllm_version", "remote_hooks"}` of the served model."""
        resp = self._http.get("/v1/lens/info")
        _raise_for(resp)
        return resp.json()

    def register_hooks(self, hooks: Sequence[Hook], prefetch_params: Sequence[str] | None = None) -> int:
        body: dict[str, Any] = {"hooks": encode_hooks(hooks)}
        if prefetch_params:
            body["prefetch_params"] = list(prefetch_params)
        return self._post("/v1/hooks/register", body)["registered"]

    def collect_hook_results(self) -> dict[str, dict[str, Any]]:
        return from_jsonable(self._post("/v1/hooks/collect")["results"])

    def clear_hooks(self) -> None:
        self._post("/v1/hooks/clear")

    def clear_hook_results(self) -> None:
        self._post("/v1/hooks/clear_results")

    def prefetch_params(self, names: Sequence[str]) -> list[str]:
        return self._post("/v1/hooks/prefetch", {"names": list(names)})["prefetched"]

    def register_vector(self, name: str, tensor: Any) -> dict[str, Any]:
        """Register (or replace) `tensor` on the server as `name`; steering entries then name it:
        `SteeringVector(name=name, layer_indices=[15], scale=4.0)`. Returns {name, shape, dtype, bytes}."""
        return self._post(VECTORS_PATH, {"name": name, "activations": tensor_to_json(tensor)})

    def list_vectors(self) -> list[dict[str, Any]]:
        """The vectors registered with this client's API key: [{name, shape, dtype, bytes}]."""
        resp = self._http.get(VECTORS_PATH)
        _raise_for(resp)
        return resp.json()["vectors"]

    def delete_vector(self, name: str) -> None:
        _raise_for(self._http.delete(f"{VECTORS_PATH}/{name}"))

    def clear_prefetched(self) -> None:
        self._post("/v1/hooks/clear_prefetched")

    def close(self) -> None:
        self._http.close()


class AsyncLensClient(_Base):
    """The async twin of `LensClient` (same methods, awaitable)."""

    def __init__(
        self, base_url: str, api_key: str | None = None, model: str | None = None, timeout: float = 600.0
    ) -> None:
        super().__init__(base_url, api_key, model)
        self._http = httpx.AsyncClient(base_url=self.base_url, headers=self.headers, timeout=timeout)

    async def _post(self, path: str, body: dict | None = None) -> dict:
        resp = await self._http.post(path, json=body or {})
        _raise_for(resp)
        return resp.json()

    async def _model(self) -> str:
        if self.model is None:
            resp = await self._http.get("/v1/models")
            _raise_for(resp)
            self.model = resp.json()["data"][0]["id"]
        return self.model

    async def generate(
        self,
        prompt: Any = None,
        *,
        messages: Any = None,
        max_tokens: int = 16,
        capture_layers: Sequence[int] | None = None,
        steering_vectors: Sequence[SteeringVector] | None = None,
        hooks: Sequence[Hook] | None = None,
        capture: dict[str, Any] | None = None,
        **sampling: Any,
    ) -> LensResult:
        """`capture_layers`: the residual stream (`resid_post`) at these layers; `capture`: any hook points,
        `{"attn_out": [3, 7], "resid_mid": [5]}` (docs/hook-points.md) — both land in `.activations`."""
        path, body = build_request(
            await self._model(),
            prompt,
            messages,
            max_tokens,
            capture_layers,
            steering_vectors,
            hooks,
            sampling,
            capture,
        )
        return parse_response(await self._post(path, body))

    async def chat(self, messages: Any, **kwargs: Any) -> LensResult:
        return await self.generate(messages=messages, **kwargs)

    async def tokenize(self, text: str, add_special_tokens: bool = True) -> list[int]:
        body = {"model": await self._model(), "prompt": text, "add_special_tokens": add_special_tokens}
        return list((await self._post("/tokenize", body))["tokens"])

    async def tokenize_chat(
        self, messages: Any, add_generation_prompt: bool = True, continue_final_message: bool = False
    ) -> list[int]:
        body = {
            "model": await self._model(),
            "messages": messages,
            "add_generation_prompt": add_generation_prompt,
            "continue_final_message": continue_final_message,
        }
        return list((await self._post("/tokenize", body))["tokens"])

    async def detokenize(self, token_ids: Sequence[int]) -> str:
        return (await self._post("/detokenize", {"model": await self._model(), "tokens": list(token_ids)}))["prompt"]

    async def info(self) -> dict[str, Any]:
        resp = await self._http.get("/v1/lens/info")
        _raise_for(resp)
        return resp.json()

    async def register_hooks(self, hooks: Sequence[Hook], prefetch_params: Sequence[str] | None = None) -> int:
        body: dict[str, Any] = {"hooks": encode_hooks(hooks)}
        if prefetch_params:
            body["prefetch_params"] = list(prefetch_params)
        return (await self._post("/v1/hooks/register", body))["registered"]

    async def collect_hook_results(self) -> dict[str, dict[str, Any]]:
        return from_jsonable((await self._post("/v1/hooks/collect"))["results"])

    async def clear_hooks(self) -> None:
        await self._post("/v1/hooks/clear")

    async def clear_hook_results(self) -> None:
        await self._post("/v1/hooks/clear_results")

    async def prefetch_params(self, names: Sequence[str]) -> list[str]:
        return (await self._post("/v1/hooks/prefetch", {"names": list(names)}))["prefetched"]

    async def register_vector(self, name: str, tensor: Any) -> dict[str, Any]:
        return await self._post(VECTORS_PATH, {"name": name, "activations": tensor_to_json(tensor)})

    async def list_vectors(self) -> list[dict[str, Any]]:
        resp = await self._http.get(VECTORS_PATH)
        _raise_for(resp)
        return resp.json()["vectors"]

    async def delete_vector(self, name: str) -> None:
        _raise_for(await self._http.delete(f"{VECTORS_PATH}/{name}"))

    async def clear_prefetched(self) -> None:
        await self._post("/v1/hooks/clear_prefetched")

    async def aclose(self) -> None:
        await self._http.aclose()


# The original vllm-lens client's name, for code written against it.
VLLMLensClient = LensClient
