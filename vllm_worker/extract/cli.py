"""`vllm-lens extract MODEL --input prompts.jsonl --layers 10,15 --out DIR [options] [vllm serve engine flags]`.

Our options are read first; every other flag goes to vLLM's engine-argument parser, exactly as
`vllm serve` reads it (`--dtype` there is the model's dtype; the stored tensors' dtype is `--out-dtype`).
The corpus is checked before the engine starts, so a malformed line fails in a second, not after
loading the model. Exit status: 0 done, 2 bad arguments or input, 130 interrupted (run the same command
again to resume).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

from vllm_worker.extract import inputs as inp
from vllm_worker.protocol.points import INNER, POINTS

DESCRIPTION = "Extract activations of a JSONL corpus to safetensors shards (docs/extraction.md)."


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="vllm-lens extract",
        description=DESCRIPTION,
        epilog="Any other flag is a `vllm serve` engine flag (e.g. --dtype, --max-model-len, --tensor-parallel-size).",
        allow_abbrev=False,  # a prefix of a vLLM flag must reach vLLM, not match one of ours
    )
    ap.add_argument("model", help="model name or folder (as for `vllm serve`)")
    ap.add_argument(
        "--input",
        required=True,
        help='JSONL: {"id", "prompt"} or {"id", "messages"} per line ("text" for "prompt"; id defaults to the line number)',
    )
    ap.add_argument("--out", required=True, help="output folder (an unfinished one is resumed)")
    ap.add_argument("--layers", required=True, help='comma-separated layer indices (negative from the end), or "all"')
    ap.add_argument("--points", default="resid_post", help=f"comma-separated hook points ({', '.join(POINTS)})")
    ap.add_argument("--positions", default="all", choices=inp.POSITIONS, help="positions kept per row")
    ap.add_argument(
        "--out-dtype", default=None, choices=("float32", "float16", "bfloat16"), help="default: the model's"
    )
    ap.add_argument("--max-ram-gb", type=float, default=4.0, help="host memory the extraction may hold (default 4)")
    ap.add_argument("--max-tokens", type=int, default=1, help="1: read the prompt only; more: generate (greedy)")
    ap.add_argument("--no-progress", action="store_true", help="no progress bar")
    return ap


def _layers(text: str) -> list[int] | str:
    if text.strip() == "all":
        return "all"
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"--layers: expected comma-separated integers or all, got {text!r}") from None


def main(argv: list[str]) -> int:
    args, engine_flags = parser().parse_known_args(argv)
    try:
        layers = _layers(args.layers)
        points = [p.strip() for p in args.points.split(",") if p.strip()]
        if not Path(args.input).is_file():
            raise ValueError(f"--input: no such file {args.input}")
        if args.max_ram_gb <= 0 or args.max_tokens < 1:
            raise ValueError("--max-ram-gb must be positive and --max-tokens at least 1")
        inp.scan(args.input, args.positions, args.max_tokens)  # before the engine starts
    except ValueError as e:
        print(f"vllm-lens extract: {e}", file=sys.stderr)
        return 2
    inner = [p for p in points if p in INNER]
    if inner and not os.environ.get("VLLM_LENS_POINTS"):
        os.environ["VLLM_LENS_POINTS"] = ",".join(inner)  # tap only what is asked (read at engine start)

    from vllm_worker import compat

    llm = compat.llm_from_engine_args(compat.engine_args_from_cli(args.model, engine_flags))
    try:
        return _run(llm, args, layers, points)
    finally:
        compat.shutdown_engine(llm)


def _run(llm: Any, args: argparse.Namespace, layers: list[int] | str, points: list[str]) -> int:
    """The extraction itself, on a started engine; the exit status."""
    from vllm_worker.extract.run import extract

    try:
        stats = extract(
            llm,
            args.input,
            args.out,
            layers=layers,
            points=points,
            positions=args.positions,
            dtype=args.out_dtype,
            max_ram_gb=args.max_ram_gb,
            max_tokens=args.max_tokens,
            progress=not args.no_progress,
        )
    except ValueError as e:
        print(f"vllm-lens extract: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(
            f"vllm-lens extract: interrupted; finished shards are kept in {args.out}: run the same command "
            "again to resume",
            file=sys.stderr,
        )
        return 130
    rate = stats["tokens"] / stats["seconds"] if stats["seconds"] else 0.0
    print(
        f"vllm-lens extract: {stats['index_rows']} rows ({stats['extracted']} new, {stats['skipped']} already "
        f"done) in {stats['shards']} shards -> {args.out}/index.json; {rate:,.0f} tokens/s",
        file=sys.stderr,
    )
    return 0
