"""Small helpers the HTTP test modules share: one place for how a test talks to a served model and reads
the server's state, so the split modules stay about their own concern."""

from __future__ import annotations

import json
import time

import httpx
import psutil
from vllm import SamplingParams

from support.engines import model_path
from support.servers import KEY, server_pid
from vllm_worker.api.client import LensClient

PROMPT = "the water of people will come down to the side"
AUTH = {"Authorization": f"Bearer {KEY}"}


def lens_client(url: str, key: str | None = KEY) -> LensClient:
    return LensClient(url, api_key=key)


def model_name() -> str:
    """The name the test servers serve the tiny model under (its folder)."""
    return str(model_path("llama"))


def offline(llama, prompt_or_messages, n=1, **extra):
    """The same request run on the offline engine: the reference an HTTP answer must equal."""
    sp = SamplingParams(max_tokens=5, temperature=0 if n == 1 else 1.0, seed=3, n=n, ignore_eos=True, extra_args=extra)
    if isinstance(prompt_or_messages, list):
        return llama.chat(prompt_or_messages, sp, use_tqdm=False)[0]
    return llama.generate([prompt_or_messages], sp, use_tqdm=False)[0]


def sse_events(url: str, path: str, body: dict) -> list[dict]:
    events = []
    with httpx.stream("POST", url + path, json=body, headers={"Authorization": f"Bearer {KEY}"}, timeout=300) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                events.append(json.loads(line[6:]))
            elif line == "data: [DONE]":
                events.append("DONE")
    return events


def post_json(url, path, body, key=KEY):
    return httpx.post(url + path, json=body, headers={"Authorization": f"Bearer {key}"}, timeout=300)


def rss_mb(url: str, each: bool = False):
    """Resident memory of the server's whole process tree (API server + engine core); `each`: per process."""
    proc = psutil.Process(server_pid(url))
    rss = [p.memory_info().rss / 2**20 for p in [proc, *proc.children(recursive=True)]]
    return rss if each else sum(rss)


def lens_counts(url: str) -> tuple[int, int, int, int]:
    info = LensClient(url, api_key=KEY).info()
    return info["pending_results"], info["stored_requests"], info["result_regions"], info["capture_bytes_in_flight"]


def wait_zero(url: str, timeout: float = 30) -> tuple:
    """The server's per-request state counts, once they are all back to zero (or as they stand at timeout)."""
    deadline = time.time() + timeout
    while True:
        got = lens_counts(url)
        if got == (0, 0, 0, 0) or time.time() > deadline:
            return got
        time.sleep(0.3)
