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
- Scheduler: `Scheduler.update_from_output` reads it and, for that call only, `_update_request_with_output`
  (which appends a step's tokens and runs `check_stop`) marks a named request `FINISHED_STOPPED` with the
  reason after its tokens were appended, when no stop condition of vLLM's own ended it first. vLLM then frees it
  and reports `finish_reason="stop"` with `stop_reason` as for a stop string. `AsyncScheduler`'s
  override is the method called (it calls the base one).
"""

from __future__ import annotations

from typing import Any, Callable

from vllm_worker.compat.version import LensIncompatibleVLLM, require, wrap

STOPS_ATTR = "lens_stops"  # {request id: stop reason} on a ModelRunnerOutput
_PER_REQUEST = "_update_request_with_output"  # the scheduler's per-request method, shadowed while stops apply


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
    """In the engine core's process: the scheduler honours the stops a step's output names.

    Only `update_from_output` is wrapped at class level. The per-request method is shadowed on the
    scheduler instance for the one call whose output names stops: a step without stops (nearly all of
    them) costs one attribute read, not one more Python call per running request."""
    sched = scheduler_cls()
    stopped_status = finished_stopped()

    def make_update(orig: Callable) -> Callable:
        def update_from_output(self, scheduler_output, model_runner_output, *args, **kwargs):
            stops = getattr(model_runner_output, STOPS_ATTR, None)
            if not stops:
                return orig(self, scheduler_output, model_runner_output, *args, **kwargs)
            # the class's own method (AsyncScheduler's override, which calls the base one), bound
            per_request = type(self)._update_request_with_output.__get__(self)

            def _update_request_with_output(request, new_token_ids, *a, **kw):
                new_token_ids, stopped = per_request(request, new_token_ids, *a, **kw)
                if not stopped and new_token_ids:
                    reason = stops.get(request.request_id)
                    if reason is not None:
                        request.status = stopped_status
                        request.stop_reason = reason
                        stopped = True
                return new_token_ids, stopped

            self.__dict__[_PER_REQUEST] = _update_request_with_output
            try:
                return orig(self, scheduler_output, model_runner_output, *args, **kwargs)
            finally:
                self.__dict__.pop(_PER_REQUEST, None)

        return update_from_output

    wrap(sched, "update_from_output", make_update)


def scheduler_calls_per_request() -> bool:
    """`Scheduler.update_from_output` reaches each request through `self._update_request_with_output` (the
    name the stops shadow on the instance): False when vLLM moved that call, which the tests make loud."""
    fn = getattr(scheduler_cls(), "update_from_output")
    code = getattr(fn, "__wrapped__", fn).__code__
    return _PER_REQUEST in code.co_names


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
    """This runner's outputs carry our stops (False e.g. on vLLM's V2 runner, which builds them elsewhere)
    and the scheduler reaches requests where the stops shadow it: else a stop action is refused, never
    silently ignored."""
    fn = getattr(type(runner), "sample_tokens", None)
    return bool(getattr(fn, "__lens_wrapped__", False)) and scheduler_calls_per_request()
