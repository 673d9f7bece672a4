"""Early assembly (`VLLM_LENS_EARLY_ASSEMBLY`, `vllm_worker/transport/early.py`): captures are copied into
their result-pool regions by a worker thread while generation runs. W2-sized captures (every layer, long
prompts, a small pool limit) come back exactly as the fetch-time path assembles them (and as HF computes
them), the background path really ran, requests that stop early get the right layout, and a request
aborted mid-generation gives its region back."""

from __future__ import annotations

import os
import time

import pytest
import torch
from vllm import SamplingParams

from support.reference import held_results, hf_model, residuals

WORDS = "the water of people will come down to the side and then a house of stone stood by the old road".split()


@pytest.fixture(autouse=True)
def _lock_order_checked(monkeypatch):
    """Every test here runs with the capture path's lock order asserted (store -> early -> pool)."""
    from vllm_worker.transport import lock_order

    monkeypatch.setattr(lock_order, "CHECK", True)


def _prompt(n_words: int, shift: int) -> str:
    return " ".join(WORDS[(i * 7 + shift) % len(WORDS)] for i in range(n_words))


def _n_layers(llm) -> int:
    return llm.llm_engine.model_config.get_total_num_hidden_layers()


def _long_capture(llm) -> SamplingParams:
    """Every layer for 150 tokens: a request still running after a few steps."""
    return SamplingParams(
        max_tokens=150,
        temperature=0,
        ignore_eos=True,
        extra_args={"output_residual_stream": list(range(_n_layers(llm)))},
    )


def _timings(llm) -> dict:
    return dict(llm.collective_rpc("lens_status")[0]["fetch_timings"])


def _run(llm, prompts: list[str], sps: list[SamplingParams]) -> list:
    return llm.generate(prompts, sps, use_tqdm=False)


def _batch(llm, stop_token: int | None = None) -> tuple[list[str], list[SamplingParams]]:
    """Six long prompts (~90-330 tokens) capturing every layer; the last one stops at `stop_token` (before
    its max_tokens: its result is smaller than the region it was given)."""
    L = _n_layers(llm)
    prompts = [_prompt(n, i) for i, n in enumerate((300, 90, 220, 160, 260, 120))]
    sps = [
        SamplingParams(
            max_tokens=m, temperature=0, ignore_eos=True, extra_args={"output_residual_stream": list(range(L))}
        )
        for m in (12, 30, 7, 20, 16, 24)
    ]
    if stop_token is not None:
        sps[-1] = SamplingParams(
            max_tokens=24,
            temperature=0,
            stop_token_ids=[stop_token],
            extra_args={"output_residual_stream": list(range(L))},
        )
    return prompts, sps


def _same(a: list, b: list) -> None:
    for x, y in zip(a, b, strict=True):
        assert list(x.outputs[0].token_ids) == list(y.outputs[0].token_ids)
        ax, ay = x.activations["residual_stream"], y.activations["residual_stream"]
        assert ax.shape == ay.shape and ax.dtype == ay.dtype
        assert torch.equal(ax, ay)  # byte for byte (float32: equal values are equal bytes, no NaN here)
        assert x.activations["layers"] == y.activations["layers"]


