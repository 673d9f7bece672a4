"""Side-by-side benchmark: every system in its own process, same prompts/model/sampling, interleaved
repeats, ratios pair by pair; writes bench/results/<date>-<machine>.{md,json,png}.

    python bench/run.py [--repeats 3] [--quick] [--device cpu|cuda] [--only small|large]

Env: BENCH_SYSTEMS (comma list) restricts systems; BENCH_* knobs in bench/worker.py and the system modules
it loads (system_base.py, hf_system.py, nnsight_vllm_system.py).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DEPS = ROOT / "bench" / ".deps"
BASE = ("W0", "W1", "W2", "W3", "W4", "W4n", "W5")
POINTS = ("W6", "W7", "W8")  # hook points (issue #24): this project only
# freeze each bench process's GC heap after its warm-up (docs/decisions.md, "W10's tail and the frontend's
# garbage collector"): a full collection over ~800k start-up objects costs 0.35 s on the H200 host, at random
GC_FREEZE = os.environ.get("BENCH_GC_FREEZE", "1") == "1"
MONITORS = ("W9", "W10", "W11", "W12", "W12n", "W13", "W14")  # probes, probe actions, ops, mlp_post (#42, #43)
CORE = BASE + ("W4b", "W4m", "W4r", "W4rb") + POINTS  # W4b, W4r, W4rb, W6-W8: this project only
ALL = CORE + MONITORS  # W9-W14: this project only, plan gpu-monitors
NAMES = {
    "W0": "plain generation",
    "W1": "capture 1 middle layer",
    "W2": "capture all layers",
    "W3": "steer 1 layer",
    "W4": "Python hook 1 layer",
    "W4n": "Python hook 1 layer, result kept on the GPU",
    "W4b": "W4n as one batched hook (one call per step)",
    "W4m": "W4n's hook on one request in the batch, the others plain",
    "W4r": "W4n declared read_only (runs after the forward)",
    "W4rb": "W4b declared read_only (runs after the forward)",
    "W5": "mixed batch (¼ capture, ¼ steer)",
    "W6": "capture attn_out + mlp_out, middle layer",
    "W7": "capture z (per head), middle layer",
    "W8": "steer mlp_out, middle layer",
    "W9": "1 probe scored, every request",
    "W10": "8 probes at 4 layers, every request",
    "W11": "probe action then steer, every request",
    "W12": "ablate 1 direction at every layer",
    "W12n": "W12 by a registered name",
    "W13": "cap 1 direction at 1 layer",
    "W14": "capture mlp_post, 1 layer",
}


def system_env(system: str) -> dict[str, str]:
    inherited = os.environ.get("PYTHONPATH", "")
    env = dict(os.environ, PYTHONPATH=f"{ROOT}:{inherited}" if inherited else str(ROOT))
    if os.environ.get("BENCH_MP") != "1":  # in-process engine: RSS is the engine's; BENCH_MP=1: vLLM's default
        env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    env.pop("VLLM_LENS_DISABLE", None)
    if system in ("vllm-eager", "vllm-compiled"):
        env["VLLM_PLUGINS"] = "none-allowed"  # allow-list naming no plugin: plain vLLM
    elif system in ("lens", "lens-eager", "lens-points", "lens-noseams", "lens-noearly", "lens-x", "lens-x2"):
        env["VLLM_PLUGINS"] = "inspect_lens_worker"
        env["VLLM_LENS_ALLOW_REMOTE_HOOKS"] = "1"
        # "lens-points": the engine taps the inner points the point workloads use (BENCH_LENS_POINTS), as an
        # operator serving them would start it; "lens" keeps the caller's setting (unset: between layers only)
        if system == "lens-points":
            env["VLLM_LENS_POINTS"] = os.environ.get("BENCH_LENS_POINTS", "attn_out,mlp_out,z")
        if system == "lens-noseams":  # steps with Python hooks off full graphs, every feature from Python (before #25)
            env["VLLM_LENS_SEAMS"] = "0"
        if system == "lens-noearly":  # captures assembled at fetch, after generation (before early assembly)
            env["VLLM_LENS_EARLY_ASSEMBLY"] = "0"
        if system in ("lens-x", "lens-x2"):  # this project with the settings in BENCH_LENS_X_ENV / BENCH_LENS_X2_ENV
            var = "BENCH_LENS_X_ENV" if system == "lens-x" else "BENCH_LENS_X2_ENV"  # ("NAME=value,NAME=value")
            for item in filter(None, os.environ.get(var, "").split(",")):
                name, _, value = item.partition("=")
                if not name.startswith("VLLM_LENS_"):
                    raise SystemExit(f"{var}: {name!r} is not a VLLM_LENS_ setting")
                env[name] = value
    elif system == "lens-before":
        # this project at an older commit (A/B): its package installed elsewhere (BENCH_LENS_BEFORE_PATH, e.g.
        # pip install --no-deps --target /root/lens-before <tree>) and first on the path; this tree and the
        # current install (/root/lens) are left off it, so only the old vllm_worker (and its entry points) exist
        before = os.environ.get("BENCH_LENS_BEFORE_PATH", "/root/lens-before")
        current = {str(ROOT), "/root/lens", os.environ.get("BENCH_LENS_PATH", "/root/lens")}
        keep = [x for x in inherited.split(":") if x and x not in current]
        env["PYTHONPATH"] = ":".join([before, *keep])
        env["VLLM_PLUGINS"] = "inspect_lens_worker"
        env["VLLM_LENS_ALLOW_REMOTE_HOOKS"] = "1"
    elif system == "vllm-lens":
        env["VLLM_PLUGINS"] = "activations"  # the original's plugin only
        env["PYTHONPATH"] = f"{os.environ.get('BENCH_VLLM_LENS_PATH', DEPS / 'vllm_lens')}:{env['PYTHONPATH']}"
    elif system == "nnsight":
        env["PYTHONPATH"] = f"{DEPS / 'nnsight'}:{env['PYTHONPATH']}"
    elif system == "nnsight-vllm":
        # nnsight 0.8.1 on vLLM, for the device's Python 3.12 (bench/peers_deps.sh; BENCH_NNSIGHT_PATH elsewhere);
        # no plugin (nnsight's engine alone; this project's must not load here); spawned workers: nnsight sets up
        # torch.distributed (and on a GPU host touches CUDA) before vLLM starts its processes
        path = os.environ.get("BENCH_NNSIGHT_PATH", str(DEPS / "nnsight312"))
        env["PYTHONPATH"] = f"{path}:{env['PYTHONPATH']}"
        env["VLLM_PLUGINS"] = "none-allowed"
        env["VLLM_WORKER_MULTIPROC_METHOD"] = "spawn"
        env.pop("VLLM_USE_V2_MODEL_RUNNER", None)  # nnsight refuses the V2 runner; it asks for V1 itself
    elif system == "transformer-lens":
        env["PYTHONPATH"] = f"{DEPS / 'transformer_lens'}:{DEPS / 'tl_extra'}:{env['PYTHONPATH']}"
    return env


class Proc:
    def __init__(self, system: str, model: str, device: str, dtype: str, log_dir: Path, wait: bool = True) -> None:
        self.system = system
        self.err = open(log_dir / f"{system}-{Path(model).name}.log", "w")
        env = system_env(system)
        env.setdefault(
            "VLLM_LOGGING_STREAM", "ext://sys.stderr"
        )  # vLLM's own log into this log (stdout is the protocol)
        cold = os.environ.get("BENCH_COLD_CACHES")
        if cold:  # start-up time, cold: this engine's own empty compile caches (vLLM, Inductor, Triton)
            base = Path(cold) / f"{system}-{Path(model).name}"
            env["VLLM_CACHE_ROOT"] = str(base / "vllm")
            env["TORCHINDUCTOR_CACHE_DIR"] = str(base / "inductor")
            env["TRITON_CACHE_DIR"] = str(base / "triton")
        self.p = subprocess.Popen(
            [sys.executable, str(ROOT / "bench" / "worker.py"), system, model, "--device", device, "--dtype", dtype],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.err,
            text=True,
            env=env,
            cwd=ROOT,
        )
        self.start = self.read() if wait else {}

    def read(self) -> dict:
        for line in self.p.stdout:
            if line.startswith("BENCH "):
                return json.loads(line[6:])
        return {"error": f"process exited ({self.p.wait()}); see {self.err.name}"}

    def ask(self, **cmd) -> dict:
        if self.p.poll() is not None:
            return {"error": f"process exited ({self.p.returncode}); see {self.err.name}"}
        self.p.stdin.write(json.dumps(cmd) + "\n")
        self.p.stdin.flush()
        return self.read()

    def close(self) -> None:
        if self.p.poll() is None:
            try:
                self.p.stdin.write('{"quit": true}\n')
                self.p.stdin.flush()
                self.p.wait(60)
            except Exception:
                self.p.kill()
        self.err.close()


def bench_model(
    label: str, model: str, plan: dict[str, tuple[str, ...]], args, log_dir: Path, progress=lambda result: None
) -> dict:
    """Start each system (alone, timed), warm up, then repeats × workloads × systems interleaved."""
    from bench import host_speed  # (as `write_results` imports its renderers)

    size = dict(n=args.n, new=args.new, prompt_len=args.prompt_len)
    procs: dict[str, Proc] = {}
    out: dict = {"model": model, "label": label, "size": size, "systems": {}}
    started: dict[str, tuple[Proc, float]] = {}
    parallel = os.environ.get("BENCH_PARALLEL_START") == "1"  # start every engine at once (device time is scarce)
    for system in plan:
        print(f"[{label}] starting {system} ...", flush=True)
        t = time.time()
        p = Proc(system, model, args.device, args.dtype, log_dir, wait=not parallel)
        started[system] = (p, t)
    for system, (p, t) in started.items():
        if parallel:
            p.start = p.read()
        entry = out["systems"].setdefault(
            system, {"startup_s": p.start.get("startup_s"), "error": p.start.get("error"), "runs": {}}
        )
        if "error" in p.start:
            print(f"[{label}] {system}: {p.start['error']}", flush=True)
            p.close()
            continue
        warm = p.ask(workload=plan[system][0], **size)  # warm-up (not recorded)
        if (system.startswith("lens") or system == "nnsight-vllm") and "W1" in plan[system] and "error" not in warm:
            warm = p.ask(workload="W1", **size)  # also checks the capture once
        if (
            system.startswith("lens")
            and "W2" in plan[system]
            and "error" not in warm
            and os.environ.get("BENCH_WARM_W2", "1") == "1"
        ):
            warm = p.ask(workload="W2", **size)  # the first all-layer batch allocates its pinned host memory
        # warm-up of each point and monitor workload (its first call also checks the values; a monitor's
        # first batch grows the result pool or the tables once, outside the timed rounds)
        for w in POINTS + MONITORS:
            if system.startswith("lens") and w in plan[system] and "error" not in warm:
                r = p.ask(workload=w, **size)
                entry.setdefault("checks", {})[w] = r.get("check") or r.get("error") or "ok (shapes, finite)"
                print(f"[{label}] {system} {w} check: {entry['checks'][w]}", flush=True)
                if r.get("error", "").startswith("n/a"):
                    continue  # skipped (e.g. z refused): the timed rounds report the same n/a
                if "error" in r:
                    warm = r
        if p.start.get("engine"):
            entry["engine"] = p.start["engine"]
            need = args.n * (args.prompt_len + args.new)
            kv = p.start["engine"].get("kv_cache_tokens")
            if kv is not None and kv < need:  # fewer requests run at once: its throughput is not comparable
                entry["kv_starved"] = f"KV cache {kv:,} tokens < {need:,} for the whole batch"
                print(f"[{label}] WARNING {system}: {entry['kv_starved']}", flush=True)
        if "error" in warm:
            entry["error"] = warm["error"]
        elif GC_FREEZE:  # every system alike, after its warm-up (as vLLM's serving benchmark does)
            got = p.ask(freeze_gc=True)
            entry["gc_frozen"] = got.get("frozen")
            if "engine_frozen" in got:
                entry["engine_gc_frozen"] = got["engine_frozen"]
        procs[system] = p
        print(f"[{label}] {system} ready in {time.time() - t:.0f}s", flush=True)
    # BENCH_ORDER: the workloads' order within a round (e.g. W2 last: a round's other workloads run after
    # a 10 GB all-layer batch was released otherwise)
    order_w = [w for w in os.environ.get("BENCH_ORDER", "").split(",") if w in ALL]
    rounds = order_w + [w for w in ALL if w not in order_w]
    for rep in range(args.repeats):
        for w in rounds:
            order = [s for s in procs if w in plan[s]]
            order = order[rep % max(len(order), 1) :] + order[: rep % max(len(order), 1)]  # rotate: drift cancels
            for s in order:
                rate = host_speed.loop_rate()
                r = procs[s].ask(workload=w, **size)
                r["host_mips"] = round(rate, 2)
                out["systems"][s]["runs"].setdefault(w, []).append(r)
                tag = r.get("error") or f"{r['out_tokens'] / r['wall']:.0f} tok/s"
                print(f"[{label}] rep {rep} {w} {s}: {tag}", flush=True)
        progress(out)
    # BENCH_W0_END=N: N more W0 runs on every engine after the rounds; against W0 in the rounds they say
    # whether an engine itself slowed down over the call (round_diagnostics renders it)
    for rep in range(int(os.environ.get("BENCH_W0_END", "0"))):
        for s in procs:
            r = procs[s].ask(workload="W0", **size)
            out["systems"][s].setdefault("w0_end", []).append(r)
            tag = r.get("error") or f"{r['out_tokens'] / r['wall']:.0f} tok/s"
            print(f"[{label}] end {rep} W0 {s}: {tag}", flush=True)
        progress(out)
    if args.bulk and label == "small" and "lens" in procs:
        out["bulk"] = procs["lens"].ask(workload="BULK", n=1000, new=4, prompt_len=16)
    for p in procs.values():
        p.close()
    return out


def summarize(result: dict) -> list[dict]:
    """Rows: median tok/s and wall; ratios per repeat vs plain eager W0 and vs vllm-lens (same workload)."""
    rows = []
    systems = result["systems"]

    def tput(s: str, w: str) -> list[float | None]:
        return [
            r["out_tokens"] / r["wall"] if "wall" in r else None for r in systems.get(s, {}).get("runs", {}).get(w, [])
        ]

    base = tput("vllm-eager", "W0")
    graphs = tput("vllm-compiled", "W0")
    for s, entry in systems.items():
        if entry.get("error") and not entry["runs"]:
            rows.append({"system": s, "workload": "-", "error": entry["error"]})
            continue
        for w, runs in entry["runs"].items():
            errs = [r["error"] for r in runs if "error" in r]
            if errs:
                rows.append({"system": s, "workload": w, "error": errs[0]})
                continue
            tp = tput(s, w)
            ref = tput("vllm-lens", w)
            pair = lambda other: [a / b for a, b in zip(tp, other) if a and b]  # noqa: E731
            best = lambda xs: max((x for x in xs if x), default=None)  # noqa: E731
            rows.append(
                {
                    "system": s,
                    "workload": w,
                    "tok_s": statistics.median(tp),
                    "wall_s": statistics.median(r["wall"] for r in runs),
                    "rss_mb": max(r["rss_mb"] for r in runs),
                    "gpu_peak_mb": runs[-1].get("gpu_peak_mb"),
                    "vs_eager": statistics.median(pair(base)) if pair(base) else None,
                    "vs_graphs": statistics.median(pair(graphs)) if pair(graphs) else None,
                    "vs_graphs_best": best(tp) / best(graphs) if best(tp) and best(graphs) else None,
                    "vs_vllm_lens": statistics.median(pair(ref)) if s != "vllm-lens" and pair(ref) else None,
                    "n": len(tp),
                }
            )
    return rows


def fmt(v, spec: str) -> str:
    return "–" if v is None else format(v, spec)


def write_results(results: list[dict], args, started: float) -> Path:
    from bench import host_speed, round_diagnostics  # the repo root is on the path (main, or an importer)

    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    machine = args.machine or f"{platform.node() or 'cpu'}-{os.cpu_count()}cpu"
    stem = out_dir / f"{dt.date.today().isoformat()}-{machine}"
    Path(f"{stem}.json").write_text(json.dumps(results, separators=(",", ":")))
    lines = [
        f"# Benchmark {dt.date.today().isoformat()} on {machine}",
        "",
        f"Command: `python bench/run.py {' '.join(sys.argv[1:])}` — {time.time() - started:.0f} s end to end. "
        f"Greedy, `ignore_eos`, {args.n} prompts × {args.prompt_len} tokens → {args.new} new tokens each, "
        f"{args.dtype}, medians over {args.repeats} interleaved repeats after one warm-up; ratios are "
        "computed repeat by repeat (same round), then the median is taken; best / best is the fastest round's "
        "tok/s over plain vLLM's fastest (a busy host only adds time: the estimate least moved by it)."
        + (
            " Each bench process's garbage-collector heap is frozen after its warm-up (`BENCH_GC_FREEZE=1`, "
            "every system alike, as `vllm bench serve` does): a full collection then walks only what the "
            "rounds made, not the ~800k objects vLLM and torch hold."
            + (
                " So is each vLLM engine core's (`BENCH_ENGINE_GC_FREEZE=1`; vLLM itself freezes it at start-up only)."
                if os.environ.get("BENCH_ENGINE_GC_FREEZE") == "1"
                else ""
            )
            if GC_FREEZE
            else " The bench processes' garbage collectors are left as they are (`BENCH_GC_FREEZE=0`)."
        ),
        "",
    ]
    for res in results:
        lines += [
            f"## {res['label']}: `{Path(res['model']).name}`",
            "",
            "| system | workload | out tok/s | wall s | RSS MB | vs plain eager | vs plain compiled/graphs "
            "| best / best | vs vllm-lens 1.3.0 |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        for r in summarize(res):
            w = r["workload"]
            label = f"{w} {NAMES.get(w, '')}".strip()
            if "error" in r:
                lines.append(f"| {r['system']} | {label} | {r['error']} | | | | | | |")
                continue
            lines.append(
                f"| {r['system']} | {label} | {r['tok_s']:.0f} | {r['wall_s']:.2f} | {r['rss_mb']:.0f} | "
                f"{fmt(r['vs_eager'], '.2f')} | {fmt(r['vs_graphs'], '.2f')} | {fmt(r['vs_graphs_best'], '.3f')} | "
                f"{fmt(r['vs_vllm_lens'], '.2f')} |"
            )
        starts = ", ".join(f"{s} {e['startup_s']:.0f} s" for s, e in res["systems"].items() if e.get("startup_s"))
        lines += ["", f"Start-up (process start to engine ready): {starts}.", ""]
        for s, e in res["systems"].items():
            if e.get("engine"):
                lines.append(f"- engine of {s}: {e['engine']}")
            if e.get("kv_starved"):
                lines.append(f"- **{s} is not comparable**: {e['kv_starved']} (engines started side by side?)")
            for w, c in e.get("checks", {}).items():
                lines.append(f"- check {s} {w}: {c}")
        lines.append("")
        lines += round_diagnostics.render(res)
        lines += host_speed.render(res)
        if res.get("bulk"):
            b = res["bulk"]
            lines += [f"Bulk capture (this project): {b.get('error') or b.get('detail')}", ""]
    Path(f"{stem}.md").write_text("\n".join(lines) + "\n")
    try:
        plot(results, Path(f"{stem}.png"))
    except Exception as e:  # the table is the result; the chart is a convenience
        print(f"plot failed: {e}", file=sys.stderr)
    return Path(f"{stem}.md")


COLORS = {
    "vllm-eager": "#4c72b0",
    "vllm-compiled": "#8fb0e0",
    "lens": "#2ca02c",
    "lens-eager": "#98df8a",
    "lens-before": "#bcbd22",
    "lens-points": "#17becf",
    "lens-noseams": "#ff7f0e",
    "lens-noearly": "#bcbd22",
    "lens-x": "#17becf",
    "lens-x2": "#7f7f7f",
    "vllm-lens": "#d62728",
    "hf": "#9467bd",
    "nnsight": "#8c564b",
    "nnsight-vllm": "#c49c94",
    "transformer-lens": "#e377c2",
}


def plot(results: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(results), figsize=(7 * len(results), 4.5), squeeze=False)
    for ax, res in zip(axes[0], results):
        ok = [r for r in summarize(res) if "error" not in r]
        # against plain eager W0 where the run has it, else against plain vLLM with CUDA graphs (the GPU runs)
        key, base = ("vs_eager", "eager") if any(r["vs_eager"] is not None for r in ok) else ("vs_graphs", "graphs")
        rows = [r for r in ok if r[key] is not None]
        systems = list(dict.fromkeys(r["system"] for r in rows))
        workloads = [w for w in ALL if any(r["workload"] == w for r in rows)]
        width = 0.8 / max(len(systems), 1)
        for i, s in enumerate(systems):
            vals = [next((r[key] for r in rows if r["system"] == s and r["workload"] == w), 0) for w in workloads]
            ax.bar([x + i * width for x in range(len(workloads))], vals, width, label=s, color=COLORS.get(s))
        ax.axhline(1.0, color="k", lw=0.8, ls="--")
        ax.set_xticks([x + 0.4 - width / 2 for x in range(len(workloads))], workloads)
        ax.set_ylabel(f"throughput vs plain vLLM {base} (W0)")
        ax.set_title(f"{res['label']}: {Path(res['model']).name}")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--n", type=int, default=64)
    ap.add_argument("--new", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--only", choices=["small", "large"], default=None)
    ap.add_argument("--models", default=None, help="label=path,... instead of the default two")
    ap.add_argument("--machine", default=None)
    ap.add_argument("--no-bulk", dest="bulk", action="store_false")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results"))
    args = ap.parse_args()
    started = time.time()
    log_dir = ROOT / "bench" / "logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    if args.models:
        models = [tuple(x.split("=", 1)) for x in args.models.split(",")]
    else:
        from bench.make_model import bench_model_path
        from vllm_worker.shipped_model import shipped_model_path

        models = [("small", str(shipped_model_path())), ("large", str(bench_model_path()))]
        if args.only:
            models = [m for m in models if m[0] == args.only]
    plans = {
        "small": {
            "vllm-eager": ("W0",),
            "vllm-compiled": ("W0",),
            "lens": CORE,
            "vllm-lens": BASE,
            "hf": ("W0", "W1", "W3"),
            "nnsight": ("W0", "W1"),
            "transformer-lens": ("W0", "W1"),
        },
        # H200: this project in vLLM's default mode against plain vLLM with and without CUDA graphs, and
        # forced eager ("before"); peers on W1 in a second call ("gpu-peers") — all of them at once would
        # not fit in the GPU's memory next to each other
        "gpu": {
            "vllm-eager": ("W0",),
            "vllm-compiled": ("W0",),
            "lens": CORE,
            "vllm-lens": ("W1",),
            "hf": ("W1",),
        },
        # probes, probe actions and ops (#42 §6, #43 §4) against plain vLLM with CUDA graphs; mlp_post (W14) on an
        # engine started with that point listed (lens-points; run with BENCH_LENS_POINTS=mlp_post), its W0 the idle cost
        # (W15, streaming with 1 probe vs plain streaming, runs over HTTP on one server: bench/stream_scores.py)
        "gpu-monitors": {
            "vllm-compiled": ("W0",),
            "lens": ("W0", "W9", "W10", "W11", "W12", "W12n", "W13"),
            "lens-points": ("W0", "W14"),
        },
        # the same against this tree with other settings (lens-x: BENCH_LENS_X_ENV), in one call: an A/B of a knob
        "gpu-monitors-ab": {
            "vllm-compiled": ("W0",),
            "lens": ("W0", "W9", "W10", "W11", "W12", "W13"),
            "lens-x": ("W0", "W9", "W10", "W11", "W12", "W13"),
        },
        "gpu-before": {
            "vllm-eager": ("W0",),
            "vllm-compiled": ("W0",),
            "lens": CORE,
            "lens-eager": ("W0", "W1", "W3", "W5"),
        },
        # hook points (issue #24): this project against plain vLLM with CUDA graphs, 8B-shaped and NeoX-shaped
        "gpu-points": {"vllm-compiled": ("W0",), "lens": ("W0", "W1", "W3", "W6", "W7", "W8")},
        "neox": {"vllm-compiled": ("W0",), "lens": ("W0", "W1", "W6", "W8")},
        # Python hooks: one per request (W4n) against one batched hook for all requests (W4b)
        "gpu-hooks": {"vllm-compiled": ("W0",), "lens": ("W0", "W4n", "W4b")},
        # Python hooks in full CUDA graphs cut at the taps (seams), against the same engine without them
        "gpu-seams": {
            "vllm-compiled": ("W0",),
            "lens": ("W0", "W1", "W3", "W4", "W4n", "W4b", "W4m"),
            "lens-noseams": ("W0", "W4n", "W4b", "W4m"),
        },
        # read-only hooks (run after the forward, overlapping the device) against the same hooks at their taps;
        # lens-noseams starts the same engine without the cut graphs (their memory: bench/ab_logs.py on the logs)
        "gpu-readonly": {
            "vllm-compiled": ("W0",),
            "lens": ("W0", "W4n", "W4r", "W4b", "W4rb", "W4m"),
            "lens-noseams": ("W0",),
        },
        # captures copied into their results during generation (early assembly) against at fetch
        "gpu-early": {"vllm-compiled": ("W0",), "lens": ("W0", "W1", "W2"), "lens-noearly": ("W0", "W1", "W2")},
        # all-layer capture, diagnosed: BENCH_PYSPY profiles the W2 runs; lens-x = a setting to try (BENCH_LENS_X_ENV)
        "gpu-w2": {"vllm-compiled": ("W0",), "lens": ("W0", "W1", "W2"), "lens-x": ("W0", "W1", "W2")},
        # capture (one layer, all layers) and steering against an earlier commit (BENCH_LENS_BEFORE_SRC) and with
        # early assembly off; each lens run's wall split around its step loop (`lens_timings.span`)
        "gpu-w2b": {
            "vllm-compiled": ("W0",),
            "lens": ("W0", "W1", "W3", "W2"),
            "lens-before": ("W0", "W1", "W3", "W2"),
            "lens-noearly": ("W0", "W2"),
        },
        # early assembly beside the step loop: two settings to try (BENCH_LENS_X_ENV, BENCH_LENS_X2_ENV) and off
        "gpu-w2c": {
            "vllm-compiled": ("W0",),
            "lens": ("W0", "W1", "W3", "W2"),
            "lens-x": ("W0", "W2"),
            "lens-x2": ("W0", "W2"),
            "lens-noearly": ("W0", "W2"),
        },
        # the same, all-layer capture only (four engines fit the GPU beside each other with room for W2's prefill)
        "gpu-w2d": {"vllm-compiled": ("W0",), "lens": ("W0", "W2"), "lens-x": ("W0", "W2"), "lens-x2": ("W0", "W2")},
        # all-layer capture against an earlier commit (BENCH_LENS_BEFORE_SRC), three engines (the shortest call)
        "gpu-w2e": {"vllm-compiled": ("W0",), "lens": ("W0", "W2"), "lens-before": ("W0", "W2")},
        # all-layer capture with a setting to try (BENCH_LENS_X_ENV, e.g. VLLM_LENS_DIRECT_POOL=0: host copies), three engines
        "gpu-w2x": {"vllm-compiled": ("W0",), "lens": ("W0", "W2"), "lens-x": ("W0", "W2")},
        # every target of #25 in one call, with this project at an earlier commit (BENCH_LENS_BEFORE_SRC) beside it
        "gpu-table": {
            "vllm-compiled": ("W0",),
            "lens": ("W0", "W1", "W2", "W3", "W4", "W4n", "W4b", "W4m", "W5"),
            "lens-before": ("W0", "W1", "W2", "W3"),
        },
        # the peers on W1 in the same call: the original vllm-lens and nnsight 0.8.1 on vLLM with its CUDA-graph
        # taps (bench/peers_deps.sh makes bench/.deps/{vllm_lens,nnsight312}, carried), nnsight's W0 beside it
        "gpu-peers": {
            "vllm-compiled": ("W0",),
            "lens": ("W0", "W1"),
            "vllm-lens": ("W1",),
            "nnsight-vllm": ("W0", "W1"),
        },
        # capture and steering with and without the cut graphs captured (the seams' cost on steps without hooks)
        "gpu-seams-ab": {"vllm-compiled": ("W0",), "lens": ("W0", "W1", "W3"), "lens-noseams": ("W0", "W1", "W3")},
        # the inner points as served: an engine tapping only the points W6-W8 use, beside the default engine
        "gpu-points2": {
            "vllm-compiled": ("W0",),
            "lens": ("W0", "W1", "W3"),
            "lens-points": ("W0", "W1", "W3", "W6", "W7", "W8"),
        },
        # A/B of two commits of this project in one call: "lens-before" = the older package (BENCH_LENS_BEFORE_PATH;
        # resid_post only, so W0/W1/W3), "lens" = this tree's
        "gpu-ab": {
            "vllm-compiled": ("W0",),
            "lens-before": ("W0", "W1", "W3"),
            "lens": ("W0", "W1", "W3", "W6", "W7", "W8"),
        },
        # the monitors of two commits in one call (BENCH_LENS_BEFORE_SRC: the older tree, installed as lens-before)
        "gpu-monitors-before": {
            "vllm-compiled": ("W0",),
            "lens-before": ("W0", "W9", "W10"),
            "lens": ("W0", "W9", "W10"),
        },
        "large": {
            "vllm-eager": ("W0",),
            "lens": ("W0", "W1", "W2", "W3"),
            "vllm-lens": ("W0", "W1", "W2", "W3"),
            "hf": ("W1",),
        },
    }
    only = set(filter(None, os.environ.get("BENCH_SYSTEMS", "").split(",")))
    only_w = set(filter(None, os.environ.get("BENCH_WORKLOADS", "").split(",")))
    results = []
    for label, path in models:
        plan = plans.get(label, plans["large"])
        if only:
            plan = {s: w for s, w in plan.items() if s in only}
        if only_w:
            plan = {s: tuple(x for x in w if x in only_w) or ("W0",) for s, w in plan.items()}
        results.append(
            bench_model(
                label, path, plan, args, log_dir, progress=lambda r: write_results(results + [r], args, started)
            )
        )
        write_results(results, args, started)  # keep partial results if a later model fails
    md = write_results(results, args, started)
    print(md.read_text())
    print(f"results: {md}")


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    main()
