"""The graph-safe path (device buffers + one kernel per layer, what runs inside CUDA graphs) against the
Python path (per-request work in the taps), on the same engine: same numbers, whichever path a step
takes. A no-op Python hook moves a request's steps to the Python path."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch
from vllm import SamplingParams

from vllm_worker import Hook, SteeringVector
from vllm_worker.counters import STEP_TIMINGS
from vllm_worker.worker import graph

D = 128
PROMPTS = [
    "the water of people will come down to the side of the first",
    "a long thing to see him",
    "they said the first people could",
]


def _noop(ctx, h):
    return None


def _vec(seed: int, shape) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * 3


def _run_paths(llama, extras: list, hook: bool, counter: str, **sampling):
    """The batch greedily (`hook`: each request also carries a no-op hook, which moves its steps to the
    Python path); returns the outputs and how much `STEP_TIMINGS[counter]` grew."""
    sps = []
    for e in extras:
        e = dict(e or {})
        if hook:
            e["apply_hooks"] = [Hook(_noop, [3])]
        sps.append(SamplingParams(temperature=0, ignore_eos=True, extra_args=e or None, **sampling))
    before = STEP_TIMINGS[counter]
    outs = llama.generate(PROMPTS, sps, use_tqdm=False)
    return outs, STEP_TIMINGS[counter] - before


def test_graph_and_python_paths_give_the_same_numbers(llama):
    """Several vectors at one layer (2-D plain + 3-D norm-matched at positions), norm-matched 2-D at
    another, captures at steered and unsteered layers, a capture-only and a plain batch-mate."""
    steer = [
        SteeringVector(_vec(1, (1, D)), [1], scale=1.5),
        SteeringVector(_vec(2, (1, 2, D)), [1], scale=0.5, norm_match=True, position_indices=[1, 3]),
        SteeringVector(_vec(3, (2, D)), [2, 0], scale=0.3, norm_match=True),
    ]
    extras = [
        {"apply_steering_vectors": steer, "output_residual_stream": [0, 1, 2, 3]},
        {"output_residual_stream": [3]},
        None,
    ]

    fast, fast_steps = _run_paths(llama, extras, False, "graph_steps", max_tokens=6, logprobs=2)
    slow, slow_steps = _run_paths(llama, extras, True, "graph_steps", max_tokens=6, logprobs=2)
    assert fast_steps >= 6 and slow_steps == 0  # each run took the path it was meant to
    for a, b in zip(fast, slow):
        assert list(a.outputs[0].token_ids) == list(b.outputs[0].token_ids)
        for la, lb in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            assert la.keys() == lb.keys()
            assert max(abs(la[k].logprob - lb[k].logprob) for k in la) <= 1e-4
        if a.activations is not None:
            x, y = a.activations["residual_stream"], b.activations["residual_stream"]
            assert x.shape == y.shape and (x - y).abs().max() <= 1e-4 * max(1.0, y.abs().max().item())
    # the steering did something (position 1 and 3 at layer 1 differ from a plain run)
    plain = llama.generate(
        [PROMPTS[0]],
        SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, extra_args={"output_residual_stream": [1]}),
        use_tqdm=False,
    )[0]
    assert (fast[0].activations["residual_stream"][1] - plain.activations["residual_stream"][0]).abs().max() > 0.5


def test_decode_steps_that_reuse_their_table_equal_the_python_path(llama):
    """Without position-indexed vectors a batch's table is the same every decode step: it stays on the
    device and only the ring's base moves (`GraphTaps.reuse`). Captures and steering of those steps equal
    the Python path's, request by request, with a plain batch-mate."""
    steer = [SteeringVector(_vec(5, (1, D)), [1], scale=1.5), SteeringVector(_vec(6, (2, D)), [2, 0], norm_match=True)]
    extras = [
        {"apply_steering_vectors": steer, "output_residual_stream": [0, 1, 2, 3]},
        {"output_residual_stream": [1, 3]},
        None,
    ]

    fast, reused = _run_paths(llama, extras, False, "reused_tables", max_tokens=8)
    slow, reused_slow = _run_paths(llama, extras, True, "reused_tables", max_tokens=8)
    assert reused >= 5 and reused_slow == 0
    for a, b in zip(fast, slow):
        assert list(a.outputs[0].token_ids) == list(b.outputs[0].token_ids)
        if a.activations is not None:
            x, y = a.activations["residual_stream"], b.activations["residual_stream"]
            assert x.shape == y.shape and x.shape[1] == len(a.prompt_token_ids) + 7
            assert (x - y).abs().max() <= 1e-4 * max(1.0, y.abs().max().item())


