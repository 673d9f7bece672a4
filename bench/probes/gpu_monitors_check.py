"""ON THE LENT H200: the features of #42 (probes, probe actions) and #43 (ops, neuron points), graph-safe
path against the Python path, in one engine with CUDA graphs (vLLM's default mode).

One batch mixes every case below with plain requests; it runs twice: as it is (the graph-safe kernel
inside vLLM's CUDA graphs) and with a no-op Python hook added to each feature request at the site it
reads first (a hook before its own request's capture at that site sends the whole step to the Python
path; the step counters printed say which path ran). Cases: ablate at every layer, cap at one layer, set
with 3-D positions, an add with phase="generated", probe scores (three probes at three layers, two of them
scored together by one batched projection on the graph path; each against a torch projection of the
captured residual), a probe action `then: stop` and `then: {steer: ...}`, mlp_in / mlp_post capture,
mlp_post steering, whole-row edits at mlp_post (ablate, norm-matched add, cap: on the graph path since
wholerow, 2026-12-05), an op chain at mlp_in (ablate, then an add by phase), a 2-D `set` at mlp_post
(phase "prompt": neuron patching) and an 8-step whole-row chain at mlp_post (the longest a chain holds on the
graph path: every step's scalars). Tokens must be equal, captures equal to bf16 rounding; plain batch-mates equal to
themselves alone. Prints `PASS|FAIL <case> <numbers>` per item and one JSON line `CHECK {...}`.

    python3 bench/probes/gpu_monitors_check.py MODEL      # the 8B-shaped dummy folder (.gpu/model)

CPU smoke test of the script itself (no graphs there; both runs then take the paths the CPU engine
takes): CHECK_DEVICE=cpu CHECK_DTYPE=float32 CHECK_DUMMY=0 CHECK_N_NEW=8 python bench/probes/gpu_monitors_check.py DIR
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any

os.environ.setdefault("VLLM_LENS_POINTS", "mlp_in,mlp_post")  # the engine taps the neuron points (#43 §2)

import numpy as np  # noqa: E402
import torch  # noqa: E402

PROMPT = 30
NEW = int(os.environ.get("CHECK_N_NEW", "16"))
REL_TOL = float(os.environ.get("CHECK_REL_TOL", "0.02"))  # bf16 rounding, grown through a few layers


def noop(ctx: Any, h: Any) -> None:
    return None


def rel(a: torch.Tensor, b: torch.Tensor) -> tuple[float, float]:
    a, b = a.float(), b.float()
    return float((a - b).norm() / b.norm().clamp_min(1e-12)), float((a - b).abs().max())


def first_crossing(s: np.ndarray, start: int) -> tuple[float, int]:
    """A threshold whose first crossing (`>`) over positions start.. is a new running maximum with the
    widest margin (past the first watched position when one exists), and that position."""
    w = s[start:]
    best, k_best = 0.0, 0
    for k in range(1, len(w) - 4):
        margin = float(w[k]) - float(np.max(w[:k]))
        if margin > best:
            best, k_best = margin, k
    if k_best == 0:  # the first watched score is the largest: it fires there
        return float(w[0]) - 1e-3 * max(abs(float(w[0])), 1e-3), start
    prev = float(np.max(w[:k_best]))
    return (prev + float(w[k_best])) / 2, start + k_best


def main() -> None:
    from vllm import LLM, SamplingParams

    from vllm_worker import Hook, SteeringVector

    model = sys.argv[1]
    dtype = os.environ.get("CHECK_DTYPE", "bfloat16")
    kw: dict[str, Any] = dict(model=model, dtype=dtype, max_model_len=1024, seed=0, enable_prefix_caching=False)
    if os.environ.get("CHECK_DUMMY", "1") == "1":
        kw["load_format"] = "dummy"
    if os.environ.get("CHECK_DEVICE", "cuda") == "cuda":
        kw["gpu_memory_utilization"] = 0.3
    t0 = time.time()
    llm = LLM(**kw)
    startup = time.time() - t0
    cfg = llm.llm_engine.model_config.hf_config
    n_layers, d, d_mlp = cfg.num_hidden_layers, cfg.hidden_size, cfg.intermediate_size
    mid, lp, lc = n_layers // 2, n_layers // 2 - 2, n_layers // 2 + 2  # probe layer, cap layer
    rng = np.random.default_rng(0)
    g = torch.Generator().manual_seed(0)
    n_req = 16
    prompts = [{"prompt_token_ids": rng.integers(100, 30000, size=PROMPT).tolist()} for _ in range(n_req)]

    def gen(extras: list[dict | None], new: int = NEW):
        sps = [SamplingParams(max_tokens=new, temperature=0, ignore_eos=True, extra_args=e or None) for e in extras]
        return llm.generate(prompts[: len(extras)], sps, use_tqdm=False)

    def status() -> dict:
        return dict(llm.collective_rpc("lens_status")[0]["step_timings"])

    # the probe: one output, logit, at layer lp
    w = torch.randn(1, d, generator=g)
    b = torch.randn(1, generator=g)
    llm.load_probe("p1", weight=w, bias=b, layers=[lp], point="resid_post")
    # two more, one layer either side, read by the probe case only: their sites have as many rows and
    # columns, so the graph path scores them together (`StagedProbes`: one batched projection)
    g2 = torch.Generator().manual_seed(11)
    extra_probes = {}
    for name, layer in (("p2", lp - 1), ("p3", lp + 1)):
        extra_probes[name] = (torch.randn(1, d, generator=g2), torch.randn(1, generator=g2), layer)
        llm.load_probe(
            name, weight=extra_probes[name][0], bias=extra_probes[name][1], layers=[layer], point="resid_post"
        )

    # preliminary (graph path): the cap range from the projections at lc, the action thresholds from scores
    dcap = torch.randn(d, generator=g)
    dcap = dcap / dcap.norm()
    pre = gen([{"output_residual_stream": [lc], "output_probe_scores": ["p1"]}] * n_req)
    proj = pre[1].activations["residual_stream"][0].float() @ dcap
    lo, hi = float(proj.quantile(0.25)), float(proj.quantile(0.75))
    s5 = pre[5].activations["probe_scores"]["p1"][:, 0].float().numpy()
    s6 = pre[6].activations["probe_scores"]["p1"][:, 0].float().numpy()
    thr_stop, pos_stop = first_crossing(s5, PROMPT - 1)
    thr_steer, pos_steer = first_crossing(s6, PROMPT - 1)

    dirs = torch.randn(n_layers, d, generator=g)
    vset = torch.randn(1, 6, d, generator=g)
    vgen = torch.randn(1, d, generator=g) * 4.0
    vsteer = torch.randn(1, d, generator=g)
    vmlp = torch.randn(1, d_mlp, generator=g) * 4.0
    umlp = torch.randn(2, d_mlp, generator=g)  # whole-row edits' directions (unit: the ops normalise)
    umlp = umlp / umlp.norm(dim=-1, keepdim=True)
    uin = torch.randn(1, d, generator=g)  # mlp_in's ablated direction
    uin = uin / uin.norm()
    vpost = torch.randn(1, d_mlp, generator=g)  # mlp_post's set rows (neuron patching)
    u8 = torch.randn(6, d_mlp, generator=g)  # an 8-step whole-row chain (the most a chain holds on the graph path)
    u8 = u8 / u8.norm(dim=-1, keepdim=True)
    cases: dict[int, tuple[str, dict, tuple[int, str]]] = {
        # index: (name, extra_args, (layer, point) of the twin's no-op hook)
        0: (
            "ablate_every_layer",
            {
                "apply_steering_vectors": [SteeringVector(dirs, list(range(n_layers)), op="ablate")],
                "output_residual_stream": [mid, n_layers - 1],
            },
            (mid, "resid_post"),
        ),
        1: (
            "cap_one_layer",
            {
                "apply_steering_vectors": [SteeringVector(dcap[None], [lc], op="cap", lo=lo, hi=hi)],
                "output_residual_stream": [lc, n_layers - 1],
            },
            (lc, "resid_post"),
        ),
        2: (
            "set_3d_positions",
            {
                "apply_steering_vectors": [SteeringVector(vset, [mid], op="set", position_indices=list(range(2, 8)))],
                "output_residual_stream": [mid, n_layers - 1],
            },
            (mid, "resid_post"),
        ),
        3: (
            "add_phase_generated",
            {
                "apply_steering_vectors": [SteeringVector(vgen, [mid], phase="generated", scale=1.0)],
                "output_residual_stream": [mid, n_layers - 1],
            },
            (mid, "resid_post"),
        ),
        4: (
            "probe_scores",
            {"output_probe_scores": ["p1", "p2", "p3"], "output_residual_stream": [lp - 1, lp, lp + 1]},
            (lp, "resid_post"),
        ),
        5: (
            "action_stop",
            {
                "probe_actions": [{"probe": "p1", "threshold": thr_stop, "then": "stop"}],
                "output_residual_stream": [lp],
                "output_probe_scores": ["p1"],
            },
            (lp, "resid_post"),
        ),
        6: (
            "action_steer",
            {
                "probe_actions": [
                    {
                        "probe": "p1",
                        "threshold": thr_steer,
                        "then": {"steer": SteeringVector(vsteer, [lp + 1], scale=8.0, norm_match=True)},
                    }
                ],
                "output_residual_stream": [lp, n_layers - 1],
                "output_probe_scores": ["p1"],
            },
            (lp, "resid_post"),
        ),
        7: (
            "mlp_in_mlp_post_capture",
            {"output_activations": {"mlp_in": [mid], "mlp_post": [mid]}},
            (mid, "mlp_in"),
        ),
        8: (
            "mlp_post_steer",
            {
                "apply_steering_vectors": [SteeringVector(vmlp, [mid], point="mlp_post")],
                "output_activations": {"mlp_post": [mid], "resid_post": [mid]},
            },
            (mid, "mlp_post"),
        ),
        9: (
            "mlp_post_whole_row",
            {
                "apply_steering_vectors": [
                    SteeringVector(umlp[:1], [mid], op="ablate", point="mlp_post"),
                    SteeringVector(vmlp, [mid], scale=0.5, norm_match=True, point="mlp_post"),
                    SteeringVector(umlp[1:], [mid], op="cap", lo=-0.05, hi=0.05, point="mlp_post"),
                ],
                "output_activations": {"mlp_post": [mid], "resid_post": [mid]},
            },
            (mid, "mlp_post"),
        ),
        10: (
            "mlp_in_op_chain",
            {
                "apply_steering_vectors": [
                    SteeringVector(uin, [mid], op="ablate", point="mlp_in"),
                    SteeringVector(vgen, [mid], scale=0.5, phase="generated", point="mlp_in"),
                ],
                "output_activations": {"mlp_in": [mid], "resid_post": [mid]},
            },
            (mid, "mlp_in"),
        ),
        11: (
            "mlp_post_set_prompt",
            {
                "apply_steering_vectors": [SteeringVector(vpost, [mid], op="set", phase="prompt", point="mlp_post")],
                "output_activations": {"mlp_post": [mid], "resid_post": [mid]},
            },
            (mid, "mlp_post"),
        ),
        12: (
            "mlp_post_whole_row_8_steps",
            {
                "apply_steering_vectors": [
                    *[SteeringVector(u8[k : k + 1], [mid + 1], op="ablate", point="mlp_post") for k in range(3)],
                    *[
                        SteeringVector(u8[k : k + 1], [mid + 1], op="cap", lo=-0.01 * k, hi=0.02 * k, point="mlp_post")
                        for k in range(3, 6)
                    ],
                    SteeringVector(vmlp, [mid + 1], scale=0.25, norm_match=True, point="mlp_post"),
                    SteeringVector(-vmlp, [mid + 1], scale=0.5, norm_match=True, point="mlp_post"),
                ],
                "output_activations": {"mlp_post": [mid + 1], "resid_post": [mid + 1]},
            },
            (mid + 1, "mlp_post"),
        ),
    }
    plain = [i for i in range(n_req) if i not in cases]

    def extras(hooked: bool) -> list[dict | None]:
        out: list[dict | None] = []
        for i in range(n_req):
            if i not in cases:
                out.append(None)
                continue
            _, e, (layer, point) = cases[i]
            e = dict(e)
            if hooked:
                e["apply_hooks"] = [Hook(noop, [layer], point=point)]
            out.append(e)
        return out

    gen(extras(False), 4)  # warm-up of both batch shapes
    gen(extras(True), 4)
    s0 = status()
    t = time.time()
    gouts = gen(extras(False))
    tg = time.time() - t
    s1 = status()
    t = time.time()
    pouts = gen(extras(True))
    tp = time.time() - t
    s2 = status()
    alone = llm.generate(
        [prompts[i] for i in plain], SamplingParams(max_tokens=NEW, temperature=0, ignore_eos=True), use_tqdm=False
    )
    base = {i: list(pre[i].outputs[0].token_ids) for i in range(n_req)}  # no ops / actions (capture only)

    def steps(a: dict, b: dict) -> dict:
        keys = ("graph_steps", "python_steps", "seam_steps", "graphless_steps")
        return {k: b.get(k, 0) - a.get(k, 0) for k in keys}

    res: dict[str, Any] = {
        "startup_s": round(startup, 1),
        "graph_s": round(tg, 3),
        "python_s": round(tp, 3),
        "graph_run_steps": steps(s0, s1),
        "python_run_steps": steps(s1, s2),
        "items": {},
    }

    def acts(o: Any) -> dict[str, torch.Tensor]:
        a = dict(o.activations or {})
        out = {}
        for k, v in a.items():
            if isinstance(v, torch.Tensor):
                out[k] = v
        return out

    for i, (name, _, _) in cases.items():
        a, p = gouts[i], pouts[i]
        ta, tp_ = list(a.outputs[0].token_ids), list(p.outputs[0].token_ids)
        item: dict[str, Any] = {"tokens_equal": ta == tp_, "n_tokens": [len(ta), len(tp_)]}
        worst = 0.0
        for k, x in acts(a).items():
            y = acts(p).get(k)
            if y is None or x.shape != y.shape:
                item[f"{k}_shape"] = [list(x.shape), None if y is None else list(y.shape)]
                worst = float("inf")
                continue
            r, m = rel(x, y)
            item[f"{k}_rel"], item[f"{k}_max_abs"] = round(r, 6), round(m, 5)
            worst = max(worst, r)
        ok = item["tokens_equal"] and worst < REL_TOL
        if name == "ablate_every_layer":  # what stays of the direction at the captured layers
            x = a.activations["residual_stream"].float()
            u = dirs[[mid, n_layers - 1]] / dirs[[mid, n_layers - 1]].norm(dim=-1, keepdim=True)
            left = (x * u[:, None, :]).sum(-1).abs().max()
            item["ablated_component_max"] = round(float(left), 5)
            item["resid_norm_mean"] = round(float(x.norm(dim=-1).mean()), 3)
            ok = ok and float(left) < 0.02 * float(x.norm(dim=-1).mean())
        if name == "cap_one_layer":
            pr = a.activations["residual_stream"][0].float() @ dcap
            item["cap_range"] = [round(lo, 4), round(hi, 4)]
            item["proj_after"] = [round(float(pr.min()), 4), round(float(pr.max()), 4)]
            tol = 0.02 * max(abs(lo), abs(hi), 1e-3)
            ok = ok and float(pr.min()) >= lo - tol and float(pr.max()) <= hi + tol
        if name == "set_3d_positions":
            x = a.activations["residual_stream"][0, 2:8].float()
            r, m = rel(x, vset[0])
            item["set_rows_vs_vector_rel"] = round(r, 6)
            ok = ok and r < REL_TOL
        if name == "add_phase_generated":
            item["prompt_tokens_unchanged_first_token_equal"] = ta[0] == base[i][0]
        if name == "probe_scores":  # (residual_stream: layers lp - 1, lp, lp + 1)
            probes_here = {"p1": (w, b, lp), **extra_probes}
            for tag, o in (("graph", a), ("python", p)):
                for pname, (pw, pb, layer) in probes_here.items():
                    key = tag if pname == "p1" else f"{tag}_{pname}"
                    sc = o.activations["probe_scores"][pname].float()
                    x = o.activations["residual_stream"][layer - (lp - 1)].float()
                    r, m = rel(sc, x @ pw.T.float() + pb.float())
                    item[f"{key}_vs_torch_rel"], item[f"{key}_vs_torch_max_abs"] = round(r, 6), round(m, 5)
                    item[f"{key}_scores_shape"] = list(sc.shape)
                    ok = ok and r < REL_TOL and sc.shape[0] == PROMPT + len(list(o.outputs[0].token_ids)) - 1
            for pname in probes_here:
                key = "scores" if pname == "p1" else f"scores_{pname}"
                r, m = rel(a.activations["probe_scores"][pname], p.activations["probe_scores"][pname])
                item[f"{key}_graph_vs_python_rel"], item[f"{key}_graph_vs_python_max_abs"] = round(r, 6), round(m, 5)
                ok = ok and r < REL_TOL
        if name in ("action_stop", "action_steer"):
            pos = pos_stop if name == "action_stop" else pos_steer
            k = pos - (PROMPT - 1)
            oa = a.activations.get("probe_actions")
            op = p.activations.get("probe_actions")
            item["expected_position"], item["expected_token_index"] = pos, k
            thr = thr_stop if name == "action_stop" else thr_steer
            pre_s = s5 if name == "action_stop" else s6
            item["threshold"] = thr
            item["prelim_scores_watched"] = [round(float(v), 5) for v in pre_s[PROMPT - 1 : pos + 2]]
            # the same run's own scores (output_probe_scores beside the action): where they first exceed
            own = a.activations["probe_scores"]["p1"][:, 0].float().numpy()
            item["own_scores_watched"] = [round(float(v), 5) for v in own[PROMPT - 1 : pos + 2]]
            over = np.nonzero(own[PROMPT - 1 :] > thr)[0]
            item["own_first_crossing"] = int(over[0]) + PROMPT - 1 if len(over) else -1
            item["outcome_graph"], item["outcome_python"] = oa, op
            fired = [bool(o and o[0].get("fired")) for o in (oa, op)]
            # both paths fire at the same position, where the run's own scores first exceed the threshold
            same = bool(oa and op and oa[0].get("position") == op[0].get("position") == item["own_first_crossing"])
            item["fired_as_predicted_by_prelim"] = bool(oa and oa[0].get("position") == pos)
            if oa and oa[0].get("position", -1) >= PROMPT - 1:
                k = int(oa[0]["position"]) - (PROMPT - 1)
            item["finish"] = [(o.outputs[0].finish_reason, str(o.outputs[0].stop_reason)) for o in (a, p)]
            ok = ok and all(fired) and same
            if name == "action_stop":
                # k + 1 generated tokens, k + 2 with asynchronous scheduling
                ok = ok and all(len(x) in (k + 1, k + 2) for x in (ta, tp_))
                ok = ok and all(o.outputs[0].stop_reason == "probe:p1" for o in (a, p))
                ok = ok and ta[: k + 1] == base[i][: k + 1]
            else:
                item["before_fire_equal_plain"] = ta[: k + 1] == base[i][: k + 1]
                item["after_fire_differs_from_plain"] = ta[k + 1 :] != base[i][k + 1 :]
                ok = ok and item["before_fire_equal_plain"] and len(ta) == NEW
        if name == "mlp_post_steer":
            item["mlp_post_width"] = list(a.activations["mlp_post"].shape)
            ok = ok and a.activations["mlp_post"].shape[-1] == d_mlp
        if name == "mlp_post_whole_row":  # the cap's projection in range on the row the capture saw
            pr = a.activations["mlp_post"][0].float() @ umlp[1]
            item["cap_proj_after"] = [round(float(pr.min()), 4), round(float(pr.max()), 4)]
            tol = 0.02 * float(a.activations["mlp_post"][0].float().norm(dim=-1).mean())
            ok = ok and a.activations["mlp_post"].shape[-1] == d_mlp and float(pr.abs().max()) <= 0.05 + tol
        if name == "mlp_in_op_chain":  # prompt rows: the direction gone; generated rows: + 0.5 vgen after it
            x = a.activations["mlp_in"][0].float()
            left = (x[: PROMPT - 1] @ uin[0]).abs().max()
            item["ablated_component_max_prompt"] = round(float(left), 5)
            ok = ok and float(left) < 0.02 * float(x.norm(dim=-1).mean())
        if name == "mlp_post_set_prompt":  # prompt rows are the vector; generated rows are not
            x = a.activations["mlp_post"][0].float()
            r, m = rel(x[: PROMPT - 1], vpost.expand(PROMPT - 1, -1))
            item["set_rows_vs_vector_rel"] = round(r, 6)
            item["generated_rows_differ"] = bool(rel(x[PROMPT:], vpost.expand(x.shape[0] - PROMPT, -1))[0] > 0.5)
            ok = ok and r < REL_TOL and item["generated_rows_differ"]
        if name == "mlp_in_mlp_post_capture":
            item["shapes"] = {k: list(v.shape) for k, v in acts(a).items()}
            ok = ok and a.activations["mlp_post"].shape[-1] == d_mlp and a.activations["mlp_in"].shape[-1] == d
        item["pass"] = bool(ok)
        res["items"][name] = item
        nums = {k: v for k, v in item.items() if k not in ("pass", "outcome_graph", "outcome_python")}
        print(f"{'PASS' if ok else 'FAIL'} {name} {json.dumps(nums, default=str)}", flush=True)
    mates = [list(gouts[i].outputs[0].token_ids) == list(o.outputs[0].token_ids) for i, o in zip(plain, alone)]
    res["items"]["plain_mates_equal_alone"] = {"pass": all(mates), "per_request": mates}
    print(f"{'PASS' if all(mates) else 'FAIL'} plain_mates_equal_alone {mates}", flush=True)
    paths_ok = res["graph_run_steps"]["python_steps"] == 0 and res["python_run_steps"]["python_steps"] > 0
    res["items"]["paths_taken"] = {"pass": paths_ok, "graph": res["graph_run_steps"], "python": res["python_run_steps"]}
    print(
        f"{'PASS' if paths_ok else 'FAIL'} paths_taken graph={res['graph_run_steps']} python={res['python_run_steps']}"
    )
    res["all_pass"] = all(v["pass"] for v in res["items"].values())
    print("CHECK " + json.dumps(res, default=str), flush=True)


if __name__ == "__main__":
    main()
