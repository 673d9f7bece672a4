"""What the server keeps per app: its engine client, whether persistent hooks are registered, the
model's shape."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vllm_worker import compat
from vllm_worker.frontend.state import engine_shape
from vllm_worker.protocol.spec import ModelShape


@dataclass
class LensState:
    engine: Any
    persistent_hooks: bool = False
    original_collect: bool = False  # the persistent hooks came in the original's form: collect answers in it
    keyed: bool = False  # started with API keys: named vectors are scoped per key (`frontend.vectors`)
    progress: Any = None  # streams' probe-score RPCs, batched (`server.probe_progress.batcher_of`)


def state_of(app: Any) -> LensState:
    return app.state.lens


def shape_of(state: LensState) -> ModelShape:
    return engine_shape(compat.processor_of_engine_client(state.engine))
