"""Every `VLLM_LENS_*` setting in one table: name, type, default, what it does and its `vllm-lens serve` flag.

The code reads settings only through `get()` / `limit()`, so an error message can always name the knob
that produced it, and docs/settings.md is generated from this table (`python -m vllm_worker.envs`; a test
fails when they differ).

One rule for when a value counts: a setting is read where the code uses it (`get` / `limit` / `given`), never
kept in a module constant at import (tests/unit/test_settings.py checks), so a change of the environment acts
on everything done after it. A setting that sizes or decides something made once (the graph path's buffers
when the model loads, direct writes on CUDA when the result pool is made) acts on what is made after the
change. Every vLLM process inherits the environment of the one that started it, so
`vllm-lens serve --lens-max-payload-mb 8` reaches the workers too.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from typing import Any

TRUE = ("1", "true", "yes", "on")
FALSE = ("0", "false", "no", "off")
UNITS = {"MB": 1 << 20, "GB": 1 << 30}  # binary: MiB, GiB


@dataclass(frozen=True)
class Setting:
    name: str
    kind: type  # bool, int, float or str
    default: Any  # a value, or a callable giving it (a default that depends on the machine or another setting)
    what: str
    flag: str | None = None  # `vllm-lens serve` flag (a bool flag takes no value)
    unit: str = ""  # "MB" / "GB" (limit() returns bytes), "s", "ms", or "" for a count / plain value
    limit: bool = False  # an operator limit: reported by /v1/lens/info, must be positive
    # a computed default that depends only on these settings: remembered per their texts (other computed
    # defaults are computed at every read)
    after: tuple[str, ...] | None = None

    def default_value(self) -> Any:
        return self.default() if callable(self.default) else self.default

    def default_text(self) -> str:
        if callable(self.default):
            return self.default.__doc__ or "computed"
        if self.kind is bool:
            return "1" if self.default else "0"
        if self.default is None:
            return "unset"
        return f"{self.default:g}" if isinstance(self.default, float) else str(self.default)


def _stored_gb() -> float:
    """= VLLM_LENS_MAX_STORED_GB"""
    return float(get("VLLM_LENS_MAX_STORED_GB"))


def _assembly_threads() -> int:
    """min(4, CPUs)"""
    return min(4, os.cpu_count() or 1)


SETTINGS: dict[str, Setting] = {
    s.name: s
    for s in (
        Setting(
            "VLLM_LENS_DISABLE",
            bool,
            False,
            "the plugin is a complete no-op: nothing is patched, no worker extension, no `activations` attribute (only these settings' names still enter vLLM's table of its variables)",
        ),
        Setting(
            "VLLM_LENS_ALLOW_UNTESTED_VLLM",
            bool,
            False,
            "start on a vLLM release outside the tested range (docs/compatibility.md) with a warning instead "
            "of refusing; every vLLM internal the plugin touches is still checked, and a moved one is still an error",
        ),
        Setting(
            "VLLM_LENS_ALLOW_REMOTE_HOOKS",
            bool,
            False,
            "accept hooks sent over HTTP (`vllm_xargs.apply_hooks`, `/v1/hooks/register`): they are cloudpickled "
            "code run in the server; without it they get 403 and nothing received is unpickled",
            flag="--allow-remote-hooks",
        ),
        Setting(
            "VLLM_LENS_MAX_PAYLOAD_MB",
            float,
            64.0,
            "one structured payload (steering vectors, hooks): 400 naming the field; a request body above it "
            "+ 1 MiB: 413 while it arrives",
            flag="--lens-max-payload-mb",
            unit="MB",
            limit=True,
        ),
        Setting(
            "VLLM_LENS_MAX_VECTORS_MB",
            float,
            1024.0,
            "named vectors registered on one engine (`POST /v1/lens/vectors`, `llm.register_vector`), every "
            "API key's together: registering past it is a 400 naming it",
            flag="--lens-max-vectors-mb",
            unit="MB",
            limit=True,
        ),
        Setting(
            "VLLM_LENS_MAX_CAPTURE_GB",
            float,
            4.0,
            "one request's capture at its largest (layers x (prompt + max_tokens - 1) x d_model x n, in the "
            "model's dtype): 400 naming output_residual_stream, before any compute",
            flag="--lens-max-capture-gb",
            unit="GB",
            limit=True,
        ),
        Setting(
            "VLLM_LENS_MAX_STORED_GB",
            float,
            8.0,
            "captures in flight (admitted, not yet returned) at their largest, summed over requests: 503 "
            "(offline: ValueError) for the request that would pass it, before any compute",
            flag="--lens-max-stored-gb",
            unit="GB",
            limit=True,
        ),
        Setting(
            "VLLM_LENS_MAX_PERSISTENT_RESULTS",
            int,
            10000,
            "requests whose persistent-hook results are kept until clear_hook_results: later requests fail "
            "with an error naming it",
            flag="--lens-max-persistent-results",
            limit=True,
        ),
        Setting(
            "VLLM_LENS_POINTS",
            str,
            "",
            "hook points inside decoder layers to tap, read when the engine starts: `all`, or a comma list of "
            "q, k, z, attn_out, resid_mid, mlp_in, router_logits, mlp_post, mlp_out (docs/hook-points.md); unset: only resid_pre "
            "/ resid_post, which cost nothing measurable — each inner tap costs compile time at start and a "
            "few % of throughput (bench/results/2026-12-01-h200-points-ab.md)",
            flag="--lens-points",
        ),
        Setting(
            "VLLM_LENS_SAE_DIR",
            str,
            "",
            "folder on the server whose SAEs (SAELens format, in sub-folders) `POST /v1/lens/saes` may load "
            "(docs/saes.md); unset: loading SAEs over HTTP is refused (403)",
            flag="--lens-sae-dir",
        ),
        Setting(
            "VLLM_LENS_PROBE_DIR",
            str,
            "",
            "folder on the server whose probes (probe.safetensors + probe.json, in sub-folders) `POST "
            "/v1/lens/probes` may load (docs/probes.md); unset: loading probes over HTTP is refused (403)",
            flag="--lens-probe-dir",
        ),
        Setting(
            "VLLM_LENS_GRAPH_PATH",
            bool,
            True,
            "capture and steering run in the graph-safe kernel (inside CUDA graphs); 0: every step with a "
            "feature takes the Python path, without graphs",
        ),
        Setting(
            "VLLM_LENS_SEAMS",
            bool,
            True,
            "steps with Python hooks keep capture and steering on the graph-safe kernel and run the hooks "
            "at their taps only; on GPU they replay a copy of each full CUDA graph cut at the taps "
            "(captured next to vLLM's own: start-up captures twice). 0: such steps run every feature from "
            "Python, off full CUDA graphs",
        ),
        Setting(
            "VLLM_LENS_V2_RUNNER",
            bool,
            False,
            "0: the plugin keeps vLLM on its V1 model runner (`VLLM_USE_V2_MODEL_RUNNER=0`); 1: vLLM's own "
            "choice stands (V2 on GPU for most models since vLLM 0.26) and the plugin serves a V2 runner through "
            "its V2 adapter (docs/scaling.md)",
        ),
        Setting(
            "VLLM_LENS_STAGE_MB",
            float,
            256.0,
            "device staging ring of the graph-safe path (captured rows of one step); a step capturing more "
            "takes the Python path",
            unit="MB",
        ),
        Setting(
            "VLLM_LENS_STEER_MB",
            float,
            64.0,
            "device table of steering entries of the graph-safe path (identical entries are stored once for "
            "all requests using them); a request whose entries do not fit takes the Python path, counted as "
            "steer_table_full in lens_status and logged once",
            unit="MB",
        ),
        Setting(
            "VLLM_LENS_SHM",
            bool,
            True,
            "results travel to a frontend on the same machine through shared memory; 0: as bytes in the RPC reply",
        ),
        Setting("VLLM_LENS_SHM_DIR", str, "/dev/shm", "where the shared-memory result pool keeps its files"),
        Setting(
            "VLLM_LENS_SHM_POOL",
            bool,
            True,
            "keep a pool of populated shared memory for results (0: no pool; results travel as bytes)",
        ),
        Setting(
            "VLLM_LENS_SHM_POOL_GB",
            float,
            _stored_gb,
            "free result-pool memory kept for reuse; beyond it free segments are given back",
            unit="GB",
            after=("VLLM_LENS_MAX_STORED_GB",),
        ),
        Setting(
            "VLLM_LENS_SHM_POOL_IDLE_S",
            float,
            60.0,
            "seconds without a fetch after which all free result-pool memory is given back",
            unit="s",
        ),
        Setting(
            "VLLM_LENS_FETCH_GROUP_SHM_GB",
            float,
            64.0,
            "estimated results per fetch round trip when they travel through shared memory (one round trip "
            "lets the worker assemble a whole batch in parallel)",
            unit="GB",
        ),
        Setting(
            "VLLM_LENS_ASSEMBLY_THREADS",
            int,
            _assembly_threads,
            "most threads copying one fetch's captures into the result pool",
        ),
        Setting(
            "VLLM_LENS_WORKER_ONE_THREAD",
            bool,
            True,
            "the worker's per-request host work runs with torch's intra-op pool limited to the calling thread: "
            "a new batch's plan (admission, the steering's flush, the plan) and the probe scores' assembly at a "
            "fetch or progress call (0: the pool as vLLM set it); steps whose batch is unchanged never resize it",
        ),
        Setting(
            "VLLM_LENS_IDLE_PROBES",
            bool,
            True,
            "make the probe scores' results of finished requests while the engine is idle (a step that ran "
            "no tokens), so that their fetch finds them made (0: all at fetch)",
        ),
        Setting(
            "VLLM_LENS_EARLY_ASSEMBLY",
            bool,
            True,
            "copy captures into their shared-memory result regions while requests run (a worker thread, as "
            "each step's copy lands), so a fetch only finishes the last steps (0: all at fetch)",
        ),
        Setting(
            "VLLM_LENS_DIRECT_POOL",
            bool,
            True,
            "the GPU writes each step's captured rows straight into their shared-memory result regions (the "
            "pool's segments registered with CUDA as they are made; one kernel per step on the copy stream): "
            "no host copy for them (read at start-up; 0: early assembly copies them on the host). Unset: on with "
            "CUDA only on a vLLM release where they were checked byte-equal to host copies (vLLM 0.26; "
            "compat.version.DIRECT_WRITES_VERIFIED). On CPU only when set to 1: the step thread then writes them "
            "at the same offsets (for tests)",
        ),
        Setting(
            "VLLM_LENS_EARLY_INTERVAL_MS",
            float,
            20.0,
            "early assembly takes the steps filed since its last wake-up at most this often (its Python shares "
            "the engine's interpreter lock with the step loop; a fetch waiting for it wakes it at once)",
            unit="ms",
        ),
        Setting(
            "VLLM_LENS_STREAM_PACE",
            float,
            2.0,
            "streams with probe scores: after each shared progress RPC the API server waits this many times its "
            "round trip before the next (the engine core answers them between steps; chunks merge meanwhile, "
            "scores unchanged); 0: back to back",
        ),
        Setting(
            "VLLM_LENS_STREAM_MAX_PAUSE_MS",
            float,
            100.0,
            "the longest of those waits: how much later than its tokens a chunk's scores may be held back",
            unit="ms",
        ),
        Setting(
            "VLLM_LENS_GPU_CLOCK",
            bool,
            False,
            "benchmarks only: time each forward pass on the device too (CUDA events around it, read when "
            "`lens_forward_clock` is asked), so a run's extra wall time can be told apart into device work and "
            "host work (read at start-up)",
        ),
        Setting(
            "VLLM_LENS_HOST_CLOCK",
            bool,
            False,
            "benchmarks only: count each worker process's garbage collections by the thread that ran them "
            "(`lens_rusage` reports them beside every thread's CPU), so host time taken from the step thread "
            "can be told apart (read at start-up)",
        ),
        Setting(
            "VLLM_LENS_INJECT_FAULT",
            str,
            None,
            "tests only: make the plugin's own code raise at one stage (admission, plan, fill, tap, kernel, "
            "file, assemble; layout: at load), to prove such a failure fails only the requests it hits",
        ),
    )
}


def parse(name: str, raw: str | None) -> Any:
    """A setting's value as written (environment or flag; None or "" = its default); `ValueError` naming
    the setting when it cannot be read."""
    s = SETTINGS[name]
    if raw is None or raw.strip() == "":
        return s.default_value()
    text = raw.strip()
    if s.kind is bool:
        if text.lower() in TRUE:
            return True
        if text.lower() in FALSE:
            return False
        raise ValueError(f"{name}: expected 1/0 (or true/false, yes/no, on/off), got {raw!r}")
    if s.kind is str:
        return text
    try:
        value = float(text)
    except ValueError:
        raise ValueError(f"{name}: expected a number, got {raw!r}") from None
    if s.kind is int:
        if not value.is_integer():
            raise ValueError(f"{name}: expected a whole number, got {raw!r}")
        value = int(value)
    if s.limit and not value > 0:
        raise ValueError(f"{name}: must be positive, got {raw!r}")
    if not s.limit and value < 0:
        raise ValueError(f"{name}: must not be negative, got {raw!r}")
    return value


_MISSING = object()
_UNKEPT = object()  # memo key of a value never remembered
# name -> {its text as set (None: unset) or, for a default computed from other settings, their texts ->
# value}; a default computed from anything else is never remembered
_parsed: dict[str, dict[Any, Any]] = {}
_NONE: dict = {}  # (never written)
KEPT_TEXTS = 64  # texts remembered per setting (then its memo starts over)
# name -> `after` of the settings whose default is computed
_COMPUTED: dict[str, tuple[str, ...] | None] = {s.name: s.after for s in SETTINGS.values() if callable(s.default)}


def _key(name: str, raw: str | None) -> Any:
    """The memo key of a setting's value: its text, or for its default (unset or blank) None, the texts
    of the settings a computed default depends on (`Setting.after`), or `_UNKEPT`."""
    if raw and not raw.isspace():
        return raw
    if name not in _COMPUTED:
        return None
    after = _COMPUTED[name]
    return _UNKEPT if after is None else tuple(os.environ.get(n) for n in after)


def _remember(memo: dict[str, dict[Any, Any]], name: str, key: Any, value: Any) -> None:
    if key is _UNKEPT:
        return
    texts = memo.setdefault(name, {})
    if len(texts) >= KEPT_TEXTS:
        texts.clear()
    texts[key] = value


def _value(name: str, raw: str | None) -> Any:
    key = _key(name, raw)
    value = _parsed.get(name, _NONE).get(key, _MISSING)
    if value is _MISSING:
        value = parse(name, raw)  # ValueError naming the setting: nothing remembered
        _remember(_parsed, name, key, value)
    return value


def get(name: str) -> Any:
    """The setting's value now (from the environment, else its default). Read on every call, so a change
    of the environment takes effect at once; only the value of a text already seen is remembered (a few
    settings are read for every request: an environment read and two dictionary look-ups)."""
    return _value(name, os.environ.get(name))


def given(name: str) -> Any:
    """The setting's value when the environment sets it, else None (a setting whose default differs by
    device: `VLLM_LENS_DIRECT_POOL` on CPU acts only when set)."""
    raw = os.environ.get(name)
    return None if raw is None or raw.strip() == "" else _value(name, raw)


def limit(name: str) -> int:
    """A size setting in bytes (MB / GB settings), or a count, as an int."""
    return int(get(name) * UNITS.get(SETTINGS[name].unit, 1))


def limits() -> dict[str, int]:
    """Every operator limit in force (what /v1/lens/info reports)."""
    return {s.name: limit(s.name) for s in SETTINGS.values() if s.limit}


def flags() -> dict[str, str]:
    """`vllm-lens serve` flag -> setting name."""
    return {s.flag: s.name for s in SETTINGS.values() if s.flag}


def markdown_table() -> str:
    """The table of docs/settings.md."""
    rows = ["| variable | type | default | `vllm-lens serve` flag | what it does |", "|---|---|---|---|---|"]
    for s in SETTINGS.values():
        kind = s.kind.__name__ + (f" ({s.unit})" if s.unit else "")
        flag = f"`{s.flag}{'' if s.kind is bool else ' N'}`" if s.flag else ""
        rows.append(f"| `{s.name}` | {kind} | {s.default_text()} | {flag} | {s.what} |")
    return "\n".join(rows) + "\n"


if __name__ == "__main__":
    sys.stdout.write(markdown_table())