@pytest.mark.parametrize("pool_gb", [None, "0.002", "0.000001"])
def test_all_layer_long_prompt_captures_equal_the_fetch_time_path(llama, monkeypatch, pool_gb):
    """None: the pool's default limit (every request assembled early); 0.002 GB: the pool accepts the
    announcements of only a few requests at a time (the others are assembled at fetch); ~0: none."""
    base, _ = held_results(llama)
    # the stop token: the 3rd token the last request generates without a stop
    probe = _run(llama, *_batch(llama))
    stop = probe[-1].outputs[0].token_ids[2]
    prompts, sps = _batch(llama, stop_token=stop)
    if pool_gb is not None:
        monkeypatch.setenv("VLLM_LENS_SHM_POOL_GB", pool_gb)
    monkeypatch.setenv("VLLM_LENS_EARLY_ASSEMBLY", "0")
    before = _timings(llama)
    off = _run(llama, prompts, sps)
    mid = _timings(llama)
    assert mid["early_requests"] == before["early_requests"]  # the setting turns it off
    monkeypatch.setenv("VLLM_LENS_EARLY_ASSEMBLY", "1")
    on = _run(llama, prompts, sps)
    after = _timings(llama)
    _same(on, off)
    assert len(on[-1].outputs[0].token_ids) < 24  # it stopped early: its region was compacted
    early = after["early_requests"] - mid["early_requests"]
    if pool_gb is None:
        assert early == len(prompts) and after["early_bytes"] > mid["early_bytes"]
        assert after["early_compact_s"] > mid["early_compact_s"]
    elif pool_gb == "0.000001":
        assert early == 0
    else:  # the pool took the announcements of some (which ones depends on when regions were taken)
        assert 1 <= early <= len(prompts)
    # and the numbers are the model's: HF's residual stream at every position of two of them
    hf = hf_model("llama")
    for out in (on[0], on[-1]):
        ids = list(out.prompt_token_ids) + list(out.outputs[0].token_ids)
        acts = out.activations["residual_stream"]
        assert acts.shape[1] == len(ids) - 1
        ref, _ = residuals(hf, ids[:-1])
        assert (acts - ref).abs().max() <= 1e-4
    del on, off, probe, out, acts
    assert held_results(llama) == (base, 0)  # every region came back, nothing stays announced


def test_the_background_path_ran_while_generating(llama, monkeypatch):
    """The copies happen during generation: after the fetch most bytes were copied by the thread's
    batches, and the fetch's own copy (fetch-time assembly) did not run for these requests."""
    monkeypatch.setenv("VLLM_LENS_EARLY_ASSEMBLY", "1")
    prompts, sps = _batch(llama)
    before = _timings(llama)
    outs = _run(llama, prompts, sps)
    after = _timings(llama)
    assert after["early_requests"] - before["early_requests"] == len(prompts)
    assert after["early_batches"] > before["early_batches"]
    L, d = _n_layers(llama), outs[0].activations["residual_stream"].shape[-1]
    result_bytes = sum(L * o.activations["residual_stream"].shape[1] * d * 4 for o in outs)
    assert after["early_bytes"] - before["early_bytes"] >= result_bytes
    assert after["copy_s"] == before["copy_s"]  # nothing was assembled at fetch
    assert after["early_fallbacks"] == before["early_fallbacks"]


def test_an_aborted_request_gives_its_region_back(llama, monkeypatch):
    monkeypatch.setenv("VLLM_LENS_EARLY_ASSEMBLY", "1")
    held, _ = held_results(llama)
    before = _timings(llama)
    engine = llama.llm_engine
    sp = _long_capture(llama)
    engine.add_request("early-abort", _prompt(200, 3), sp)
    for _ in range(4):
        engine.step()
    deadline = time.monotonic() + 10
    while held_results(llama)[0] == held and time.monotonic() < deadline:  # its region, taken by the thread
        time.sleep(0.05)
    assert held_results(llama)[0] == held + 1
    engine.abort_request(["early-abort"])
    assert not engine.has_unfinished_requests()
    deadline = time.monotonic() + 10
    while held_results(llama) != (held, 0) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert held_results(llama) == (held, 0)
    after = _timings(llama)
    assert after["early_freed"] == before["early_freed"] + 1
    assert llama.collective_rpc("lens_status")[0]["stored_requests"] == 0
    # and the engine goes on: a new request's captures are complete
    out = _run(llama, [_prompt(50, 1)], [sp.clone()])[0]
    assert out.activations["residual_stream"].shape[1] == len(out.prompt_token_ids) + 149


def test_a_release_that_arrives_twice_never_frees_a_later_allocation():
    """The n samples of a request share one payload, so the regions it gives back are released once per
    sample; with early assembly a region may be taken again between the two (measured: two samples then
    shared one region). Releases carry the allocation's serial: the late duplicate is ignored."""
    from vllm_worker.transport.result_pool import ResultPool

    pool = ResultPool()
    try:
        path, off, _, _ = pool.alloc(4096)
        first = (path, off, pool.serial(path, off))
        assert pool.free([first]) == 1
        path2, off2, _, _ = pool.alloc(4096)
        assert (path2, off2) == (path, off)  # the same place, a later allocation
        assert pool.free([first]) == 0 and pool.status()["stale_releases"] == 1
        assert pool.status()["regions_in_use"] == 1
        assert pool.free([(path, off, pool.serial(path, off))]) == 1
        assert pool.free([(path, off)]) == 0  # an old-style entry of a free region: ignored as before
    finally:
        pool.close()


