"""A scorer that reads a named SAE feature: the sample's answer is read teacher-forced through the same
server with `output_sae_features`, and the sample is flagged when the feature fires on it. The SAE must be
loaded on the server (`POST /v1/lens/saes`, docs/saes.md)."""

from __future__ import annotations

from inspect_ai.model import get_model
from inspect_ai.scorer import Score, Scorer, Target, mean, scorer, stderr
from inspect_ai.solver import TaskState

from ._lens_model import lens_api
from .solvers import answer_window, detect_candidates


@scorer(metrics=[mean(), stderr()])
def sae_feature(sae: str, feature: int, threshold: float = 0.0) -> Scorer:
    """1 when feature `feature` of the loaded SAE `sae` exceeds `threshold` on any token of the answer
    (the last assistant message, or the generated output), else 0. Metadata: the feature's largest value,
    the answer tokens it fired on and the tokens read."""

    async def score(state: TaskState, target: Target) -> Score:
        model = get_model()
        answer = state.output.completion if state.output and state.output.completion else state.messages[-1].text
        messages = [{"role": m.role, "content": m.text} for m in state.messages]
        if not messages or messages[-1]["role"] != "assistant":
            messages.append({"role": "assistant", "content": answer})
        client = await lens_api(model).lens_client()
        try:
            r = await client.generate(
                messages=messages,
                max_tokens=1,
                temperature=0,
                add_generation_prompt=False,
                continue_final_message=True,
                vllm_xargs={"output_sae_features": {"sae": sae, "features": [int(feature)]}},
            )
        finally:
            await client.aclose()
        (start, end), _ = answer_window(r.prompt_token_ids, await detect_candidates(model, answer))
        values = r.activations["sae_features"][sae]["values"][start:end, 0]
        fired = [i for i, v in enumerate(values.tolist()) if v > threshold]
        top = float(values.max()) if len(values) else 0.0
        return Score(
            value=1.0 if fired else 0.0,
            answer=answer,
            explanation=f"SAE {sae!r} feature {feature}: max {top:.3f} over {len(values)} answer tokens",
            metadata={"max_activation": top, "fired_at": fired, "n_tokens": len(values)},
        )

    return score
