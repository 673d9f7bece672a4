"""Every touch of a vLLM internal, behind a version check: import from here, never from vLLM directly.

If vLLM moves something we rely on, `check()` (plugin load) and the worker's own checks raise
`LensIncompatibleVLLM` naming it: the plugin never silently does nothing. One module per side of vLLM:
`engine` (engine construction, plugins), `requests` (per-request frontend hooks, outputs, RPC), `errors`
(exception classes vLLM maps to HTTP codes), `request_ids` (how vLLM names requests), `runner` (the
worker's model runner and CUDA-graph dispatch; `runner_v2`: vLLM's V2 runner, when opted in), `model` (decoder-layer list, parameters across ranks), `layouts` (where each family's inner points are),
`offline` (what `vllm-lens extract` reads from and builds with vLLM), `cpu_lora` (a vLLM-CPU LoRA fix),
`data_parallel` (which of several engine cores ran a request, RPC to one or all of them), `stops` (a
worker ending a request: `probe_actions`), `provenance` (the serving set-up a score depends on), `ipc` (steering rows as views of the engine core's
received frame).
`batch_invariance` (whether vLLM's batch-invariant mode is on, and
the ops it replaces). `tests/core/test_adapter.py` exercises each against the installed vLLM.
"""

from vllm_worker.compat.batch_invariance import (  # noqa: F401
    batch_invariant_mode,
    enable_batch_invariant_mode,
)
from vllm_worker.compat.cpu_lora import (  # noqa: F401
    patch_cpu_lora_no_adapter_rows,
)
from vllm_worker.compat.data_parallel import (  # noqa: F401
    dp_client_cls,
    engine_count,
    engines_fed,
    engines_of,
    forget_routes,
    patch_dp_routing,
    routing_unavailable,
)
from vllm_worker.compat.engine import (  # noqa: F401
    add_llm_methods,
    add_output_defaults,
    api_keys,
    check,
    declare_settings,
    engine_args_cls,
    force_v1_model_runner,
    patch_compile_hash,
    patch_endpoint_plugins,
    patch_engine_args,
    patch_splitting_ops,
    select_model_runner,
)
from vllm_worker.compat.errors import (  # noqa: F401
    capacity_error_cls,
    forbidden_error_cls,
    validation_error_cls,
)
from vllm_worker.compat.ipc import raw_view, raw_view_code, rows_by_view  # noqa: F401
from vllm_worker.compat.layouts import (  # noqa: F401
    Layout,
    head_shape,
    inner_modules,
    kv_heads,
    layout_for,
    missing_points,
    mlp_width,
    model_class,
    module_output,
)
from vllm_worker.compat.model import (  # noqa: F401
    EmptyParameter,
    attention_inputs,
    decoder_layers,
    full_parameter,
    layer_inputs,
    pp_share,
    residual_parts,
)
from vllm_worker.compat.offline import (  # noqa: F401
    engine_args_from_cli,
    llm_busy,
    llm_from_engine_args,
    served_model,
    shared_sampling_params,
    shutdown_engine,
)
from vllm_worker.compat.provenance import plugin_version, serving_provenance  # noqa: F401
from vllm_worker.compat.request_ids import (  # noqa: F401
    child_index,
    external_request_id,
    server_request_id,
)
from vllm_worker.compat.requests import (  # noqa: F401  # noqa: F401
    async_llm_cls,
    input_processor_cls,
    input_processor_of,
    llm_engine_cls,
    model_capture_limits,
    model_shape,
    offline_mixin_cls,
    patch_aborts,
    patch_async_generate,
    patch_engine_loop,
    patch_offline_add_request,
    patch_process_inputs,
    patch_run_engine,
    processor_of_engine_client,
    processor_of_llm,
    processor_of_llm_engine,
    request_prompt_len,
    rpc,
    rpc_async,
    set_request_cache_salt,
)
from vllm_worker.compat.runner import (  # noqa: F401
    batch_layout,
    draft_tokens,
    ensure_pp_buffers,
    forward_replays_full_graph,
    full_graphs_unsupported,
    graph_taps_unsupported,
    hf_config,
    hidden_size,
    host_positions,
    iter_stage_layers,
    live_request_ids,
    max_tokens,
    patch_cudagraph_dispatch,
    patch_full_graphs,
    patch_runner,
    patch_step_notices,
    pp_last_stage,
    request_extra_args,
    request_max_positions,
    runner_classes,
    runner_model,
    runner_prompt_len,
    sequence_parallel_moe,
    tp_all_gather,
    tp_rank,
    tp_world_size,
    weak_ref,
    weak_refs,
)
from vllm_worker.compat.stops import (  # noqa: F401
    STOPS_ATTR,
    patch_runner_stops,
    patch_scheduler_stops,
    runner_stops_installed,
    scheduler_calls_per_request,
)
from vllm_worker.compat.version import (  # noqa: F401
    SUPPORTED,
    TESTED,
    LensIncompatibleVLLM,
    check_version,
    require,
    vllm_version,
    wrap,
)
