"""Activation oracles as Inspect parts: a solver that reads the conversation's activations from the base
model and asks an oracle LoRA about them (the vectors injected at placeholders), and its scorer.

An oracle is an adapter folder as `inspect_lens.oracle_fit.fit_oracle` writes it (the eval
`evals/activation_oracle.py` on first use, or `examples/activation_oracle_fit.py`): a peft adapter plus
`oracle.json` (source layer, injection layer, placeholder, question, topics). The base model is the
one the task runs on (`vllm-lens/<base>`); the oracle runs on the same server as a LoRA, loaded on first
use. A server the provider starts gets LoRA enabled before it starts (the solver calls the provider's
`prepare_lora` first); a server you started needs `--enable-lora --max-lora-rank R` and
`VLLM_ALLOW_RUNTIME_LORA_UPDATING=True`.
"""

from __future__ import annotations

import json
import zlib
from pathlib import Path
from typing import Any, Sequence

import torch
from inspect_ai.model import ChatMessageUser, GenerateConfig, get_model
from inspect_ai.scorer import Score, Target, accuracy, scorer, stderr
from inspect_ai.solver import Generate, Solver, TaskState, solver

from ._lens_model import lens_api
from .oracle_data import PLACEHOLDER, QUESTION, oracle_prompt
from .solvers import read_window

CONDITIONS = ("real", "shuffled", "none")


def load_oracle(path: str | Path) -> dict[str, Any]:
    """`oracle.json` of an adapter folder, with the folder's path and a LoRA name for the server."""
    path = Path(path).expanduser()
    meta_file = path / "oracle.json"
    if not meta_file.exists():
        raise ValueError(
            f"oracle: {path} has no oracle.json: fit one there with inspect_lens.oracle_fit.ensure_oracle "
            "(or examples/activation_oracle_fit.py --out DIR); evals/activation_oracle.py does it "
            "on first use"
        )
    meta = json.loads(meta_file.read_text())
    return {**meta, "path": str(path), "name": f"oracle-{path.name}"}


def _vectors(window: torch.Tensor, positions: str | Sequence[int]) -> torch.Tensor:
    """(k, d) vectors from the window's stream (n, d): "mean" (one), "last" (one), "all" (each token),
    or window-relative indices."""
    if positions == "mean":
        return window.float().mean(0, keepdim=True)
    if positions == "last":
        return window[-1:].float()
    if positions == "all":
        return window.float()
    if isinstance(positions, str):
        raise ValueError(f"positions: expected 'mean', 'last', 'all' or a list of ints, got {positions!r}")
    return window[list(positions)].float()


async def placeholder_positions(
    client: Any, source_layer: int, k: int, question: str, placeholder: str
) -> tuple[list[dict[str, str]], list[int]]:
    """(oracle messages, positions of the k placeholders in the prompt the server will build): the
    placeholders are the tail of the prompt cut just after them, checked against the full prompt."""
    messages = [{"role": "user", "content": oracle_prompt(source_layer, k, question, placeholder)}]
    full = await client.tokenize_chat(messages)
    head = await client.tokenize_chat(
        [{"role": "user", "content": f"Layer: {source_layer}\n{placeholder * k}"}],
        add_generation_prompt=False,
        continue_final_message=True,
    )
    ph = await client.tokenize(placeholder, add_special_tokens=False)
    pos = list(range(len(head) - k, len(head)))
    if len(ph) != 1 or full[: len(head)] != head or any(full[p] != ph[0] for p in pos):
        raise ValueError(
            f"placeholder: {placeholder!r} must tokenize to one token that stays one token in the "
            f"oracle prompt (got {ph}); pick another placeholder (and train the oracle with it)"
        )
    return messages, pos


