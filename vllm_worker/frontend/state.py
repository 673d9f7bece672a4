"""What the plugin keeps for one engine in the frontend (`FrontendState`, on the engine's input processor),
and the per-request entries waiting for their results (`Pending` in a `PendingMap`). Every other frontend
module reads this state; this module imports none of them."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from vllm_worker import compat
from vllm_worker.protocol.spec import ModelShape


@dataclass
class Pending:
    key: str
    n: int
    layers: list[int]  # tap sites captured (the rows of the fetched tensor)
    d_model: int
    reserved: int = 0  # bytes of capture at its largest, counted against VLLM_LENS_MAX_STORED_GB
    points: dict[str, list[int]] = field(default_factory=dict)  # what was asked: {point: layers}
    shape: ModelShape | None = None  # the served model's (heads, experts): how z / q / k / router rows come back
    # probes scored (`RequestSpec.probe_outputs`) and where the prompt ends: the aggregates' positions
    probes: dict[str, dict[str, Any]] = field(default_factory=dict)
    prompt_len: int = 0
    vector_refs: tuple[str, ...] = ()  # named vectors it names by reference (`frontend.vector_refs`), pinned


class PendingMap(dict):
    """Request id -> Pending, keeping the sum of their capture reservations (admission checks it for every
    new request: summing a 100k-request offline batch each time would be quadratic), and unpinning the
    named vectors an entry names by reference when it goes. Only item setting, `pop` and `del` are used on
    it (they keep both)."""

    def __init__(self) -> None:
        super().__init__()
        self.reserved = 0
        self.unpin: Any = None  # the vector registry's `unpin` (set with the first request pinning vectors)

    def __setitem__(self, key: str, value: Pending) -> None:
        old = dict.get(self, key)
        self.reserved += value.reserved - (old.reserved if old is not None else 0)
        super().__setitem__(key, value)
        if old is not None and old.vector_refs and self.unpin is not None:
            self.unpin(old.vector_refs)

    def pop(self, key: str, *default: Any) -> Any:
        had = key in self
        p = super().pop(key, *default)
        if had:
            self.reserved -= p.reserved
            if p.vector_refs and self.unpin is not None:
                self.unpin(p.vector_refs)
        return p

    def __delitem__(self, key: str) -> None:
        self.pop(key)


@dataclass
class FrontendState:
    """Everything the plugin keeps for one engine in the frontend. It lives on the engine's input processor,
    the one object that `LLM`, `LLMEngine`, `AsyncLLM`, the HTTP server and every new request all reach,
    under one attribute (`STATE_ATTR`): no other `_lens_*` attribute is set on vLLM's objects here."""

    pending: PendingMap = field(default_factory=PendingMap)
    consumer: str | None = None  # who hands results back: "offline", "engine", "async" or "http"
    pools: set[str] = field(default_factory=set)  # ids of the workers' result pools (learnt from fetches)
    engine_pools: dict[int, set[str]] = field(default_factory=dict)  # the same per data-parallel engine
    shm_everywhere: bool | None = None  # every worker shares this machine (asked once)
    persistent_hooks: bool = False  # `llm.register_hooks` ran: every request's outputs may carry errors
    shape: ModelShape | None = None  # the served model's shape and points (fixed once the engine runs)
    vectors: Any = None  # named vectors (`frontend.vectors.VectorRegistry`), made on first use

    def pools_of(self, engine: int | None) -> set[str]:
        """Result pools of data-parallel engine `engine` (None: of every engine)."""
        return self.pools if engine is None else self.engine_pools.setdefault(engine, set())

    saes: dict[str, Any] = field(default_factory=dict)  # loaded SAEs by name (`frontend/saes.LoadedSae`)
    probes: dict[str, Any] = field(default_factory=dict)  # loaded probes by name (`frontend/probes.LoadedProbe`)
    # validated capture / probe-score specs by the frozen form of the caller's keys (`spec_memo`): an
    # extraction or a monitored batch sends thousands of requests with the same spec, validated once
    specs: dict[Any, Any] = field(default_factory=dict)
    capture_limits: tuple[int, int] | None = None  # (max_model_len, bytes per value), fixed once the engine runs
    engines_fed: int | None = None  # engine cores this frontend feeds (`compat.engines_fed`), fixed likewise
    rows_by_view: bool | None = None  # steering rows sent as views (`compat.rows_by_view`), fixed likewise
    fetches: Any = None  # concurrent async fetches sharing round trips (`frontend.fetch.FetchBatcher`)


STATE_ATTR = "_inspect_lens"


def engine_state(obj: Any) -> FrontendState:
    """The plugin's state of the engine behind `obj` (an input processor, `LLM`, `LLMEngine`, `AsyncLLM` or
    API-server engine client), made on first use."""
    st = getattr(obj, "__dict__", {}).get(STATE_ATTR)  # `obj` is the processor (every new request)
    if st is not None:
        return st
    proc = compat.input_processor_of(obj)
    st = proc.__dict__.get(STATE_ATTR)
    if st is None:
        st = FrontendState()
        setattr(proc, STATE_ATTR, st)
    return st


def engine_shape(obj: Any) -> ModelShape:
    """The served model's shape and available hook points, worked out once per engine (not per request)."""
    state = engine_state(obj)
    if state.shape is None:
        state.shape = ModelShape(*compat.model_shape(compat.input_processor_of(obj)))
    return state.shape


def pending_of(processor: Any) -> PendingMap:
    return engine_state(processor).pending


def mark_consumer(processor: Any, who: str) -> None:
    """Record who hands results back to callers for this engine (`offline` LLM or the `http` plugin)."""
    engine_state(processor).consumer = who


def consumer_of(processor: Any) -> str | None:
    return engine_state(processor).consumer


def result_pools(engine: Any) -> set[str]:
    """Ids of the result pools of this engine's workers (learnt from fetched results)."""
    return engine_state(engine).pools


def mark_engine_consumer(processor: Any, who: str) -> None:
    """A caller driving the engine directly (`LLMEngine.add_request`, `AsyncLLM.generate`) becomes the
    consumer of results unless an `LLM` or the HTTP server already is."""
    if consumer_of(processor) is None:
        mark_consumer(processor, who)
