"""One benchmarked system in its own process: load once, then run workloads on request.

    python bench/worker.py SYSTEM MODEL_DIR [--device cpu|cuda] [--dtype float32]

Protocol: one JSON command per stdin line ({"workload": "W1", "n": 64, "new": 32, "prompt_len": 32}),
one `BENCH {...}` line per answer on stdout ({"wall": s, "out_tokens": n, "rss_mb": ..., "hwm_mb": ...}
or {"error": "..."}). The first answer reports the start-up time.

Systems: vllm-eager, vllm-compiled (plain vLLM, plugins off), lens (this project), lens-points (this project tapping the inner points W6-W8 use), lens-before (this
project at an older commit, for an A/B; see bench/run.py), vllm-lens (the original, 1.3.0), hf (transformers + forward hooks), nnsight (its HF LanguageModel),
nnsight-vllm (nnsight on vLLM, CUDA graphs kept by its taps; W0/W1), transformer-lens. Which plugin loads is
decided by the parent through VLLM_PLUGINS; this file only builds requests.

W6-W8 (hook points, issue #24) exist for this project only (lens, lens-eager): W6 captures attn_out +
mlp_out of the middle layer, W7 captures z (per-head attention output before o_proj) there (skipped with
"n/a: ..." when the plugin refuses the point), W8 steers mlp_out there (W3's vector and scale). Their
first call (the parent's warm-up) also checks the values once and reports it as "check".
"""

from __future__ import annotations

import gc
import json
import os
import signal
import subprocess
import sys
import time
import traceback
from typing import Any

import monitor_workloads
import round_diagnostics
from hf_system import HFSystem
from nnsight_vllm_system import NNsightVLLMSystem
from system_base import engine_room, freeze_engine_heap, kv_cache_tokens, prompts

WORKLOADS = ("W0", "W1", "W2", "W3", "W4", "W4n", "W4b", "W4m", "W4r", "W4rb", "W5", "W6", "W7", "W8")
WORKLOADS += monitor_workloads.MONITOR_WORKLOADS  # W9-W14: probes, probe actions, ops, mlp_post (#42, #43)
POINT_WORKLOADS = ("W6", "W7", "W8")  # hook points: this project only


def mem_mb() -> tuple[float, float]:
    rss = hwm = 0.0
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                rss = int(line.split()[1]) / 1024
            elif line.startswith("VmHWM:"):
                hwm = int(line.split()[1]) / 1024
    return rss, hwm


def gpu_mem_mb() -> float | None:
    try:
        import torch

        return torch.cuda.max_memory_allocated() / 2**20 if torch.cuda.is_available() else None
    except Exception:
        return None


_SPY_RUNS: dict[str, int] = {}


def profiler(system: str, workload: str) -> subprocess.Popen | None:
    """py-spy sampling this process and its children (vLLM's engine core) during one timed run, when
    BENCH_PYSPY (an output folder) is set and the workload is in BENCH_PYSPY_WORKLOADS (default W2). Host-side
    profile of where a step's time goes; non-blocking sampling, so the run is not paused (BENCH_PYSPY_NATIVE=1:
    native frames too, which py-spy samples by pausing the process: for where a C call waits, not for timing)."""
    out = os.environ.get("BENCH_PYSPY")
    wanted = os.environ.get("BENCH_PYSPY_WORKLOADS", "W2").split(",")
    if not out or workload not in wanted:
        return None
    k = _SPY_RUNS[workload] = _SPY_RUNS.get(workload, -1) + 1
    path = os.path.join(out, f"pyspy-{system}-{workload}-{k}.txt")
    exe = os.environ.get("BENCH_PYSPY_BIN", "py-spy")
    native = os.environ.get("BENCH_PYSPY_NATIVE") == "1"
    cmd = [exe, "record", "--pid", str(os.getpid()), "--subprocesses", "--threads", "--idle"]
    cmd += ["--native"] if native else ["--nonblocking"]
    cmd += ["--rate", "200", "--format", "raw", "--output", path]
    p = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=open(path + ".log", "w"))
    time.sleep(1.0)  # py-spy attaches before the run starts
    return p