@solver
def activation_oracle(
    oracle: str,
    question: str | None = None,
    source_layer: int | None = None,
    injection_layer: int | None = None,
    positions: str | Sequence[int] = "mean",
    placeholder: str | None = None,
    controls: Sequence[str] = ("shuffled", "none"),
    max_tokens: int = 8,
    seed: int = 0,
    key: str = "activation_oracle",
) -> Solver:
    """Ask oracle `oracle` (an adapter folder with `oracle.json`) about the current conversation.

    The last message's tokens are read from the base model with capture at `source_layer` (teacher-forced
    with its turn left open, so nothing is generated); `positions` picks the vectors: "mean" over them
    (what the shipped oracle is trained on), "last", "all", or indices into them. The oracle prompt has
    one placeholder per vector; each vector is added there after `injection_layer`, norm-matched
    (`SteeringVector(..., norm_match=True, position_indices=...)`), on the oracle LoRA. `controls` asks
    again with the vectors' dimensions shuffled (same norm, no meaning; the permutation seeded with `seed`
    + crc32 of the sample id, the same in every run) and with no vector.
    Results in `state.metadata[key]`: answers per condition and their log-probabilities, question,
    layers, positions, window tokens.
    Composable after any solver: it adds no messages."""
    meta = load_oracle(oracle)
    q = question or meta.get("question", QUESTION)
    layer = meta["source_layer"] if source_layer is None else source_layer
    inject = meta.get("injection_layer", 1) if injection_layer is None else injection_layer
    ph = placeholder or meta.get("placeholder", PLACEHOLDER)
    for c in controls:
        if c not in CONDITIONS[1:]:
            raise ValueError(f"controls: expected a subset of {CONDITIONS[1:]}, got {c!r}")

    async def solve(state: TaskState, generate: Generate) -> TaskState:
        model = get_model()
        api = lens_api(model)
        api.prepare_lora(meta["path"])  # a server the provider is still to start: with LoRA on
        client = await api.lens_client()
        try:
            msgs = [{"role": m.role, "content": m.text} for m in state.messages]
            window, window_ids, exact = await read_window(client, model, msgs, msgs[-1]["content"], layer)
            vecs = _vectors(window, positions)
            asked = await ask_oracle(
                model,
                client,
                meta,
                vecs,
                question=q,
                source_layer=layer,
                placeholder=ph,
                injection_layer=inject,
                controls=controls,
                max_tokens=max_tokens,
                seed=seed + zlib.crc32(str(state.sample_id).encode()) % 10_000,  # not hash(): salted per process
            )
        finally:
            await client.aclose()
        state.metadata[key] = {
            **asked,
            "question": q,
            "oracle": meta["path"],
            "source_layer": layer,
            "injection_layer": inject,
            "positions": positions if isinstance(positions, str) else list(positions),
            "n_vectors": len(vecs),
            "window_token_ids": window_ids,
            "window_exact": exact,
        }
        return state

    return solve


async def ask_oracle(
    model: Any,
    client: Any,
    meta: dict[str, Any],
    vecs: torch.Tensor,
    *,
    question: str,
    source_layer: int,
    placeholder: str,
    injection_layer: int,
    controls: Sequence[str] = ("shuffled", "none"),
    max_tokens: int = 8,
    seed: int = 0,
) -> dict[str, Any]:
    """Ask the oracle LoRA (`load_oracle`'s `meta`) `question` about `vecs` (k, d) read at `source_layer`,
    injected norm-matched at its k placeholders after `injection_layer`; `controls` ask again with the
    vectors' dimensions shuffled (seeded) and with none. Returns answers and their log-probabilities per condition and the
    placeholder positions. Shared by the `activation_oracle` solver and the Petri target."""
    from vllm_worker import SteeringVector

    messages, pos = await placeholder_positions(client, source_layer, len(vecs), question, placeholder)
    g = torch.Generator().manual_seed(seed)
    shuffled = vecs[:, torch.randperm(vecs.shape[1], generator=g)]
    answers: dict[str, str] = {}
    logprobs: dict[str, float] = {}
    for cond in ("real", *controls):
        body: dict[str, Any] = {"lora_request": {"lora_name": meta["name"], "lora_path": meta["path"]}}
        if cond != "none":
            v = vecs if cond == "real" else shuffled
            body["extra_args"] = {
                "apply_steering_vectors": [
                    SteeringVector(v[None], [injection_layer], scale=1.0, norm_match=True, position_indices=pos)
                ]
            }
        out = await model.generate(
            [ChatMessageUser(content=messages[0]["content"])],
            config=GenerateConfig(max_tokens=max_tokens, temperature=0, logprobs=True, extra_body=body),
        )
        answers[cond] = out.completion.strip()
        lp = out.choices[0].logprobs if out.choices else None
        if lp is not None:  # the oracle's confidence in its own answer
            logprobs[cond] = float(sum(t.logprob for t in lp.content))
    return {"answers": answers, "answer_logprobs": logprobs, "placeholder_positions": pos}


def _match(answer: str, target: str) -> bool:
    words = answer.lower().replace(".", " ").replace(",", " ").split()
    return bool(words) and words[0] == target.lower()


@scorer(metrics={c: [accuracy(), stderr()] for c in CONDITIONS})
def oracle_match(key: str = "activation_oracle") -> Any:
    """C/I per condition: does the oracle's answer (its first word) equal the target? `real` against the
    controls is the evidence that the oracle reads the activation."""

    async def score(state: TaskState, target: Target) -> Score:
        answers = (state.metadata.get(key) or {}).get("answers") or {}
        value = {c: ("C" if _match(answers[c], target.text) else "I") if c in answers else "N" for c in CONDITIONS}
        return Score(value=value, answer=answers.get("real"), explanation=json.dumps(answers))

    return score
