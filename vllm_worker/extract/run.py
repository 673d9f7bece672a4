"""Bulk extraction on an offline `vllm.LLM`: the corpus goes through the engine in chunks whose captures,
at their largest, fit a share of the RAM budget; each chunk's rows are cut to the positions kept,
copied out of the shared-memory results (which then go back to the workers for reuse) and appended to
the current shard, written (by a thread, while the next shard fills and the next chunk runs) when it
reaches its share of the budget, or at a chunk's end when no shard is being written. So host memory stays
bounded whatever the corpus size, and a crash or Ctrl-C loses at most the rows in flight (on Ctrl-C and on an error, rows already done are written first).

Budget (`max_ram_gb` = B): captures in flight <= B/2 (also <= VLLM_LENS_MAX_STORED_GB), one shard being
filled and one being written, each <= min(B/8, 256 MiB); the rest is headroom for the rows' token ids and
Python objects. A single row larger than its share goes alone.

Host time per row matters: with short prompts plain generation is itself host-bound, so the extractor
tokenizes in batches, validates the one capture spec once (sent as its JSON text) and lets vLLM copy its
SamplingParams shallowly (`compat.shared_sampling_params`); figures in docs/decisions.md.
"""

from __future__ import annotations

import itertools
import json
import threading
import time
from pathlib import Path
from typing import Any, Callable, Iterator

import torch

from vllm_worker import compat
from vllm_worker.envs import limit
from vllm_worker.extract import inputs as inp
from vllm_worker.extract import shards as sh
from vllm_worker.frontend.state import engine_shape
from vllm_worker.protocol.points import MLP_POST, K, Q, Z
from vllm_worker.protocol.spec import ACTIVATIONS_KEY, capture_points, capture_sites

OUT_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
# rows per generate call (memory is bounded by bytes, not rows): fewer rows in flight keep fewer objects alive
# at each garbage collection (why 2048: docs/decisions.md, "Bulk extraction")
MAX_CHUNK_ROWS = 2048
MAX_SHARD_BYTES = 256 << 20  # shards are written while the next fills: smaller ones overlap more
TOKENIZE_ROWS = 256  # rows tokenized per batched tokenizer call


def _dtype_name(dtype: torch.dtype) -> str:
    return {v: k for k, v in OUT_DTYPES.items()}[dtype]


def _row_width(points: dict[str, list[int]], shape: Any) -> int:
    """Values per captured row (z / q / k are as wide as their heads)."""
    width = shape.d_model
    if Z in points or Q in points:
        width = max(width, shape.n_heads * shape.d_head)
    if K in points:
        width = max(width, shape.n_kv_heads * shape.d_head)
    return width


