"""Content digests of steering vectors as they arrive in payloads, without hashing the same bytes again:
the last few payloads' bytes are kept with their digest and a new payload is compared with them byte for
byte (a memcmp, several times cheaper than BLAKE3 over the same bytes). Exact comparison, so an equal
digest is only ever reused for equal bytes: nothing a client sends can take another content's digest.
Bounded (`KEPT` entries, each at most `MAX_BYTES`); what is kept is the payload's own `bytes` object."""

from __future__ import annotations

from typing import Any

import torch

from vllm_worker.protocol.recent import recall, remember
from vllm_worker.worker.graph_entries import digest

KEPT = 8  # recent payload byte strings remembered ...
MAX_BYTES = 16 << 20  # ... each at most this large
MIN_BYTES = 4096  # below this, hashing is as cheap as the lookup
_EDGE = 64  # bytes from each end in the lookup key (a cheap first test before the full comparison)


class RecentDigests:
    """`digest` of a payload tensor, remembered for its bytes."""

    def __init__(self) -> None:
        self._memo: dict[tuple, tuple[bytes, bytes]] = {}  # (dtype, shape, edges) -> (the bytes, their digest)

    def of(self, raw: Any, t: torch.Tensor) -> bytes:
        """The digest of `t` (`graph_entries.digest`), where `raw` is the payload's bytes `t` was read from
        (anything else, e.g. a memoryview: hashed as it is)."""
        if not isinstance(raw, bytes) or not MIN_BYTES <= len(raw) <= MAX_BYTES:
            return digest(t)
        key = (t.dtype, tuple(t.shape), raw[:_EDGE], raw[-_EDGE:])
        got = recall(self._memo, key)
        if got is None or got[0] != raw:  # (bytes comparison: exact)
            got = (raw, digest(t))
            remember(self._memo, key, got, KEPT)
        return got[1]