def _early_of(worker):
    return worker.model_runner._lens_runtime.store.early


@pytest.mark.parametrize("direct", [False, True], ids=["host", "direct"])
@pytest.mark.parametrize("when", ["first batch", "after regions were taken"])
def test_a_failing_early_assembly_thread_falls_back_to_the_fetch_time_path(llama, monkeypatch, when, direct):
    """Our background copy fails (injected at its first batch, or after some requests' regions were
    taken and half written): no request fails and none waits for the thread — every result is assembled at
    fetch from the arenas, exactly as with early assembly off; early assembly stays off for the worker
    (reset here for the other tests). Direct mode (`VLLM_LENS_DIRECT_POOL`): a direct region whose rows the
    thread never copied (a prefill chunk, a late member's rows) is completed from the arenas at fetch."""
    from vllm_worker.transport import early
    from vllm_worker.worker import faults

    prompts, sps = _batch(llama)
    monkeypatch.setenv("VLLM_LENS_EARLY_ASSEMBLY", "0")
    want = _run(llama, prompts, sps)
    monkeypatch.setenv("VLLM_LENS_EARLY_ASSEMBLY", "1")
    if direct:
        monkeypatch.setenv("VLLM_LENS_DIRECT_POOL", "1")
    before = _timings(llama)
    if direct:  # every region is made by the thread (none at a first step): its requests join the direct
        # members later, and the rows before the join are the thread's to copy — then the thread fails
        from vllm_worker.transport.result_pool import ResultPool

        monkeypatch.setattr(ResultPool, "alloc_now", lambda self, *a, **k: None)
        real, calls = early.EarlyAssembler._batch, []

        def regions_then_fail(self, items):
            calls.append(len(items))
            if when == "first batch" or len(calls) > 1:
                for arena in {id(a): a for a, *_ in items}.values():
                    self._regions(arena)
                raise RuntimeError("injected: the early-assembly thread fails after taking regions")
            return real(self, items)

        monkeypatch.setattr(early.EarlyAssembler, "_batch", regions_then_fail)
    elif when == "first batch":
        monkeypatch.setattr(faults, "STAGE", "early")
    else:
        real, calls = early.EarlyAssembler._batch, []

        def second_fails(self, items):
            calls.append(len(items))
            if len(calls) > 1:
                raise RuntimeError("injected: the early-assembly thread fails after its first batch")
            return real(self, items)

        monkeypatch.setattr(early.EarlyAssembler, "_batch", second_fails)
    try:
        got = _run(llama, prompts, sps)
        # (direct, after a good first batch: the joined requests' steps may all be written directly, leaving
        # the thread nothing more to fail at)
        assert llama.collective_rpc(lambda w: _early_of(w).broken) == [True] or (direct and when != "first batch")
    finally:
        monkeypatch.undo()
        llama.collective_rpc(lambda w: setattr(_early_of(w), "broken", False))
    after = _timings(llama)
    _same(got, want)
    if direct:  # (whether requests joined the direct members before the thread failed depends on timing)
        if when == "first batch":
            assert after["direct_joins"] == before["direct_joins"]  # no region was ever written directly
        return
    assert after["early_requests"] == before["early_requests"]  # none was served from a half-written region
    if when != "first batch":
        assert after["early_bytes"] > before["early_bytes"]  # the first batch did write into regions


