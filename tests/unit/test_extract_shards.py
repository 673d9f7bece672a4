"""The shard files of an extraction (`vllm_worker.extract.shards`), written from one flat buffer per shard
and rows kept as tuples (`run._Writer`): the same bytes as the safetensors header and JSON rows that
`json.dumps` of the equivalent dicts gives, readable by the `safetensors` package; and the writer's
buffers: a row that does not fit starts the next shard, a row larger than a shard goes alone, and the
written shard's buffer is reused."""

from __future__ import annotations

import json
import struct

import torch
from safetensors.torch import load_file

from vllm_worker.extract import shards as sh
from vllm_worker.extract.run import _Writer

ROWS = [
    ('a "quoted" id, é\n', 1, 0, 3, 3, (1, 2, 3), (("resid_post", (2, 3, 4)), ("z", (2, 3, 2, 2)))),
    (7, 2, 1, 1, 4, (5, 6, 7, 8), (("resid_post", (2, 1, 4)), ("z", (2, 1, 2, 2)))),
]


def test_shard_files_are_the_text_json_dumps_gives(tmp_path):
    sh.write_rows(tmp_path / "r.json", ROWS)
    want = {
        "rows": [
            {
                "id": r[0],
                "line": r[1],
                "start": r[2],
                "n_positions": r[3],
                "n_prompt": r[4],
                "token_ids": list(r[5]),
                "tensors": {p: f"{i}.{p}" for p, _ in r[6]},
            }
            for i, r in enumerate(ROWS)
        ]
    }
    assert (tmp_path / "r.json").read_text() == json.dumps(want, separators=(",", ":"))

    data = torch.randn(24 + 24 + 8 + 8).to(torch.bfloat16)
    size = sh.write_safetensors_flat(
        tmp_path / "x.safetensors", sh.row_layout(ROWS, "BF16", 2), data, {"format": sh.FORMAT}
    )
    raw = (tmp_path / "x.safetensors").read_bytes()
    assert size == len(raw)
    (n,) = struct.unpack("<Q", raw[:8])
    header, off = {"__metadata__": {"format": sh.FORMAT}}, 0
    for i, r in enumerate(ROWS):
        for point, shape in r[6]:
            k = 2 * int(torch.Size(shape).numel())
            header[f"{i}.{point}"] = {"dtype": "BF16", "shape": list(shape), "data_offsets": [off, off + k]}
            off += k
    assert raw[8 : 8 + n].decode().rstrip() == json.dumps(header, separators=(",", ":")) and n % 8 == 0
    got = load_file(tmp_path / "x.safetensors")
    assert torch.equal(got["0.z"].flatten(), data[24:48]) and torch.equal(got["1.z"].flatten(), data[-8:])
    assert got["1.resid_post"].shape == (2, 1, 4)


def test_writer_buffers(tmp_path):
    done = []
    w = _Writer(tmp_path, 0, 40, {}, lambda n, rows: done.append((n, rows)), torch.float32)  # 10 values a shard

    def row(i: int, n: int) -> None:
        w.take(n).copy_(torch.full((n,), float(i)))
        w.add((i, i + 1, 0, 1, 1, (i,), (("resid_post", (1, 1, n)),)), n)

    row(0, 4)
    row(1, 4)
    row(2, 4)  # does not fit: the first shard (rows 0, 1) is handed over first
    second = w.buf
    row(3, 25)  # larger than a shard: alone, in a buffer of its own
    row(4, 6)  # in the second shard's buffer, reused once that shard is written
    assert w.buf is second and second is not None and second.numel() == 10
    w.close()
    assert done == [(0, 2), (1, 1), (2, 1), (3, 1)]
    shards = [load_file(tmp_path / f"{sh.shard_name(n)}.safetensors") for n in range(4)]
    assert [sorted(s) for s in shards] == [["0.resid_post", "1.resid_post"]] + [["0.resid_post"]] * 3
    assert torch.equal(shards[0]["1.resid_post"], torch.full((1, 1, 4), 1.0))
    for n, (i, k) in enumerate([(2, 4), (3, 25), (4, 6)], 1):
        assert torch.equal(shards[n]["0.resid_post"], torch.full((1, 1, k), float(i)))
    assert [r["id"] for r in sh.shard_rows(tmp_path, 0)] == [0, 1]