def _double(ctx, h):
    ctx.saved["calls"] = ctx.saved.get("calls", 0) + 1
    return h * 2


def _batched_norm(ctx, h):
    for rid, s, e in ctx.rows:
        ctx.saved[rid].setdefault("norms", []).append(h[s:e].norm(dim=-1))
    return None


def test_hooks_on_the_graph_path_equal_the_python_path(llama, monkeypatch):
    """Steps whose only Python is hooks keep capture and steering on the graph-safe kernel and run the hooks
    at their sites after it (`worker.seams`; on GPU inside cut full graphs): same tokens, logprobs,
    captures and hook results as the all-Python path (`VLLM_LENS_SEAMS=0`), with captured, steered and
    plain batch-mates. A request hooking and capturing at the same site keeps the Python path's order
    (steer, hook, capture), so such a batch runs on the Python path."""
    v = _vec(4, (1, D))
    extras = [
        {"apply_hooks": [Hook(_double, [1])], "output_residual_stream": [0, 2, 3]},  # capture after the edit
        {
            "apply_steering_vectors": [SteeringVector(v, [2], scale=0.5, norm_match=True)],
            "output_residual_stream": [1, 3],
        },
        {"apply_hooks": [Hook(_batched_norm, [2], batched=True)]},
        None,
        {"apply_hooks": [Hook(_batched_norm, [2], batched=True)], "output_residual_stream": [3]},
    ]
    prompts = PROMPTS + PROMPTS[:2]

    def run(seams_on: bool, ex=extras):
        monkeypatch.setenv("VLLM_LENS_SEAMS", "1" if seams_on else "0")
        sps = [SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logprobs=2, extra_args=e) for e in ex]
        before = dict(STEP_TIMINGS)
        outs = llama.generate(prompts[: len(ex)], sps, use_tqdm=False)
        return outs, {k: STEP_TIMINGS[k] - before[k] for k in ("graph_steps", "seam_steps", "python_steps")}

    seam, seam_steps = run(True)
    python, python_steps = run(False)
    assert seam_steps["seam_steps"] >= 6 and seam_steps["python_steps"] == 0
    assert python_steps["graph_steps"] == 0 and python_steps["python_steps"] >= 6
    for a, b in zip(seam, python):
        assert list(a.outputs[0].token_ids) == list(b.outputs[0].token_ids)
        for la, lb in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            assert la.keys() == lb.keys() and max(abs(la[k].logprob - lb[k].logprob) for k in la) <= 1e-4
        if a.activations is not None:
            x, y = a.activations["residual_stream"], b.activations["residual_stream"]
            assert x.shape == y.shape and (x - y).abs().max() <= 1e-4 * max(1.0, y.abs().max().item())
    assert seam[0].hook_results["0"]["calls"] == python[0].hook_results["0"]["calls"] >= 6
    for i in (2, 4):
        x, y = seam[i].hook_results["0"]["norms"], python[i].hook_results["0"]["norms"]
        assert len(x) == len(y) >= 6 and all(torch.allclose(p, q, rtol=1e-4) for p, q in zip(x, y))
    # the edit reached what the same request captured after it (layer 2), and only that request
    n = len(seam[0].prompt_token_ids)
    alone = llama.generate(
        PROMPTS[:2], SamplingParams(max_tokens=1, extra_args={"output_residual_stream": [1, 2]}), use_tqdm=False
    )
    assert (
        seam[0].activations["residual_stream"][1, :n] - alone[0].activations["residual_stream"][1, :n]
    ).abs().max() > 1e-2

    # hook and capture at the same site of one request: the Python path, where the capture sees the edit
    mixed, steps = run(True, [{"apply_hooks": [Hook(_double, [1])], "output_residual_stream": [1]}, None])
    assert steps["seam_steps"] == 0 and steps["python_steps"] >= 6
    got, want = mixed[0].activations["residual_stream"][0, :n], 2 * alone[0].activations["residual_stream"][0, :n]
    assert (got - want).abs().max() <= 1e-4 * want.abs().max()


def _graph_taps(monkeypatch, steer_mb: float = 1.0) -> graph.GraphTaps:
    monkeypatch.setenv("VLLM_LENS_STEER_MB", repr(steer_mb))
    return graph.GraphTaps([0, 1, 2], 8, torch.float32, torch.device("cpu"), 16, None)


