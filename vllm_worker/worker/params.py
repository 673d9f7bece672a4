"""Full parameters for hooks (`ctx.get_parameter`): gathered across tensor-parallel shards, and shared
across pipeline stages when prefetched (a hook on stage 0 may read `lm_head.weight` from the last one)."""

from __future__ import annotations

import torch

from vllm_worker import compat


class UnknownParameter(KeyError):
    """No pipeline stage has the parameter a prefetch names (the caller's mistake)."""

    def __init__(self, name: str) -> None:
        super().__init__(f"prefetch_params: no pipeline stage has a parameter {name!r}")
        self.name = name


class Params:
    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self.prefetched: dict[str, torch.Tensor] = {}

    def get(self, name: str) -> torch.Tensor:
        """Full parameter: prefetched copy if any, else gathered from this stage's TP shards."""
        if name in self.prefetched:
            return self.prefetched[name]
        try:
            return compat.full_parameter(self.model, name).detach()
        except compat.EmptyParameter:
            raise
        except KeyError:
            raise KeyError(
                f"parameter {name!r} is not on this pipeline stage (or does not exist); prefetch it first "
                "with llm.prefetch_params([...])"
            ) from None

    def prefetch(self, names: list[str]) -> list[str]:
        """Collective on every rank: gather TP shards, then share across pipeline stages."""
        for name in names:
            try:
                local = self.get(name)
            except KeyError:
                local = None
            try:
                self.prefetched[name] = compat.pp_share(local, name).detach().clone()
            except KeyError:
                raise UnknownParameter(name) from None
        return sorted(self.prefetched)

    def clear(self) -> None:
        self.prefetched.clear()