def test_diagnostics_split_a_run_and_count_its_cpu(llama):
    """The benchmark's diagnostics (`lens_forward_clock`, `lens_rusage`) read real numbers: every forward of a
    run is on the clock with the step thread's CPU seconds, and the worker's CPU use and result pool grow."""
    t0 = time.monotonic()
    u0 = llama.collective_rpc("lens_rusage")[0]
    _run(llama, *_batch(llama))
    u1 = llama.collective_rpc("lens_rusage")[0]
    t1 = time.monotonic()
    mine = [c for c in llama.collective_rpc("lens_forward_clock")[0] if t0 <= c[0] and c[1] <= t1]
    assert len(mine) >= 30  # prefill chunks and the longest request's decode steps
    assert all(len(c) == 3 and c[0] <= c[1] for c in mine)
    cpus = [c[2] for c in mine]
    assert cpus == sorted(cpus) and cpus[-1] > cpus[0]  # the step thread computed between its first and last step
    assert u1["process"]["user_s"] + u1["process"]["sys_s"] > u0["process"]["user_s"] + u0["process"]["sys_s"]
    assert u1["step_thread"]["user_s"] >= u0["step_thread"]["user_s"]
    assert u1["pool"]["bytes"] > 0 and u1["pool"]["allocs"] > u0["pool"].get("allocs", 0)
    # re-plans (a batch composition changed) sit between forwards, each before the forward it planned
    replans = [r for r in llama.collective_rpc("lens_replan_clock")[0] if t0 <= r[0] <= t1]
    assert replans and all(dt > 0 and n >= 1 for _, dt, n in replans)
    starts = [c[0] for c in mine]
    assert all(any(s >= t + dt for s in starts) for t, dt, _ in replans)


def _direct_batch(llama) -> tuple[list[str], list[SamplingParams]]:
    """`_batch` whose last request stops early (its region is compacted at fetch)."""
    probe = _run(llama, *_batch(llama))
    return _batch(llama, stop_token=probe[-1].outputs[0].token_ids[2])


def _host_then_direct(llama, monkeypatch, prompts: list, sps: list) -> tuple[list, list, dict, dict]:
    """The batch with host copies, then with direct writes: (host results, direct results, the worker's
    timings before and after the direct run)."""
    monkeypatch.setenv("VLLM_LENS_DIRECT_POOL", "0")
    want = _run(llama, prompts, sps)
    monkeypatch.setenv("VLLM_LENS_DIRECT_POOL", "1")
    before = _timings(llama)
    got = _run(llama, prompts, sps)
    after = _timings(llama)
    _same(got, want)
    return want, got, before, after


def test_direct_writes_equal_host_copies(llama, monkeypatch):
    """`VLLM_LENS_DIRECT_POOL`: each graph-path step's rows are written straight into their requests' regions
    (on CPU by the step thread, at the element offsets the GPU's kernel gets) and the background thread only
    marks them: the results are byte for byte those of host copies, the host copied nothing, every row was
    written directly, and every region comes back."""
    monkeypatch.setenv("VLLM_LENS_EARLY_ASSEMBLY", "1")
    held, _ = held_results(llama)
    prompts, sps = _direct_batch(llama)  # (also grows the pool: direct regions are never waited for)
    want, got, before, after = _host_then_direct(llama, monkeypatch, prompts, sps)
    assert len(got[-1].outputs[0].token_ids) < 24  # stopped early: compacted in place
    assert after["direct_regions"] - before["direct_regions"] == len(prompts)
    assert after["early_requests"] - before["early_requests"] == len(prompts)
    assert after["direct_steps"] > before["direct_steps"]
    # the decode steps of the whole batch: every row went directly, none into host arenas
    assert after["direct_only_steps"] - before["direct_only_steps"] >= 6
    L = _n_layers(llama)
    rows = sum(L * o.activations["residual_stream"].shape[1] for o in got)
    assert after["direct_rows"] - before["direct_rows"] >= rows  # (a finished request's last row may be extra)
    assert after["early_bytes"] == before["early_bytes"]  # no host copy into a region
    assert after["copy_s"] == before["copy_s"] and after["early_fallbacks"] == before["early_fallbacks"]
    hf = hf_model("llama")
    out = got[-1]
    ids = list(out.prompt_token_ids) + list(out.outputs[0].token_ids)
    ref, _ = residuals(hf, ids[:-1])
    assert (out.activations["residual_stream"] - ref).abs().max() <= 1e-4
    del got, want, out
    assert held_results(llama) == (held, 0)


