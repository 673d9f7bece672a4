"""The output folder of an extraction: safetensors shards written atomically beside a JSON list of their
rows, the run's settings (`meta.json`, checked when a run resumes) and the merged `index.json`.

    DIR/meta.json                    settings of the run (model, points and layers, positions, dtype, ...)
    DIR/shard-00000.safetensors      one tensor per row and point: "<row in shard>.<point>"
    DIR/shard-00000.json             that shard's rows: id, line, tensors, start, n_positions, token ids
    DIR/index.json                   every row, in input order, with its shard (written when the run ends)

A shard counts as finished once its `.json` exists: it is written (temporary file, fsync, rename) after
the tensors' file was renamed into place, so a crash at any moment leaves finished shards whole and at
most an orphan that the next run removes. Shards are written here, not with the `safetensors` package,
straight from the buffer their rows were copied into (never serialised in memory a second time); the
files are standard safetensors.
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import torch

FORMAT = "inspect-lens-extract/1"
META, INDEX = "meta.json", "index.json"
DTYPES = {
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int32: "I32",
    torch.int64: "I64",
}
TORCH_DTYPES = {v: k for k, v in DTYPES.items()}


def shard_name(n: int) -> str:
    return f"shard-{n:05d}"


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def write_atomic(path: Path, write: Any) -> None:
    """`write(file)` into `path.tmp`, fsync, rename over `path`: readers see the old file or the new one."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        write(f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def write_json(path: Path, obj: Any) -> None:
    write_atomic(path, lambda f: f.write(json.dumps(obj, separators=(",", ":")).encode()))


def _bytes_of(t: torch.Tensor) -> memoryview:
    t = t.contiguous()
    return memoryview(t.reshape(-1).view(torch.uint8).numpy()) if t.numel() else memoryview(b"")


def _writev_all(fd: int, views: list[memoryview]) -> None:
    """`os.writev` until every byte is written (a call may write part of them)."""
    i = 0
    while i < len(views):
        n = os.writev(fd, views[i:] if i else views)
        while i < len(views) and n >= len(views[i]):
            n -= len(views[i])
            i += 1
        if n:
            views[i] = views[i][n:]


def row_layout(rows: list[tuple], dtype: str, esize: int) -> list[str]:
    """The safetensors header entries (JSON text, `"<row>.<point>": {dtype, shape, data_offsets}`) of rows
    whose values lie one after another in a shard's data, rows in order and each row's points in order;
    a row is `(..., ((point, shape), ...))` as `run._Writer` keeps it."""
    entries = []
    off = 0
    names: dict[str, str] = {}
    for i, row in enumerate(rows):
        for point, shape in row[-1]:
            name = names.get(point)
            if name is None:
                name = names[point] = json.dumps("." + point)[1:-1]
            n = esize
            for d in shape:
                n *= d
            dims = ",".join(map(str, shape))
            entries.append(f'"{i}{name}":{{"dtype":"{dtype}","shape":[{dims}],"data_offsets":[{off},{off + n}]}}')
            off += n
    return entries


def write_safetensors_flat(path: Path, entries: list[str], data: torch.Tensor, metadata: dict[str, str]) -> int:
    """A standard safetensors file (little-endian header length, JSON header padded to 8 bytes, raw data)
    from its header entries (`row_layout`) and its whole data section as one tensor, written with one
    system call; returns its size."""
    meta = '"__metadata__":' + json.dumps(metadata, separators=(",", ":")) if metadata else ""
    head = ("{" + meta + ("," if meta and entries else "") + ",".join(entries) + "}").encode()
    head += b" " * (-len(head) % 8)
    view = _bytes_of(data)

    def write(f: Any) -> None:
        f.write(struct.pack("<Q", len(head)))
        f.write(head)
        f.flush()
        if len(view):
            _writev_all(f.fileno(), [view])  # drops the GIL

    write_atomic(path, write)
    return 8 + len(head) + len(view)


