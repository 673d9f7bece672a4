"""The worker extension vLLM mixes into every worker (`worker_extension_cls`).

Importing this module happens only in worker processes (vLLM resolves the extension there), so it
is where the model-runner patches are installed. Methods are prefixed `lens_` (vLLM refuses name
clashes with the worker) and are called through `collective_rpc`.
"""

from __future__ import annotations

import logging
from typing import Any, Callable

from vllm_worker import compat, counters
from vllm_worker.protocol import errors, rpc
from vllm_worker.transport import shm
from vllm_worker.worker import gpu_clock, host_clock, seams, vector_refs
from vllm_worker.worker.params import UnknownParameter
from vllm_worker.worker.runtime import LensRuntime

logger = logging.getLogger("vllm_worker")


class Unsupported:
    """Stands in for the runtime on a model whose layout the plugin cannot read (no decoder-layer list):
    the engine serves plain requests as if the plugin were not installed, and every request that asked
    for a feature gets one clear failure naming the model class (HTTP 400 / `ValueError`) at its fetch."""

    def __init__(self, runner: Any, reason: str) -> None:
        self.reason = f"inspect-lens cannot act on this model: {reason}"
        try:
            self.model_class = compat.model_class(compat.hf_config(runner))
        except Exception:  # noqa: BLE001 - only for the message
            self.model_class = type(compat.runner_model(runner)).__name__
        # the owners the extension calls directly (as it calls the runtime's), standing in
        self.store, self.persistent = _NoStore(), _NoPersistent()
        self.params, self.saes = _NoParams(self._refuse), _NoSaes(self._refuse)
        self.probes = _NoProbes(self._refuse)

    def fetch(self, wanted: list, shm_host: str | None = None, released: list | None = None) -> dict:
        fail = errors.failure("unsupported", f"{self.model_class}: {self.reason}", "model layout")
        return {key: {child: {"error": fail} for child in children} for key, children in wanted}

    def status(self) -> dict:
        return {
            "unsupported": self.reason,
            "model_class": self.model_class,
            "layers": [],
            "points": [],
            "stored_requests": 0,
            "stored_bytes": 0,
            "steps_with_features": 0,
            "persistent_hooks": 0,
            "persistent_results": 0,
            "prefetched": [],
            "result_regions": 0,
            "result_pool": None,
            "request_states": 0,
            "steering_entries": 0,
            "steering_shared_chains": 0,
            "steer_table_full": 0,
            "probe_score_chunks": 0,
            "action_slots": 0,
            "action_requests": 0,
            "action_stops": 0,
        }

    def collect_hook_results(self) -> None:
        return None

    def pop_persistent_errors(self, request_ids: list) -> dict:
        return {}

    def clear_hooks(self) -> None:
        return None

    def _refuse(self, *args: Any) -> Any:
        raise ValueError(f"{self.model_class}: {self.reason}")

    register_hooks = _refuse


class _NoStore:
    """The result store's stand-in on an unsupported model: nothing is stored, so nothing to drop or free."""

    def drop(self, keys: list) -> int:
        return 0

    def release(self, released: list | None) -> int:
        return 0

    def pool_status(self) -> None:
        return None


class _NoPersistent:
    def clear_results(self) -> None:
        return None


class _NoParams:
    def __init__(self, refuse: Callable[..., Any]) -> None:
        self.prefetch = refuse

    def clear(self) -> None:
        return None


class _NoSaes:
    def __init__(self, refuse: Callable[..., Any]) -> None:
        self.load = refuse


class _NoProbes:
    def __init__(self, refuse: Callable[..., Any]) -> None:
        self.load = refuse
        self.delete = lambda name: False


def _on_loaded(runner: Any) -> None:
    compat.ensure_pp_buffers(runner)
    host_clock.start()
    if getattr(runner, "_lens_runtime", None) is None:
        try:
            runner._lens_runtime = LensRuntime(runner)
        except compat.LensIncompatibleVLLM as e:  # an unknown layout still serves: plain requests run
            logger.warning("inspect-lens: %s; plain requests are served, feature requests are refused", e)
            runner._lens_runtime = Unsupported(runner, str(e))