def test_direct_requests_without_a_region_at_their_first_step_join_later(llama, monkeypatch):
    """A request whose region cannot be taken at its arena's first step (no room the GPU can write: here
    `alloc_now` refuses every request) gets it from the thread, and joins the arena's direct members at a
    later step: the GPU writes its rows from then on, the steps after every request has joined need no host
    rows, and its rows before the join are copied on the host. Results equal host copies byte for byte."""
    from vllm_worker.transport import early
    from vllm_worker.transport.result_pool import ResultPool

    monkeypatch.setenv("VLLM_LENS_EARLY_ASSEMBLY", "1")
    refused, late = [0], [False]
    real_rows, real_regions = early.EarlyAssembler.direct_rows, early.EarlyAssembler._regions

    def alloc_now(self, *args, **kwargs):
        refused[0] += 1
        return None

    def direct_rows(self, arena, *args, **kwargs):  # (the step thread)
        if arena.members is not None and not late[0]:  # an arena's second step: the thread's regions come now
            made = self.dmade  # (regions the thread made for earlier tests count too)
            late[0] = True
            t = time.monotonic()
            while self.dmade == made and time.monotonic() - t < 10:
                time.sleep(0.001)
        return real_rows(self, arena, *args, **kwargs)

    def regions(self, arena):  # (the thread) no region before that step
        t = time.monotonic()
        while self.direct and not late[0] and time.monotonic() - t < 10:
            time.sleep(0.001)
        return real_regions(self, arena)

    monkeypatch.setattr(ResultPool, "alloc_now", alloc_now)
    monkeypatch.setattr(early.EarlyAssembler, "direct_rows", direct_rows)
    monkeypatch.setattr(early.EarlyAssembler, "_regions", regions)
    prompts, sps = _direct_batch(llama)
    want, got, before, after = _host_then_direct(llama, monkeypatch, prompts, sps)
    delta = {k: after[k] - before[k] for k in ("direct_regions", "direct_joins", "direct_only_steps", "early_bytes")}
    assert late[0] and refused[0] >= len(prompts) and delta["direct_regions"] == 0, delta
    assert delta["direct_joins"] >= 1 and delta["direct_only_steps"] >= 1 and delta["early_bytes"] > 0, delta


def _keep(ctx, h):
    ctx.saved["n"] = ctx.saved.get("n", 0) + h.shape[0]


def test_direct_mode_with_python_path_steps_and_an_abort(llama, monkeypatch):
    """A request that hooks the layer it captures makes its batch's steps run from Python, which writes no
    region directly: its batch-mates, whose first step ran from Python, are copied on the host as before and
    the results equal host copies (a direct region whose later steps run from Python: the unit test
    `test_direct_offsets_and_marks`). A direct request aborted mid-generation gives its region back."""
    from vllm_worker import Hook

    monkeypatch.setenv("VLLM_LENS_EARLY_ASSEMBLY", "1")
    held, _ = held_results(llama)
    prompts, sps = _direct_batch(llama)
    hooked = SamplingParams(
        max_tokens=3,
        temperature=0,
        ignore_eos=True,
        extra_args={"apply_hooks": [Hook(_keep, [1])], "output_residual_stream": [1]},
    )
    prompts, sps = [*prompts, _prompt(40, 5)], [*sps, hooked]
    want, got, before, after = _host_then_direct(llama, monkeypatch, prompts, sps)
    assert got[-1].hook_results == want[-1].hook_results
    assert after["direct_regions"] == before["direct_regions"]  # regions are taken at a graph-path step only
    assert 0 < after["early_bytes"] - before["early_bytes"]  # host copies
    assert after["early_requests"] - before["early_requests"] == len(prompts)
    del got, want
    # an aborted direct request
    engine = llama.llm_engine
    sp = _long_capture(llama)
    before = _timings(llama)
    engine.add_request("direct-abort", _prompt(200, 3), sp)
    for _ in range(4):
        engine.step()
    assert held_results(llama)[0] == held + 1  # taken in its first step, not by the thread
    assert _timings(llama)["direct_regions"] == before["direct_regions"] + 1
    engine.abort_request(["direct-abort"])
    deadline = time.monotonic() + 10
    while held_results(llama) != (held, 0) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert held_results(llama) == (held, 0)


def _direct_off_later(ctx, h):
    """A hook that turns direct writes off (CPU: read per step) at its 6th call, mid-decode."""
    import os

    ctx.saved["calls"] = ctx.saved.get("calls", 0) + 1
    if ctx.saved["calls"] == 6:
        os.environ["VLLM_LENS_DIRECT_POOL"] = "0"


