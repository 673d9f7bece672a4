"""An SAE in the SAELens on-disk format, read without SAELens: `cfg.json` (architecture, d_in, d_sae, the
TransformerLens hook name, `apply_b_dec_to_input`, `normalize_activations`, `k` and
`rescale_acts_by_decoder_norm` for TopK) and `sae_weights.safetensors` (`W_enc` (d_in, d_sae), `b_enc`,
`W_dec` (d_sae, d_in), `b_dec`, `threshold` for JumpReLU). Both the pre-6.0 layout (hook name and
activation at the top level) and the 6.x one (`metadata` / `meta`) are read. Everything the SAE computes
here is float32. A field that would change the math and is not implemented is a ValueError naming it,
never ignored.

The math (as SAELens's inference SAEs): x' = norm_in(x) - b_dec * apply_b_dec_to_input;
pre = x' @ W_enc + b_enc; features = relu(pre) (standard), relu(pre) * (pre > threshold) (JumpReLU), or
the k largest of pre kept, through relu (TopK); decode(f) = norm_out(f @ W_dec + b_dec). A TopK SAE with
`rescale_acts_by_decoder_norm` (pre scaled by ‖W_dec[i]‖, f divided by it on decode) is read with the
norms folded into W_enc, b_enc and W_dec: the same features and reconstruction.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from vllm_worker.protocol import points as pts

CFG_FILE = "cfg.json"
WEIGHTS_FILE = "sae_weights.safetensors"
ARCHITECTURES = ("standard", "jumprelu", "topk")
NORMALISATIONS = ("none", "constant_norm_rescale", "layer_norm")
# TransformerLens hook names -> our points (`blocks.12.hook_resid_post`)
HOOKS = {
    "hook_resid_pre": pts.RESID_PRE,
    "hook_resid_mid": pts.RESID_MID,
    "hook_resid_post": pts.RESID_POST,
    "hook_attn_out": pts.ATTN_OUT,
    "hook_mlp_out": pts.MLP_OUT,
}
_HOOK_RE = re.compile(r"^blocks\.(\d+)\.(\w+)$")


def hook_point(hook_name: Any, field: str = "cfg.json: hook_name") -> tuple[str, int]:
    """(point, layer) of a TransformerLens hook name; a ValueError naming the supported ones otherwise."""
    m = _HOOK_RE.match(hook_name) if isinstance(hook_name, str) else None
    if m is None or m.group(2) not in HOOKS:
        raise ValueError(
            f"{field}: unsupported hook {hook_name!r}; supported: blocks.<layer>.<hook> with hook one of "
            f"{', '.join(HOOKS)}"
        )
    return HOOKS[m.group(2)], int(m.group(1))


@dataclass
class Sae:
    """One SAE's weights (float32, on one device) and how it reads the stream."""

    point: str
    layer: int
    architecture: str  # standard | jumprelu | topk
    W_enc: torch.Tensor  # (d_in, d_sae)
    b_enc: torch.Tensor  # (d_sae,)
    W_dec: torch.Tensor  # (d_sae, d_in)
    b_dec: torch.Tensor  # (d_in,)
    threshold: torch.Tensor | None = None  # (d_sae,) JumpReLU
    k: int = 0  # TopK
    apply_b_dec_to_input: bool = True
    normalize: str = "none"
    hook_name: str = ""

    @property
    def d_in(self) -> int:
        return self.W_enc.shape[0]

    @property
    def d_sae(self) -> int:
        return self.W_enc.shape[1]

    def to(self, device: torch.device | str) -> "Sae":
        def mv(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t.to(device, torch.float32).contiguous()

        return replace(
            self,
            W_enc=mv(self.W_enc),
            b_enc=mv(self.b_enc),
            W_dec=mv(self.W_dec),
            b_dec=mv(self.b_dec),
            threshold=mv(self.threshold),
        )

    def encode(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | float]:
        """(features (n, d_sae), the factor that maps a decoded difference back to the stream's scale)."""
        x = x.float()
        out_scale: torch.Tensor | float = 1.0
        if self.normalize == "constant_norm_rescale":
            coeff = math.sqrt(self.d_in) / x.norm(dim=-1, keepdim=True)
            x, out_scale = x * coeff, 1.0 / coeff
        elif self.normalize == "layer_norm":
            x = x - x.mean(dim=-1, keepdim=True)
            std = x.std(dim=-1, keepdim=True)
            x, out_scale = x / (std + 1e-5), std
        if self.apply_b_dec_to_input:
            x = x - self.b_dec
        pre = x @ self.W_enc + self.b_enc
        if self.architecture == "topk":
            top = pre.topk(self.k, dim=-1)
            return torch.zeros_like(pre).scatter_(-1, top.indices, top.values.relu()), out_scale
        if self.architecture == "jumprelu":  # SAELens: relu, then the mask (a threshold < 0 keeps no negatives)
            return pre.relu() * (pre > self.threshold), out_scale
        return pre.relu(), out_scale

    def decode(self, f: torch.Tensor, out_scale: torch.Tensor | float = 1.0, mean: Any = None) -> torch.Tensor:
        """The reconstruction (`mean`: the row means taken out by layer_norm, added back)."""
        y = (f @ self.W_dec + self.b_dec) * out_scale
        return y if mean is None else y + mean

    def clamp_delta(self, x: torch.Tensor, ids: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        """What clamping features `ids` to `values` adds to the stream `x`: decode(f with f[ids] = values) -
        decode(f), i.e. (values - f[ids]) @ W_dec[ids] in the stream's scale — the SAE's error term kept."""
        f, out_scale = self.encode(x)
        return ((values - f[:, ids]) @ self.W_dec[ids]) * out_scale


def _cfg_get(cfg: dict, key: str, default: Any = None) -> Any:
    if key in cfg:
        return cfg[key]
    for meta in ("metadata", "meta"):
        if isinstance(cfg.get(meta), dict) and key in cfg[meta]:
            return cfg[meta][key]
    return default


def _architecture(cfg: dict) -> tuple[str, int]:
    arch = cfg.get("architecture", "standard")
    act = cfg.get("activation_fn_str", cfg.get("activation_fn", "relu"))
    kwargs = cfg.get("activation_fn_kwargs") or {}
    if arch == "standard" and act == "topk":  # pre-6.0 TopK: a standard SAE with a topk activation
        arch = "topk"
    if arch not in ARCHITECTURES:
        raise ValueError(f"cfg.json: architecture {arch!r} is not supported (supported: {', '.join(ARCHITECTURES)})")
    if arch == "standard" and act not in ("relu", None):
        raise ValueError(f"cfg.json: activation_fn {act!r} is not supported (relu, topk)")
    if arch != "topk":
        return arch, 0
    k = cfg.get("k", kwargs.get("k"))
    if isinstance(k, bool) or not isinstance(k, int) or k <= 0:
        raise ValueError(f"cfg.json: k: a TopK SAE needs a positive int k, got {k!r}")
    return arch, k


def _normalisation(cfg: dict) -> str:
    norm = cfg.get("normalize_activations", "none")
    if isinstance(norm, bool):  # SAELens's old boolean form
        norm = "expected_average_only_in" if norm else "none"
    if norm == "expected_average_only_in":
        # a constant factor SAELens keeps outside the folder (its pretrained directory) and folds in when it
        # loads a release; without it the features would be silently off-scale
        raise ValueError(
            f"{CFG_FILE}: normalize_activations 'expected_average_only_in' needs its scaling factor s, which is "
            "not in the SAE's folder: fold it into the weights (W_enc * s, W_dec / s, b_dec / s, as SAELens's "
            "fold_activation_norm_scaling_factor does) and set normalize_activations to 'none'"
        )
    if norm not in NORMALISATIONS:
        raise ValueError(f"{CFG_FILE}: normalize_activations {norm!r} is not supported ({', '.join(NORMALISATIONS)})")
    return str(norm)


def load(path: str | Path) -> Sae:
    """Read an SAE folder (CPU, float32); every problem is a ValueError naming the file and field."""
    from safetensors import safe_open

    folder = Path(path)
    if not folder.is_dir():
        raise ValueError(f"path: {str(path)!r} is not a directory holding {CFG_FILE} and {WEIGHTS_FILE}")
    try:
        cfg = json.loads((folder / CFG_FILE).read_text())
    except FileNotFoundError:
        raise ValueError(f"path: no {CFG_FILE} in {str(folder)!r}") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"{CFG_FILE}: not valid JSON ({e.msg})") from None
    if not isinstance(cfg, dict):
        raise ValueError(f"{CFG_FILE}: expected a JSON object")
    hook_name = _cfg_get(cfg, "hook_name", _cfg_get(cfg, "hook_point"))
    point, layer = hook_point(hook_name, f"{CFG_FILE}: hook_name")
    if _cfg_get(cfg, "hook_head_index", _cfg_get(cfg, "hook_point_head_index")) is not None:
        raise ValueError(f"{CFG_FILE}: hook_head_index: SAEs on one head are not supported")
    if cfg.get("reshape_activations", "none") != "none":
        raise ValueError(f"{CFG_FILE}: reshape_activations {cfg['reshape_activations']!r} is not supported")
    if cfg.get("finetuning_scaling_factor"):
        raise ValueError(f"{CFG_FILE}: finetuning_scaling_factor is not supported")
    arch, k = _architecture(cfg)
    norm = _normalisation(cfg)
    apply_b_dec = cfg.get("apply_b_dec_to_input", True)
    if not isinstance(apply_b_dec, bool):
        raise ValueError(f"{CFG_FILE}: apply_b_dec_to_input: expected true or false, got {apply_b_dec!r}")
    rescale = cfg.get("rescale_acts_by_decoder_norm", False)
    if not isinstance(rescale, bool):
        raise ValueError(f"{CFG_FILE}: rescale_acts_by_decoder_norm: expected true or false, got {rescale!r}")
    if rescale and arch != "topk":
        raise ValueError(f"{CFG_FILE}: rescale_acts_by_decoder_norm is only supported for topk SAEs, not {arch!r}")
    weights = folder / WEIGHTS_FILE
    if not weights.is_file():
        raise ValueError(f"path: no {WEIGHTS_FILE} in {str(folder)!r}")
    try:
        with safe_open(str(weights), framework="pt", device="cpu") as f:
            t = {name: f.get_tensor(name).float() for name in f.keys()}
    except Exception as e:  # noqa: BLE001 - a damaged file is the caller's input
        raise ValueError(f"{WEIGHTS_FILE}: cannot be read ({type(e).__name__}: {e})") from None
    for name in ("W_enc", "b_enc", "W_dec", "b_dec"):
        if name not in t:
            raise ValueError(f"{WEIGHTS_FILE}: no tensor {name!r} (has: {', '.join(sorted(t))})")
    d_in, d_sae = cfg.get("d_in"), cfg.get("d_sae")
    if not isinstance(d_in, int) or not isinstance(d_sae, int):
        if t["W_enc"].ndim != 2:
            raise ValueError(f"{WEIGHTS_FILE}: W_enc has shape {tuple(t['W_enc'].shape)}, expected (d_in, d_sae)")
        d_in, d_sae = t["W_enc"].shape
    want = {"W_enc": (d_in, d_sae), "b_enc": (d_sae,), "W_dec": (d_sae, d_in), "b_dec": (d_in,)}
    threshold = None
    if arch == "jumprelu":
        if "threshold" in t:
            threshold = t["threshold"]
        elif "log_threshold" in t:
            threshold = t["log_threshold"].exp()
        else:
            raise ValueError(f"{WEIGHTS_FILE}: a JumpReLU SAE needs a 'threshold' tensor")
        t["threshold"] = threshold
        want["threshold"] = (d_sae,)
    for name, shape in want.items():
        if tuple(t[name].shape) != shape:
            raise ValueError(f"{WEIGHTS_FILE}: {name} has shape {tuple(t[name].shape)}, expected {shape} (d_in, d_sae)")
        if not torch.isfinite(t[name]).all():
            raise ValueError(f"{WEIGHTS_FILE}: {name} contains NaN or inf")
    if k > d_sae:
        raise ValueError(f"{CFG_FILE}: k {k} > d_sae {d_sae}")
    if rescale:  # fold the decoder norms: pre * n = x' @ (W_enc * n) + b_enc * n; (f / n) @ W_dec = f @ (W_dec / n)
        n = t["W_dec"].norm(dim=-1)
        if not (n > 0).all():
            raise ValueError(f"{WEIGHTS_FILE}: rescale_acts_by_decoder_norm: W_dec has rows of norm 0")
        t["W_enc"], t["b_enc"], t["W_dec"] = t["W_enc"] * n, t["b_enc"] * n, t["W_dec"] / n.unsqueeze(1)
    return Sae(
        point,
        layer,
        arch,
        t["W_enc"],
        t["b_enc"],
        t["W_dec"],
        t["b_dec"],
        threshold,
        k,
        apply_b_dec,
        norm,
        str(hook_name),
    )


def save(sae: Sae, path: str | Path, **meta: Any) -> Path:
    """Write `sae` in the SAELens 6.x layout (what `load` and SAELens's `load_from_disk` read)."""
    from safetensors.torch import save_file

    folder = Path(path)
    folder.mkdir(parents=True, exist_ok=True)
    tensors = {"W_enc": sae.W_enc, "b_enc": sae.b_enc, "W_dec": sae.W_dec, "b_dec": sae.b_dec}
    if sae.threshold is not None:
        tensors["threshold"] = sae.threshold
    save_file({k: v.detach().float().contiguous().cpu() for k, v in tensors.items()}, str(folder / WEIGHTS_FILE))
    name = next(h for h, p in HOOKS.items() if p == sae.point)
    cfg: dict[str, Any] = {
        "architecture": sae.architecture,
        "d_in": sae.d_in,
        "d_sae": sae.d_sae,
        "dtype": "float32",
        "device": "cpu",
        "apply_b_dec_to_input": sae.apply_b_dec_to_input,
        "normalize_activations": sae.normalize,
        "reshape_activations": "none",
        "metadata": {"hook_name": f"blocks.{sae.layer}.{name}", "sae_lens_version": "6.0.0", **meta},
    }
    if sae.architecture == "topk":
        cfg["k"] = sae.k
    (folder / CFG_FILE).write_text(json.dumps(cfg, indent=1))
    return folder
