"""How long another thread waits for the GIL while the HTTP server encodes one huge capture (a timing: it
belongs here, not in the test suite, where a loaded machine makes it flaky). Prints the longest wait.

    python bench/probes/gil_wait.py [MB]   # default 600 MB of float32
"""

from __future__ import annotations

import sys
import threading
import time

import torch

from vllm_worker.protocol import wire


def longest_wait(mb: int) -> float:
    t = torch.empty(mb * 250_000)
    done = threading.Event()

    def encode() -> None:
        wire.json_chunks({"residual_stream": wire.to_jsonable(t, lazy=True)})
        done.set()

    th = threading.Thread(target=encode)
    th.start()
    gaps, last = [], time.perf_counter()
    while not done.is_set():
        time.sleep(0.001)
        now = time.perf_counter()
        gaps.append(now - last)
        last = now
    th.join()
    return max(gaps)


if __name__ == "__main__":
    mb = int(sys.argv[1]) if len(sys.argv) > 1 else 600
    print(f"{mb} MB capture: another thread waited at most {longest_wait(mb):.3f} s for the GIL")
