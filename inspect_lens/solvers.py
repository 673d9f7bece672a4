"""Solvers: capture the residual stream of a sample's answer, and generate under steering.

Captured tensors stay in this process (`captured(state)`), never in the eval log: the sample's
metadata gets a summary (layers, shape, detection window) instead.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch
from inspect_ai.model import GenerateConfig, get_model
from inspect_ai.solver import Generate, Solver, TaskState, solver

from ._lens_model import resolve_layers, tokenize

_CAPTURES: dict[str, "Captured"] = {}


@dataclass
class Captured:
    layers: list[int]
    residual: torch.Tensor  # (n_layers, n_positions, d_model); row i = residual after the layer at token i
    token_ids: list[int]  # the token at each position
    window: tuple[int, int]  # positions of the detection window [start, end)
    window_exact: bool  # the window's tokens equal the detect text tokenized alone

    def window_acts(self, layer: int) -> torch.Tensor:
        """(n_window, d_model) activations at `layer` over the detection window."""
        if layer not in self.layers:
            raise ValueError(f"layer {layer} was not captured (captured: {self.layers})")
        return self.residual[self.layers.index(layer), self.window[0] : self.window[1]]


def captured(state: TaskState, pop: bool = False) -> Captured:
    """The capture `capture_activations` made for this sample."""
    got = (_CAPTURES.pop if pop else _CAPTURES.get)(state.uuid, None)
    if got is None:
        raise ValueError(
            f"sample {state.sample_id!r} has no captured activations: put capture_activations() "
            "in the solver chain before scorers that read them"
        )
    return got


def answer_window(prompt_ids: list[int], candidates: list[list[int]]) -> tuple[tuple[int, int], bool]:
    """A teacher-forced prompt ends with the answer: the window is its last k positions, k from the first
    candidate tokenization of the detect text that equals the prompt's tail (exact), else the first one
    (the function `vllm-lens probes calibrate` windows replies with)."""
    from vllm_worker.probes.calibrate import reply_window

    return reply_window(prompt_ids, candidates)


async def detect_candidates(model: Any, detect: str) -> list[list[int]]:
    """The detect text tokenized alone and with a leading space: byte-level BPE folds the space that
    precedes it in context (template or speaker prefix) into its first token."""
    out = [await tokenize(model, detect)]
    if not detect.startswith(" "):
        out.append(await tokenize(model, " " + detect))
    return out


async def read_window(
    client: Any, model: Any, messages: list[dict[str, str]], detect: str, layer: int
) -> tuple[torch.Tensor, list[int], bool]:
    """Read `messages` (ending with the assistant text) teacher-forced through the lens client with
    capture at `layer`: (activations over the `detect` window (n, d), the window's token ids, exact)."""
    r = await client.generate(
        messages=messages,
        max_tokens=1,
        temperature=0,
        capture_layers=[layer],
        add_generation_prompt=False,
        continue_final_message=True,
    )
    (start, end), exact = answer_window(r.prompt_token_ids, await detect_candidates(model, detect))
    return r.activations["residual_stream"][0, start:end], list(r.prompt_token_ids[start:end]), exact


@solver
def capture_activations(
    layers: int | Sequence[int] | str | None = None, *, detect_key: str = "detect_text", generate_answer: bool = False
) -> Solver:
    """Capture the residual stream at `layers` (default: the middle layer) for the sample's answer.

    Teacher-forced (default, when the last message is the assistant's): the answer is read, not generated
    (one forward pass; no token is added). The detection window is `metadata[detect_key]` (a suffix of the
    answer; default the whole answer). With `generate_answer=True` or no trailing assistant message the
    model generates (task config applies) and the window is the generated tokens.
    """

    async def solve(state: TaskState, generate: Generate) -> TaskState:
        model = get_model()
        layer_list = await resolve_layers(model, layers)
        extra = {"extra_args": {"output_residual_stream": layer_list}}
        teacher_forced = not generate_answer and state.messages and state.messages[-1].role == "assistant"
        if teacher_forced:
            out = await model.generate(
                state.messages, config=GenerateConfig(max_tokens=1, temperature=0, extra_body=extra)
            )
            meta = out.metadata or {}
            prompt_ids = list(meta.get("prompt_token_ids") or [])
            detect = (state.metadata or {}).get(detect_key) or state.messages[-1].text
            window, exact = answer_window(prompt_ids, await detect_candidates(model, detect))
            token_ids = prompt_ids
        else:
            state = await generate(state, extra_body=extra)
            out = state.output
            meta = out.metadata or {}
            prompt_ids = list(meta.get("prompt_token_ids") or [])
            gen = list(meta.get("token_ids") or [])
            # generated token j is an input at position n_prompt + j; the last one never is
            window, exact = (len(prompt_ids), len(prompt_ids) + max(len(gen) - 1, 0)), True
            token_ids = prompt_ids + gen[:-1]
        acts = meta.get("activations")
        if not acts:
            raise RuntimeError("the server returned no activations (is the model served by vllm-lens?)")
        cap = Captured(list(acts["layers"]), acts["residual_stream"], token_ids, window, exact)
        _CAPTURES[state.uuid] = cap
        state.metadata["inspect_lens_capture"] = {
            "layers": cap.layers,
            "shape": list(cap.residual.shape),
            "dtype": str(cap.residual.dtype),
            "window": list(window),
            "window_exact": exact,
            "teacher_forced": bool(teacher_forced),
        }
        return state

    return solve


def steer(vectors: Any, *, capture_layers: Sequence[int] | None = None, **generate_args: Any) -> Solver:
    """Generate under steering. `vectors`: a `SteeringVector`, a registered name
    (`register_steering_vector`), a `{"name": ..., "layer_indices": [...]}` entry naming a vector on the
    server, or a list of those. Tensors never reach the eval log: each `SteeringVector` becomes an entry
    naming its tensor by content (uploaded to the server once by the provider), and that entry is what the
    logged plan and each sample's model call show. `capture_layers` also captures the residual stream (in
    `state.output.metadata["activations"]`)."""
    from .steering import named_entries

    if isinstance(vectors, (str, dict)) or not isinstance(vectors, Sequence):
        vectors = [vectors]
    named_entries(vectors)  # fail at task construction on unknown names / bad types
    # local names stay names (readable in the log); SteeringVectors become entries naming their tensor
    logged: list = []
    for v in vectors:
        logged.extend([v] if isinstance(v, (str, dict)) else named_entries(v))
    return _steer(logged, capture_layers=capture_layers, **generate_args)


@solver(name="steer")
def _steer(vectors: list, *, capture_layers: Sequence[int] | None = None, **generate_args: Any) -> Solver:
    async def solve(state: TaskState, generate: Generate) -> TaskState:
        extra: dict[str, Any] = {"apply_steering_vectors": list(vectors)}
        if capture_layers is not None:
            extra["output_residual_stream"] = list(capture_layers)
        return await generate(state, extra_body={"extra_args": extra}, **generate_args)

    return solve
