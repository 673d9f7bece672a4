"""The stream's value at chosen rows of a tap (Python path): what captures, SAE features, probe scores and
probe actions all read — `hidden`, plus `residual` where vLLM carries the stream in two parts."""

from __future__ import annotations

import torch


def stream_rows(hidden: torch.Tensor, residual: torch.Tensor | None, idx: torch.Tensor) -> torch.Tensor:
    x = hidden.index_select(0, idx)
    return x if residual is None else x + residual.index_select(0, idx)
