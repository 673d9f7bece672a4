"""Bulk extraction at flat memory: N short prompts (default 10,000) through `vllm_worker.extract.extract`
on one in-process engine, the process's RSS sampled every 0.2 s, against plain generation of the same
prompts (`LLM.generate`, max_tokens=1, nothing captured) on the same engine; repeats interleaved.

    .venv/bin/python bench/extract.py [--model tiny|smollm2|PATH] [--rows 10000] [--layers 2] \
        [--positions all] [--max-ram-gb 0.25] [--repeats 2] [--out bench/results/F.json]
    # the lent GPU (a model folder, random weights of its shape): --device cuda --dtype bfloat16 --dummy

Prints a markdown table (throughput, ratio, RSS at each tenth of the run, growth over the second half).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

WORDS = (
    "the water of people will come down to the side how many first time was said each word "
    "long make thing see him two has look more day could go come did number sound no most"
).split()


def rss_mb() -> float:
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) for l in f if l.startswith("VmRSS")) / 1024


class GcCount:
    """Garbage collections (per generation) and seconds spent in them, while counting (`gc.callbacks`)."""

    def __init__(self) -> None:
        self.n = [0, 0, 0]
        self.gen_s = [0.0, 0.0, 0.0]
        self._t = 0.0

    def _cb(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._t = time.perf_counter()
        else:
            self.n[info["generation"]] += 1
            self.gen_s[info["generation"]] += time.perf_counter() - self._t

    def __enter__(self) -> "GcCount":
        import gc

        gc.callbacks.append(self._cb)
        return self

    def __exit__(self, *exc: object) -> None:
        import gc

        gc.callbacks.remove(self._cb)

    def as_dict(self) -> dict:
        return {"collections": list(self.n), "gc_s": sum(self.gen_s), "gen_s": list(self.gen_s)}


class Sampler:
    """RSS every `every` seconds in a thread, with the rows done so far (set by the caller)."""

    def __init__(self, every: float = 0.2) -> None:
        self.every, self.rows, self.samples = every, 0, []
        self._stop = threading.Event()
        self.t0 = time.perf_counter()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            self.samples.append((time.perf_counter() - self.t0, self.rows, rss_mb()))
            self._stop.wait(self.every)

    def stop(self) -> list:
        self._stop.set()
        self._thread.join()
        self.samples.append((time.perf_counter() - self.t0, self.rows, rss_mb()))
        return self.samples


def corpus(path: Path, n: int) -> None:
    with path.open("w") as f:
        for i in range(n):
            k = 6 + i % 11
            f.write(json.dumps({"id": i, "prompt": " ".join(WORDS[(i * 7 + j * 3) % len(WORDS)] for j in range(k))}))
            f.write("\n")


def model_of(name: str) -> str:
    if name == "tiny":
        from support.engines import model_path

        return str(model_path("llama"))
    if name == "smollm2":
        from vllm_worker.shipped_model import shipped_model_path

        return str(shipped_model_path())
    return name


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--rows", type=int, default=10000)
    ap.add_argument("--layers", default="2")
    ap.add_argument("--positions", default="all")
    ap.add_argument("--max-ram-gb", type=float, default=0.25)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--eager", action="store_true", help="enforce_eager (default: vLLM's compiled mode)")
    ap.add_argument("--out", default=None)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--dummy", action="store_true", help="random weights of the model folder's shape")
    ap.add_argument(
        "--chunk-rows",
        type=int,
        default=None,
        help="rows per generate call (vllm_worker.extract.run.MAX_CHUNK_ROWS; default: the shipped value)",
    )
    ap.add_argument(
        "--profile",
        default=None,
        metavar="FILE",
        help="instead of timing: one plain generation and one extraction under cProfile; prints their Python "
        "function calls (a measure the machine's load does not move) and writes both profiles' top entries to FILE (and FILE.plain.prof, FILE.extract.prof)",
    )
    args = ap.parse_args()

    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    if args.model in ("tiny", "smollm2"):
        import conftest  # noqa: F401  (test models, offline settings)
    from vllm import LLM, SamplingParams

    from vllm_worker.extract import extract
    from vllm_worker.extract import run as extract_run

    if args.chunk_rows:  # fewer rows in flight per call: fewer live objects at each collection, more calls
        extract_run.MAX_CHUNK_ROWS = args.chunk_rows
    work = Path(tempfile.mkdtemp(prefix="lens-extract-bench-"))
    src = work / "prompts.jsonl"
    corpus(src, args.rows)
    lines = [json.loads(l) for l in src.read_text().splitlines()]
    model = model_of(args.model)
    t = time.perf_counter()
    kw: dict = {"load_format": "dummy"} if args.dummy else {}
    if args.device == "cpu":
        kw["kv_cache_memory_bytes"] = 256 << 20
    else:
        kw["gpu_memory_utilization"] = 0.5
    llm = LLM(model, dtype=args.dtype, max_model_len=512, seed=0, enforce_eager=args.eager, **kw)
    start_s = time.perf_counter() - t
    layers = [int(x) for x in args.layers.split(",")]
    prompts = [r["prompt"] for r in lines]
    sp = SamplingParams(max_tokens=1, temperature=0, detokenize=False)
    llm.generate(prompts[:64], sp, use_tqdm=False)  # warm-up
    if args.profile:
        profile(llm, prompts, sp, src, work, layers, args)
        shutil.rmtree(work, ignore_errors=True)
        return
    runs: list[dict] = []
    for rep in range(args.repeats):
        sampler = Sampler()
        with GcCount() as gcs:
            t, c = time.perf_counter(), time.process_time()
            outs = llm.generate(prompts, sp, use_tqdm=False)
            plain_s, plain_cpu = time.perf_counter() - t, time.process_time() - c
        tokens = sum(len(o.prompt_token_ids) for o in outs)
        del outs
        runs.append(
            {
                "kind": "plain",
                "rep": rep,
                "s": plain_s,
                "cpu_s": plain_cpu,
                "tokens": tokens,
                "gc": gcs.as_dict(),
                "rss": sampler.stop(),
            }
        )

        out = work / f"acts-{rep}"
        shutil.rmtree(out, ignore_errors=True)
        sampler = Sampler()

        def on_shard(shard: int, rows: int, s: Sampler = sampler) -> None:
            s.rows += rows

        with GcCount() as gcs:
            t, c = time.perf_counter(), time.process_time()
            stats = extract(
                llm,
                src,
                out,
                layers=layers,
                positions=args.positions,
                max_ram_gb=args.max_ram_gb,
                progress=False,
                on_shard=on_shard,
            )
            ext_s, ext_cpu = time.perf_counter() - t, time.process_time() - c
        size = sum(p.stat().st_size for p in out.glob("*.safetensors"))
        runs.append(
            {
                "kind": "extract",
                "rep": rep,
                "s": ext_s,
                "cpu_s": ext_cpu,
                "tokens": stats["tokens"],
                "stats": stats,
                "bytes": size,
                "gc": gcs.as_dict(),
                "rss": sampler.stop(),
            }
        )
        print(
            f"rep {rep}: plain {plain_s:.1f}s, extract {ext_s:.1f}s ({stats['chunks']} chunks, {stats['shards']} shards, {size / 2**20:.0f} MiB)",
            file=sys.stderr,
        )
    shutil.rmtree(work, ignore_errors=True)

    report = {
        "model": model,
        "rows": args.rows,
        "layers": layers,
        "positions": args.positions,
        "max_ram_gb": args.max_ram_gb,
        "engine_start_s": start_s,
        "eager": args.eager,
        "chunk_rows": extract_run.MAX_CHUNK_ROWS,
        "device": args.device,
        "dtype": args.dtype,
        "runs": runs,
    }
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1))
    print(table(report))


def profile(llm, prompts: list[str], sp, src: Path, work: Path, layers: list[int], args) -> None:
    """cProfile of one plain generation and one extraction of the same prompts (after a warm extraction
    of a few rows, so one-off costs such as the first validation are out)."""
    import cProfile
    import io
    import pstats

    from vllm_worker.extract import extract

    kw = dict(layers=layers, positions=args.positions, max_ram_gb=args.max_ram_gb, progress=False)
    warm = work / "warm.jsonl"
    warm.write_text("".join(src.read_text().splitlines(keepends=True)[:64]))
    extract(llm, warm, work / "acts-warm", **kw)
    report = io.StringIO()
    calls = {}
    gcs = {}
    for kind in ("plain", "extract"):
        prof = cProfile.Profile()
        t = time.perf_counter()
        with GcCount() as gcs[kind]:
            if kind == "plain":
                prof.runcall(llm.generate, prompts, sp, use_tqdm=False)
            else:
                prof.runcall(extract, llm, src, work / "acts-prof", **kw)
        s = time.perf_counter() - t
        prof.dump_stats(f"{args.profile}.{kind}.prof")
        st = pstats.Stats(prof, stream=report)
        calls[kind] = st.total_calls
        print(f"\n===== {kind}: {st.total_calls:,} calls, {s:.2f} s under the profiler", file=report)
        st.sort_stats("tottime").print_stats(40)
        st.sort_stats("cumulative").print_stats("vllm_worker", 60)
    Path(args.profile).write_text(report.getvalue())
    print(
        f"{len(prompts):,} prompts: Python calls plain {calls['plain']:,}, extract {calls['extract']:,} "
        f"({calls['extract'] / calls['plain'] - 1:+.1%}); garbage collections (gen 0/1/2) plain "
        f"{'/'.join(map(str, gcs['plain'].n))}, extract {'/'.join(map(str, gcs['extract'].n))}; profiles in {args.profile}"
    )


def _gc_text(run: dict) -> str:
    g = run.get("gc")
    if not g:
        return "-"
    return "/".join(map(str, g["collections"])) + f" ({'/'.join(f'{x:.2f}' for x in g['gen_s'])} s)"


def table(report: dict) -> str:
    runs = report["runs"]
    plain = sorted(r["s"] for r in runs if r["kind"] == "plain")
    ext = sorted(r["s"] for r in runs if r["kind"] == "extract")
    # CPU seconds of the process (all its threads): moved less than wall time by other processes' load
    plain_cpu = sorted(r.get("cpu_s", 0.0) for r in runs if r["kind"] == "plain")
    ext_cpu = sorted(r.get("cpu_s", 0.0) for r in runs if r["kind"] == "extract")
    tok = runs[0]["tokens"]
    lines = [
        f"{report['rows']:,} prompts ({tok:,} tokens), model {Path(report['model']).name}, layers {report['layers']}, "
        f"positions {report['positions']}, --max-ram-gb {report['max_ram_gb']}",
        "",
        "| run | seconds (each repeat) | tokens/s (best) | vs plain | CPU s (each repeat) | vs plain (CPU, best) |",
        "|---|---|---|---|---|---|",
        f"| plain `LLM.generate` (max_tokens=1) | {', '.join(f'{s:.1f}' for s in plain)} | {tok / plain[0]:,.0f} | 1.00x "
        f"| {', '.join(f'{s:.1f}' for s in plain_cpu)} | 1.00x |",
        f"| extract | {', '.join(f'{s:.1f}' for s in ext)} | {tok / ext[0]:,.0f} | {plain[0] / ext[0]:.2f}x "
        f"| {', '.join(f'{s:.1f}' for s in ext_cpu)} | {plain_cpu[0] / max(ext_cpu[0], 1e-9):.2f}x |",
        "",
        "Garbage collections (generation 0/1/2) and seconds in each generation's, each repeat: plain "
        + ", ".join(_gc_text(r) for r in runs if r["kind"] == "plain")
        + "; extract "
        + ", ".join(_gc_text(r) for r in runs if r["kind"] == "extract"),
        "",
        "RSS (MiB) of the process during each extraction, at each tenth of the run's rows:",
        "",
        "| repeat | start | " + " | ".join(f"{10 * i}%" for i in range(1, 11)) + " | max | growth over 2nd half |",
        "|---|---|" + "---|" * 12,
    ]
    for r in (r for r in runs if r["kind"] == "extract"):
        s = r["rss"]
        n = report["rows"]
        at = []
        for i in range(1, 11):
            hit = [x for x in s if x[1] >= n * i / 10]
            at.append(hit[0][2] if hit else s[-1][2])
        half = [x[2] for x in s if x[1] >= n / 2]
        growth = half[-1] - half[0] if half else 0.0
        lines.append(
            f"| {r['rep']} | {s[0][2]:.0f} | "
            + " | ".join(f"{v:.0f}" for v in at)
            + f" | {max(x[2] for x in s):.0f} | {growth:+.1f} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    main()
