"""Entry point of the `vllm.general_plugins` group: vLLM calls `register()` in every process."""

from __future__ import annotations

import logging

logger = logging.getLogger("vllm_worker")

EXTENSION = "vllm_worker.worker.extension.LensWorkerExtension"
_registered = False
_warned_eager = False


def disabled() -> bool:
    from vllm_worker import envs

    return bool(envs.get("VLLM_LENS_DISABLE"))


def _adjust_engine_args(args):
    """Copy of the engine args with our worker extension (never edits the caller's). Compilation and CUDA
    graphs stay as the user set them; only a vLLM that cannot run our taps in graphs gets eager mode."""
    import copy

    from vllm_worker.worker.composed import PREFIX as COMPOSED_PREFIX
    from vllm_worker.worker.composed import name_for

    global _warned_eager
    from vllm_worker import compat

    compat.select_model_runner()
    new = copy.copy(args)
    user_ext = args.worker_extension_cls or ""
    if not user_ext:
        new.worker_extension_cls = EXTENSION
    elif user_ext != EXTENSION and not user_ext.startswith(COMPOSED_PREFIX):
        new.worker_extension_cls = name_for(user_ext)
    if not args.enforce_eager:
        why = compat.graph_taps_unsupported()
        if why is not None:
            if not _warned_eager:
                logger.warning(
                    "inspect-lens: forcing enforce_eager=True because the taps cannot run inside "
                    "compiled graphs here (%s). Set VLLM_LENS_DISABLE=1 to run vLLM without the "
                    "plugin.",
                    why,
                )
                _warned_eager = True
            new.enforce_eager = True
    return new


def _endpoints():
    from vllm_worker.server.endpoints import LensEndpoints

    return LensEndpoints()


def _async_consumer(engine_client) -> bool:
    """A caller of `AsyncLLM.generate` gets results on its outputs — except vLLM's own OpenAI server,
    which would drop them: there only our HTTP plugin is a consumer (without it, capture is refused)."""
    import sys

    from vllm_worker import compat, frontend

    processor = compat.processor_of_engine_client(engine_client)
    if "vllm.entrypoints.openai.api_server" not in sys.modules:
        frontend.mark_engine_consumer(processor, "async")
    return frontend.consumer_of(processor) == "async"


def _compile_marker() -> str:
    """What our taps add to a compiled graph: the tap layout's version and the inner points tapped."""
    from vllm_worker.protocol.points import SITES_PER_LAYER, enabled_inner

    return f"inspect-lens: taps v4, {SITES_PER_LAYER} sites/layer, inner={','.join(sorted(enabled_inner()))}"


def _declare_settings(quiet: bool) -> None:
    """Our settings in vLLM's table of environment variables (no warning per `VLLM_LENS_*` at each start,
    none fatal under `--fail-on-environ-validation`) — also when the plugin is disabled, since
    `VLLM_LENS_DISABLE` is one of them; then a vLLM that moved the table is not our concern."""
    from vllm_worker.compat.engine import declare_settings
    from vllm_worker.envs import SETTINGS

    try:
        declare_settings(list(SETTINGS))
    except Exception:
        if not quiet:
            raise


def register() -> None:
    global _registered
    if _registered:
        return
    _declare_settings(quiet=disabled())
    if disabled():
        return
    from vllm_worker import compat, frontend
    from vllm_worker.frontend import llm_methods

    compat.check()
    compat.add_output_defaults()
    compat.add_llm_methods(llm_methods.METHODS)
    compat.patch_engine_args(_adjust_engine_args)
    if compat.graph_taps_unsupported() is None:
        from vllm_worker.worker.taps import OP

        compat.patch_splitting_ops(OP)
        compat.patch_compile_hash(_compile_marker)
    compat.patch_process_inputs(frontend.on_new_request)
    compat.patch_run_engine(frontend.attach_outputs)
    compat.patch_aborts(frontend.forget)
    compat.patch_dp_routing(frontend.fetch_key)
    compat.patch_offline_add_request(lambda llm: frontend.mark_consumer(compat.processor_of_llm(llm), "offline"))
    compat.patch_engine_loop(
        lambda engine: frontend.mark_engine_consumer(compat.processor_of_llm_engine(engine), "engine"),
        frontend.attach_engine_outputs,
    )
    compat.patch_async_generate(_async_consumer, frontend.attach_async_output)
    compat.patch_endpoint_plugins("inspect_lens_http", _endpoints)
    compat.patch_cpu_lora_no_adapter_rows()
    compat.patch_scheduler_stops()  # the engine core finishes requests a probe action stopped
    _registered = True
