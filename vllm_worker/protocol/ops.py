"""What a steering entry does at its site (`SteeringVector.op`) and at which positions (`.phase`), with the
checks that need no model: one rule for the object callers build (`api.steering`) and for the JSON form a
server reads (`frontend.validation`), each error naming the field.

Op codes travel in the request payload and in the graph-safe entry table (`worker.graph_entries`)."""

from __future__ import annotations

from typing import Any

import torch

from vllm_worker.protocol.checks import finite_number

OPS = ("add", "ablate", "cap", "set")
PHASES = ("all", "prompt", "generated")
ADD, ABLATE, CAP, SET = range(4)
CODE = {name: i for i, name in enumerate(OPS)}
# the end of a "generated" span (positions are absolute token positions, far below this)
FAR = 1 << 62


def _f(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def op_name(value: Any, field: str = "op") -> str:
    if not isinstance(value, str) or value not in OPS:
        raise ValueError(f"{field}: expected one of {', '.join(map(repr, OPS))}, got {str(value)[:40]!r}")
    return value


def phase_name(value: Any, field: str = "phase") -> str:
    if not isinstance(value, str) or value not in PHASES:
        raise ValueError(f"{field}: expected one of {', '.join(map(repr, PHASES))}, got {str(value)[:40]!r}")
    return value


def bound(value: Any, field: str) -> float | None:
    return None if value is None else finite_number(value, field)


def check_fields(
    op: str,
    phase: str,
    lo: float | None,
    hi: float | None,
    scale: float,
    norm_match: bool,
    has_values: bool,
    three_d: bool,
    prefix: str = "",
) -> None:
    """The combinations an entry may not ask for, whatever the model (`prefix`: the entry's field name)."""
    if op != "cap" and (lo is not None or hi is not None):
        raise ValueError(f"{_f(prefix, 'lo' if lo is not None else 'hi')}: only with op='cap', got op={op!r}")
    if op == "cap":
        if lo is None and hi is None:
            raise ValueError(f"{_f(prefix, 'lo')}: op='cap' needs lo, hi or both (the range of x·d)")
        if lo is not None and hi is not None and lo > hi:
            raise ValueError(f"{_f(prefix, 'lo')}: lo {lo} > hi {hi}")
    if op != "add":
        if norm_match:
            raise ValueError(f"{_f(prefix, 'norm_match')}: only with op='add', got op={op!r}")
        if scale != 1.0:
            raise ValueError(f"{_f(prefix, 'scale')}: not used by op={op!r}; leave it at 1.0 (got {scale})")
        if not has_values:
            raise ValueError(f"{_f(prefix, 'activations')}: op={op!r} needs activations (a direction or values)")
    if three_d and phase == "generated":
        raise ValueError(
            f"{_f(prefix, 'phase')}: 'generated' contradicts 3-D activations (their positions lie in the prompt)"
        )


def check_directions(op: str, acts: torch.Tensor, prefix: str = "") -> torch.Tensor | None:
    """ablate / cap need a direction in every row (a zero row has none). Returns the rows' norms
    (`(..., 1)`, float32; None for other ops): a caller making unit rows divides by them, not a second pass."""
    if op not in ("ablate", "cap"):
        return None
    norms = acts.float().norm(dim=-1, keepdim=True)
    if bool((norms == 0).any()):
        at = [int(i) for i in torch.nonzero(norms.squeeze(-1) == 0)[0]]
        raise ValueError(f"{_f(prefix, 'activations')}: row {at} is zero; op={op!r} needs a non-zero direction")
    return norms


def span(phase: str, prompt_len: int) -> tuple[int, int] | None:
    """The absolute positions a phase covers: the prompt's, those of generated tokens (the forward pass
    of each generated token that is fed back), or None for every position."""
    if phase == "prompt":
        return (0, prompt_len)
    if phase == "generated":
        return (prompt_len, FAR)
    return None
