"""Bulk extraction (`vllm_worker.extract`, `vllm-lens extract`): what lands on disk equals a direct capture
of the same prompt and HF's residual stream; a run interrupted after some shards resumes to the same
index without rewriting them; host memory stays bounded by chunking; a malformed line is named and
nothing done is lost; the CLI end to end."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from vllm import SamplingParams

from support.engines import model_path
from support.reference import hf_model, residuals
from vllm_worker import compat
from vllm_worker.extract import ExtractInputError, extract
from vllm_worker.extract import open as open_extraction

WORDS = "the water of people will come down to the side how many first time was said each".split()
CHAT_OPEN = [{"role": "user", "content": "how many water"}]
CHAT_DONE = [
    {"role": "system", "content": "the first"},
    {"role": "user", "content": "how many water"},
    {"role": "assistant", "content": "the side of the water"},
]


def _prompt(i: int, n: int = 6) -> str:
    return " ".join(WORDS[(i * 5 + j) % len(WORDS)] for j in range(n + i % 5))


def _write(path: Path, rows: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def _direct(llm, prompt, points: dict, chat: bool = False):
    sp = SamplingParams(max_tokens=1, temperature=0, extra_args={"output_activations": points})
    if chat:
        return llm.chat([prompt], sp, use_tqdm=False)[0]
    return llm.generate([prompt], sp, use_tqdm=False)[0]


def test_extraction_equals_direct_capture_and_hf(llama, tmp_path):
    rows = [{"id": f"p{i}", "prompt": _prompt(i)} for i in range(5)]
    rows += [{"id": 7, "messages": CHAT_OPEN}, {"id": "done", "messages": CHAT_DONE}]
    src = _write(tmp_path / "in.jsonl", rows)
    stats = extract(llama, src, tmp_path / "all", layers=[1, -1], points=["resid_post", "mlp_out"], progress=False)
    assert stats["extracted"] == 7 and stats["index_rows"] == 7
    ds = open_extraction(tmp_path / "all")
    assert ds.complete and ds.ids == [r["id"] for r in rows] and ds.points == {"resid_post": [1, 3], "mlp_out": [1, 3]}
    points = {"resid_post": [1, 3], "mlp_out": [1, 3]}
    hf = hf_model("llama")
    for r in rows[:5]:
        got, ref = ds.get(r["id"]), _direct(llama, r["prompt"], points)
        assert got["token_ids"] == list(ref.prompt_token_ids)
        for p in points:  # the same numbers as a direct capture of the same prompt
            assert torch.equal(got[p], ref.activations[p]), p
        want, _ = residuals(hf, got["token_ids"])  # and as HF's residual stream
        assert (got["resid_post"] - want[[1, 3]]).abs().max() <= 1e-4
    chat = _direct(llama, CHAT_OPEN, points, chat=True)  # chat template applied as LLM.chat does
    assert ds.get(7)["token_ids"] == list(chat.prompt_token_ids)
    assert torch.equal(ds.get(7)["mlp_out"], chat.activations["mlp_out"])
    # the files are plain safetensors; `tokens` walks every position of one point and layer
    from safetensors.torch import load_file

    row = ds.rows[0]
    assert torch.equal(load_file(tmp_path / "all" / row["shard"])[row["tensors"]["mlp_out"]], ds[0]["mlp_out"])
    flat = torch.cat(list(ds.tokens("resid_post", 3, batch_size=16)))
    assert torch.equal(flat, torch.cat([ds[i]["resid_post"][1] for i in range(len(ds))]))
    assert all(b.shape[0] == 16 for b in list(ds.tokens("resid_post", 3, batch_size=16))[:-1])

    # last / answer positions, stored in another dtype
    only = _write(tmp_path / "chat.jsonl", [{"id": "done", "messages": CHAT_DONE}])
    extract(llama, only, tmp_path / "ans", layers=[2], positions="answer", dtype="bfloat16", progress=False)
    got = open_extraction(tmp_path / "ans").get("done")
    tok = llama.get_tokenizer()
    head = tok.encode(
        tok.apply_chat_template(CHAT_DONE[:2], tokenize=False, add_generation_prompt=True), add_special_tokens=False
    )
    full = _direct(llama, {"prompt_token_ids": got["token_ids"]}, {"resid_post": [2]}).activations["resid_post"]
    assert got["start"] == len(head) and got["n_positions"] == len(got["token_ids"]) - len(head) > 0
    assert got["token_ids"][: len(head)] == head
    assert torch.equal(got["resid_post"], full[:, len(head) :].to(torch.bfloat16))
    extract(llama, src, tmp_path / "last", layers=[0], positions="last", progress=False)
    last = open_extraction(tmp_path / "last").get("p2")
    assert last["n_positions"] == 1 and last["start"] == len(last["token_ids"]) - 1
    assert torch.equal(
        last["resid_post"], _direct(llama, rows[2]["prompt"], {"resid_post": [0]}).activations["resid_post"][:, -1:]
    )


def test_resume_after_interrupt_gives_the_same_index(llama, tmp_path):
    src = _write(tmp_path / "in.jsonl", [{"id": i, "prompt": _prompt(i)} for i in range(40)])
    opts = dict(layers=[0, 2], max_ram_gb=24e-6, progress=False)  # shards of a few rows
    full = extract(llama, src, tmp_path / "a", **opts)
    assert full["shards"] >= 6

    def stop_after_3(shard, rows):
        if shard == 2:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        extract(llama, src, tmp_path / "b", on_shard=stop_after_3, **opts)
    b = tmp_path / "b"
    assert not (b / "index.json").exists()
    assert sorted(p.name for p in b.glob("shard-*.json")) == [f"shard-0000{i}.json" for i in range(3)]
    partial = open_extraction(b)
    assert not partial.complete and 0 < len(partial) < 40
    kept = {p.name: (p.stat().st_ino, p.stat().st_mtime_ns) for p in b.glob("shard-*")}
    # what a crash would leave: a temporary file and tensors whose rows file was never written
    (b / "shard-00003.safetensors").write_bytes(b"partial")
    (b / "shard-00003.json.tmp").write_bytes(b"{")
    with pytest.raises(ValueError, match="positions='all', not 'last'"):
        extract(llama, src, b, positions="last", **opts)
    again = extract(llama, src, b, **opts)
    assert again["skipped"] == len(partial) and again["extracted"] == 40 - len(partial)
    assert {p.name: (p.stat().st_ino, p.stat().st_mtime_ns) for p in b.glob("shard-0000[0-2]*")} == kept
    assert not list(b.glob("*.tmp"))
    index_a = json.loads((tmp_path / "a" / "index.json").read_text())
    index_b = json.loads((b / "index.json").read_text())
    assert index_a["rows"] == index_b["rows"]
    da, db = open_extraction(tmp_path / "a"), open_extraction(b)
    assert all(torch.equal(da[i]["resid_post"], db[i]["resid_post"]) for i in range(40))


def test_host_memory_is_bounded_by_chunks(llama, tmp_path):
    """Captures are submitted in chunks that fit the budget, and each result goes back to the workers once
    copied out: the results held and the worker's result pool stay at one chunk's size while the output
    grows to many times the budget. (RSS over 10,000 prompts: bench/extract.py.)"""
    n = 120
    src = _write(tmp_path / "in.jsonl", [{"id": i, "prompt": _prompt(i, 16)} for i in range(n)])
    samples = []

    def sample(shard, rows):
        status = compat.rpc(llama, "lens_status")[0]
        pool = status["result_pool"] or {}
        samples.append((status["result_regions"], pool.get("bytes", 0), pool.get("segments_made", 0)))

    budget = 2 / 1024  # 2 MiB: chunks of <= 1 MiB of captures (~7 rows), shards of <= 256 KiB
    points = ["resid_post", "attn_out", "resid_mid", "mlp_out"]
    stats = extract(
        llama, src, tmp_path / "x", layers="all", points=points, max_ram_gb=budget, progress=False, on_shard=sample
    )
    written = sum(p.stat().st_size for p in (tmp_path / "x").glob("*.safetensors"))
    assert stats["extracted"] == n and written > 8 * (2 << 20)  # the output is many times the budget
    assert stats["chunks"] >= 15 and stats["max_chunk_bytes"] <= stats["chunk_bytes"] == 1 << 20
    assert stats["shards"] >= 30
    rows_per_chunk = -(-n // stats["chunks"]) * 2
    assert max(s[0] for s in samples) <= rows_per_chunk  # results held: at most about one chunk's
    assert samples[-1][1] == samples[0][1] <= 32 << 20  # the result pool did not grow with the corpus
    assert samples[-1][2] == samples[0][2]  # (no new shared memory made after the first chunk)
    assert compat.rpc(llama, "lens_status")[0]["stored_requests"] == 0


def test_malformed_line_is_named_and_nothing_done_is_lost(llama, tmp_path):
    good = [{"id": i, "prompt": _prompt(i)} for i in range(6)]
    for bad, match in [
        ('{"id": 3, "prompt": "a"', "in.jsonl line 3: not valid JSON"),
        ({"id": 3, "txt": "a"}, "line 3: unknown field txt"),
        ({"id": 3, "text": "a", "prompt": "a"}, "line 3: expected exactly one of prompt, text or messages"),
        ({"id": 3, "messages": [{"role": "user"}]}, r"line 3: messages\[0\]"),
        ({"id": 1, "prompt": "a"}, r"line 3: duplicate id 1 \(first on line 2\)"),
    ]:
        src = _write(tmp_path / "in.jsonl", good[:2] + [bad] + good[2:])
        with pytest.raises(ExtractInputError, match=match):
            extract(llama, src, tmp_path / "bad", layers=[0], progress=False)
        assert not list((tmp_path / "bad").glob("shard-*"))  # checked before anything ran
    # a line only the engine can judge (too long for max_model_len 512): the rows before it are kept
    src = _write(tmp_path / "in.jsonl", good + [{"id": "long", "prompt": "the " * 600}])
    with pytest.raises(ExtractInputError, match="line 7: .* exceed the engine's max_model_len 512"):
        extract(llama, src, tmp_path / "bad", layers=[0], progress=False)
    assert len(open_extraction(tmp_path / "bad")) == 6
    _write(tmp_path / "in.jsonl", good + [{"id": "long", "prompt": "the " * 20}])
    assert extract(llama, src, tmp_path / "bad", layers=[0], progress=False)["extracted"] == 1


def test_cli_end_to_end(llama, tmp_path):
    """One `vllm-lens extract` run (its own engine, in a subprocess): the files equal a direct capture; a line
    in the usual corpus form (`text`, no id) is extracted under its line number; a clean run's stderr has no
    leaked shared memory."""
    rows = [{"id": f"r{i}", "prompt": _prompt(i)} for i in range(12)] + [{"id": "c", "messages": CHAT_DONE}]
    rows.append({"text": _prompt(20)})  # line 14
    src = _write(tmp_path / "in.jsonl", rows)
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(Path(__file__).parents[2]), os.environ.get("PYTHONPATH", "")]),
    }
    cmd = [sys.executable, "-m", "vllm_worker.plugin.cli", "extract", str(model_path("llama"))]
    cmd += ["--input", str(src), "--out", str(tmp_path / "o"), "--layers", "1,3", "--points", "resid_post,mlp_out"]
    cmd += ["--positions", "last", "--out-dtype", "float16", "--max-ram-gb", "0.001", "--no-progress"]
    cmd += [
        "--dtype",
        "float32",
        "--max-model-len",
        "512",
        "--enforce-eager",
        "--kv-cache-memory-bytes",
        str(128 << 20),
    ]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "14 rows (14 new, 0 already done)" in done.stderr
    assert "leaked shared_memory" not in done.stderr and "resource_tracker" not in done.stderr, done.stderr[-3000:]
    ds = open_extraction(tmp_path / "o")
    assert ds.meta["dtype"] == "float16" and ds.meta["positions"] == "last" and len(ds) == 14
    assert ds.ids[-1] == 14
    for rid, prompt in ((rows[0]["id"], rows[0]["prompt"]), (rows[11]["id"], rows[11]["prompt"]), (14, _prompt(20))):
        ref = _direct(llama, prompt, {"resid_post": [1, 3], "mlp_out": [1, 3]})
        got = ds.get(rid)
        assert got["token_ids"] == list(ref.prompt_token_ids)
        for p in ("resid_post", "mlp_out"):
            assert got[p].dtype == torch.float16 and got[p].shape == (2, 1, 128)
            torch.testing.assert_close(got[p].float(), ref.activations[p][:, -1:].half().float(), rtol=1e-3, atol=1e-3)