def test_full_entry_table_sends_the_request_to_the_python_path(monkeypatch):
    from vllm_worker.worker.plan import DeviceSteer

    g = _graph_taps(monkeypatch, steer_mb=3 * 2 * 8 * 4 / (1 << 20))  # room for 3 entries
    two_d = DeviceSteer({0: 0, 1: 1}, torch.ones(2, 8), None, 1.0, False)
    got = graph.request_entries(g, [two_d])
    assert got is not None and len(got[1]) == 2 and set(got[0]) == {0, 1}
    three_d = DeviceSteer({2: 0}, torch.ones(1, 2, 8), None, 1.0, True, positions=[4, 5])
    assert graph.request_entries(g, [three_d]) is None  # 2 more entries do not fit: refused, nothing taken
    g.free_entries(got[1])
    again = graph.request_entries(g, [three_d])
    assert again is not None and again[0][2][0] == -1 and list(again[0][2][1]) == [4, 5]
    # entries reach the device table at the next flush (one copy for a step's new requests), not before
    ents = list(again[0][2][2])
    assert not g.A[ents].any() and not g.B[ents].any()
    g.flush_entries()
    assert not g.A[ents].any() and (g.B[ents] == 1 / 8**0.5).all() and g.bflag[ents].tolist() == [1, 1]


def test_ring_never_hands_out_rows_still_in_use(monkeypatch):
    g = _graph_taps(monkeypatch)
    assert g.ring_alloc(g.stage_rows + 1) is None
    a = g.ring_alloc(g.stage_rows - 4)
    b = g.ring_alloc(8)  # does not fit after a: starts over at 0
    assert a == 0 and b == 0


def test_steps_that_copy_nothing_out_keep_the_ring_and_its_base(monkeypatch):
    """Rows read only on the device, in the stream's order (probe scores, SAE features, action rows), may be
    taken again by the next step: the ring stays and so does the base (no device write a step); a step whose
    rows are copied out moves it, and the next step never takes rows of a copy still pending."""
    g = _graph_taps(monkeypatch)
    a = g.ring_alloc(4)  # captures: copied out after the step
    b = g.ring_alloc(4, copied=False)
    c = g.ring_alloc(4, copied=False)
    assert (a, b, c) == (0, 4, 4)
    g.set_base(b)
    filled = g.table.base.clone()
    g.table.base.fill_(-7)  # (a write of the base by the step before would show here)
    g.set_base(c)
    assert int(g.table.base) == -7 and int(filled) == 4
    assert g.ring_alloc(4) == 4 and g.ring_alloc(4, copied=False) == 8


def test_a_step_resets_what_the_step_before_used_and_touches_no_other_column(monkeypatch):
    """The table is column-major and a step uploads only its own columns and the last step's: a row
    the last step pointed somewhere must never point there in the next (another request may sit in it)."""
    g = _graph_taps(monkeypatch)
    ctl = g.host_ctl(6, frozenset({1}))
    ctl[1, :6, 0] = range(6)  # step 1: column 1 captures 6 rows
    g.upload(6, frozenset({1}))
    assert g.ctl[1, :6, 0].tolist() == list(range(6)) and bool((g.ctl[[0, 2]] == -1).all())
    ctl = g.host_ctl(2, frozenset({2}))  # step 2: 2 rows steer at column 2
    assert g.table.fill_cols == [1, 2]  # column 1 is reset, column 0 is never touched
    ctl[2, :2, 1] = 7
    g.upload(2, frozenset({2}))
    assert bool((g.ctl[1] == -1).all()) and g.ctl[2, :2, 1].tolist() == [7, 7] and bool((g.ctl[2, 2:] == -1).all())
    g.clear()  # a step off this path: nothing may still point anywhere
    assert bool((g.ctl == -1).all()) and g.table.dirty_cols == frozenset()


def test_steps_over_changing_columns_leave_exactly_each_steps_table(monkeypatch):
    """Steps that use several columns upload them as one block scattered on the device: after any sequence
    of steps (columns and row counts changing), the device table is the step's own table and -1 elsewhere."""
    rng = np.random.default_rng(0)
    g = graph.GraphTaps([0, 1, 2, 3, 4], 8, torch.float32, torch.device("cpu"), 16, None)
    for step in range(60):
        n = int(rng.integers(1, 17))
        live = frozenset(int(c) for c in rng.choice(5, size=int(rng.integers(0, 6)), replace=False))
        ctl = g.host_ctl(n, live)
        want = np.full((5, 16, 2), -1, dtype=np.int32)
        for c in live:
            rows = rng.choice(n, size=int(rng.integers(1, n + 1)), replace=False)
            vals = rng.integers(0, 100, size=(len(rows), 2)).astype(np.int32)
            ctl[c, rows] = vals
            want[c, rows] = vals
        g.upload(n, live)
        assert np.array_equal(g.ctl.numpy(), want), f"step {step}: columns {sorted(live)}, {n} rows"


