"""Regenerates the pictures of docs/examples.md against a running server (SmolLM2 in the docs).

    vllm-lens serve ~/.cache/inspect-lens/smollm2-135m-instruct-0.1.2-f32 --allow-remote-hooks
    python examples/jacobian_lens_fit.py --out lens.pt
    python docs/make_gallery.py --base-url http://127.0.0.1:8000 --lens lens.pt

Runs each example script as a user would, then opens the two HTML pages in headless Chromium
(Playwright, Debian's `chromium`) for screenshots: the emotion page with a token hovered, and the chat
page after a message sent from the page and a generated token pinned.
"""

from __future__ import annotations

import argparse
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
EX, IMG = ROOT / "examples", ROOT / "docs" / "images"
FLAGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]


def example(*args: str) -> None:
    cmd = [sys.executable, str(EX / args[0]), *args[1:]]
    print("$", " ".join(cmd[1:]), flush=True)
    subprocess.run(cmd, check=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base-url", default="http://127.0.0.1:8000")
    ap.add_argument("--lens", required=True)
    ap.add_argument("--message", default="What is the capital of France?")
    args = ap.parse_args()
    IMG.mkdir(exist_ok=True)
    url = ["--base-url", args.base_url]
    example(
        "causal_tracing.py",
        *url,
        "--prompt",
        "The Eiffel Tower is located in the city of",
        "--subject",
        "The Eiffel Tower",
        "--out",
        str(IMG / "causal_tracing.png"),
    )
    example(
        "logit_lens.py", *url, "--prompt", "The capital of France is the city of", "--out", str(IMG / "logit_lens.png")
    )
    example(
        "jacobian_lens.py",
        "run",
        *url,
        "--lens",
        args.lens,
        "--prompt",
        "The capital of France is the city of",
        "--grid-out",
        str(IMG / "jacobian_lens.png"),
    )
    example("emotion_tracker.py", *url, "--out", str(IMG / "emotions.html"))
    from playwright.sync_api import sync_playwright

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    chat = subprocess.Popen(
        [
            sys.executable,
            str(EX / "jacobian_lens_chat.py"),
            *url,
            "--lens",
            args.lens,
            "--port",
            str(port),
            "--max-tokens",
            "24",
            "--out",
            str(IMG / "chat.html"),
        ]
    )
    try:
        with sync_playwright() as pw:
            b = pw.chromium.launch(executable_path=shutil.which("chromium") or "/usr/bin/chromium", args=FLAGS)
            page = b.new_page(viewport={"width": 1200, "height": 760})
            page.goto((IMG / "emotions.html").as_uri())
            page.select_option("#by", "strongest")
            page.hover(".tok.reply >> nth=3")
            page.screenshot(path=str(IMG / "emotion_tracker.png"), full_page=True)
            for _ in range(120):
                try:
                    page.goto(f"http://127.0.0.1:{port}/")
                    break
                except Exception:
                    time.sleep(0.5)
            page.fill("#input", args.message)
            page.click("#send")
            page.wait_for_function("document.querySelectorAll('.assistant .tok').length > 0", timeout=300_000)
            page.click(".assistant .tok >> nth=2")
            page.screenshot(path=str(IMG / "jacobian_lens_chat.png"))
            b.close()
    finally:
        chat.terminate()
        chat.wait(timeout=60)
    (IMG / "emotions.html").unlink()
    (IMG / "chat.html").unlink()
    print("wrote", ", ".join(sorted(p.name for p in IMG.glob("*.png"))))


if __name__ == "__main__":
    main()
