"""inspect-lens, Inspect side: linear probes and their metrics (provider, solvers and scorers follow).

`inspect_lens` never touches vLLM internals; it talks to a `vllm-lens serve` server over HTTP."""

from .probes import LinearProbe, auroc, recall_at_threshold, threshold_at_fpr

__all__ = ["LinearProbe", "auroc", "recall_at_threshold", "threshold_at_fpr"]