def send(obj: dict) -> None:
    sys.stdout.write("BENCH " + json.dumps(obj) + "\n")
    sys.stdout.flush()


# ------------------------------------------------------------------------------------------ vLLM family


class VLLMSystem:
    def __init__(self, kind: str, model: str, device: str, dtype: str) -> None:
        from vllm import LLM

        self.kind = kind
        # plain vLLM and this project in vLLM's default mode (compiled, CUDA graphs on GPU); "-eager" variants
        # force eager mode ("lens-eager" = how this project ran before its taps worked in graphs)
        eager = kind in ("vllm-eager", "lens-eager")
        kw: dict = dict(
            model=model, dtype=dtype, seed=0, max_model_len=1024, enforce_eager=eager, enable_prefix_caching=False
        )
        kw.update(engine_room(device))
        self.llm = LLM(**kw)
        cfg = self.llm.llm_engine.model_config.hf_config
        self.n_layers, self.d = cfg.num_hidden_layers, cfg.hidden_size
        self.n_heads = cfg.num_attention_heads
        self.d_mlp = getattr(cfg, "intermediate_size", None)
        self.d_head = getattr(cfg, "head_dim", None) or self.d // self.n_heads
        self.z_refused: str | None = None  # why the plugin refused point "z" (W7), once probed
        self._checked: set[str] = set()
        self._last_status: dict = {}
        self._gc: round_diagnostics.GcClock | None = None  # the frontend's collections per run (lens systems)
        try:  # what the engine really runs (CUDA graphs or not), for the results' start-up line
            comp = self.llm.llm_engine.vllm_config.compilation_config
            self.engine_mode = {
                "enforce_eager": self.llm.llm_engine.model_config.enforce_eager,
                "cudagraph_mode": str(comp.cudagraph_mode),
                "architecture": (getattr(cfg, "architectures", None) or ["?"])[0],
                # with it the engine core plans step N + 1 while the device runs step N (host work hides)
                "async_scheduling": getattr(self.llm.llm_engine.vllm_config.scheduler_config, "async_scheduling", None),
            }
            self.engine_mode.update(kv_cache_tokens(self.llm))
        except Exception as e:  # informative only
            self.engine_mode = {"error": f"{type(e).__name__}: {e}"}
        if kind.startswith("lens"):  # which build of this project this process runs (A/B: lens vs lens-before)
            import vllm_worker

            self.engine_mode["package"] = os.path.dirname(vllm_worker.__file__)
            try:  # V1 or V2 model runner (bench/probes/gpu_v2_check.py); older builds lack the RPC
                self.engine_mode["runner"] = self.llm.collective_rpc("lens_runner")[0]
            except Exception as e:  # noqa: BLE001 - informative only
                self.engine_mode["runner"] = f"unknown ({type(e).__name__})"
        self.engine_mode["VLLM_USE_V2_MODEL_RUNNER"] = os.environ.get("VLLM_USE_V2_MODEL_RUNNER")
        import torch

        g = torch.Generator().manual_seed(0)
        self.vec = torch.randn(1, self.d, generator=g) * 2.0
        if kind.startswith("lens") and hasattr(self.llm, "load_probe"):  # W9-W11's probes (older builds: none)
            monitor_workloads.load_probes(self.llm, self.n_layers, self.d)
        if kind.startswith("lens") and hasattr(self.llm, "register_vector"):  # W12n's (older builds: none)
            monitor_workloads.register_vectors(self.llm, self.vec)

    def _types(self):
        if self.kind == "vllm-lens":
            from vllm_lens import Hook, SteeringVector
        else:
            from vllm_worker import Hook, SteeringVector
        return Hook, SteeringVector

    def _rusage(self) -> dict | None:
        """The worker's cumulative CPU use and result-pool growth (`lens_rusage`; None: not a lens build
        that has it)."""
        if not self.kind.startswith("lens"):
            return None
        try:
            return self.llm.collective_rpc("lens_rusage")[0]
        except Exception:  # noqa: BLE001 - diagnostics only (an older tree, e.g. lens-before)
            return None

    def _replans(self) -> list | None:
        """The worker's latest re-plans (`lens_replan_clock`; None: a tree without it)."""
        try:
            return self.llm.collective_rpc("lens_replan_clock")[0]
        except Exception:  # noqa: BLE001 - diagnostics only (an older tree)
            return None

    def extra(self, workload: str, i: int, n: int) -> dict:
        mid = self.n_layers // 2
        if workload == "W0":
            return {}
        if self.kind in ("vllm-eager", "vllm-compiled"):
            raise NotImplementedError("plain vLLM has no capture/steering/hooks")
        if (
            workload in POINT_WORKLOADS or workload in monitor_workloads.MONITOR_WORKLOADS
        ) and not self.kind.startswith("lens"):
            raise NotImplementedError(f"{workload} is benchmarked for this project only")
        if workload in monitor_workloads.MONITOR_WORKLOADS:
            return monitor_workloads.extra(workload, self.n_layers, self.d, self.vec, self._types()[1])
        Hook, SteeringVector = self._types()
        if workload == "W5":  # a quarter capture, a quarter steer, the rest plain
            workload = "W1" if i % 4 == 0 else "W3" if i % 4 == 1 else "W0"
            if workload == "W0":
                return {}
        if workload == "W1":
            return {"output_residual_stream": [mid]}
        if workload == "W2":
            return {"output_residual_stream": list(range(self.n_layers))}
        if workload == "W3":
            return {"apply_steering_vectors": [SteeringVector(activations=self.vec, layer_indices=[mid], scale=1.0)]}
        if workload == "W4":
            return {"apply_hooks": [Hook(fn=_norm_hook, layer_indices=[mid])]}
        if workload == "W4n":
            return {"apply_hooks": [Hook(fn=_norm_hook_on_device, layer_indices=[mid])]}
        if workload == "W4m":  # one request in the batch carries W4n's hook, the others nothing
            return {"apply_hooks": [Hook(fn=_norm_hook_on_device, layer_indices=[mid])]} if i == 0 else {}
        if workload == "W4b":  # W4n's reading as one batched hook: one call per step for every request
            if not self.kind.startswith("lens"):
                raise NotImplementedError("batched hooks (W4b) are this project's")
            return {"apply_hooks": [Hook(fn=_norm_hook_batched, layer_indices=[mid], batched=True)]}
        if workload in ("W4r", "W4rb"):  # W4n / W4b declared read-only: they run after the step's forward
            if not self.kind.startswith("lens"):
                raise NotImplementedError("read-only hooks (W4r, W4rb) are this project's")
            if workload == "W4r":
                return {"apply_hooks": [Hook(fn=_norm_hook_on_device, layer_indices=[mid], read_only=True)]}
            return {"apply_hooks": [Hook(fn=_norm_hook_batched, layer_indices=[mid], batched=True, read_only=True)]}
        if workload == "W6":
            return {"output_activations": {"attn_out": [mid], "mlp_out": [mid]}}
        if workload == "W7":
            return {"output_activations": {"z": [mid]}}
        if workload == "W8":
            return {
                "apply_steering_vectors": [
                    SteeringVector(activations=self.vec, layer_indices=[mid], scale=1.0, point="mlp_out")
                ]
            }
        raise ValueError(workload)

    def _one(self, prompt: list[int], extra: dict, new: int = 1):
        from vllm import SamplingParams

        sp = SamplingParams(max_tokens=new, temperature=0, ignore_eos=True, extra_args=extra or None)
        return self.llm.generate([{"prompt_token_ids": prompt}], [sp], use_tqdm=False)[0]

    def _probe_z(self, prompt: list[int]) -> None:
        """W7: one 1-token request asking for z; a refusal (unknown / unavailable point) skips W7."""
        if self.z_refused is not None or "z-probe" in self._checked:
            return
        try:
            self._one(prompt, {"output_activations": {"z": [self.n_layers // 2]}})
        except (ValueError, TypeError, KeyError) as e:
            self.z_refused = f"{type(e).__name__}: {str(e).splitlines()[0][:240] if str(e) else ''}"
        self._checked.add("z-probe")

    def _check_points(self, workload: str, outs, ps: list[list[int]], sps, prompt_len: int, new: int) -> str | None:
        """Results must really be there: shapes, finite non-zero values every call; once per workload also
        the batch's first request against the same request alone, and what the values must satisfy."""
        import torch

        n_pos = prompt_len + new - 1
        mid = self.n_layers // 2
        if workload in ("W6", "W7"):
            acts = outs[0].activations
            keys = ("attn_out", "mlp_out") if workload == "W6" else ("z",)
            for k in keys:
                a = acts[k]
                want = (1, n_pos, self.d) if k != "z" else (1, n_pos, self.n_heads, self.d_head)
                flat_ok = (
                    k == "z" and tuple(a.shape[:2]) == (1, n_pos) and a[0, 0].numel() == self.n_heads * self.d_head
                )
                assert tuple(a.shape) == want or flat_ok, f"{k}: shape {tuple(a.shape)}, expected {want}"
                assert bool(a.float().isfinite().all()) and float(a.float().abs().sum()) > 0, f"{k}: empty/non-finite"
        if workload in self._checked:
            return None
        self._checked.add(workload)
        note = None
        if workload in ("W6", "W7"):
            alone = self._one(ps[0], sps[0].extra_args, new=new)
            for k in keys:
                a, b = alone.activations[k][:, 0].float(), outs[0].activations[k][:, 0].float()
                assert torch.allclose(a, b, rtol=0.05, atol=0.05 * float(a.abs().max())), f"{k}: capture misaligned"
        if workload == "W6":  # resid_post = resid_pre + attn_out + mlp_out (sequential and parallel layouts)
            pts = ("resid_pre", "attn_out", "mlp_out", "resid_post")
            got = self._one(ps[0], {"output_activations": {p: [mid] for p in pts}}).activations
            pre, att, mlp, post = (got[p][0, :prompt_len].float() for p in pts)
            gap = (pre + att + mlp - post).norm()
            err = float(gap / post.norm())
            note = (
                f"layer {mid}, prompt positions: |resid_pre + attn_out + mlp_out - resid_post| = {err:.2e} x "
                f"|resid_post| = {float(gap / (att + mlp).norm()):.2e} x |attn_out + mlp_out|; "
                f"|attn_out| = {float(att.norm() / post.norm()):.2e} x |resid_post|, "
                f"|mlp_out| = {float(mlp.norm() / post.norm()):.2e} x |resid_post|"
            )
            assert err < 0.05, note
        if workload == "W7":
            z = outs[0].activations["z"]
            note = f"z[{mid}] shape {tuple(z.shape)} (n_heads {self.n_heads}, d_head {self.d_head})"
        if workload == "W8":  # steering mlp_out of layer mid moves resid_post of mid by exactly the vector
            cap = {"output_activations": {"resid_post": [mid]}}
            plain = self._one(ps[0], cap).activations["resid_post"][0, :prompt_len].float()
            steer = self.extra("W8", 0, 1)
            steered = self._one(ps[0], {**cap, **steer}).activations["resid_post"][0, :prompt_len].float()
            vec = self.vec.float().reshape(1, -1)
            err = float((steered - plain - vec).norm() / (vec.norm() * prompt_len**0.5))
            note = (
                f"layer {mid}: resid_post(steered) - resid_post(plain) vs the vector, relative error "
                f"{err:.2e} over {prompt_len} prompt positions (|vector| {float(vec.norm()):.1f}, "
                f"|resid_post| per position {float(plain.norm() / prompt_len**0.5):.2f})"
            )
            assert err < 0.05, note
        return note

    def bulk(self, n: int, new: int, prompt_len: int) -> dict:
        """n capture requests (middle layer) in rounds of n/4, results dropped: does RSS stay flat?"""
        from vllm import SamplingParams

        mid, rss, toks = self.n_layers // 2, [round(mem_mb()[0])], 0
        sp = SamplingParams(
            max_tokens=new, temperature=0, ignore_eos=True, extra_args={"output_residual_stream": [mid]}
        )
        for r in range(4):
            ps = [[(p + 7919 * r) % 30000 + 100 for p in q] for q in prompts(n // 4, prompt_len)]
            outs = self.llm.generate([{"prompt_token_ids": p} for p in ps], sp, use_tqdm=False)
            toks += sum(len(o.outputs[0].token_ids) for o in outs)
            del outs
            rss.append(round(mem_mb()[0]))
        return {
            "out_tokens": toks,
            "detail": f"{n} requests × ({prompt_len} prompt + {new} new tokens), capture layer "
            f"{mid}: RSS MB before and after each quarter = {rss}",
        }

    def run(self, workload: str, n: int, new: int, prompt_len: int) -> int | dict:
        import torch
        from vllm import SamplingParams

        if workload == "BULK":
            return self.bulk(n, new, prompt_len)
        ps = prompts(n, prompt_len)
        if workload == "W7" and self.kind.startswith("lens"):
            self._probe_z(ps[0])  # once; untimed only on the parent's warm-up call
            if self.z_refused:
                raise NotImplementedError(f"point 'z' refused by this build: {self.z_refused}")
        sps = [
            SamplingParams(
                max_tokens=new, temperature=0, ignore_eos=True, extra_args=self.extra(workload, i, n) or None
            )
            for i in range(n)
        ]
        # BENCH_W2_CHUNK: split an all-layer capture into several generate calls (the original tool hangs
        # when one engine->frontend message passes 4 GiB)
        chunk = int(os.environ.get("BENCH_W2_CHUNK", "0")) if workload == "W2" and self.kind == "vllm-lens" else 0
        outs = []
        use0 = self._rusage()
        if self._gc is None and self.kind.startswith("lens"):
            self._gc = round_diagnostics.GcClock()
        if self._gc is not None:
            self._gc.take()  # (the collections before this run are not its own)
        t_gen = time.monotonic()
        for s in range(0, n, chunk or n):
            outs += self.llm.generate(
                [{"prompt_token_ids": p} for p in ps[s : s + (chunk or n)]], sps[s : s + (chunk or n)], use_tqdm=False
            )
        t_end = time.monotonic()
        # the timed part: generation, results included (what a user waits for); the bench's own checks and
        # diagnostics below are not the workload's
        self.gen_wall = t_end - t_gen
        if self.kind.startswith("lens"):
            from vllm_worker import frontend

            self.timings = dict(frontend.FRONTEND_TIMINGS)
            if self._gc is not None:
                self.timings["gc"] = self._gc.take()  # the frontend's collections during the generate call
            try:  # the worker's host seconds around graph-path steps (plan / forward / after) and in fetches
                st = self.llm.collective_rpc("lens_status")[0]
                now = {"step": st["step_timings"], "fetch": st["fetch_timings"]}
                # cumulative in the worker: this run's share is the difference from the last run
                for k, v in now.items():
                    last = self._last_status.get(k, {})
                    self.timings[k] = {x: round(y - last.get(x, 0), 4) for x, y in v.items()}
                self._last_status = now
                span = split_wall(self.llm.collective_rpc("lens_forward_clock")[0], t_gen, t_end, self._replans())
                if span:
                    self.timings["span"] = span
                use1 = self._rusage()
                if use0 and use1:
                    self.timings["rusage"] = _delta(use0, use1)
                # what is held after the run, and after one plain step that sees the batch leave (round_diagnostics)
                self.timings["held_after"] = round_diagnostics.worker_counts(st)
                self.timings["frontend"] = round_diagnostics.frontend_counts(self.llm)
                if os.environ.get("BENCH_SETTLE", "1") == "1":
                    st = round_diagnostics.settle(self.llm, ps[0])
                    self.timings["held_settled"] = round_diagnostics.worker_counts(st)
                    self._last_status = {"step": st["step_timings"], "fetch": st["fetch_timings"]}  # flush not counted
            except Exception as e:  # noqa: BLE001 - diagnostics only
                self.timings["step"] = f"{type(e).__name__}: {e}"
        if workload in ("W1", "W2"):  # results must really be there (no silent no-op)
            acts = outs[0].activations["residual_stream"]
            assert acts.shape[1] == prompt_len + new - 1, acts.shape
            assert bool(acts.float().isfinite().all()) and float(acts.float().abs().sum()) > 0
            if self.kind.startswith("lens") and workload not in self._checked:
                # once (warm-up): the batch's captures line up with a request run alone (first position)
                alone = self.llm.generate([{"prompt_token_ids": ps[0]}], [sps[0]], use_tqdm=False)[0]
                a, b = alone.activations["residual_stream"][:, 0].float(), acts[:, 0].float()
                assert torch.allclose(a, b, rtol=0.05, atol=0.05 * float(a.abs().max())), "capture misaligned"
                self._checked.add(workload)
        if workload in ("W4n", "W4b", "W4r", "W4rb") and self.kind.startswith("lens"):  # the hook really ran
            import torch

            assert all(bool(torch.isfinite(torch.as_tensor(o.hook_results["0"]["norm"]))) for o in outs)
        if workload == "W4m" and self.kind.startswith("lens"):
            import torch

            assert bool(torch.isfinite(torch.as_tensor(outs[0].hook_results["0"]["norm"])))
        if workload in monitor_workloads.MONITOR_WORKLOADS:  # results really there (no silent no-op)
            monitor_workloads.check(workload, outs, prompt_len, new, self.d_mlp or 0)
        out_tokens = sum(len(o.outputs[0].token_ids) for o in outs)
        if workload in POINT_WORKLOADS:
            note = self._check_points(workload, outs, ps, sps, prompt_len, new)
            if note:
                return {"out_tokens": out_tokens, "check": note}
        return out_tokens


def _delta(a: dict, b: dict) -> dict:
    """b - a for nested dicts of numbers (cumulative counters read before and after a run)."""
    out: dict = {}
    for k, v in b.items():
        if isinstance(v, dict):
            out[k] = _delta(a.get(k, {}), v)
        elif isinstance(v, (int, float)):
            out[k] = round(v - a.get(k, 0), 4)
    return out


def split_wall(clock: list, t0: float, t1: float, replans: list | None = None) -> dict | None:
    """A generate call's wall time (`time.monotonic` t0..t1) split by the worker's forward passes (their
    (start, end) on the same clock): before the first forward (requests admitted, scheduled), the step loop
    (first forward's start to the last one's end) with the host seconds inside forwards, and after the last
    forward (outputs processed, results fetched); with `replans` (`lens_replan_clock`), the steps whose
    batch changed and the outliers among steps (`outliers`)."""
    mine = [tuple(c) for c in clock if t0 <= c[0] and c[1] <= t1]
    if not mine:
        return None
    first, last = mine[0][0], mine[-1][1]
    out = {
        "steps": len(mine),
        "lead_s": round(first - t0, 4),
        "loop_s": round(last - first, 4),
        "in_forward_s": round(sum(c[1] - c[0] for c in mine), 4),
        "tail_s": round(t1 - last, 4),
    }
    if len(mine) > 1 and len(mine[0]) > 2:  # the step thread's CPU seconds from the first step's start to the
        # last one's (against the same stretch of wall): below it, that thread waited (GIL, device, queue)
        out["loop_cpu_s"] = round(mine[-1][2] - mine[0][2], 4)
        out["loop_to_last_start_s"] = round(mine[-1][0] - first, 4)
    out.update(device_split(mine))
    if replans is not None:
        out.update(outliers(mine, [r for r in replans if t0 <= r[0] <= t1]))
    return out


def outliers(mine: list, replans: list) -> dict:
    """Where a loop's extra time sits: each re-plan's step (the first forward starting after it), host ms
    and the batch's requests then (while the batch grows, the rise from the step before is what it admitted);
    the 5 largest host times inside a forward and (device clock) device gaps before a forward, each as
    [step, ms, ms of the re-plan before that step or 0]; the device gaps summed before re-planned steps and
    elsewhere. A cost paid once per batch composition shows at the re-planned steps, a per-step one does not."""
    starts = [c[0] for c in mine]
    at: dict[int, float] = {}
    size: dict[int, int] = {}  # the batch's requests at the step's (last) re-plan
    for t, dt, n in replans:
        i = next((k for k, s in enumerate(starts) if s >= t), None)
        if i is not None:
            at[i] = at.get(i, 0.0) + dt * 1e3
            size[i] = int(n)
    host = sorted(((round((c[1] - c[0]) * 1e3, 2), i) for i, c in enumerate(mine)), reverse=True)[:5]
    out = {
        "replan_steps": [[i, round(ms, 2), size[i]] for i, ms in sorted(at.items())],
        "top_host_fwd": [[i, ms, round(at.get(i, 0.0), 2)] for ms, i in host],
    }
    if mine and len(mine[0]) >= 5:  # gap k: after forward k, before forward k + 1
        gaps = [(c[4], k + 1) for k, c in enumerate(mine[:-1]) if c[4] is not None]
        top = sorted(gaps, reverse=True)[:5]
        out["top_dev_gaps"] = [[i, round(ms, 2), round(at.get(i, 0.0), 2)] for ms, i in top]
        out["dev_gap_ms_replanned"] = round(sum(ms for ms, i in gaps if i in at), 2)
        out["dev_gap_ms_other"] = round(sum(ms for ms, i in gaps if i not in at), 2)
    return out


def device_split(mine: list) -> dict:
    """With `VLLM_LENS_GPU_CLOCK=1` (entries carry device ms): the loop's device time inside forwards and
    between them, and per decode step (all but the first 3) the medians of: host start-to-start, host time
    inside the forward, device time of the forward, device time from its end to the next forward's start."""
    if not mine or len(mine[0]) < 5:
        return {}
    import statistics

    gaps = [c[4] for c in mine[:-1] if c[4] is not None]
    dec = mine[3:] if len(mine) > 6 else mine
    med = statistics.median
    out = {
        "dev_fwd_s": round(sum(c[3] for c in mine) / 1e3, 4),
        "dev_between_s": round(sum(gaps) / 1e3, 4),
        "dev_fwd_first3_ms": [round(c[3], 2) for c in mine[:3]],
        "med_step_ms": round(1e3 * med(b[0] - a[0] for a, b in zip(dec, dec[1:])), 3) if len(dec) > 1 else None,
        "med_host_fwd_ms": round(1e3 * med(c[1] - c[0] for c in dec), 3),
        "med_dev_fwd_ms": round(med(c[3] for c in dec), 3),
        "med_dev_between_ms": round(med(c[4] for c in dec[:-1] if c[4] is not None), 3) if len(dec) > 1 else None,
    }
    return out


def _norm_hook(ctx, h):
    ctx.saved["norm"] = h.float().norm(dim=-1).mean().item() if h.numel() else 0.0
    return None


def _norm_hook_batched(ctx, h):
    """W4b: W4n's per-request mean norm for every request of the step in one call: one segment sum on the
    device over `ctx.segment_ids` / `ctx.counts` (made by the plugin without a device sync) and one
    `ctx.save_rows` (each request's value is split off when results leave the worker). No per-request
    Python. An older plugin without those helpers (lens-before) gets the former per-request form."""
    import torch

    if not hasattr(ctx, "save_rows"):
        return _norm_hook_batched_v1(ctx, h)
    sums = torch.zeros(len(ctx.rows), device=h.device).index_add_(0, ctx.segment_ids, h.float().norm(dim=-1))
    ctx.save_rows("norm", sums / ctx.counts)
    return None


def _norm_hook_batched_v1(ctx, h):
    import torch

    counts = torch.tensor([e - s for _, s, e in ctx.rows], device=h.device)
    seg = torch.repeat_interleave(torch.arange(len(ctx.rows), device=h.device), counts)
    means = torch.zeros(len(ctx.rows), device=h.device).index_add_(0, seg, h.float().norm(dim=-1)) / counts
    for i, (rid, _, _) in enumerate(ctx.rows):
        ctx.saved[rid]["norm"] = means[i]
    return None


def _norm_hook_on_device(ctx, h):
    """W4n: the same reading kept on the GPU (no device sync per request per step; it reaches the host
    with the results)."""
    ctx.saved["norm"] = h.float().norm(dim=-1).mean()
    return None


# ------------------------------------------------------------------------------------------ main


def main() -> None:
    kind, model = sys.argv[1], sys.argv[2]
    device = sys.argv[sys.argv.index("--device") + 1] if "--device" in sys.argv else "cpu"
    dtype = sys.argv[sys.argv.index("--dtype") + 1] if "--dtype" in sys.argv else "float32"
    engine_freeze = os.environ.get("BENCH_ENGINE_GC_FREEZE") == "1"
    if engine_freeze:  # (a callable crosses to the engine core's workers: vLLM pickles it only when allowed)
        os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
    t0 = time.perf_counter()
    try:
        cls = {"hf": HFSystem, "nnsight": HFSystem, "transformer-lens": HFSystem, "nnsight-vllm": NNsightVLLMSystem}
        system = cls.get(kind, VLLMSystem)(kind, model, device, dtype)
    except Exception as e:
        traceback.print_exc(file=sys.stderr)
        send({"error": f"start-up failed: {type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"})
        return
    send({"startup_s": time.perf_counter() - t0, "engine": getattr(system, "engine_mode", None)})
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd.get("quit"):
            break
        if cmd.get("freeze_gc"):  # after the warm-up (bench/run.py: BENCH_GC_FREEZE)
            gc.collect()
            gc.freeze()
            frozen: dict[str, Any] = {"frozen": gc.get_freeze_count()}
            llm = getattr(system, "llm", None)
            if engine_freeze and llm is not None:  # every vLLM system alike (BENCH_ENGINE_GC_FREEZE)
                frozen["engine_frozen"] = llm.collective_rpc(freeze_engine_heap)
            send(frozen)
            continue
        try:
            if device == "cuda":
                import torch

                torch.cuda.synchronize()
            spy = profiler(kind, cmd["workload"])
            t = time.perf_counter()
            try:
                system.gen_wall = None
                got = system.run(cmd["workload"], cmd["n"], cmd["new"], cmd["prompt_len"])
                if device == "cuda":
                    torch.cuda.synchronize()
                wall = time.perf_counter() - t
                if getattr(system, "gen_wall", None) is not None:  # vLLM systems: generate() alone is timed
                    wall = system.gen_wall
            finally:
                if spy is not None:
                    spy.send_signal(signal.SIGINT)
                    spy.wait(timeout=60)
            rss, hwm = mem_mb()
            extra = got if isinstance(got, dict) else {"out_tokens": got}
            timings = getattr(system, "timings", None)
            if timings is not None:  # cumulative fetch/decode seconds after generation (this project)
                extra["lens_timings"] = timings
            send({"wall": wall, "rss_mb": rss, "hwm_mb": hwm, "gpu_peak_mb": gpu_mem_mb(), **extra})
        except NotImplementedError as e:
            send({"error": f"n/a: {e}"})
        except Exception as e:
            traceback.print_exc(file=sys.stderr)
            send({"error": f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"})


if __name__ == "__main__":
    main()
