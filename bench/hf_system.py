"""The transformers-based systems (hf, nnsight, transformer-lens): the baselines that run without vLLM,
apart from worker.py's vLLM family. Their libraries are imported only when one of them is started."""

from __future__ import annotations

import os

from system_base import prompts


class HFSystem:
    """transformers generate with forward hooks: the batch is one padded tensor, hooks see all rows."""

    def __init__(self, kind: str, model: str, device: str, dtype: str) -> None:
        import torch
        from transformers import AutoModelForCausalLM

        self.kind, self.device = kind, device
        if os.environ.get("BENCH_LOAD_FORMAT") == "dummy":  # real shapes, random weights (no weights on disk)
            from transformers import AutoConfig

            torch.set_default_dtype(getattr(torch, dtype))
            with torch.device(device):
                self.model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model)).eval()
        else:
            self.model = (
                AutoModelForCausalLM.from_pretrained(model, torch_dtype=getattr(torch, dtype)).to(device).eval()
            )
        cfg = self.model.config
        self.n_layers, self.d = cfg.num_hidden_layers, cfg.hidden_size
        self.vec = (torch.randn(1, self.d, generator=torch.Generator().manual_seed(0)) * 2.0).to(
            device, self.model.dtype
        )
        self.batch = int(os.environ.get("BENCH_HF_BATCH", "64"))
        if kind == "nnsight":
            from nnsight import LanguageModel

            self.nn = LanguageModel(self.model, tokenizer=_tokenizer(model))
        if kind == "transformer-lens":
            from transformer_lens.model_bridge import TransformerBridge

            self.tl = TransformerBridge.boot_transformers(
                model, device=device, dtype=getattr(torch, dtype), hf_model=self.model
            )

    def run(self, workload: str, n: int, new: int, prompt_len: int) -> int:
        import torch

        if workload == "W5":
            raise NotImplementedError("no per-request features in a padded HF batch")
        out_tokens = 0
        n = min(n, int(os.environ.get("BENCH_HF_MAX_N", n)))  # tok/s at HF's batch size; fewer prompts, same rate
        ps = prompts(n, prompt_len)
        for s in range(0, n, self.batch):
            ids = torch.tensor(ps[s : s + self.batch], device=self.device)
            if self.kind == "nnsight":
                out_tokens += self._nnsight(workload, ids, new)
            elif self.kind == "transformer-lens":
                out_tokens += self._tl(workload, ids, new)
            else:
                out_tokens += self._hf(workload, ids, new)
        return out_tokens

    def _hf(self, workload: str, ids, new: int) -> int:
        import torch

        layers = self.model.model.layers
        mid = self.n_layers // 2
        saved: list = []
        handles = []

        def capture(_m, _i, out):
            h = out[0] if isinstance(out, tuple) else out
            saved.append(h.detach().to("cpu", copy=True))

        def steer(_m, _i, out):
            if isinstance(out, tuple):
                return (out[0] + self.vec,) + tuple(out[1:])
            return out + self.vec

        def hook(_m, _i, out):
            h = out[0] if isinstance(out, tuple) else out
            saved.append(h.float().norm(dim=-1).mean().item())

        def hook_on_device(_m, _i, out):
            h = out[0] if isinstance(out, tuple) else out
            saved.append(h.float().norm(dim=-1).mean())

        if workload == "W1":
            handles.append(layers[mid].register_forward_hook(capture))
        elif workload == "W2":
            handles += [layer.register_forward_hook(capture) for layer in layers]
        elif workload == "W3":
            handles.append(layers[mid].register_forward_hook(steer))
        elif workload == "W4":
            handles.append(layers[mid].register_forward_hook(hook))
        elif workload == "W4n":
            handles.append(layers[mid].register_forward_hook(hook_on_device))
        try:
            with torch.inference_mode():
                out = self.model.generate(
                    ids,
                    attention_mask=torch.ones_like(ids),
                    max_new_tokens=new,
                    min_new_tokens=new,
                    do_sample=False,
                    pad_token_id=0,
                )
        finally:
            for h in handles:
                h.remove()
        if workload in ("W1", "W2"):
            assert saved, "no activations captured"
        return (out.shape[1] - ids.shape[1]) * ids.shape[0]

    def _tl(self, workload: str, ids, new: int) -> int:
        """TransformerLens (4.x TransformerBridge) hook points: blocks.{i}.hook_out is the residual stream."""
        import torch

        mid = self.n_layers // 2
        saved: list = []

        def capture(h, hook):
            saved.append(h.detach().to("cpu", copy=True))

        def steer(h, hook):
            return h + self.vec

        def norm(h, hook):
            saved.append(h.float().norm(dim=-1).mean().item())

        hooks = {
            "W0": [],
            "W1": [(f"blocks.{mid}.hook_out", capture)],
            "W2": [(f"blocks.{i}.hook_out", capture) for i in range(self.n_layers)],
            "W3": [(f"blocks.{mid}.hook_out", steer)],
            "W4": [(f"blocks.{mid}.hook_out", norm)],
        }[workload]
        with torch.inference_mode(), self.tl.hooks(fwd_hooks=hooks):
            out = self.tl.generate(
                ids, max_new_tokens=new, stop_at_eos=False, do_sample=False, verbose=False, return_type="tokens"
            )
        if workload in ("W1", "W2"):
            assert saved, "no activations captured"
        return (out.shape[1] - ids.shape[1]) * ids.shape[0]

    def _nnsight(self, workload: str, ids, new: int) -> int:
        import torch

        if workload not in ("W0", "W1", "W3"):
            raise NotImplementedError("only W0/W1/W3 implemented for nnsight here")
        mid = self.n_layers // 2
        layer = self.nn.model.layers[mid]
        saves = []
        with torch.inference_mode():
            with self.nn.generate(
                {"input_ids": ids, "attention_mask": torch.ones_like(ids)},
                max_new_tokens=new,
                min_new_tokens=new,
                do_sample=False,
                pad_token_id=0,
            ) as tracer:
                out = self.nn.generator.output.save()  # before the all-steps block: code after it never runs
                if workload != "W0":
                    with tracer.all():
                        if workload == "W1":
                            saves.append(layer.output[0].save())
                        else:
                            layer.output[0][:] += self.vec
        return (out.shape[1] - ids.shape[1]) * ids.shape[0]


def _tokenizer(model: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model)