class _Writer:
    """The shard being filled and the ones already written. Rows are copied into one flat buffer per shard
    (the safetensors file's data section, written with one system call) and kept as tuples of plain values:
    a chunk's thousands of rows leave no tensor or dict per row alive for the garbage collector to walk.
    A full shard is written by a thread while the next one fills and the engine runs the next chunk (file
    writes and fsync release the GIL): at most one shard is being written, so two shards' rows are held at
    most, and the written shard's buffer is reused by the next. `on_shard` runs in the caller's thread
    once its shard is on disk; if it raises, nothing more is written (as if the run stopped there)."""

    def __init__(
        self,
        out: Path,
        next_shard: int,
        shard_bytes: int,
        meta: dict,
        on_shard: Callable | None,
        dtype: torch.dtype = torch.float32,
    ):
        self.out, self.n, self.meta, self.on_shard, self.dtype = out, next_shard, meta, on_shard, dtype
        self.esize = torch.empty((), dtype=dtype).element_size()
        self.limit = max(1, shard_bytes // self.esize)  # values per shard buffer
        self.buf: torch.Tensor | None = None
        self.spare: torch.Tensor | None = None  # the buffer of the shard last written, for the next one
        self.used = 0  # values filled in `buf`
        self.rows: list[tuple] = []  # (id, line, start, n_positions, n_prompt, token ids, ((point, shape), ...))
        self.written = 0
        self.stopped = False
        self._busy: tuple[threading.Thread, int, int, list[BaseException], torch.Tensor] | None = None

    def take(self, n: int) -> torch.Tensor:
        """`n` values of the shard being filled, to copy one row into (after `add`-ing the rows before it);
        a shard the row does not fit is handed over first, and a row larger than a shard goes alone."""
        if self.rows and self.used + n > self.limit:
            self.flush()
        if self.buf is None or self.used + n > self.buf.numel():
            size = max(n, self.limit)
            if self.spare is not None and self.spare.numel() >= size:
                self.buf, self.spare = self.spare, None
            else:
                self.buf = torch.empty(size, dtype=self.dtype)
        return self.buf[self.used : self.used + n]

    def add(self, row: tuple, n: int) -> None:
        """The row whose `n` values were copied into the last `take`."""
        self.rows.append(row)
        self.used += n
        if self.used >= self.limit:
            self.flush()

    def flush(self) -> None:
        """Hand the rows so far to the writing thread (after the previous shard is finished)."""
        self.wait()
        if not self.rows or self.stopped:
            return
        buf, used, rows, n = self.buf, self.used, self.rows, self.n
        assert buf is not None
        self.buf, self.used, self.rows = None, 0, []
        self.n += 1
        failed: list[BaseException] = []
        thread = threading.Thread(target=self._write, args=(n, buf[:used], rows, failed), name="lens-extract-shard")
        self._busy = (thread, n, len(rows), failed, buf)
        thread.start()

    def _write(self, n: int, data: torch.Tensor, rows: list, failed: list) -> None:
        try:
            name = sh.shard_name(n)
            layout = sh.row_layout(rows, sh.DTYPES[self.dtype], self.esize)
            sh.write_safetensors_flat(self.out / f"{name}.safetensors", layout, data, {"format": sh.FORMAT})
            sh.write_rows(self.out / f"{name}.json", rows)  # written last: the shard is finished
        except BaseException as e:  # noqa: BLE001 - raised again in the caller's thread (`wait`)
            failed.append(e)

    def flush_if_idle(self) -> None:
        """End of a chunk: if no shard is being written, hand over the rows so far now, so they are written
        while the engine runs the next chunk instead of when the shard fills (for the last chunk's rows
        after the run). Holds no more than before: still one shard written and one filling at most."""
        if self._busy is None or not self._busy[0].is_alive():
            self.flush()

    def wait(self) -> None:
        """Block until the shard being written is on disk; raise its error, or run `on_shard` for it."""
        if self._busy is None:
            return
        thread, n, done, failed, buf = self._busy
        thread.join()
        self._busy = None
        if buf.numel() == self.limit:  # (a buffer made for one larger row is not kept)
            self.spare = buf
        if failed:
            self.stopped = True
            raise failed[0]
        self.written += 1
        if self.on_shard is not None:
            try:
                self.on_shard(n, done)
            except BaseException:
                self.stopped = True  # the caller stops the run after this shard
                raise

    def close(self) -> None:
        """Write what is left and wait for it."""
        self.flush()
        self.wait()
        self.buf = self.spare = None


def _check_meta(out: Path, meta: dict) -> None:
    path = out / sh.META
    if not path.exists():
        sh.write_json(path, meta)
        return
    old = json.loads(path.read_text())
    for key in ("format", "model", "points", "positions", "dtype", "max_tokens"):
        if old.get(key) != meta.get(key):
            raise ValueError(
                f"{out} holds an extraction made with {key}={old.get(key)!r}, not {meta.get(key)!r}: "
                "resume with the same settings, or write to another folder"
            )


def _keep(tok: inp.Tokenized, out: Any, positions: str, points: dict, writer: _Writer) -> int:
    """Copy one finished request's kept positions into the shard being filled (so the shared-memory result
    they came from can go back to the workers) and add its row; returns the row's tokens."""
    acts = out.activations
    if acts is None:
        raise RuntimeError(f"inspect-lens extract: no activations came back for id {tok.row.id!r}")
    generated = out.outputs[0].token_ids
    n_prompt = len(tok.token_ids)
    n_run = n_prompt + len(generated) - 1  # the last generated token is never fed back
    if positions == "all":
        start, n = 0, n_run
    elif positions == "last":
        start, n = n_run - 1, 1
    else:
        start = min(tok.answer_start, n_run)
        n = n_run - start
    srcs = []
    size = 0
    for point in points:
        t = acts[point]
        if t.shape[1] != n_run:
            raise RuntimeError(
                f"inspect-lens extract: id {tok.row.id!r}: {point} has {t.shape[1]} positions, expected {n_run}"
            )
        src = t[:, start : start + n]
        srcs.append(src)
        size += src.numel()
    flat = writer.take(size)
    at = 0
    shapes = []
    for point, src in zip(points, srcs):
        k = src.numel()
        flat[at : at + k].view(src.shape).copy_(src)
        shapes.append((point, tuple(src.shape)))
        at += k
    # the tokens of the positions that ran (a tuple of ints, like the rest of the row: nothing the garbage
    # collector keeps walking)
    ids = tuple(tok.token_ids) if len(generated) == 1 else tuple((list(tok.token_ids) + list(generated))[:n_run])
    writer.add((tok.row.id, tok.row.line, start, n, n_prompt, ids, tuple(shapes)), size)
    return len(ids)


def extract(
    llm: Any,
    input: inp.Source,
    out: str | Path,
    *,
    layers: list[int] | str,
    points: list[str] | tuple[str, ...] = ("resid_post",),
    positions: str = "all",
    dtype: str | None = None,
    max_ram_gb: float = 4.0,
    max_tokens: int = 1,
    progress: bool = True,
    on_shard: Callable[[int, int], None] | None = None,
) -> dict[str, Any]:
    """Extract activations of every row of `input` (a JSONL path, or a list of `{"id", "prompt" |
    "messages"}`) at `points` x `layers` into the folder `out`; resumes what a previous run there
    finished. Returns a summary (rows, chunks, shards, tokens, seconds, budgets).

    `positions`: "all" (every position that ran), "last" (the last one), "answer" (the assistant's reply:
    the final assistant message's tokens and the generated ones — docs/extraction.md). `max_tokens` 1
    reads the prompt only; more generates greedily and keeps the generated positions too. `dtype`: of the
    stored tensors (default: the model's). `on_shard(shard, rows)` runs after each shard is written."""
    if positions not in inp.POSITIONS:
        raise ValueError(f"positions: expected one of {', '.join(inp.POSITIONS)}, got {positions!r}")
    if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
        raise ValueError(f"max_tokens: expected a whole number >= 1, got {max_tokens!r}")
    if not (isinstance(max_ram_gb, (int, float)) and max_ram_gb > 0):
        raise ValueError(f"max_ram_gb: expected a positive number, got {max_ram_gb!r}")
    if dtype is not None and dtype not in OUT_DTYPES:
        raise ValueError(f"dtype: expected one of {', '.join(OUT_DTYPES)}, got {dtype!r}")
    if isinstance(points, str):
        points = [p for p in points.split(",") if p]
    if not points:
        raise ValueError("points: expected at least one hook point")

    if compat.llm_busy(llm):
        raise ValueError("extract: this LLM still has unfinished requests (an interrupted generate?); use a fresh LLM")
    processor = compat.processor_of_llm(llm)
    shape = engine_shape(processor)
    wanted = capture_points({p: layers for p in points}, shape)  # ValueError naming the field
    if MLP_POST in wanted:  # its rows are d_mlp wide: the shard layout assumes one row width per point set
        raise ValueError("points: mlp_post is not supported by extract yet (capture it with output_activations)")
    model, model_dtype, max_len = compat.served_model(processor)
    out_dtype = OUT_DTYPES[dtype] if dtype else model_dtype
    if out_dtype not in sh.DTYPES:
        raise ValueError(f"dtype: the model's {model_dtype} cannot be stored; pass dtype")
    n_sites = len(capture_sites(wanted))
    row_bytes = _row_width(wanted, shape) * n_sites * torch.empty((), dtype=model_dtype).element_size()

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    meta = {
        "format": sh.FORMAT,
        "model": model,
        "points": wanted,
        "layers": sorted({l for ls in wanted.values() for l in ls}),
        "positions": positions,
        "dtype": _dtype_name(out_dtype),
        "max_tokens": max_tokens,
        "d_model": shape.d_model,
    }
    _check_meta(out, meta)

    total = inp.scan(input, positions, max_tokens)  # every line checked before anything runs
    sh.clean_unfinished(out)
    done_shards = sh.finished_shards(out)
    done = {inp._id_key(r["id"]) for r in sh.iter_rows(out)}

    ram = int(max_ram_gb * (1 << 30))
    chunk_bytes = max(1, min(ram // 2, int(limit("VLLM_LENS_MAX_STORED_GB") * 0.9)))
    shard_bytes = max(1, min(ram // 8, MAX_SHARD_BYTES))
    per_request = limit("VLLM_LENS_MAX_CAPTURE_GB")
    writer = _Writer(out, (done_shards[-1] + 1) if done_shards else 0, shard_bytes, meta, on_shard, out_dtype)
    tokenizer = llm.get_tokenizer()
    # the capture as its JSON string (a form the frontend takes): validated once for all the rows, as the
    # same text (`frontend/spec_memo`)
    capture = json.dumps(wanted, separators=(",", ":"))
    sp = compat.shared_sampling_params(
        max_tokens=max_tokens, temperature=0.0, detokenize=False, extra_args={ACTIVATIONS_KEY: capture}
    )

    from tqdm import tqdm

    bar = tqdm(total=total, initial=len(done), unit="row", desc="extract", dynamic_ncols=True, disable=not progress)
    stats: dict[str, Any] = {
        "rows": total,
        "skipped": len(done),
        "extracted": 0,
        "chunks": 0,
        "tokens": 0,
        "max_chunk_bytes": 0,
    }
    t0 = time.perf_counter()
    rows = inp.rows(input, positions, max_tokens)
    todo = _tokenized(tokenizer, (r for r in rows if inp._id_key(r.id) not in done) if done else rows)
    pending: inp.Tokenized | None = None
    bad: inp.ExtractInputError | None = None
    try:
        while bad is None:
            chunk: list[inp.Tokenized] = []
            size = 0
            while len(chunk) < MAX_CHUNK_ROWS:
                tok = pending if pending is not None else next(todo, None)
                pending = None
                if tok is None:
                    break
                try:
                    _check_length(input, tok, max_tokens, max_len, row_bytes, per_request)
                except inp.ExtractInputError as e:
                    bad = e  # the rows before it are extracted and written first: nothing done is lost
                    break
                need = row_bytes * (len(tok.token_ids) + max_tokens - 1)
                if chunk and size + need > chunk_bytes:
                    pending = tok  # starts the next chunk
                    break
                chunk.append(tok)
                size += need
            if not chunk:
                break
            stats["chunks"] += 1
            stats["max_chunk_bytes"] = max(stats["max_chunk_bytes"], size)
            outs = llm.generate([{"prompt_token_ids": t.token_ids} for t in chunk], sp, use_tqdm=False)
            if len(outs) != len(chunk) or any(list(o.prompt_token_ids) != t.token_ids for o, t in zip(outs, chunk)):
                raise RuntimeError("inspect-lens extract: the LLM answered other requests than this chunk's")
            for i, tok in enumerate(chunk):
                stats["tokens"] += _keep(tok, outs[i], positions, wanted, writer)
                outs[i] = None  # this row's result memory goes back to the workers once copied out
                stats["extracted"] += 1
            del outs
            writer.flush_if_idle()
            elapsed = time.perf_counter() - t0
            bar.set_postfix_str(f"{stats['tokens'] / max(elapsed, 1e-9):,.0f} tok/s, {writer.n} shards", refresh=False)
            bar.update(len(chunk))
        writer.close()
        if bad is not None:
            raise bad
    except BaseException:
        # rows already copied out are complete: keep them (a resumed run skips them)
        try:
            writer.close()
        finally:
            bar.close()
        raise
    bar.close()
    stats["index_rows"] = sh.write_index(out, meta)
    stats.update(
        seconds=time.perf_counter() - t0,
        shards=len(sh.finished_shards(out)),
        shards_written=writer.written,
        chunk_bytes=chunk_bytes,
        shard_bytes=shard_bytes,
        out=str(out),
    )
    return stats


def _tokenized(tokenizer: Any, rows: Iterator[inp.Row]) -> Iterator[inp.Tokenized]:
    """The rows' token ids, tokenized TOKENIZE_ROWS at a time (one batched tokenizer call each)."""
    while True:
        block = list(itertools.islice(rows, TOKENIZE_ROWS))
        if not block:
            return
        yield from inp.tokenize(tokenizer, block)


def _check_length(src: inp.Source, tok: inp.Tokenized, max_tokens: int, max_len: int, row_bytes: int, cap: int):
    n = len(tok.token_ids)
    if n == 0:
        raise inp.ExtractInputError(f"{inp._where(src, tok.row.line)}: the prompt has no tokens")
    if n + max_tokens > max_len:
        raise inp.ExtractInputError(
            f"{inp._where(src, tok.row.line)}: {n} prompt tokens + max_tokens {max_tokens} exceed the engine's "
            f"max_model_len {max_len}"
        )
    if row_bytes * (n + max_tokens - 1) > cap:
        raise inp.ExtractInputError(
            f"{inp._where(src, tok.row.line)}: its capture needs {row_bytes * (n + max_tokens - 1) / 2**30:.2f} GiB, above "
            f"VLLM_LENS_MAX_CAPTURE_GB ({cap / 2**30:.2f} GiB)"
        )
