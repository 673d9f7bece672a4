"""The served probe format: a folder with `probe.safetensors` (`weight` (n_out, len(layers) * d_model),
`bias` (n_out,), optional `mean` / `std` over the same concatenated input) and `probe.json` (`layers`,
`point`, `output`, optional `threshold`, `aggregate`, `d_model`, `model`, `metadata`). One writer
(`save_probe`) and one reader (`load_probe_files`) that every producer and the engine share, both through
`check_probe`, so a file the writer accepts is a file the engine loads. No vLLM import."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from vllm_worker.probes import aggregation
from vllm_worker.protocol import points as pts
from vllm_worker.protocol.checks import finite_number, int_list

WEIGHTS_FILE = "probe.safetensors"
CONFIG_FILE = "probe.json"
FORMAT_VERSION = 1
OUTPUTS = ("logit", "sigmoid")
_TENSORS = ("weight", "bias", "mean", "std")
_CONFIG = ("format_version", "layers", "point", "output", "threshold", "aggregate", "d_model", "model", "metadata")


@dataclass
class Probe:
    """A checked probe: score(x) = ((x - mean) / std) @ weight.T + bias over the rows of `layers`
    concatenated in that order (then a sigmoid when `output == "sigmoid"`)."""

    weight: torch.Tensor  # (n_out, len(layers) * d_model) float32
    bias: torch.Tensor  # (n_out,) float32
    layers: list[int]
    point: str = pts.RESID_POST
    output: str = "logit"
    threshold: float | None = None
    aggregate: list[str] = field(default_factory=list)
    mean: torch.Tensor | None = None  # (len(layers) * d_model,)
    std: torch.Tensor | None = None
    model: str | None = None
    metadata: dict[str, Any] = field(default_factory=dict)

    @property
    def n_out(self) -> int:
        return int(self.weight.shape[0])

    @property
    def d_model(self) -> int:
        return int(self.weight.shape[1]) // len(self.layers)

    def folded(self) -> tuple[list[torch.Tensor], torch.Tensor]:
        """(per layer (n_out, d_model) weights with `std` folded in, the bias with `mean` folded in): the
        score is then sum_l x_l @ W_l.T + b, one matmul per layer's rows (what the workers run)."""
        w = self.weight.double()
        b = self.bias.double()
        if self.std is not None:
            w = w / self.std.double()
        if self.mean is not None:
            b = b - w @ self.mean.double()
        return [c.float().contiguous() for c in w.split(self.d_model, dim=1)], b.float()

    def score(self, rows: torch.Tensor) -> torch.Tensor:
        """Reference scores of `rows` (n, len(layers) * d_model) in float32 (tests, calibration)."""
        x = rows.to(torch.float32)
        if self.mean is not None:
            x = x - self.mean
        if self.std is not None:
            x = x / self.std
        y = x @ self.weight.T + self.bias
        return torch.sigmoid(y) if self.output == "sigmoid" else y


def _tensor(value: Any, f: str) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        try:
            value = torch.as_tensor(value)
        except Exception:  # noqa: BLE001 - what it is does not matter, only that it is not numbers
            raise ValueError(f"{f}: expected a tensor of numbers, got {type(value).__name__}") from None
    if not (value.is_floating_point() or value.dtype in (torch.int32, torch.int64)):
        raise ValueError(f"{f}: expected a floating-point tensor, got {value.dtype}")
    # a copy of its own: a loaded probe must not change when the caller later writes into their tensor
    t = value.detach().to("cpu", torch.float32, copy=True).contiguous()
    if not bool(torch.isfinite(t).all()):
        raise ValueError(f"{f}: contains NaN or inf values")
    return t


def _vector(value: Any, f: str, n: int, what: str) -> torch.Tensor:
    t = _tensor(value, f)
    if t.dim() == 0 and n == 1:
        t = t.reshape(1)
    if tuple(t.shape) != (n,):
        raise ValueError(f"{f}: expected shape ({n},) ({what}), got {tuple(t.shape)}")
    return t


