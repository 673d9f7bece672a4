"""Content digests of steering vectors as they arrive in payloads, without hashing the same bytes again:
the last few payloads' bytes are kept with their digest and a new payload is compared with them byte for
byte (a memcmp, several times cheaper than BLAKE3 over the same bytes). Exact comparison, so an equal
digest is only ever reused for equal bytes: nothing a client sends can take another content's digest.
Bounded (`KEPT` entries, each at most `MAX_BYTES`); what is kept is the payload's own `bytes` object (or a
copy of a view's bytes: a view would pin the engine core's received message)."""

from __future__ import annotations

from typing import Any

import msgspec
import torch

from vllm_worker.protocol.recent import by_bytes
from vllm_worker.worker.graph_entries import digest

KEPT = 8  # recent payload byte strings remembered ...
MAX_BYTES = 16 << 20  # ... each at most this large
MIN_BYTES = 4096  # below this, hashing is as cheap as the lookup


class RecentDigests:
    """`digest` of a payload tensor, remembered for its bytes."""

    def __init__(self) -> None:
        self._memo: dict[tuple, tuple[bytes, bytes]] = {}  # `recent.by_bytes`: (the bytes, their digest)

    def of(self, raw: Any, t: torch.Tensor) -> bytes:
        """The digest of `t` (`graph_entries.digest`), where `raw` is the payload's bytes `t` was read from
        (a `memoryview` of the received message, `compat.raw_view`, or its `Ext` in-process: compared as
        bytes, and copied into `bytes` when remembered, never kept itself; anything else: hashed as it is)."""
        if isinstance(raw, msgspec.msgpack.Ext):
            raw = raw.data
        if not isinstance(raw, (bytes, memoryview)) or not MIN_BYTES <= len(raw) <= MAX_BYTES:
            return digest(t)
        if isinstance(raw, memoryview) and (raw.format != "B" or raw.ndim != 1):
            return digest(t)
        # the form is in the key (rows repeated from one sent row, `spec.decode`, vs dense rows): equal bytes
        # in two forms are different contents (the digest itself is of the rows, equal for equal rows)
        repeated = t.ndim > 1 and t.shape[0] > 1 and t.stride(0) == 0
        return by_bytes(self._memo, (t.dtype, tuple(t.shape), repeated), raw, lambda: digest(t), KEPT)
