"""After a bench/run.py call (ON THE DEVICE): what each engine's start-up was made of, from its log and its
own compile cache (BENCH_COLD_CACHES). Prints one JSON object per engine log.

    python bench/ab_logs.py bench/logs [COLD_CACHE_DIR] > $OUT/startup.json

Per engine: vLLM's own start-up lines (Dynamo transform, torch.compile total, graph capture, init engine),
the CUDA-graph capture progress bars' last state (count, seconds, rate), "CUDA Graph is empty" warnings, and
from computation_graph.py the pieces vLLM split the model into (submodules of the split graph; the pieces
holding attention or one of this project's ops are counted apart).
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

LINES = {
    "dynamo_s": r"Dynamo bytecode transform time: ([\d.]+) s",
    "compile_range_s": r"Compiling a graph for compile range .* takes ([\d.]+) s",
    "torch_compile_total_s": r"torch\.compile took ([\d.]+) s in total",
    "graph_capture_s": r"Graph capturing finished in ([\d.]+) secs",
    "graph_capture_gib": r"Graph capturing finished in [\d.]+ secs, took ([\d.]+) GiB",
    "init_engine_s": r"init engine \(profile, create kv cache, warmup model\) took ([\d.]+)",
    "init_compilation_s": r"init engine \(profile, create kv cache, warmup model\) took [\d.]+ s \(compilation: ([\d.]+) s",
    "model_load_s": r"Model loading took [\d.]+ GiB (?:memory )?and ([\d.]+) seconds",
}
BAR = re.compile(
    r"Capturing CUDA graphs \(([^)]*)\):\s*(\d+)%\|[^|]*\|\s*(\d+)/(\d+) \[([\d:]+)<[^,\]]*(?:,\s*([\d.]+)\s*it/s)?"
)


def secs(t: str) -> int:
    s = 0
    for part in t.split(":"):
        s = s * 60 + int(part)
    return s


def pieces(root: Path) -> list[dict]:
    out = []
    for g in sorted(root.rglob("computation_graph.py")):
        src = g.read_text(errors="replace")
        top = re.findall(r"self\.(submod_\d+)\(", src)
        blocks = re.split(r"\n\s*class (submod_\d+)\(torch\.nn\.Module\)", src)
        body = {blocks[i]: blocks[i + 1] for i in range(1, len(blocks) - 1, 2)}
        names = list(dict.fromkeys(top))
        attn = [n for n in names if re.search(r"unified_attention|attention_with_output|\.attn\b", body.get(n, ""))]
        lens = [n for n in names if "vllm_lens" in body.get(n, "")]
        out.append(
            {
                "file": str(g.relative_to(root)),
                "submodules": len(names),
                "with_attention": len(attn),
                "with_lens_ops": len(lens),
                # op -> how many pieces call it (a splitting op is a piece of its own)
                "lens_ops": {
                    op: sum(1 for n in names if re.search(rf"torch\.ops\.vllm_lens\.{op}\b", body.get(n, "")))
                    for op in sorted(set(re.findall(r"torch\.ops\.vllm_lens\.(\w+)", src)))
                },
            }
        )
    return out


def main() -> None:
    logs = Path(sys.argv[1])
    cold = Path(sys.argv[2]) if len(sys.argv) > 2 else None
    for log in sorted(logs.glob("*.log")):
        text = log.read_text(errors="replace")
        rec: dict = {"log": log.name}
        for k, pat in LINES.items():
            vals = [float(x) for x in re.findall(pat, text)]
            if vals:
                rec[k] = vals if len(vals) > 1 else vals[0]
        bars: dict[str, tuple] = {}
        for chunk in re.split(r"[\r\n]", text):
            m = BAR.search(chunk)
            if m:
                bars[m.group(1)] = (int(m.group(3)), int(m.group(4)), secs(m.group(5)), m.group(6))
        rec["capture_bars"] = {
            k: {"done": d, "of": n, "elapsed_s": e, "it_per_s": float(r) if r else None}
            for k, (d, n, e, r) in bars.items()
        }
        rec["cuda_graph_empty_warnings"] = text.count("The CUDA Graph is empty")
        rec["warnings"] = sorted({ln.strip()[:200] for ln in text.splitlines() if "Warning" in ln or "WARNING" in ln})[
            :20
        ]
        if cold is not None:
            rec["pieces"] = pieces(cold / log.stem)
        print(json.dumps(rec))


if __name__ == "__main__":
    main()
