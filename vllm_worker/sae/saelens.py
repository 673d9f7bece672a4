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

Transcoders (SAELens's `transcoder`, `jumprelu_transcoder`, `skip_transcoder`): the encoder reads one hook
point (`hook_name`, e.g. `blocks.L.ln2.hook_normalized`, our `mlp_in`) and the decoder writes another
(`hook_name_out`, e.g. `blocks.L.hook_mlp_out`): W_dec is (d_sae, d_out), b_dec (d_out,) and is never
subtracted from the input (SAELens refuses `apply_b_dec_to_input` there), and the decode is not
un-normalised (the output lives at another point). A skip transcoder's `W_skip` (d_out, d_in) adds
x @ W_skip.T to the reconstruction; it cancels in a clamp's difference.
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
# SAELens transcoder architectures -> the encoder they use
TRANSCODERS = {"transcoder": "standard", "jumprelu_transcoder": "jumprelu", "skip_transcoder": "standard"}
NORMALISATIONS = ("none", "constant_norm_rescale", "layer_norm")
# TransformerLens hook names -> our points (`blocks.12.hook_resid_post`)
HOOKS = {
    "hook_resid_pre": pts.RESID_PRE,
    "hook_resid_mid": pts.RESID_MID,
    "hook_resid_post": pts.RESID_POST,
    "hook_attn_out": pts.ATTN_OUT,
    "hook_mlp_out": pts.MLP_OUT,
    # what the MLP reads: TransformerLens's normalised stream after ln2 (with the norm's weight applied here)
    "ln2.hook_normalized": pts.MLP_IN,
    "mlp.hook_post": pts.MLP_POST,  # refused when loaded (the point is not built yet)
}
_HOOK_RE = re.compile(r"^blocks\.(\d+)\.([\w.]+)$")


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
    # transcoders: the point the decoder writes (None: an SAE, which writes where it reads)
    out_point: str | None = None
    out_layer: int = -1
    hook_name_out: str = ""
    W_skip: torch.Tensor | None = None  # (d_out, d_in): skip transcoders

    @property
    def transcoder(self) -> bool:
        return self.out_point is not None

    @property
    def d_out(self) -> int:
        return self.W_dec.shape[1]

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
            W_skip=mv(self.W_skip),
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
        if self.transcoder:  # the decode writes another point: never scaled back by this one's norm
            out_scale = 1.0
        elif self.apply_b_dec_to_input:
            x = x - self.b_dec
        pre = x @ self.W_enc + self.b_enc
        if self.architecture == "topk":
            top = pre.topk(self.k, dim=-1)
            return torch.zeros_like(pre).scatter_(-1, top.indices, top.values.relu()), out_scale
        if self.architecture == "jumprelu":  # SAELens: relu, then the mask (a threshold < 0 keeps no negatives)
            return pre.relu() * (pre > self.threshold), out_scale
        return pre.relu(), out_scale

    def decode(self, f: torch.Tensor, out_scale: torch.Tensor | float = 1.0, mean: Any = None) -> torch.Tensor:
        """The reconstruction (`mean`: the row means taken out by layer_norm, added back); a transcoder's is
        of its output point (`reconstruct` adds a skip transcoder's skip term, which needs the input)."""
        y = (f @ self.W_dec + self.b_dec) * out_scale
        return y if mean is None else y + mean

    def reconstruct(self, x: torch.Tensor) -> torch.Tensor:
        """A transcoder's prediction of its output point from the input point's rows `x`."""
        y = self.decode(self.encode(x)[0])
        return y if self.W_skip is None else y + x.float() @ self.W_skip.T

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
    if arch in TRANSCODERS:
        return TRANSCODERS[arch], 0
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
    kind = str(cfg.get("architecture", "standard"))
    transcoder = kind in TRANSCODERS
    norm = _normalisation(cfg)
    apply_b_dec = cfg.get("apply_b_dec_to_input", not transcoder)
    if not isinstance(apply_b_dec, bool):
        raise ValueError(f"{CFG_FILE}: apply_b_dec_to_input: expected true or false, got {apply_b_dec!r}")
    out_point, out_layer, hook_name_out = None, -1, ""
    if transcoder:
        if apply_b_dec:  # b_dec is d_out wide: SAELens refuses it for transcoders too
            raise ValueError(f"{CFG_FILE}: apply_b_dec_to_input: must be false for a transcoder ({kind!r})")
        hook_name_out = _cfg_get(cfg, "hook_name_out")
        out_point, out_layer = hook_point(hook_name_out, f"{CFG_FILE}: hook_name_out")
        if _cfg_get(cfg, "hook_head_index_out") is not None:
            raise ValueError(f"{CFG_FILE}: hook_head_index_out: transcoders writing one head are not supported")
        if out_layer != layer or pts.POINTS.index(out_point) <= pts.POINTS.index(point):
            raise ValueError(
                f"{CFG_FILE}: hook_name_out: a transcoder here writes a later point of the layer it reads "
                f"(read {hook_name!r}, write {hook_name_out!r})"
            )
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
    d_out = d_in
    if transcoder:
        d_out = cfg.get("d_out")
        if isinstance(d_out, bool) or not isinstance(d_out, int) or d_out <= 0:
            raise ValueError(f"{CFG_FILE}: d_out: a transcoder needs its output width as a positive int, got {d_out!r}")
    want = {"W_enc": (d_in, d_sae), "b_enc": (d_sae,), "W_dec": (d_sae, d_out), "b_dec": (d_out,)}
    if kind == "skip_transcoder":
        if "W_skip" not in t:
            raise ValueError(f"{WEIGHTS_FILE}: a skip transcoder needs a 'W_skip' tensor (d_out, d_in)")
        want["W_skip"] = (d_out, d_in)
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
            raise ValueError(
                f"{WEIGHTS_FILE}: {name} has shape {tuple(t[name].shape)}, expected {shape} (d_in, d_sae, d_out)"
            )
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
        out_point,
        out_layer,
        str(hook_name_out or ""),
        t.get("W_skip") if kind == "skip_transcoder" else None,
    )


def save(sae: Sae, path: str | Path, **meta: Any) -> Path:
    """Write `sae` in the SAELens 6.x layout (what `load` and SAELens's `load_from_disk` read)."""
    from safetensors.torch import save_file

    folder = Path(path)
    folder.mkdir(parents=True, exist_ok=True)
    tensors = {"W_enc": sae.W_enc, "b_enc": sae.b_enc, "W_dec": sae.W_dec, "b_dec": sae.b_dec}
    if sae.threshold is not None:
        tensors["threshold"] = sae.threshold
    if sae.W_skip is not None:
        tensors["W_skip"] = sae.W_skip
    save_file({k: v.detach().float().contiguous().cpu() for k, v in tensors.items()}, str(folder / WEIGHTS_FILE))
    name = next(h for h, p in HOOKS.items() if p == sae.point)
    arch = sae.architecture
    if sae.W_skip is not None and arch != "standard":
        raise ValueError(f"W_skip: SAELens has skip transcoders with a ReLU encoder only, not {arch!r}")
    if sae.transcoder:
        arch = "skip_transcoder" if sae.W_skip is not None else f"{'jumprelu_' if arch == 'jumprelu' else ''}transcoder"
        out = next(h for h, p in HOOKS.items() if p == sae.out_point)
        meta = {"hook_name_out": f"blocks.{sae.out_layer}.{out}", **meta}
    cfg: dict[str, Any] = {
        "architecture": arch,
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
    if sae.transcoder:
        cfg["d_out"] = sae.d_out
    (folder / CFG_FILE).write_text(json.dumps(cfg, indent=1))
    return folder