def test_a_steady_plan_reuses_its_table_and_only_the_base_moves(monkeypatch):
    """A decode step of an unchanged batch uploads nothing: the table already on the device serves it, with
    captures landing at the step's ring base. Any other table in between (another plan, a step off this
    path) makes the next step upload again."""
    g = graph.GraphTaps([0, 1, 2], 8, torch.float32, torch.device("cpu"), 16, None)
    plan_a, plan_b = object(), object()
    assert not g.reuse(plan_a)  # nothing uploaded yet
    ctl = g.host_ctl(4, frozenset({1}))
    ctl[1, :4, 0] = range(4)
    g.upload(4, frozenset({1}), plan_a)
    h = torch.arange(32, dtype=torch.float32).view(4, 8)
    for base in (0, 5, 9):
        assert g.reuse(plan_a) and g.active and g.fired == 0 and g.live_cols == frozenset({1})
        g.set_base(base)
        g.stage.zero_()
        g.apply(h.clone(), None, 1)
        assert torch.equal(g.stage[base : base + 4], h) and float(g.stage.abs().sum()) == float(h.abs().sum())
    assert not g.reuse(plan_b)
    ctl = g.host_ctl(2, frozenset({2}))
    ctl[2, :2, 0] = range(2)
    g.upload(2, frozenset({2}))  # a table of no plan (positions-dependent): never reused
    assert not g.reuse(plan_a) and not g.reuse(None)
    ctl = g.host_ctl(4, frozenset({1}))
    ctl[1, :4, 0] = range(4)
    g.upload(4, frozenset({1}), plan_a)
    g.clear()
    assert not g.reuse(plan_a) and bool((g.ctl == -1).all())


@pytest.mark.skipif(__import__("importlib").util.find_spec("triton") is None, reason="triton not installed")
def test_triton_kernel_matches_the_torch_semantics():
    """The CUDA kernel, run by Triton's interpreter on CPU tensors, against the torch implementation
    used on CPU: capture slots, plain and norm-matched entries, rows with nothing to do, no residual."""
    code = textwrap.dedent("""
        import torch
        from vllm_worker.worker import graph, graph_kernels
        g = graph.GraphTaps([0, 1], 96, torch.float32, torch.device("cpu"), 16, None)
        torch.manual_seed(0)
        g.A[:5] = torch.randn(5, 96); g.B[:5] = torch.randn(5, 96); g.bflag[:5] = torch.tensor([0, 1, 0, 1, 0])
        g.ctl[1, 1] = torch.tensor([3, 1]); g.ctl[1, 2] = torch.tensor([-1, 2]); g.ctl[1, 4] = torch.tensor([7, -1])
        g.ctl[0, 5] = torch.tensor([9, 3]); g.active = True; g.live_cols = frozenset({0, 1})
        g.set_base(2)  # slots count from the step's base
        kernel = graph_kernels.make_tap_kernel()
        worst = 0.0
        for has_r in (True, False):
            h = torch.randn(7, 96); r = torch.randn(7, 96) if has_r else None
            h1 = h.clone(); g.stage.zero_(); g._kernel = None
            g.apply(h1, r, 1); g.apply(h1, r, 0); s1 = g.stage[:12].clone()
            assert s1[:2].abs().sum() == 0 and s1[11].abs().sum() > 0  # rows 3, 7, 9 land at 5, 9, 11
            h2 = h.clone(); g.stage.zero_(); g._kernel = kernel
            g.apply(h2, r, 1); g.apply(h2, r, 0); s2 = g.stage[:12].clone()
            assert (h1 - h).abs().max() > 1 and s1.abs().sum() > 1
            worst = max(worst, (h1 - h2).abs().max().item(), (s1 - s2).abs().max().item())
        print("WORST", worst)
    """)
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    line = [l for l in proc.stdout.splitlines() if l.startswith("WORST")]
    assert line, proc.stderr[-3000:]
    assert float(line[0].split()[1]) <= 1e-4


