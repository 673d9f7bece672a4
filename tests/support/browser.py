"""Headless Chromium (Debian's package) driven by Playwright, for the pages our examples write."""

from __future__ import annotations

import shutil

import pytest

CHROMIUM_FLAGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]


@pytest.fixture(scope="module")
def browser():
    """One browser per test module; each test opens its own page. Module scope, not session: Playwright's
    sync API runs an event loop on this thread while it is open, and later tests call asyncio.run.
    Fails (never skips) without Chromium: scripts/test.sh installs it."""
    from playwright.sync_api import sync_playwright

    exe = shutil.which("chromium") or "/usr/bin/chromium"
    with sync_playwright() as pw:
        b = pw.chromium.launch(executable_path=exe, args=CHROMIUM_FLAGS)
        yield b
        b.close()


def open_page(browser, url: str, errors: list[str]):
    """A page at `url` whose console errors and uncaught exceptions are appended to `errors`."""
    page = browser.new_page(viewport={"width": 1280, "height": 800})
    page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.goto(url)
    return page
