"""Ending a request from the worker (`probe_actions` with `then: "stop"`): the worker names requests to
stop on the step's model-runner output, and the scheduler finishes them as it would on a stop token.

Why this route: the scheduler (engine core) and the worker may be two processes (multiprocess engine) or
one (`VLLM_ENABLE_V1_MULTIPROCESSING=0`); the model-runner output is the one object that goes from the
worker to the scheduler every step in both, and vLLM pickles it whole (a plain attribute travels). Only
the output rank's output reaches the scheduler; under tensor parallelism every rank computes the same
scores, so all ranks agree on what they attach.

- Worker: `GPUModelRunner.sample_tokens` (vLLM >= 0.26 splits `execute_model` and `sample_tokens`; the
  output is built in the latter) gets `STOPS_ATTR = {request id: stop reason}` on its `ModelRunnerOutput`
  (an async output: on the `ModelRunnerOutput` its `get_output()` builds, in the worker process).
- Scheduler: `Scheduler.update_from_output` reads it, and `Scheduler._update_request_with_output` (which
  appends a step's tokens and runs `check_stop`) marks a named request `FINISHED_STOPPED` with the reason
  after its tokens were appended, when no stop condition of vLLM's own ended it first. vLLM then frees it
  and reports `finish_reason="stop"` with `stop_reason` as for a stop string. `AsyncScheduler` calls the
  base method, so one wrap serves both.
"""

from __future__ import annotations

from typing import Any, Callable

from vllm_worker.compat.version import LensIncompatibleVLLM, require, wrap

STOPS_ATTR = "lens_stops"  # {request id: stop reason} on a ModelRunnerOutput
_PENDING = "_lens_stops_pending"  # the same, on the scheduler while it takes the output in


def scheduler_cls() -> type:
    try:
        from vllm.v1.core.sched.scheduler import Scheduler
    except ImportError as err:
        raise LensIncompatibleVLLM(f"vLLM internal moved: vllm.v1.core.sched.scheduler.Scheduler ({err})") from err
    require(Scheduler, "update_from_output", "Scheduler")
    require(Scheduler, "_update_request_with_output", "Scheduler")
    return Scheduler


def finished_stopped() -> Any:
    try:
        from vllm.v1.request import RequestStatus
    except ImportError as err:
        raise LensIncompatibleVLLM(f"vLLM internal moved: vllm.v1.request.RequestStatus ({err})") from err
    return require(RequestStatus, "FINISHED_STOPPED", "RequestStatus")


def patch_scheduler_stops() -> None:
    """In the engine core's process: the scheduler honours the stops a step's output names."""
    sched = scheduler_cls()
    stopped_status = finished_stopped()

    def make_update(orig: Callable) -> Callable:
        def update_from_output(self, scheduler_output, model_runner_output, *args, **kwargs):
            stops = getattr(model_runner_output, STOPS_ATTR, None)
            if not stops:
                return orig(self, scheduler_output, model_runner_output, *args, **kwargs)
            setattr(self, _PENDING, stops)
            try:
                return orig(self, scheduler_output, model_runner_output, *args, **kwargs)
            finally:
                setattr(self, _PENDING, None)

        return update_from_output

    def make_tokens(orig: Callable) -> Callable:
        def _update_request_with_output(self, request, new_token_ids, *args, **kwargs):
            new_token_ids, stopped = orig(self, request, new_token_ids, *args, **kwargs)
            stops = getattr(self, _PENDING, None)
            if stops and not stopped and new_token_ids:
                reason = stops.get(request.request_id)
                if reason is not None:
                    request.status = stopped_status
                    request.stop_reason = reason
                    stopped = True
            return new_token_ids, stopped

        return _update_request_with_output

    wrap(sched, "update_from_output", make_update)
    wrap(sched, "_update_request_with_output", make_tokens)


def output_cls() -> type:
    try:
        from vllm.v1.outputs import AsyncModelRunnerOutput, ModelRunnerOutput
    except ImportError as err:
        raise LensIncompatibleVLLM(f"vLLM internal moved: vllm.v1.outputs.ModelRunnerOutput ({err})") from err
    require(AsyncModelRunnerOutput, "get_output", "AsyncModelRunnerOutput")
    return ModelRunnerOutput


def patch_runner_stops(stops_of: Callable[[Any], dict[str, str] | None]) -> None:
    """In the worker: `stops_of(runner)` after each step's sampling names the requests to end (and why)."""
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    out_cls = output_cls()

    def attach(runner: Any, out: Any) -> Any:
        if isinstance(out, out_cls):
            stops = stops_of(runner)
            if stops:
                setattr(out, STOPS_ATTR, stops)
        elif out is not None and hasattr(out, "get_output"):  # async scheduling: built later, same process
            inner = out.get_output

            def get_output() -> Any:
                return attach(runner, inner())

            out.get_output = get_output
        return out

    def make(orig: Callable) -> Callable:
        def sample_tokens(self, *args, **kwargs):
            return attach(self, orig(self, *args, **kwargs))

        return sample_tokens

    wrap(GPUModelRunner, "sample_tokens", make)


def runner_stops_installed(runner: Any) -> bool:
    """This runner's outputs carry our stops (False e.g. on vLLM's V2 runner, which builds them elsewhere):
    a stop action is refused there, never silently ignored."""
    fn = getattr(type(runner), "sample_tokens", None)
    return bool(getattr(fn, "__lens_wrapped__", False))
