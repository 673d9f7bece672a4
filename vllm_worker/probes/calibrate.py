"""`vllm-lens probes calibrate MODEL --probe DIR --control control.jsonl --fpr 0.01 [--aggregate mean]`:
score a control set (benign text the probe should stay quiet on) through the engine and write into
`probe.json` the threshold that at most `fpr` of the control responses exceed.

The control file uses the extraction corpus's lines (`{"id", "prompt"}` or `{"id", "messages"}`,
`vllm_worker.extract.inputs`). A conversation ending with the assistant's turn is read teacher-forced
(nothing generated; the reply is continued, not closed, as Inspect's provider reads it) and scored over
the reply's tokens; any other line generates `--max-tokens` tokens (greedy) and is scored over the
generated ones. A response's score is the probe's aggregate over those positions
(`vllm_worker.probes.aggregation`), the same function served aggregates and Inspect scorers use.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from pathlib import Path
from typing import Any, Sequence

import torch

from vllm_worker.probes import aggregation
from vllm_worker.probes.format import CONFIG_FILE, load_probe_files
from vllm_worker.protocol.checks import finite_number

CHUNK = 256  # control rows per engine call (the progress bar moves per chunk)
PROBE_NAME = "lens-calibrate"


def threshold_at_fpr(control_scores: Sequence[float], fpr: float) -> float:
    """Smallest threshold with at most `floor(fpr * n)` of the control scores strictly above it."""
    c = sorted(float(x) for x in control_scores)
    if not c:
        raise ValueError("calibrate: empty control set")
    if any(math.isnan(x) for x in c):
        raise ValueError("calibrate: a control score is NaN (an empty response window?)")
    if not 0 <= fpr < 1:
        raise ValueError(f"fpr: must be in [0, 1), got {fpr}")
    k = int(math.floor(fpr * len(c)))  # controls allowed above the threshold
    return c[len(c) - 1 - k]


def reply_window(prompt_ids: list[int], candidates: list[list[int]]) -> tuple[tuple[int, int], bool]:
    """A teacher-forced prompt ends with the reply: the window is its last k positions, k from the first
    candidate tokenization of the reply that equals the prompt's tail (exact), else the first one. The
    Inspect scorers find their windows with this same function, so both score the same positions."""
    end = len(prompt_ids)
    for ids in candidates:
        if ids and prompt_ids[end - len(ids) :] == ids:
            return (end - len(ids), end), True
    return (max(0, end - len(candidates[0])), end), False


def _tokens(tokenizer: Any, row: Any) -> tuple[list[int], int | None]:
    """(prompt token ids, first position of the reply read teacher-forced, or None when generating). The
    reply's window is its own tokens (alone, or after a space folded into its first token), as Inspect's
    scorers locate the detect text: not the template's separator before it."""
    from vllm_worker.extract import inputs as inp

    msgs = row.messages
    if msgs is None or msgs[-1]["role"] != "assistant":
        return inp.tokenize(tokenizer, [row])[0].token_ids, None
    text = tokenizer.apply_chat_template(msgs, tokenize=False, continue_final_message=True)
    ids = list(tokenizer.encode(text, add_special_tokens=False))
    reply = msgs[-1]["content"]
    cands = [list(tokenizer.encode(reply, add_special_tokens=False))]
    if not reply.startswith(" "):
        cands.append(list(tokenizer.encode(" " + reply, add_special_tokens=False)))
    (start, end), _ = reply_window(ids, cands)
    if start >= end:
        raise ValueError(f"line {row.line}: the assistant's reply is empty")
    return ids, start


def response_scores(
    llm: Any, name: str, control: str | Path, aggregate: str, output: int, max_tokens: int, progress: bool
) -> list[float]:
    """The aggregate of probe `name` (output column `output`) over each control response, in file order."""
    from vllm import SamplingParams

    from vllm_worker.extract import inputs as inp

    n = inp.scan(control, "all", max_tokens)
    tokenizer = llm.get_tokenizer()
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=n, desc="calibrate", unit="response", file=sys.stderr)
    scores: list[float] = []
    batch: list[tuple[list[int], int | None]] = []

    def flush() -> None:
        by_mode: dict[bool, list[int]] = {True: [], False: []}
        for i, (_, start) in enumerate(batch):
            by_mode[start is not None].append(i)
        got: dict[int, float] = {}
        for forced, idx in by_mode.items():
            if not idx:
                continue
            sp = SamplingParams(
                max_tokens=1 if forced else max_tokens,
                temperature=0,
                extra_args={"output_probe_scores": [name]},
            )
            outs = llm.generate([{"prompt_token_ids": batch[i][0]} for i in idx], sp, use_tqdm=False)
            for i, out in zip(idx, outs):
                per_token = torch.as_tensor(out.activations["probe_scores"][name])
                n_prompt = len(batch[i][0])
                if forced:
                    window = per_token[batch[i][1] : n_prompt]
                else:  # generated token j is read at position n_prompt + j; the last one never is
                    window = per_token[n_prompt - 1 : n_prompt - 1 + len(out.outputs[0].token_ids)]
                if window.shape[0] == 0:
                    raise ValueError(f"{control}: response {i + 1} of a chunk has no scored position")
                got[i] = float(aggregation.aggregate(window[:, output], aggregate))
        scores.extend(got[i] for i in range(len(batch)))
        if bar is not None:
            bar.update(len(batch))
        batch.clear()

    for row in inp.rows(control, "all", max_tokens):
        batch.append(_tokens(tokenizer, row))
        if len(batch) >= CHUNK:
            flush()
    if batch:
        flush()
    if bar is not None:
        bar.close()
    return scores


