"""Linear probes on residual-stream activations: standardize + logistic regression, trained per token,
scored per response by averaging token scores over a detection window. Saved as JSON (no pickle).

    probe = LinearProbe.fit(token_acts, token_labels)        # (N, d) float, (N,) {0,1}
    scores = probe.score_tokens(acts)                       # (T,) logits, one per token
    probe.score_response(acts, window=(start, end))          # mean over the window
    probe.calibrate(control_scores, fpr=0.01)                # threshold from a control set
    probe.save("probe.json"); LinearProbe.load("probe.json")
    probe.save_served("probe_dir")                           # the engine's format: served as is
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import numpy as np


@dataclass
class LinearProbe:
    mean: np.ndarray  # (d,)
    scale: np.ndarray  # (d,)
    coef: np.ndarray  # (d,) in standardized space
    intercept: float
    layer: int | None = None
    threshold: float | None = None  # response-score threshold at `calibrated_fpr`
    calibrated_fpr: float | None = None
    meta: dict = field(default_factory=dict)

    @classmethod
    def fit(
        cls,
        acts: np.ndarray,
        labels: np.ndarray,
        *,
        C: float = 1.0,
        layer: int | None = None,
        max_iter: int = 2000,
        seed: int = 0,
    ) -> "LinearProbe":
        """Per-token logistic regression on standardized activations (labels 1 = deceptive)."""
        from sklearn.linear_model import LogisticRegression

        x = np.asarray(acts, dtype=np.float64)
        y = np.asarray(labels).astype(int)
        if x.ndim != 2 or y.shape != (x.shape[0],):
            raise ValueError(f"fit: expected acts (N, d) and labels (N,), got {x.shape} and {y.shape}")
        if set(np.unique(y)) != {0, 1}:
            raise ValueError("fit: labels must contain both classes 0 and 1")
        mean = x.mean(0)
        scale = x.std(0)
        scale[scale < 1e-8] = 1.0
        clf = LogisticRegression(C=C, max_iter=max_iter, random_state=seed)
        clf.fit((x - mean) / scale, y)
        return cls(mean, scale, clf.coef_[0].copy(), float(clf.intercept_[0]), layer)

    def score_tokens(self, acts: np.ndarray) -> np.ndarray:
        """Logit per token: higher = more like the positive (deceptive) class."""
        x = np.asarray(acts, dtype=np.float64)
        return ((x - self.mean) / self.scale) @ self.coef + self.intercept

    def score_response(self, acts: np.ndarray, window: tuple[int, int | None] = (0, None)) -> float:
        """Mean token score over `acts[window[0]:window[1]]` (the detection window)."""
        s = self.score_tokens(np.asarray(acts)[window[0] : window[1]])
        if s.size == 0:
            raise ValueError(f"score_response: empty detection window {window}")
        return float(s.mean())

    def calibrate(self, control_scores: Sequence[float], fpr: float = 0.01) -> float:
        """Threshold so that at most `fpr` of control (benign) responses score above it."""
        self.threshold = threshold_at_fpr(control_scores, fpr)
        self.calibrated_fpr = fpr
        return self.threshold

    def to_json(self) -> dict:
        return {
            "format": "inspect-lens-linear-probe/1",
            "layer": self.layer,
            "mean": self.mean.tolist(),
            "scale": self.scale.tolist(),
            "coef": self.coef.tolist(),
            "intercept": self.intercept,
            "threshold": self.threshold,
            "calibrated_fpr": self.calibrated_fpr,
            "meta": self.meta,
        }

    @classmethod
    def from_json(cls, obj: dict) -> "LinearProbe":
        if obj.get("format") != "inspect-lens-linear-probe/1":
            raise ValueError(f"not an inspect-lens probe file (format={obj.get('format')!r})")
        arr = {k: np.asarray(obj[k], dtype=np.float64) for k in ("mean", "scale", "coef")}
        if not arr["mean"].shape == arr["scale"].shape == arr["coef"].shape:
            raise ValueError("probe file: mean, scale and coef must have the same length")
        return cls(
            arr["mean"],
            arr["scale"],
            arr["coef"],
            float(obj["intercept"]),
            obj.get("layer"),
            obj.get("threshold"),
            obj.get("calibrated_fpr"),
            dict(obj.get("meta") or {}),
        )

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        path.write_text(json.dumps(self.to_json()))
        return path

    @classmethod
    def load(cls, path: str | Path) -> "LinearProbe":
        """A JSON probe file, or a served probe folder (`save_served`)."""
        if Path(path).is_dir():
            return cls.from_served(path)
        return cls.from_json(json.loads(Path(path).read_text()))

    def save_served(self, folder: str | Path, *, layer: int | None = None, model: str | None = None) -> Path:
        """Write the probe in the engine's format (`vllm_worker.probes.format`: probe.safetensors with weight
        (1, d), bias, mean, std; probe.json with layers, output "logit", threshold, aggregate "mean" — the
        response score this probe's threshold was fitted on), so `llm.load_probe(name, folder)` and
        `--lens-probe-dir` serve it unchanged. float32 on disk, as the engine computes."""
        from vllm_worker.probes.format import save_probe

        lyr = self.layer if layer is None else layer
        if lyr is None:
            raise ValueError("layer: this probe has no layer; pass save_served(..., layer=L)")
        meta = {"source_format": "inspect-lens-linear-probe/1", "calibrated_fpr": self.calibrated_fpr, **self.meta}
        return save_probe(
            folder,
            weight=self.coef[None, :],
            bias=[self.intercept],
            layers=[int(lyr)],
            output="logit",
            threshold=self.threshold,
            aggregate=["mean"],
            mean=self.mean,
            std=self.scale,
            model=model if model is not None else self.meta.get("model"),
            metadata=json.loads(json.dumps(meta, default=str)),
        )

    @classmethod
    def from_served(cls, folder: str | Path) -> "LinearProbe":
        """A served probe folder with one output at one layer, as a `LinearProbe` (threshold kept)."""
        from vllm_worker.probes.format import load_probe_files

        p = load_probe_files(folder)
        if p.n_out != 1 or len(p.layers) != 1 or p.output != "logit":
            raise ValueError(
                f"path: {str(folder)!r} is a probe with {p.n_out} outputs at layers {p.layers} ({p.output}); "
                "a LinearProbe is one logit at one layer"
            )
        d = p.d_model
        mean = np.zeros(d) if p.mean is None else p.mean.double().numpy()
        scale = np.ones(d) if p.std is None else p.std.double().numpy()
        meta = dict(p.metadata)
        fpr = meta.pop("calibrated_fpr", None)
        meta.pop("source_format", None)
        if p.model is not None:
            meta.setdefault("model", p.model)
        return cls(mean, scale, p.weight[0].double().numpy(), float(p.bias[0]), p.layers[0], p.threshold, fpr, meta)


def threshold_at_fpr(control_scores: Sequence[float], fpr: float) -> float:
    """Smallest threshold with at most `fpr` of the control scores strictly above it (the definition
    `vllm-lens probes calibrate` uses, so a threshold fitted here and one fitted there agree)."""
    from vllm_worker.probes.calibrate import threshold_at_fpr as fit

    return fit(control_scores, fpr)


def auroc(scores: Sequence[float], labels: Sequence[int]) -> float:
    """Area under the ROC curve (probability a positive outscores a negative; ties count half)."""
    s = np.asarray(scores, dtype=np.float64)
    y = np.asarray(labels).astype(int)
    pos, neg = s[y == 1], s[y == 0]
    if pos.size == 0 or neg.size == 0:
        return float("nan")
    greater = (pos[:, None] > neg[None, :]).sum()
    ties = (pos[:, None] == neg[None, :]).sum()
    return float((greater + 0.5 * ties) / (pos.size * neg.size))


def recall_at_threshold(scores: Sequence[float], labels: Sequence[int], threshold: float) -> float:
    """Fraction of positives scoring strictly above `threshold`."""
    s = np.asarray(scores, dtype=np.float64)
    y = np.asarray(labels).astype(int)
    pos = s[y == 1]
    return float("nan") if pos.size == 0 else float((pos > threshold).mean())
