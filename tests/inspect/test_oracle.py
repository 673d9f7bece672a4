"""Activation oracle end to end on the tiny model: a tiny oracle trained by the example script, then
`evals/activation_oracle.py` through `vllm-lens/<model>` with the oracle as a LoRA on the same server.
The oracle's answers equal HF + peft generating with the same norm-matched injection at the same
position of a vector read from the same window."""

from __future__ import annotations

import torch

from support import ROOT, load_script
from support.engines import model_path
from support.oracle import PLACEHOLDER
from support.servers import run_eval


def _example(name: str):
    """examples/<name>.py as a module of its own name (evals/ has an activation_oracle.py too)."""
    return load_script(ROOT / "examples" / f"{name}.py", f"example_{name}")


def test_activation_oracle_eval_equals_hf_peft(lora_server, tiny_oracle, tmp_path):
    import json

    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from inspect_lens.oracle_data import text_window

    oracle_task = load_script(ROOT / "evals" / "activation_oracle.py").activation_oracle
    from support.servers import LORA_MODEL

    name = str(model_path("llama"))
    log = run_eval(
        oracle_task(oracle=str(tiny_oracle)), lora_server, tmp_path, model=f"vllm-lens/{LORA_MODEL}", limit=8
    )
    metrics = {m for s in log.results.scores for m in s.metrics}
    assert {"accuracy"} <= metrics and {s.name for s in log.results.scores} >= {"real", "shuffled", "none"}
    assert len(log.samples) == 8 and len({s.target for s in log.samples}) == 8  # one per topic

    fit = _example("activation_oracle_fit")
    tok = AutoTokenizer.from_pretrained(name)
    base = AutoModelForCausalLM.from_pretrained(name, dtype=torch.float32).eval()
    oracle = PeftModel.from_pretrained(base, str(tiny_oracle)).merge_and_unload().eval()
    inj = fit.Injector(oracle.model.layers[1])
    fresh = AutoModelForCausalLM.from_pretrained(name, dtype=torch.float32).eval()
    meta = json.loads((tiny_oracle / "oracle.json").read_text())
    for sample in log.samples[:3]:
        m = sample.metadata["activation_oracle"]
        text = sample.input if isinstance(sample.input, str) else sample.input[-1].content
        ids, (a, b) = text_window(tok, text)
        assert m["window_token_ids"] == ids[a:b]
        vec = fit.source_vectors(fresh, tok, [text], meta["source_layer"])
        prompt, pos, n_prompt = fit.encode(tok, meta["source_layer"], None, PLACEHOLDER)
        assert m["placeholder_positions"] == [pos]
        lps = {}
        for cond, v in (("real", vec), ("none", None)):
            inj.vectors, inj.positions = v, [pos]
            seq, lp = list(prompt), 0.0
            with torch.no_grad():
                for _ in range(8):  # greedy, full forward each step (the hook sees the placeholder row)
                    logits = oracle(torch.tensor([seq]), use_cache=False).logits[0, -1].float()
                    nxt = int(logits.argmax())
                    lp += float(logits.log_softmax(-1)[nxt])
                    seq.append(nxt)
                    if nxt == tok.eos_token_id:
                        break
            inj.vectors = None
            want = tok.decode(seq[n_prompt:], skip_special_tokens=True).strip()
            assert m["answers"][cond] == want, (cond, m["answers"], want)
            assert abs(m["answer_logprobs"][cond] - lp) <= 2e-4, (cond, m["answer_logprobs"], lp)
            lps[cond] = lp
        assert (
            abs(lps["real"] - lps["none"]) > 5e-4
        )  # the injection moves the answer's log-probability (tiny model: a little)
    # the in-process example (one engine: capture on the base model, injection on the LoRA) gives the
    # answers the eval got through the server
    from support.engines import make_engine

    example = _example("activation_oracle")
    texts = [s.input if isinstance(s.input, str) else s.input[-1].content for s in log.samples[:3]]
    got = example.ask(make_engine("llama", enable_lora=True, max_lora_rank=8, max_loras=1), str(tiny_oracle), texts)
    for r, sample in zip(got, log.samples[:3]):
        answers = sample.metadata["activation_oracle"]["answers"]
        assert (r["answer"], r["without_vector"]) == (answers["real"], answers["none"])
