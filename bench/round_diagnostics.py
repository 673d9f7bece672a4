"""Per-round diagnostics of this project's engines in a benchmark call: what the worker and the frontend
hold after each timed run, and the W0 runs repeated at the end of the call. A wall that grows round after
round (W9 / W13 on the H200, 2026-12-04) is then attributed: to state left behind (counts that do not
return to 0), to the step loop (step counters), or to the engine itself (W0 at the end slower than in the
rounds).

Used by worker.py (the counts, in the lens process) and run.py (the tables, in the results' .md).
"""

from __future__ import annotations

import gc
import statistics
import sys
from typing import Any

# step counters shown per round (cumulative in the worker; worker.py records each run's difference)
STEP_KEYS = ("graph_steps", "python_steps", "plan_s", "forward_s", "after_s", "admit_s", "admit_steps")
DEVICE_KEYS = ("dev_fwd_s", "dev_between_s", "med_step_ms", "med_host_fwd_ms", "med_dev_fwd_ms", "med_dev_between_ms")
# what the worker holds for live requests (each back to 0 once they leave, seen at the next step)
HELD_KEYS = ("request_states", "steering_entries", "probe_score_chunks", "action_slots", "stored_requests")


def worker_counts(status: dict[str, Any]) -> dict[str, Any]:
    """The scalar counts of one `lens_status` answer (the result pool's too, as `pool_*`)."""
    out = {k: v for k, v in status.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
    pool = status.get("result_pool")
    if isinstance(pool, dict):
        out.update({f"pool_{k}": v for k, v in pool.items() if isinstance(v, (int, float)) and not isinstance(v, bool)})
    return out


def frontend_counts(llm: Any) -> dict[str, Any]:
    """What the frontend process holds: the plugin's pending requests and cached capture specs, vLLM's
    output-processor request states, and Python's live object count (its growth is a leak's sign)."""
    # gc-tracked objects made since vLLM froze its start-up ones (gc.freeze), and Python's allocated blocks
    out: dict[str, Any] = {"py_objects": len(gc.get_objects()), "alloc_blocks": sys.getallocatedblocks()}
    try:
        from vllm_worker.frontend.state import engine_state

        st = engine_state(llm)
        out["pending"] = len(st.pending)
        out["specs"] = len(st.specs)
    except Exception as e:  # noqa: BLE001 - diagnostics only (an older tree)
        out["frontend_error"] = type(e).__name__
    try:
        out["vllm_request_states"] = len(llm.llm_engine.output_processor.request_states)
    except Exception:  # noqa: BLE001 - a vLLM without that attribute
        pass
    return out


def settle(llm: Any, prompt: list[int]) -> dict[str, Any]:
    """One plain 1-token request (untimed), so the worker sees the last batch leave; then `lens_status`:
    what is still held was left behind."""
    from vllm import SamplingParams

    llm.generate([{"prompt_token_ids": prompt}], SamplingParams(max_tokens=1), use_tqdm=False)
    return llm.collective_rpc("lens_status")[0]


# ---------------------------------------------------------------------------------------------- tables


def _tok_s(r: dict) -> float | None:
    return r["out_tokens"] / r["wall"] if r.get("wall") else None


def _outlier_row(w: str, i: int, span: dict) -> str:
    def cells(items: list) -> str:
        return " ".join(f"{x[0]}:{x[1]}" + (f"(+{x[2]})" if len(x) > 2 and x[2] else "") for x in items) or "-"

    def replans(items: list) -> str:  # step:ms, then [requests in the batch] where recorded
        return " ".join(f"{x[0]}:{x[1]}" + (f"[{x[2]}]" if len(x) > 2 else "") for x in items) or "-"

    gaps = f"{_num(span.get('dev_gap_ms_replanned'))} / {_num(span.get('dev_gap_ms_other'))}"
    return (
        f"| {w} | {i} | {replans(span['replan_steps'])} | {cells(span.get('top_host_fwd', []))} | "
        f"{cells(span.get('top_dev_gaps', []))} | {gaps if 'top_dev_gaps' in span else '-'} |"
    )


def render(result: dict) -> list[str]:
    """Markdown lines: per lens system and workload, one row per round (wall, step loop split, step
    counters, what is held after the run and after a flush step); then W0 at the end of the call."""
    lines: list[str] = []
    for system, entry in result.get("systems", {}).items():
        rows, odd = [], []
        for w, runs in entry.get("runs", {}).items():
            for i, r in enumerate(runs):
                lt = r.get("lens_timings")
                if not isinstance(lt, dict):
                    continue
                step = lt.get("step") if isinstance(lt.get("step"), dict) else {}
                span = lt.get("span") or {}
                after = lt.get("held_after") or {}
                settled = lt.get("held_settled") or {}
                fe = lt.get("frontend") or {}
                steps = "/".join(_num(step.get(k)) for k in STEP_KEYS)
                held = "/".join(_num(after.get(k)) for k in HELD_KEYS)
                held2 = "/".join(_num(settled.get(k)) for k in HELD_KEYS)
                split = "/".join(_num(span.get(k)) for k in ("lead_s", "loop_s", "tail_s"))
                dev = "/".join(_num(span.get(k)) for k in DEVICE_KEYS) if "dev_fwd_s" in span else "-"
                gcs = lt.get("gc") or {}
                gc2 = f"{_num(gcs.get('gen2', 0))} / {_num(gcs.get('gen2_s', 0.0))}" if "gc" in lt else "-"
                rows.append(
                    f"| {w} | {i} | {_num(r.get('wall'))} | {split} | {steps} | {dev} | {held} | {held2} | "
                    f"{_num(fe.get('pending'))} / {_num(fe.get('py_objects'))} | {gc2} | {_worker_host(lt)} |"
                )
                if "replan_steps" in span:
                    odd.append(_outlier_row(w, i, span))
        if not rows:
            continue
        lines += [
            f"### Per round: {system}",
            "",
            "Steps: "
            + "/".join(STEP_KEYS)
            + " (this run's share). Device (`VLLM_LENS_GPU_CLOCK`): "
            + "/".join(DEVICE_KEYS)
            + " (medians over decode steps). Held: "
            + "/".join(HELD_KEYS)
            + " after the run,"
            " then after one plain 1-token request (settled: should be 0 / 0 / 0 / 0 / 0 or the one request).",
            "",
            "| workload | round | wall s | lead/loop/tail s | steps | device | held after | held settled | frontend pending / objects | full GCs / s | worker threads CPU s; worker GCs |",
            "|---|---|---|---|---|---|---|---|---|---|---|",
            *rows,
            "",
        ]
        if odd:
            lines += [
                f"Outliers ({system}): each re-plan's step and host ms (a batch composition changed), [the batch's "
                "requests then]; the largest "
                "host ms inside a forward and device gaps before one, as step:ms(+ms of a re-plan before it); "
                "device gap ms summed before re-planned steps / elsewhere.",
                "",
                "| workload | round | re-plans | top host in forward | top device gaps | gap ms re-planned / other |",
                "|---|---|---|---|---|---|",
                *odd,
                "",
            ]
    end = []
    for system, entry in result.get("systems", {}).items():
        runs = [x for x in (_tok_s(r) for r in entry.get("runs", {}).get("W0", [])) if x]
        tail = [x for x in (_tok_s(r) for r in entry.get("w0_end", [])) if x]
        if runs and tail:
            ratio = statistics.median(tail) / statistics.median(runs)
            end.append(
                f"| {system} | {' / '.join(f'{x:.0f}' for x in runs)} | {' / '.join(f'{x:.0f}' for x in tail)} | {ratio:.3f} |"
            )
    if end:
        lines += [
            "### W0 at the end of the call (did the engine itself slow down?)",
            "",
            "| system | W0 tok/s in the rounds | W0 tok/s at the end | end / rounds (medians) |",
            "|---|---|---|---|",
            *end,
            "",
        ]
    return lines


def _worker_host(lt: dict) -> str:
    """The worker process's threads with the most CPU in the run (`lens_rusage`'s "threads": the step thread
    is one of them) and its collections as thread:gen<g>xN/seconds (`VLLM_LENS_HOST_CLOCK`)."""
    ru = lt.get("rusage") if isinstance(lt.get("rusage"), dict) else {}
    threads = sorted((ru.get("threads") or {}).items(), key=lambda kv: -kv[1])
    cells = " ".join(f"{name}:{cpu:.3f}" for name, cpu in threads[:3] if cpu > 0)
    gcs = []
    for name, got in (ru.get("gc") or {}).items():
        for g in (0, 1, 2):
            if got.get(f"gen{g}"):
                gcs.append(f"{name}:gen{g}x{_num(got[f'gen{g}'])}/{got.get(f'gen{g}_s', 0.0):.4f}")
    return f"{cells or '-'}; {' '.join(gcs) or '-'}"


def _num(v: Any) -> str:
    if v is None:
        return "–"
    if isinstance(v, float):
        return f"{v:.3f}" if abs(v) < 100 else f"{v:.0f}"
    return str(v)


class GcClock:
    """This process's garbage collections during a run: count and seconds per generation, every thread
    together (the worker's clock, `host_clock.GcClock`, read as differences) — a full collection over the
    frontend's live objects can stall a run's tail (W10: `decode_s` 0.5 s in one round, 0.06 in the next)."""

    def __init__(self) -> None:
        from vllm_worker.worker.host_clock import GcClock as ByThread  # (lens systems only: the plugin is there)

        self._clock = ByThread()
        self._last: dict[str, float] = {}

    def take(self) -> dict[str, Any]:
        """{"gen<g>": collections, "gen<g>_s": seconds} since the last call, generations that ran only."""
        now: dict[str, float] = {}
        for per_thread in self._clock.snapshot().values():
            for k, v in per_thread.items():
                now[k] = now.get(k, 0) + v
        out: dict[str, Any] = {}
        for k in sorted(k for k in now if not k.endswith("_s")):  # gen-1 < gen0 < gen1 < gen2
            n = int(now[k] - self._last.get(k, 0))
            if n:
                out[k], out[f"{k}_s"] = n, round(now[f"{k}_s"] - self._last.get(f"{k}_s", 0.0), 4)
        self._last = now
        return out
