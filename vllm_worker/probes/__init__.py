"""Linear probes served by the engine (docs/probes.md, "Probes on the engine"): the on-disk format
(`format`: `probe.safetensors` + `probe.json`) and the aggregates of per-token scores (`aggregates`). No vLLM
import: Inspect scorers and the calibration command use them as they are."""

from vllm_worker.probes.aggregation import aggregate, aggregates, series  # noqa: F401
from vllm_worker.probes.format import Probe, check_probe, load_probe_files, save_probe  # noqa: F401
