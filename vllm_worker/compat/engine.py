"""Engine construction: the engine args (our worker extension, the model runner: V1, or V2 when opted in), compilation (our tap op
as a splitting op, the compile-cache key), the HTTP endpoint plugin under plain `vllm serve`, and the
attributes and methods we add to vLLM's public objects. `check()` runs at plugin load."""

from __future__ import annotations

import functools
from typing import Any, Callable

from vllm_worker.compat.ipc import raw_view_code
from vllm_worker.compat.requests import input_processor_cls, offline_mixin_cls
from vllm_worker.compat.version import LensIncompatibleVLLM, check_version, require, wrap


def engine_args_cls() -> type:
    from vllm.engine.arg_utils import EngineArgs

    require(EngineArgs, "create_engine_config", "EngineArgs")
    require(EngineArgs, "worker_extension_cls", "EngineArgs")
    require(EngineArgs, "enforce_eager", "EngineArgs")
    return EngineArgs


def force_v1_model_runner() -> None:
    """Our worker patches live on the V1 `GPUModelRunner`. vLLM >= 0.26 on GPU defaults non-MoE models to
    the V2 runner (`vllm/v1/worker/gpu/`), where they would silently never run: select V1 through its
    env switch (read when the engine config is built, inherited by worker processes), and refuse V2.
    The default; `VLLM_LENS_V2_RUNNER=1` serves V2 instead (`select_model_runner`)."""
    import os

    import vllm.envs as envs

    if "VLLM_USE_V2_MODEL_RUNNER" not in getattr(envs, "environment_variables", {}):
        return  # this vLLM has no V2 runner
    value = os.environ.get("VLLM_USE_V2_MODEL_RUNNER", "").strip().lower()
    if value in ("1", "true"):
        raise LensIncompatibleVLLM(
            "inspect-lens hooks the V1 model runner; VLLM_USE_V2_MODEL_RUNNER=1 would make "
            "every capture/steering request a silent no-op. Unset it, set VLLM_LENS_V2_RUNNER=1 to "
            "use the plugin's V2 adapter, or set VLLM_LENS_DISABLE=1 to run without the plugin."
        )
    os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "0"


def select_model_runner() -> None:
    """Which model runner the engine may build: by default V1 (`force_v1_model_runner`); with
    `VLLM_LENS_V2_RUNNER=1` vLLM's own choice stands (V2 on GPU for most models), and every V2 internal the
    adapter uses is checked now (`runner_v2.internals`), so a moved one fails here, naming it."""
    from vllm_worker.compat import runner_v2

    if runner_v2.enabled():
        runner_v2.check()
    else:
        force_v1_model_runner()


def patch_engine_args(adjust: Callable[[Any], Any]) -> None:
    """`adjust(engine_args) -> engine_args` runs before every engine config is built (offline and serve)."""

    def make(orig: Callable) -> Callable:
        def create_engine_config(self, *args, **kwargs):
            return orig(adjust(self), *args, **kwargs)

        return create_engine_config

    wrap(engine_args_cls(), "create_engine_config", make)


def patch_splitting_ops(op: str) -> None:
    """Add our tap op to vLLM's piecewise-compilation `splitting_ops` (after vLLM filled in its defaults),
    so it runs eagerly between CUDA-graph pieces: a step with Python hooks can then still use piecewise
    graphs. Full graphs record the op's graph-safe kernel like any other. Empty lists (one flat graph)
    stay empty: there the op is inside the graph and steps with hooks run without graphs."""
    from vllm.config import CompilationConfig

    def make(orig: Callable) -> Callable:
        def set_splitting_ops_for_v1(self, *args, **kwargs):
            out = orig(self, *args, **kwargs)
            if self.splitting_ops and op not in self.splitting_ops:
                self.splitting_ops.append(op)
            return out

        return set_splitting_ops_for_v1

    wrap(CompilationConfig, "set_splitting_ops_for_v1", make)