def check_probe(
    weight: Any,
    bias: Any = None,
    layers: Any = None,
    point: Any = pts.RESID_POST,
    output: Any = "logit",
    threshold: Any = None,
    aggregate: Any = None,
    mean: Any = None,
    std: Any = None,
    d_model: Any = None,
    model: Any = None,
    metadata: Any = None,
) -> Probe:
    """A `Probe` from its parts, every field checked (ValueError naming it). A 1-D `weight` is one output."""
    w = _tensor(weight, "weight")
    if w.dim() == 1:
        w = w.unsqueeze(0)
    if w.dim() != 2 or w.shape[0] == 0 or w.shape[1] == 0:
        raise ValueError(f"weight: expected shape (n_out, len(layers) * d_model), got {tuple(w.shape)}")
    if isinstance(layers, int) and not isinstance(layers, bool):
        layers = [layers]
    if layers is None or not isinstance(layers, (list, tuple, range)) or not layers:
        raise ValueError(f"layers: expected a non-empty list of layer indices, got {layers!r}")
    ls = int_list(layers, "layers", "layer indices")
    if any(l < 0 for l in ls) or len(set(ls)) != len(ls):
        raise ValueError(f"layers: expected distinct non-negative layer indices, got {ls}")
    p = pts.point_name(point, "point")
    if w.shape[1] % len(ls):
        raise ValueError(
            f"weight: {w.shape[1]} columns are not len(layers) * d_model for {len(ls)} layers (the layers' rows "
            "concatenated in the order of `layers`)"
        )
    d = w.shape[1] // len(ls)
    if d_model is not None:
        if isinstance(d_model, bool) or not isinstance(d_model, int) or d_model != d:
            raise ValueError(
                f"d_model: {d_model!r} does not match the weight ({w.shape[1]} columns / {len(ls)} layers)"
            )
    if output not in OUTPUTS:
        raise ValueError(f"output: expected one of {list(OUTPUTS)}, got {output!r}")
    b = torch.zeros(w.shape[0]) if bias is None else _vector(bias, "bias", w.shape[0], "n_out")
    m = None if mean is None else _vector(mean, "mean", w.shape[1], "len(layers) * d_model")
    s = None if std is None else _vector(std, "std", w.shape[1], "len(layers) * d_model")
    if s is not None and not bool((s > 0).all()):
        raise ValueError("std: every value must be > 0")
    th = None if threshold is None else finite_number(threshold, "threshold")
    agg = [] if aggregate is None else aggregation.names(aggregate, "aggregate")
    if model is not None and not isinstance(model, str):
        raise ValueError(f"model: expected a string (the model it was fitted on), got {model!r}")
    if metadata is not None and not isinstance(metadata, dict):
        raise ValueError(f"metadata: expected an object, got {type(metadata).__name__}")
    return Probe(w, b, ls, p, str(output), th, agg, m, s, model, dict(metadata or {}))


def save_probe(
    folder: str | Path,
    weight: Any,
    bias: Any = None,
    layers: Any = None,
    point: str = pts.RESID_POST,
    output: str = "logit",
    threshold: float | None = None,
    aggregate: Any = None,
    mean: Any = None,
    std: Any = None,
    model: str | None = None,
    metadata: dict[str, Any] | None = None,
) -> Path:
    """Write a probe in the served format (checked first, as the engine checks it); the folder's path."""
    from safetensors.torch import save_file

    p = check_probe(weight, bias, layers, point, output, threshold, aggregate, mean, std, None, model, metadata)
    out = Path(folder)
    out.mkdir(parents=True, exist_ok=True)
    tensors = {"weight": p.weight, "bias": p.bias}
    if p.mean is not None:
        tensors["mean"] = p.mean
    if p.std is not None:
        tensors["std"] = p.std
    save_file(tensors, str(out / WEIGHTS_FILE))
    cfg: dict[str, Any] = {
        "format_version": FORMAT_VERSION,
        "layers": p.layers,
        "point": p.point,
        "output": p.output,
        "d_model": p.d_model,
    }
    for key, v in (("threshold", p.threshold), ("aggregate", p.aggregate or None), ("model", p.model)):
        if v is not None:
            cfg[key] = v
    if p.metadata:
        cfg["metadata"] = p.metadata
    (out / CONFIG_FILE).write_text(json.dumps(cfg, indent=1))
    return out


def load_probe_files(folder: str | Path) -> Probe:
    """Read and check a probe folder (ValueError naming the file's field)."""
    from safetensors import safe_open

    root = Path(folder)
    for name in (WEIGHTS_FILE, CONFIG_FILE):
        if not (root / name).is_file():
            raise ValueError(
                f"path: {str(root)!r} has no {name} (a probe folder holds {WEIGHTS_FILE} and {CONFIG_FILE})"
            )
    try:
        cfg = json.loads((root / CONFIG_FILE).read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{CONFIG_FILE}: not valid JSON ({e.msg} at position {e.pos})") from None
    if not isinstance(cfg, dict):
        raise ValueError(f"{CONFIG_FILE}: expected an object, got {type(cfg).__name__}")
    unknown = sorted(set(cfg) - set(_CONFIG))
    if unknown:
        raise ValueError(f"{CONFIG_FILE}: unknown fields {unknown}{pts.closest(unknown[0], _CONFIG)}")
    version = cfg.get("format_version", FORMAT_VERSION)
    if version != FORMAT_VERSION:
        raise ValueError(f"format_version: this engine reads version {FORMAT_VERSION}, got {version!r}")
    try:
        with safe_open(str(root / WEIGHTS_FILE), framework="pt") as f:
            keys = list(f.keys())
            tensors = {k: f.get_tensor(k) for k in keys}
    except Exception as e:  # noqa: BLE001 - a damaged file is the caller's input
        raise ValueError(f"{WEIGHTS_FILE}: cannot be read ({type(e).__name__}: {e})") from None
    extra = sorted(set(tensors) - set(_TENSORS))
    if extra:
        raise ValueError(f"{WEIGHTS_FILE}: unknown tensors {extra}; expected weight, bias and optionally mean, std")
    if "weight" not in tensors:
        raise ValueError(f"weight: {WEIGHTS_FILE} has no 'weight' tensor")
    if "layers" not in cfg:
        raise ValueError(f"layers: {CONFIG_FILE} has no 'layers'")
    return check_probe(
        tensors["weight"],
        tensors.get("bias"),
        cfg["layers"],
        cfg.get("point", pts.RESID_POST),
        cfg.get("output", "logit"),
        cfg.get("threshold"),
        cfg.get("aggregate"),
        tensors.get("mean"),
        tensors.get("std"),
        cfg.get("d_model"),
        cfg.get("model"),
        cfg.get("metadata"),
    )