def test_direct_writes_turned_off_mid_arena_fall_back_to_host_copies(llama, monkeypatch):
    """Direct writes go off while an arena is being written directly (a hook of a batch-mate turns the setting
    off mid-decode; on CUDA: a failed write): the arena's later steps get host rows again and its direct
    requests' rows are copied by the thread, so every result still equals host copies byte for byte."""
    monkeypatch.setenv("VLLM_LENS_EARLY_ASSEMBLY", "1")
    from vllm_worker import Hook

    prompts, sps = _direct_batch(llama)
    L = _n_layers(llama)
    hooked = SamplingParams(
        max_tokens=20,
        temperature=0,
        ignore_eos=True,
        extra_args={"apply_hooks": [Hook(_direct_off_later, [0])], "output_residual_stream": list(range(2, L))},
    )
    prompts, sps = [*prompts, _prompt(60, 2)], [*sps, hooked]
    _, got, before, after = _host_then_direct(llama, monkeypatch, prompts, sps)
    assert got[-1].hook_results["0"]["calls"] == 20 and os.environ["VLLM_LENS_DIRECT_POOL"] == "0"
    assert after["direct_only_steps"] > before["direct_only_steps"]  # written directly before the switch ...
    assert after["early_bytes"] > before["early_bytes"]  # ... and copied on the host after it
    assert after["early_fallbacks"] == before["early_fallbacks"]


def test_mlp_post_rows_interleave_on_every_path_and_equal_hf(llama, monkeypatch):
    """mlp_post's d_model-wide pieces are laid out with each position's pieces adjacent (`row_layout`), so the
    frontend hands the d_mlp rows out as a view: the same bytes with early assembly off (fetch-time), on
    (host copies) and with direct writes, beside a resid_post capture between two mlp_post layers, a request
    that stops early (its region compacted) among them — and HF's values at prompt and generated positions."""
    from support.reference import point_activations

    capture = {"mlp_post": [0, 2], "resid_post": [1]}
    prompts = [_prompt(n, i) for i, n in enumerate((120, 40, 90))]

    def params(stop: int | None) -> list[SamplingParams]:
        sps = [
            SamplingParams(max_tokens=m, temperature=0, ignore_eos=True, extra_args={"output_activations": capture})
            for m in (12, 20, 9)
        ]
        if stop is not None:
            sps[-1] = SamplingParams(
                max_tokens=20, temperature=0, stop_token_ids=[stop], extra_args={"output_activations": capture}
            )
        return sps

    stop = _run(llama, prompts, params(None))[-1].outputs[0].token_ids[2]
    sps = params(stop)
    runs, counts = [], []
    for early, direct in (("0", "0"), ("1", "0"), ("1", "1")):
        monkeypatch.setenv("VLLM_LENS_EARLY_ASSEMBLY", early)
        monkeypatch.setenv("VLLM_LENS_DIRECT_POOL", direct)
        before = _timings(llama)
        runs.append(_run(llama, prompts, sps))
        after = _timings(llama)
        counts.append({k: after[k] - before[k] for k in ("early_requests", "direct_rows", "early_compact_s")})
    assert counts[0]["early_requests"] == 0 and counts[1]["early_requests"] == len(prompts)  # each path ran
    assert counts[1]["direct_rows"] == 0 and counts[2]["direct_rows"] > 0
    assert counts[1]["early_compact_s"] > 0  # the request that stopped early: its region compacted
    assert len(runs[0][-1].outputs[0].token_ids) < 20  # it stopped early
    for got in runs[1:]:
        for x, y in zip(got, runs[0], strict=True):
            assert list(x.outputs[0].token_ids) == list(y.outputs[0].token_ids)
            for point in capture:
                assert torch.equal(x.activations[point], y.activations[point]), point
    hf = hf_model("llama")
    for out in (runs[2][0], runs[2][-1]):
        ids = list(out.prompt_token_ids) + list(out.outputs[0].token_ids)
        ref, _ = point_activations(hf, "llama", ids[:-1])
        post = out.activations["mlp_post"]
        assert post.shape == (2, len(ids) - 1, 256)
        assert post.untyped_storage().data_ptr() == out.activations["resid_post"].untyped_storage().data_ptr()
        for k, layer in enumerate(capture["mlp_post"]):
            assert (post[k] - ref["mlp_post"][layer]).abs().max() <= 1e-4
        assert (out.activations["resid_post"][0] - ref["resid_post"][1]).abs().max() <= 1e-4
