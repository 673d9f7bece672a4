"""Admission templates: a request whose steering and probe actions are, byte for byte, those of a recent
request (a batch of requests sending one vector or acting on one probe) reuses what admission derived from
that content — the decoded steers and actions, their content digests, the vectors in the model's dtype,
position tables, and the shared steering entries they hold — and pays only for what is its own: its
`DeviceSteer`s, action slots, gates and one more count on the shared entries (`Admission._new`).

Matched by exact bytes, never by a hash alone: the payload's fields are re-encoded by msgpack with the
tensors' bytes left out (the key: equal only for equal fields, floats by their bits), then each tensor's
bytes are compared with the template's own copy (a memcmp). A template holds copies, never a view of a
received message, and nothing a request may write: per-request objects are made from it at admission."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import msgspec

from vllm_worker.protocol.recent import EDGE, recall, remember, same_bytes

KEPT = 8  # templates remembered (least recently used dropped) ...
MAX_BYTES = 4 << 20  # ... each from a payload with at most this many bytes of tensors (rows repeated: `_strip`);
# a template also keeps the vectors in the model's dtype and a probe action's gated rows: up to ~4x this
# payload keys a template may cover: the rest of a payload (hooks, SAEs, probes) is admitted as before
_FIELDS = frozenset({"v", "key", "capture", "steer", "actions", "n", "release", "fetch", "shm"})
_PER_REQUEST = ("key", "capture", "n", "release", "fetch", "shm")  # never part of the key


@dataclass(eq=False)
class Template:
    """What admission derived from one content (`Admission._template` fills it; read-only once made)."""

    blobs: list[bytes]  # the tensors' bytes, in the order `split` found them (copies)
    payload: dict  # the payload rebuilt from `blobs` (no per-request field): what `spec.decode` reads
    steers: list = field(default_factory=list)  # `spec.Steer`s decoded from `payload` (views of `blobs`)
    actions: list = field(default_factory=list)  # action dicts decoded from `payload`
    contents: list = field(default_factory=list)  # per steer: its content digest (None without the graph path)
    host: list = field(default_factory=list)  # per steer: its vectors in the model's dtype (never written)
    luts: list = field(default_factory=list)  # per steer: position -> row (host, never written), or None
    keeps: list = field(default_factory=list)  # per steer: set's kept columns (host, never written), or None
    layers: list = field(default_factory=list)  # per steer: site -> row (copied for each request)
    sites: frozenset = frozenset()  # every site its steering names
    # the shared (ungated) steering entries of the latest admission that took no new entry: (the table's
    # `dropped` then, the entries, their ids, the chains found) — valid while no chain has left the table
    shared: tuple | None = None
    gated: Any = None  # a probe action's steering rows per site (`graph_entries.gated_rows`; False: not covered)
    prepared: Any = None  # its actions as slots need them (`ActionTable.prepare`; False: not covered)
    stops: bool = False  # an action of it stops the request
    gate_index: int | None = None  # its steering's gating (`admission._gate_index`; None: not yet known)
    # every steer needs per-request work (`plan.split_steers` keeps them all, no simple add): its requests
    # skip the split (it reads only what the content fixes: positions, norm_match, op, phase, gated or not)
    all_per_request: bool | None = None


def split(payload: Any) -> tuple[bytes, list[Any]] | None:
    """(key, the tensors' bytes as sent) of a payload a template can cover; None: admitted as before (no
    steering or action, hooks / SAEs / probes, a tensor in a form not compared here, too many bytes)."""
    if not isinstance(payload, dict) or not payload.keys() <= _FIELDS:
        return None
    steer, actions = payload.get("steer"), payload.get("actions")
    if not steer and not actions:
        return None
    blobs: list[Any] = []
    more: list[int] = []  # (rows sent once with a `repeat`: the bytes of the others, which the template holds)
    try:
        parts = [[_strip(s, blobs, more) for s in steer or ()], [_strip(a, blobs, more) for a in actions or ()]]
        if sum(map(len, blobs)) + (sum(more) if more else 0) > MAX_BYTES:
            return None
        return msgspec.msgpack.encode([payload.get("v"), parts]), blobs
    except (TypeError, ValueError, AttributeError, msgspec.EncodeError):  # (not a payload `encode` makes)
        return None


def _strip(item: dict, blobs: list[Any], more: list[int]) -> dict:
    """`item` with each tensor's bytes replaced by None (appended to `blobs`, as contiguous bytes views). A row
    sent once with a `repeat` (`spec._wire`) is that many rows in the template's host copies (`Template.host`):
    the other rows' bytes go to `more`, so that `MAX_BYTES` bounds what a template holds, not what was sent."""
    out = {}
    for k, v in item.items():
        if type(v) is dict and "data" in v:
            raw = v["data"]
            if isinstance(raw, msgspec.msgpack.Ext):
                raw = raw.data
            if isinstance(raw, memoryview):
                if raw.format != "B" or raw.ndim != 1:
                    raise ValueError("not a byte view")
            elif not isinstance(raw, bytes):
                raise ValueError("not bytes")
            blobs.append(raw)
            if "repeat" in v:
                more.append(len(raw) * (v["repeat"] - 1))
            v = {**v, "data": None}
        out[k] = v
    return out