def test_identical_steering_is_one_refcounted_chain(monkeypatch):
    """Requests with the same content (vector bytes, op, scale, range) hold the same entries; each gives
    its use back, the entries go back to the free list with the last user, and content queued but never
    copied (a failed flush) is never found by a later request. Probe actions' gated entries are never
    shared (their gate is per request)."""
    from vllm_worker.protocol.ops import ABLATE
    from vllm_worker.worker.plan import DeviceSteer

    g = _graph_taps(monkeypatch)
    v = torch.nn.functional.normalize(torch.randn(2, 8), dim=-1)

    def ablate(t: torch.Tensor) -> DeviceSteer:
        return DeviceSteer({0: 0, 1: 1}, t.clone(), None, 1.0, False, op=ABLATE)

    a = graph.request_entries(g, [ablate(v)])
    b = graph.request_entries(g, [ablate(v)])
    c = graph.request_entries(g, [ablate(v.flip(0))])  # the same rows at other sites: other content
    assert a is not None and b is not None and c is not None
    assert a[0][0][0] == b[0][0][0] and a[0][1][0] == b[0][1][0] and g.entries.in_use() == 4
    g.flush_entries()
    g.free_entries(a[1])
    assert g.entries.in_use() == 4 and torch.equal(g.A[b[0][0][0]], v[0])  # b still holds it, unchanged
    g.free_entries(b[1])
    g.free_entries(c[1])
    assert g.entries.in_use() == 0 and g.entries.shared_chains() == 0
    plain = DeviceSteer({2: 0}, torch.ones(1, 8), None, 2.0, False)
    x = graph.request_entries(g, [plain], gated=True)
    y = graph.request_entries(g, [plain], gated=True)
    assert x is not None and y is not None and set(x[1]).isdisjoint(y[1])
    g.free_entries(x[1] + y[1])
    d = graph.request_entries(g, [ablate(v)])
    assert d is not None
    g.drop_new_entries()  # its flush failed: the request is failed and frees its entries
    g.free_entries(d[1])
    e = graph.request_entries(g, [ablate(v)])
    assert e is not None and set(e[1]) == set(g.entries._new)  # stored anew, to be copied at the next flush
    g.flush_entries()
    assert torch.equal(g.A[e[0][0][0]], v[0]) and g.entries.in_use() == 2


def test_phase_rows_choose_their_entry_together_and_settle_once_generated():
    """Entries chosen by phase (prompt / generated) are picked for all rows at once from the step's
    positions; once every such row is generated the plan's table no longer changes (`steady`: reused)."""
    from vllm_worker.worker.plan import RequestState, graph_plan

    def req(default: int, gen: int, split: int) -> RequestState:
        r = RequestState([], {}, 0, [], [], None)
        r.entries = {0: (default, np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int32), gen, split)}
        return r

    a, b = req(3, 4, 5), req(-1, 7, 2)  # b: generated phase only (its prompt rows take no entry)
    gp = graph_plan([(a, 0, 6), (b, 6, 7)], {}, 7, {0: 1})
    ctl = np.full((2, 8, 2), -1, dtype=np.int32)
    gp.fill(ctl, np.array([0, 1, 2, 3, 4, 5, 9]))  # a's prefill crosses its split at position 5
    assert ctl[1, :7, 1].tolist() == [3, 3, 3, 3, 3, 4, 7] and gp.live_cols == frozenset({1}) and not gp.steady
    gp = graph_plan([(a, 0, 1), (b, 1, 2)], {}, 2, {0: 1})
    ctl = np.full((2, 8, 2), -1, dtype=np.int32)
    gp.fill(ctl, np.array([4, 1]))
    assert ctl[1, :2, 1].tolist() == [3, -1] and not gp.steady
    gp.fill(ctl, np.array([6, 2]))
    assert ctl[1, :2, 1].tolist() == [4, 7] and gp.steady


def test_fixed_entries_of_many_requests_and_layers_are_planned_in_one_go():
    """The plan's fixed entries (every row of a request at a column takes one entry) are laid out without
    a Python loop per (request, layer): the same rows, columns and entries, in request then column order,
    as the plain expansion; a request's entries changing (failed: none left) are seen by the next plan."""
    from vllm_worker.worker.plan import RequestState, graph_plan

    reqs = []
    for i in range(5):
        r = RequestState([], {}, 0, [], [], None)
        r.entries = {
            l: (10 * i + l, np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int32), -1, -1) for l in range(4)
        }
        reqs.append(r)
    active = [(r, 3 * i, 3 * i + 1 + i % 3) for i, r in enumerate(reqs)]
    col = {l: 3 - l for l in range(4)}
    gp = graph_plan(active, {}, 15, col)
    want = [(row, col[l], 10 * i + l) for i, (_, s, e) in enumerate(active) for l in range(4) for row in range(s, e)]
    assert list(zip(gp.st_rows.tolist(), gp.st_cols.tolist(), gp.st_ents.tolist())) == want
    assert gp.st_ents.dtype == np.int32 and gp.steady
    reqs[1].entries = {}
    gp = graph_plan(active, {}, 15, col)
    assert not any(3 <= row < 5 for row in gp.st_rows.tolist())
