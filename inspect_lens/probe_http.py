"""The server's probe registry over HTTP (`/v1/lens/probes`), for the provider: list what is loaded, load
a folder from the operator's `--lens-probe-dir`. Refusals keep the server's message (it names the field)."""

from __future__ import annotations

from typing import Any


def _headers(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


async def list_probes(root: str, api_key: str | None) -> dict[str, dict[str, Any]]:
    """{name: what the server says of it (hash, path, layers, ...)} of the probes loaded on the server."""
    import httpx

    async with httpx.AsyncClient(base_url=root, headers=_headers(api_key), timeout=60) as http:
        resp = await http.get("/v1/lens/probes")
    if resp.status_code >= 400:
        raise ValueError(f"output_probe_scores: the server cannot list probes ({resp.status_code}): {resp.text[:300]}")
    body = resp.json()
    items = (body.get("probes") or body.get("data") or []) if isinstance(body, dict) else body
    return {p["name"]: p for p in items or []}


class ProbeNameTaken(ValueError):
    """The server has another probe (other weights) under the name: loading would swap it under the feet of
    whoever loaded it (another eval sharing the server)."""


async def load_probe(root: str, api_key: str | None, name: str, path: str) -> dict[str, Any]:
    """Load the probe folder `path` (on the server's file system) under `name`, never replacing a different
    probe of that name (`replace: false`); what the server says of it."""
    import httpx

    async with httpx.AsyncClient(base_url=root, headers=_headers(api_key), timeout=300) as http:
        resp = await http.post("/v1/lens/probes", json={"name": name, "path": path, "replace": False})
    if resp.status_code == 409:
        raise ProbeNameTaken(f"output_probe_scores: probe {name!r} from {path!r}: {resp.text[:500]}")
    if resp.status_code >= 400:
        raise ValueError(f"output_probe_scores: the server refused probe {name!r} from {path!r}: {resp.text[:500]}")
    body = resp.json()
    return body.get("probe", body) if isinstance(body, dict) else {"name": name}