def rebuilt(payload: dict, blobs: list[bytes]) -> dict:
    """`payload` without its per-request fields, its tensors reading `blobs` (the template's copies)."""
    it = iter(blobs)

    def fill(item: dict) -> dict:
        return {k: ({**v, "data": next(it)} if type(v) is dict and "data" in v else v) for k, v in item.items()}

    out = {k: v for k, v in payload.items() if k not in _PER_REQUEST and k not in ("steer", "actions")}
    out["key"] = ""
    out["steer"] = [fill(s) for s in payload.get("steer") or ()]
    out["actions"] = [fill(a) for a in payload.get("actions") or ()]
    return out


class Templates:
    """The recent templates by key (`KEPT`)."""

    def __init__(self, kept: int = KEPT) -> None:
        self.kept = kept
        self._memo: dict[tuple, Template] = {}  # by `mark`
        self._seen: dict[tuple, bool] = {}  # recent (key, tensors' edges) without a template (`seen`)
        self.hits = 0  # requests admitted from a template made by an earlier one (tests, probes)

    def find(self, mark: tuple, blobs: list[Any]) -> Template | None:
        """The template of exactly these fields and bytes (`mark`: `mark(key, blobs)`), or None."""
        got = recall(self._memo, mark)
        if got is None or len(got.blobs) != len(blobs) or not all(map(same_bytes, got.blobs, blobs)):
            return None
        self.hits += 1
        return got

    def seen(self, mark: tuple) -> bool:
        """Whether a recent payload had these fields and tensors with these first and last bytes: a template
        is made at the second sighting, so requests that each send their own vectors pay no template (a
        guess only: `find` compares every byte)."""
        if recall(self._seen, mark) is not None:
            return True
        remember(self._seen, mark, True, 4 * self.kept)
        return False

    def keep(self, mark: tuple, t: Template) -> None:
        """Remember `t` (once admission has filled it without failing) under `mark`, in place of any other."""
        remember(self._memo, mark, t, self.kept)


def mark(key: bytes, blobs: list[Any]) -> tuple:
    """A template's memo key: the fields and each tensor's first and last bytes. Keyed by the fields alone,
    requests alternating between two vectors (equal fields) would each replace the other's template and
    make a new one every time, costlier than no template; the full bytes are compared after (`find`)."""
    return (key, *[bytes(b[:EDGE]) + bytes(b[-EDGE:]) for b in blobs])


def make(payload: dict, blobs: list[Any]) -> Template:
    """A new, empty template for `payload` (its own copies of the bytes: never a view of the message)."""
    own = [b if isinstance(b, bytes) else b.tobytes() for b in blobs]
    return Template(own, rebuilt(payload, own))