def write_rows(path: Path, rows: list[tuple]) -> None:
    """A shard's `.json`, `{"rows": [{"id", "line", "start", "n_positions", "n_prompt", "token_ids",
    "tensors": {point: "<row>.<point>"}}, ...]}` — the text `json.dumps(..., separators=(",", ":"))` gives,
    made row by row (no dict per row) — written atomically. A row is `(id, line, start, n_positions,
    n_prompt, token ids, ((point, shape), ...))` as `run._Writer` keeps it."""
    quoted: dict[str, tuple[str, str]] = {}
    parts = []
    for i, (rid, line, start, n, n_prompt, ids, shapes) in enumerate(rows):
        tensors = []
        for point, _ in shapes:
            q = quoted.get(point)
            if q is None:
                q = quoted[point] = (json.dumps(point), json.dumps("." + point)[1:-1])
            tensors.append(f'{q[0]}:"{i}{q[1]}"')
        parts.append(
            f'{{"id":{json.dumps(rid)},"line":{line},"start":{start},"n_positions":{n},"n_prompt":{n_prompt},'
            f'"token_ids":[{",".join(map(str, ids))}],"tensors":{{{",".join(tensors)}}}}}'
        )
    text = '{"rows":[' + ",".join(parts) + "]}"
    write_atomic(path, lambda f: f.write(text.encode()))


class MappedShard:
    """A safetensors file mapped read-only (copy-on-write: tensors over it never change the file);
    `tensor(name)` is a zero-copy view, read from disk only when touched."""

    def __init__(self, path: Path) -> None:
        with open(path, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            self.header: dict[str, Any] = json.loads(f.read(n))
        self.metadata = self.header.pop("__metadata__", {})
        self.data_start = 8 + n
        self.map = np.memmap(path, dtype=np.uint8, mode="c")

    def tensor(self, name: str) -> torch.Tensor:
        h = self.header[name]
        b, e = h["data_offsets"]
        raw = self.map[self.data_start + b : self.data_start + e]
        dtype = TORCH_DTYPES[h["dtype"]]
        if e == b:
            return torch.empty(h["shape"], dtype=dtype)
        return torch.from_numpy(raw).view(dtype).view(h["shape"])


def finished_shards(out: Path) -> list[int]:
    """Numbers of the shards whose rows file exists, ascending."""
    found = []
    for p in out.glob("shard-*.json"):
        try:
            found.append(int(p.stem.split("-", 1)[1]))
        except ValueError:
            continue
    return sorted(found)


def clean_unfinished(out: Path) -> list[str]:
    """Remove what an interrupted run left half-written: temporary files and tensor files whose rows file
    was never written. Returns the names removed."""
    done = {shard_name(n) for n in finished_shards(out)}
    gone = []
    for p in list(out.glob("*.tmp")) + [p for p in out.glob("shard-*.safetensors") if p.stem not in done]:
        p.unlink(missing_ok=True)
        gone.append(p.name)
    return gone


def shard_rows(out: Path, n: int) -> list[dict]:
    return json.loads((out / f"{shard_name(n)}.json").read_text())["rows"]


def iter_rows(out: Path) -> Iterator[dict]:
    """Every finished row, shard by shard (one shard's list in memory at a time)."""
    for n in finished_shards(out):
        for r in shard_rows(out, n):
            yield {**r, "shard": f"{shard_name(n)}.safetensors"}


def write_index(out: Path, meta: dict) -> int:
    """`index.json` from the finished shards, streamed (never the whole corpus in memory); returns rows."""
    count = 0

    def write(f: Any) -> None:
        nonlocal count
        head = json.dumps({**meta, "complete": True}, separators=(",", ":"))
        f.write(head[:-1].encode() + b',"rows":[')
        for i, r in enumerate(iter_rows(out)):
            f.write((b"," if i else b"") + json.dumps(r, separators=(",", ":")).encode())
            count += 1
        f.write(b"]}")

    write_atomic(out / INDEX, write)
    return count