def patch_endpoint_plugins(name: str, factory: Callable[[], Any]) -> None:
    """Plain `vllm serve`: vLLM loads endpoint plugins only when `VLLM_PLUGINS` names them. When
    `VLLM_PLUGINS` is unset (vLLM's default: every installed general plugin loads, ours included), add
    our HTTP routes too, so installing the package is enough. An explicit `VLLM_PLUGINS` list is the
    operator's choice and is respected."""
    import os

    import vllm.plugins as vp

    orig = require(vp, "load_endpoint_plugins", "vllm.plugins")
    if getattr(orig, "__lens_wrapped__", False):
        return

    def load_endpoint_plugins(supported_tasks=None, *args, **kwargs):
        plugins = orig(supported_tasks, *args, **kwargs)
        if os.environ.get("VLLM_PLUGINS") is None and not any(getattr(p, "name", None) == name for p in plugins):
            ours = factory()
            if ours.required_tasks is None or set(ours.required_tasks) & set(supported_tasks or ()):
                plugins.append(ours)
        return plugins

    functools.update_wrapper(load_endpoint_plugins, orig)
    load_endpoint_plugins.__lens_wrapped__ = True  # type: ignore[attr-defined]  # a marker on a function object
    vp.load_endpoint_plugins = load_endpoint_plugins


def api_keys(args: Any) -> list[str]:
    """The API keys a server started with `args` requires (vLLM's `--api-key`, else `VLLM_API_KEY`; the
    rule of `vllm.entrypoints.serve.middleware.register`); [] when it runs without keys."""
    import os

    if args is None:
        return []
    keys = require(args, "api_key", "the server's args")
    if isinstance(keys, str):
        keys = [keys]
    return [k for k in (keys or [os.environ.get("VLLM_API_KEY")]) if k]


def patch_compile_hash(marker: Callable[[], str]) -> None:
    """Mix `marker()` into the compilation config's hash, which keys vLLM's compile cache: a graph compiled
    without our taps (a plugin-disabled run on the same machine), or with other taps (another tap layout,
    other `VLLM_LENS_POINTS`), is then never reused by our engines. Called when the hash is computed."""
    from vllm.config import CompilationConfig

    def make(orig: Callable) -> Callable:
        def compute_hash(self, *args, **kwargs):
            import hashlib

            return hashlib.sha256(f"{orig(self, *args, **kwargs)}|{marker()}".encode()).hexdigest()

        return compute_hash

    wrap(CompilationConfig, "compute_hash", make)


def declare_settings(names: list[str]) -> int:
    """Our `VLLM_LENS_*` settings entered in vLLM's table of its environment variables
    (`vllm.envs.environment_variables`): vLLM warns at every engine start about each `VLLM_*` variable it
    does not know, and refuses to start on one with `--fail-on-environ-validation`. The entries return the
    raw text (ours are read through `vllm_worker.envs`). Returns how many were added."""
    import os

    import vllm.envs as venvs

    table = getattr(venvs, "environment_variables", None)
    if not isinstance(table, dict):
        raise LensIncompatibleVLLM(
            "vllm.envs.environment_variables (vLLM's table of its settings) is missing or not a dict; "
            "inspect-lens declares its VLLM_LENS_* settings there"
        )
    added = 0
    for name in names:
        if name not in table:
            table[name] = functools.partial(os.environ.get, name)
            added += 1
    return added


def add_output_defaults() -> None:
    """`RequestOutput.activations` / `CompletionOutput.activations` exist (None) on every output."""
    from vllm.outputs import CompletionOutput, RequestOutput

    for cls in (RequestOutput, CompletionOutput):
        for name in ("activations", "hook_results", "hook_error"):
            if not hasattr(cls, name):
                setattr(cls, name, None)


def add_llm_methods(methods: dict[str, Callable]) -> None:
    """Public methods on `vllm.LLM` (persistent hooks); never overrides one vLLM already has."""
    from vllm.entrypoints.llm import LLM

    for name, fn in methods.items():
        existing = getattr(LLM, name, None)
        if existing is not None and not getattr(existing, "__lens_wrapped__", False):
            raise LensIncompatibleVLLM(f"vllm.LLM already defines {name}; refusing to shadow it")
        fn.__lens_wrapped__ = True  # type: ignore[attr-defined]  # a marker on a function object
        setattr(LLM, name, fn)


def check() -> None:
    """Everything the plugin needs, checked up front (plugin load in the frontend)."""
    check_version()
    engine_args_cls()
    input_processor_cls()
    offline_mixin_cls()
    raw_view_code()