def _around_forward(runner: Any, orig: Any, *args: Any, **kwargs: Any) -> Any:
    rt = getattr(runner, "_lens_runtime", None)
    if rt is None or isinstance(rt, Unsupported):  # e.g. a drafter's runner or a model loaded before the patch
        return orig(runner, *args, **kwargs)
    return rt.around_forward(orig, *args, **kwargs)


def _stops(runner: Any) -> dict[str, str] | None:
    rt = getattr(runner, "_lens_runtime", None)
    return None if rt is None or isinstance(rt, Unsupported) else rt.actions.stops()


def _finished(runner: Any, req_ids: Any) -> None:
    rt = getattr(runner, "_lens_runtime", None)
    if rt is None or isinstance(rt, Unsupported):
        return
    try:
        rt.note_finished(req_ids)
    except Exception as e:  # noqa: BLE001 - only an earlier payload is lost: the fetch makes it
        logger.warning("inspect-lens: noting finished requests failed (%s: %s)", type(e).__name__, e)


def _idle(runner: Any) -> None:
    rt = getattr(runner, "_lens_runtime", None)
    if rt is None or isinstance(rt, Unsupported):
        return
    try:
        rt.idle()
    except Exception as e:  # noqa: BLE001 - as `_finished`
        logger.warning("inspect-lens: preparing finished requests' results failed (%s: %s)", type(e).__name__, e)


def _needs_python(runner: Any) -> int:
    rt = getattr(runner, "_lens_runtime", None)
    return 0 if rt is None or isinstance(rt, Unsupported) else rt.prepare_step()


compat.check_version()
compat.patch_runner(_on_loaded, _around_forward)
compat.patch_runner_stops(_stops)
compat.patch_step_notices(_finished, _idle)
if compat.graph_taps_unsupported() is None:  # else the frontend forced eager mode (with a warning)
    compat.patch_cudagraph_dispatch(_needs_python)
    _why_not_cut = compat.full_graphs_unsupported()
    if _why_not_cut is None:
        compat.patch_full_graphs(seams.capture, seams.wanted, seams.replay, seams.fallback)
    else:  # steps with Python hooks then stay off full graphs (piecewise graphs run them)
        logger.warning("inspect-lens: full CUDA graphs cannot be cut at the taps: %s", _why_not_cut)


