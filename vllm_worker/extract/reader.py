"""Reading an extraction folder back: `open(DIR)` maps its shards lazily (a row's tensor is read from disk
when touched, nothing is loaded up front but the index), indexes rows by position and by id, and
iterates the corpus in batches of rows or of token positions. A map-style torch `Dataset`, so it works
with `DataLoader`. Imports neither vLLM nor the engine: it runs anywhere torch does."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterator

import torch
from torch.utils.data import Dataset

from vllm_worker.extract import shards as sh


class Extraction(Dataset):
    """An extraction folder. `ds[i]` / `ds.get(id)`: `{"id", "token_ids", "start", "n_positions", <point>:
    tensor (n_layers, n_positions, d) (z / q / k: (..., n_heads, d_head))}`, tensors memory-mapped.
    `complete` is False for a folder whose run has not finished (its finished shards are readable)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        index = self.path / sh.INDEX
        if index.exists():
            data = json.loads(index.read_text())
            self.rows: list[dict] = data.pop("rows")
            self.meta: dict = data
        elif (self.path / sh.META).exists():
            self.meta = {**json.loads((self.path / sh.META).read_text()), "complete": False}
            self.rows = list(sh.iter_rows(self.path))
        else:
            raise FileNotFoundError(f"{self.path}: no {sh.INDEX} or {sh.META}: not an extraction folder")
        if self.meta.get("format") != sh.FORMAT:
            raise ValueError(f"{self.path}: format {self.meta.get('format')!r}, expected {sh.FORMAT!r}")
        self.complete = bool(self.meta.get("complete"))
        self.points: dict[str, list[int]] = self.meta["points"]
        self._by_id = {r["id"]: i for i, r in enumerate(self.rows)}
        self._shards: dict[str, sh.MappedShard] = {}

    def __repr__(self) -> str:
        return (
            f"Extraction({str(self.path)!r}, rows={len(self.rows)}, points={self.points}, "
            f"positions={self.meta['positions']!r}, dtype={self.meta['dtype']}, complete={self.complete})"
        )

    def __len__(self) -> int:
        return len(self.rows)

    @property
    def ids(self) -> list[Any]:
        return [r["id"] for r in self.rows]

    def _shard(self, name: str) -> sh.MappedShard:
        m = self._shards.get(name)
        if m is None:
            m = self._shards[name] = sh.MappedShard(self.path / name)
        return m

    def __getitem__(self, i: int) -> dict[str, Any]:
        r = self.rows[i]
        shard = self._shard(r["shard"])
        item = {k: r[k] for k in ("id", "token_ids", "start", "n_positions")}
        for point, key in r["tensors"].items():
            item[point] = shard.tensor(key)
        return item

    def get(self, id: Any) -> dict[str, Any]:
        """The row with this id (`KeyError` naming it when absent)."""
        if id not in self._by_id:
            raise KeyError(f"no row with id {id!r} in {self.path}")
        return self[self._by_id[id]]

    def tensor(self, id: Any, point: str | None = None, layer: int | None = None) -> torch.Tensor:
        """One row's tensor at `point` (the only one when there is one), all its layers or one layer
        (as stored: `layer` is a model layer index, not a row of the tensor)."""
        point = point or self._only_point()
        t = self.get(id)[point]
        return t if layer is None else t[self._layer_row(point, layer)]

    def _only_point(self) -> str:
        if len(self.points) != 1:
            raise ValueError(f"point: this extraction has several ({', '.join(self.points)}); name one")
        return next(iter(self.points))

    def _layer_row(self, point: str, layer: int) -> int:
        layers = self.points[point]
        if layer not in layers:
            raise ValueError(f"layer: {point} was extracted at layers {layers}, not {layer}")
        return layers.index(layer)

    def batches(self, batch_size: int = 64) -> Iterator[list[dict[str, Any]]]:
        """Rows in corpus order, `batch_size` at a time (each shard mapped once)."""
        for s in range(0, len(self.rows), batch_size):
            yield [self[i] for i in range(s, min(s + batch_size, len(self.rows)))]

    def tokens(
        self, point: str | None = None, layer: int | None = None, batch_size: int = 4096
    ) -> Iterator[torch.Tensor]:
        """Every kept position of every row, `batch_size` at a time: `(batch_size, d)` tensors at one point
        and layer (the last batch may be smaller), in corpus order — what an SAE or a probe trains on.
        Holds at most one batch in memory."""
        point = point or self._only_point()
        if layer is None:
            if len(self.points[point]) != 1:
                raise ValueError(f"layer: {point} has layers {self.points[point]}; name one")
            layer = self.points[point][0]
        row = self._layer_row(point, layer)
        parts: list[torch.Tensor] = []
        have = 0
        for i in range(len(self.rows)):
            t = self[i][point][row].flatten(1) if point in ("z", "q", "k") else self[i][point][row]
            while t.shape[0]:
                take = t[: batch_size - have]
                parts.append(take)
                have += take.shape[0]
                t = t[take.shape[0] :]
                if have == batch_size:
                    yield torch.cat(parts)
                    parts, have = [], 0
        if have:
            yield torch.cat(parts)


def open_extraction(path: str | Path) -> Extraction:
    """An extraction folder written by `vllm-lens extract` / `vllm_worker.extract.extract`."""
    return Extraction(path)
