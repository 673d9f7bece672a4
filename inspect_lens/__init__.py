"""inspect-lens, Inspect side: the `vllm-lens/<model>` provider (registered by entry point), solvers that
capture and steer, linear probes, the deception- and coup-probe scorers and their metrics, and our datasets.

`inspect_lens` never touches vLLM internals; it talks to a `vllm-lens serve` server over HTTP."""

from .metrics import auroc_by, auroc_ci, probe_auroc, recall_at_fpr
from .oracle import activation_oracle, oracle_match
from .probes import LinearProbe, auroc, recall_at_threshold, threshold_at_fpr
from .sae_scorers import sae_feature
from .scorers import coup_probe, deception_probe
from .served_probes import probe_scorer, probe_scores
from .solvers import Captured, capture_activations, captured, steer
from .steering import register_steering_vector

__all__ = [
    "Captured",
    "LinearProbe",
    "activation_oracle",
    "auroc",
    "auroc_by",
    "auroc_ci",
    "capture_activations",
    "captured",
    "coup_probe",
    "deception_probe",
    "oracle_match",
    "probe_auroc",
    "probe_scorer",
    "probe_scores",
    "recall_at_fpr",
    "recall_at_threshold",
    "register_steering_vector",
    "sae_feature",
    "steer",
    "threshold_at_fpr",
]