def write_threshold(folder: str | Path, threshold: float, calibration: dict[str, Any]) -> dict[str, Any]:
    """Set `threshold` in the folder's probe.json (its aggregate listed first, the calibration recorded in
    `metadata.calibration`); the fields changed are checked as the engine's reader checks them."""
    path = Path(folder) / CONFIG_FILE
    cfg = json.loads(path.read_text())
    cfg["threshold"] = threshold
    agg = calibration["aggregate"]
    cfg["aggregate"] = [agg, *[a for a in cfg.get("aggregate") or [] if a != agg]]
    cfg["metadata"] = {**(cfg.get("metadata") or {}), "calibration": calibration}
    finite_number(threshold, "threshold")
    aggregation.names(cfg["aggregate"], "aggregate")
    tmp = path.with_name(CONFIG_FILE + ".tmp")
    tmp.write_text(json.dumps(cfg, indent=1))
    os.replace(tmp, path)  # whole or not at all: a crash never leaves half a probe.json
    return cfg


def calibrate(
    llm: Any,
    probe_dir: str | Path,
    control: str | Path,
    fpr: float,
    aggregate: str | None = None,
    output: int = 0,
    max_tokens: int = 32,
    progress: bool = True,
) -> dict[str, Any]:
    """Score `control` with the probe in `probe_dir` on `llm`, write the threshold; the calibration record."""
    from vllm_worker import compat

    probe = load_probe_files(probe_dir)
    agg = aggregate or (probe.aggregate[0] if probe.aggregate else "mean")
    aggregation.names(agg, "aggregate")
    if not 0 <= output < probe.n_out:
        raise ValueError(f"output: the probe has {probe.n_out} outputs, got index {output}")
    if not 0 <= fpr < 1:
        raise ValueError(f"fpr: must be in [0, 1), got {fpr}")
    llm.load_probe(PROBE_NAME, str(probe_dir))
    try:
        scores = response_scores(llm, PROBE_NAME, control, agg, output, max_tokens, progress)
    finally:
        llm.delete_probe(PROBE_NAME)
    threshold = threshold_at_fpr(scores, fpr)
    record = {
        "aggregate": agg,
        "fpr": fpr,
        "output": output,
        "n_control": len(scores),
        "above": sum(s > threshold for s in scores),
        "control": str(control),
        "max_tokens": max_tokens,
        "provenance": compat.serving_provenance(compat.processor_of_llm(llm)),
    }
    write_threshold(probe_dir, threshold, record)
    return {"threshold": threshold, **record}


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="vllm-lens probes calibrate",
        description="Fit a probe's threshold on a control set (docs/probes.md, Calibration).",
        epilog="Any other flag is a `vllm serve` engine flag (e.g. --dtype, --max-model-len, --tensor-parallel-size).",
        allow_abbrev=False,
    )
    ap.add_argument("model", help="model name or folder (as for `vllm serve`)")
    ap.add_argument("--probe", required=True, help="probe folder (probe.safetensors + probe.json); updated in place")
    ap.add_argument("--control", required=True, help='JSONL control set: {"id", "prompt"} or {"id", "messages"}')
    ap.add_argument("--fpr", type=float, default=0.01, help="false-positive rate on the control set (default 0.01)")
    ap.add_argument("--aggregate", default=None, help="mean, max, last, rolling_max:W, ema:A (default: the probe's)")
    ap.add_argument("--output", type=int, default=0, help="probe output column (default 0)")
    ap.add_argument("--max-tokens", type=int, default=32, help="tokens generated for lines without a reply")
    ap.add_argument("--no-progress", action="store_true", help="no progress bar")
    return ap


def main(argv: list[str]) -> int:
    if not argv or argv[0] != "calibrate":
        print(
            "usage: vllm-lens probes calibrate MODEL --probe DIR --control F.jsonl [--fpr 0.01] (--help)",
            file=sys.stderr,
        )
        return 2
    args, engine_flags = parser().parse_known_args(argv[1:])
    try:
        probe = load_probe_files(args.probe)
        if args.aggregate is not None:
            aggregation.names(args.aggregate, "--aggregate")
        if not 0 <= args.fpr < 1:
            raise ValueError(f"--fpr: must be in [0, 1), got {args.fpr}")
        if not 0 <= args.output < probe.n_out:
            raise ValueError(f"--output: the probe has {probe.n_out} outputs, got {args.output}")
        if args.max_tokens < 1:
            raise ValueError("--max-tokens: must be at least 1")
        if not Path(args.control).is_file():
            raise ValueError(f"--control: no such file {args.control}")
        from vllm_worker.extract import inputs as inp

        inp.scan(args.control, "all", args.max_tokens)  # a malformed line fails before the engine starts
    except ValueError as e:
        print(f"vllm-lens probes calibrate: {e}", file=sys.stderr)
        return 2
    from vllm_worker import compat

    llm = compat.llm_from_engine_args(
        compat.engine_args_from_cli(args.model, engine_flags, "vllm-lens probes calibrate")
    )
    try:
        got = calibrate(
            llm, args.probe, args.control, args.fpr, args.aggregate, args.output, args.max_tokens, not args.no_progress
        )
    except ValueError as e:
        print(f"vllm-lens probes calibrate: {e}", file=sys.stderr)
        return 2
    finally:
        compat.shutdown_engine(llm)
    print(
        f"vllm-lens probes calibrate: threshold {got['threshold']:.6g} ({got['aggregate']}; {got['above']} of "
        f"{got['n_control']} control responses above, fpr {got['fpr']}) -> {Path(args.probe) / CONFIG_FILE}",
        file=sys.stderr,
    )
    return 0
