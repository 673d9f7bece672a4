"""Named vectors held by the workers (`frontend.vector_refs`): each registration's rows, pushed once, and
a payload's steers that name one by reference made back into the bytes the frontend would have sent
(the rows repeated; one `bytes` object per registration, form and repeat, so that admission's memos by
content find it at once). A reference this worker does not hold fails the request (an internal error:
the frontend pins what it names until the request is fetched, so that is our bug, never another vector)."""

from __future__ import annotations

import threading
from typing import Any

from vllm_worker.protocol.recent import recall, remember
from vllm_worker.protocol.spec import VECTOR_DROPS_KEY, VECTOR_REFS_KEY

ROWS_KEPT = 16  # repeated rows remembered (a registration named with several layer counts and ops)


class HeldVectors:
    def __init__(self) -> None:
        self._held: dict[str, tuple[bytes, bytes | None, list[int]]] = {}
        self._rows: dict[tuple[str, bool, int], bytes] = {}  # (vid, unit, repeat) -> the repeated rows
        self._lock = threading.Lock()
        self.resolved = 0  # steers made back from references (diagnostics: `lens_status`)

    def put(self, items: list, drop: list) -> int:
        with self._lock:
            for vid, plain, unit, shape in items:
                self._held[str(vid)] = (bytes(plain), None if unit is None else bytes(unit), [int(n) for n in shape])
            self._forget(drop)
            return len(self._held)

    def resolve(self, payload: Any) -> Any:
        """`payload` with its references made bytes (a new dict; vLLM's is never edited), and its drops
        done; `payload` itself when it has neither. Its steers are looked at only when the frontend marked
        it (`VECTOR_REFS_KEY`, set wherever it sends one by reference): most payloads name no vector."""
        if not isinstance(payload, dict) or (VECTOR_REFS_KEY not in payload and VECTOR_DROPS_KEY not in payload):
            return payload
        steers = payload.get("steer")
        refs = [i for i, s in enumerate(steers or ()) if isinstance(s, dict) and "ref" in (s.get("vec") or {})]
        drop = payload.get(VECTOR_DROPS_KEY)
        out = dict(payload)
        out.pop(VECTOR_REFS_KEY, None)
        with self._lock:
            if drop:  # (first: a reference this request cannot resolve must not keep them)
                self._forget(drop)
            if refs:
                assert steers is not None
                out["steer"] = list(steers)
                for i in refs:
                    out["steer"][i] = {**steers[i], "vec": self._vec(steers[i]["vec"])}
                self.resolved += len(refs)
        out.pop(VECTOR_DROPS_KEY, None)
        return out

    def _vec(self, ref: dict) -> dict[str, Any]:
        vid, unit, repeat = str(ref["ref"]), bool(ref["unit"]), int(ref["repeat"])
        held = self._held.get(vid)
        if held is None:
            raise LookupError(f"steering vector {vid} is not held by this worker (the request named it by reference)")
        form = held[1] if unit else held[0]
        if form is None:
            raise LookupError(f"steering vector {vid} has no unit rows (a zero row)")
        key = (vid, unit, repeat)
        data = recall(self._rows, key)
        if data is None:
            data = form * repeat
            remember(self._rows, key, data, ROWS_KEPT)
        shape = [held[2][0] * repeat, *held[2][1:]]
        return {"dtype": "float32", "shape": shape, "data": data}

    def _forget(self, vids: list) -> None:
        gone = {str(v) for v in vids}
        for v in gone:
            self._held.pop(v, None)
        for key in [k for k in self._rows if k[0] in gone]:
            del self._rows[key]

    def count(self) -> int:
        return len(self._held)


HELD = HeldVectors()  # (per process: registration ids are random, so engines in one process never meet)
