"""A tiny activation oracle trained by examples/activation_oracle_fit.py on the tiny Llama (session-wide:
the oracle eval, the Petri audit and the inspect-demo notebook share it)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from support import ROOT
from support.engines import model_path

PLACEHOLDER = " the"  # one token for the tiny model's tokenizer (" ?" is two there)


@pytest.fixture(scope="session")
def tiny_oracle(tmp_path_factory):
    out = tmp_path_factory.mktemp("oracle") / "tiny-oracle"
    proc = subprocess.run(
        [
            sys.executable,
            str(ROOT / "examples/activation_oracle_fit.py"),
            "--model",
            str(model_path("llama")),
            "--source-layer",
            "2",
            "--steps",
            "6",
            "--placeholder",
            PLACEHOLDER,
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "held-out accuracy" in proc.stdout and (out / "oracle.json").exists()
    assert (out / "adapter_config.json").exists()
    return out