class LensWorkerExtension:
    """RPC surface of the plugin inside each worker: implements `protocol.rpc.LensWorkerRpc`, exactly (mypy
    checks the signatures through `_as_contract`, tests/unit/test_rpc_contract.py that no method is left
    out or added)."""

    def _lens_rt(self) -> Any:
        rt = getattr(getattr(self, "model_runner", None), "_lens_runtime", None)
        if rt is None:
            raise RuntimeError("inspect-lens is not installed on this worker's model runner")
        return rt

    def lens_fetch(self, wanted: list, shm_host: str | None = None, released: list | None = None) -> dict:
        return self._lens_rt().fetch(
            [(k, {int(c): int(n) for c, n in ch.items()}) for k, ch in wanted],
            None if shm_host is None else str(shm_host),
            released,
        )

    def lens_release(self, released: list) -> int:
        return self._lens_rt().store.release(released)

    def lens_runner(self) -> str:
        """The model runner class vLLM built for this worker (V1, or V2 under VLLM_LENS_V2_RUNNER=1)."""
        cls = type(getattr(self, "model_runner", None))
        return f"{cls.__module__}.{cls.__qualname__}"

    def lens_host_id(self) -> str | None:
        return shm.host_id()

    def lens_drop(self, keys: list) -> int:
        return self._lens_rt().store.drop(list(keys))

    def lens_status(self) -> dict:
        return self._lens_rt().status()

    def lens_forward_clock(self) -> list:
        """(start, end, thread CPU at start[, device ms of the forward, device ms to the next]) of the latest
        forward passes (diagnostics: `counters.FORWARD_CLOCK`, `gpu_clock`)."""
        return gpu_clock.resolve(list(counters.FORWARD_CLOCK))

    def lens_replan_clock(self) -> list:
        """(start, seconds, batch requests) of the latest re-plans (diagnostics: `counters.REPLANS`)."""
        return list(counters.REPLANS)

    def lens_rusage(self) -> dict:
        """Cumulative CPU use of this worker (diagnostics for benchmarks): the process, the thread that runs
        the steps (RPCs run on it), and the result pool's growth."""
        import resource

        def use(who: int) -> dict:
            r = resource.getrusage(who)
            return {
                "user_s": r.ru_utime,
                "sys_s": r.ru_stime,
                "minflt": r.ru_minflt,
                "majflt": r.ru_majflt,
                "vcsw": r.ru_nvcsw,
                "ivcsw": r.ru_nivcsw,
            }

        out = {"process": use(resource.RUSAGE_SELF)}
        if hasattr(resource, "RUSAGE_THREAD"):
            out["step_thread"] = use(resource.RUSAGE_THREAD)
        out.update(host_clock.report())  # every thread's CPU; the collections by thread (VLLM_LENS_HOST_CLOCK)
        pool = self._lens_rt().store.pool_status()
        if pool is not None:
            out["pool"] = {k: v for k, v in pool.items() if isinstance(v, (int, float))}
        return out

    def lens_register_hooks(self, hooks: list) -> int:
        return self._lens_rt().register_hooks(
            [(bytes(h[0]), list(h[1]), str(h[2]), bool(h[3]), bool(h[4])) for h in hooks]
        )

    def lens_collect_hook_results(self) -> bytes | None:
        return self._lens_rt().collect_hook_results()

    def lens_pop_persistent_errors(self, request_ids: list) -> dict:
        return self._lens_rt().pop_persistent_errors([str(r) for r in request_ids])

    def lens_clear_hook_results(self) -> None:
        self._lens_rt().persistent.clear_results()

    def lens_clear_hooks(self) -> None:
        self._lens_rt().clear_hooks()

    def lens_load_sae(self, name: str, path: str, uid: str) -> dict:
        return self._lens_rt().saes.load(str(name), str(path), str(uid))

    def lens_load_probe(self, name: str, uid: str, probe: dict) -> dict:
        return self._lens_rt().probes.load(str(name), str(uid), dict(probe))

    def lens_delete_probe(self, name: str) -> bool:
        return bool(self._lens_rt().probes.delete(str(name)))

    def lens_probe_progress(self, wanted: list) -> list:
        rt = self._lens_rt()
        if isinstance(rt, Unsupported):
            return []
        return rt.probe_progress([(str(k), int(c), int(s)) for k, c, s in wanted])

    def lens_prefetch(self, names: list, report: bool = False) -> list | dict:
        """`report`: {"prefetched": names} or {"error": Failure} for a parameter no stage has (the HTTP
        route tells the caller's failure from ours by its kind, not by an exception's wording)."""
        if not report:
            return self._lens_rt().params.prefetch(list(names))
        rt = self._lens_rt()
        if isinstance(rt, Unsupported):
            return {"error": errors.failure("unsupported", f"{rt.model_class}: {rt.reason}", "prefetch")}
        try:
            return {"prefetched": rt.params.prefetch(list(names)), "error": None}
        except UnknownParameter as e:
            return {"error": errors.failure("unsupported", f"no pipeline stage has a parameter {e.name!r}", "prefetch")}

    def lens_clear_prefetched(self) -> None:
        self._lens_rt().params.clear()

    def lens_vectors(self, put: list, drop: list) -> int:
        return vector_refs.HELD.put(list(put), list(drop))


def _as_contract(ext: LensWorkerExtension) -> rpc.LensWorkerRpc:
    """Never called: mypy holds the extension's signatures to the contract's here."""
    return ext
