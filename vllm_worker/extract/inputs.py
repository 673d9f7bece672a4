"""The extraction corpus: JSONL lines `{"id", "prompt"}` or `{"id", "messages"}` (`text` is taken for
`prompt`, the usual corpus form; without `id` a line's id is its line number), checked in one streaming
pass before anything runs (a malformed line or a duplicate id is an error naming its line, so nothing is
half-done because of line 90,000), then read again chunk by chunk and turned into token ids the way
vLLM itself would (completions: the tokenizer's special tokens; chat: the template, no extra ones)."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Iterator, Sequence

POSITIONS = ("all", "last", "answer")
ROLES = ("system", "user", "assistant", "tool", "developer")


class ExtractInputError(ValueError):
    """A line of the corpus that cannot be extracted: the message names the line and the field."""


@dataclass
class Row:
    line: int  # 1-based line of the input file (or index + 1 of a list)
    id: Any  # str or int, as given
    prompt: str | None = None
    messages: list[dict] | None = None


Source = str | Path | Sequence[dict]


def _where(src: Source, line: int) -> str:
    return f"{src} line {line}" if isinstance(src, (str, Path)) else f"input row {line}"


def _lines(src: Source) -> Iterator[tuple[int, Any]]:
    """(line number, parsed JSON or the raw text when it is not JSON) of every non-blank line."""
    if isinstance(src, (str, Path)):
        with Path(src).open(encoding="utf-8") as f:
            for n, text in enumerate(f, 1):
                if not text.strip():
                    continue
                try:
                    yield n, json.loads(text)
                except json.JSONDecodeError as e:
                    raise ExtractInputError(f"{_where(src, n)}: not valid JSON ({e.msg} at column {e.colno})") from None
    else:
        for n, obj in enumerate(src, 1):
            yield n, obj


PROMPT_FIELDS = ("prompt", "text")  # `text`: the usual field of a plain-text corpus


def check_row(obj: Any, where: str, positions: str, max_tokens: int, line: int) -> Row:
    """One parsed line (line number `line`) as a `Row`; `ExtractInputError` naming the field when it is
    malformed. Without `id` the row's id is `line`."""
    if not isinstance(obj, dict):
        raise ExtractInputError(f'{where}: expected an object {{"id": ..., "prompt": ...}}, got {type(obj).__name__}')
    rid = obj.get("id", line)
    if isinstance(rid, bool) or not isinstance(rid, (str, int)) or rid == "":
        raise ExtractInputError(f"{where}: id must be a non-empty string or an integer, got {rid!r}")
    unknown = sorted(set(obj) - {"id", "messages", *PROMPT_FIELDS})
    if unknown:
        raise ExtractInputError(f"{where}: unknown field {unknown[0]} (expected id and prompt, text or messages)")
    given = [k for k in ("messages", *PROMPT_FIELDS) if k in obj]
    if len(given) != 1:
        raise ExtractInputError(f"{where}: expected exactly one of prompt, text or messages")
    field = given[0]
    if field != "messages":
        if not isinstance(obj[field], str) or not obj[field]:
            raise ExtractInputError(f"{where}: {field} must be a non-empty string")
        if positions == "answer" and max_tokens <= 1:
            raise ExtractInputError(
                f"{where}: --positions answer keeps the assistant's reply: give messages ending with an "
                "assistant turn, or generate one with --max-tokens > 1"
            )
        return Row(line, rid, prompt=obj[field])
    msgs = obj["messages"]
    if not isinstance(msgs, list) or not msgs:
        raise ExtractInputError(f"{where}: messages must be a non-empty list of {{role, content}}")
    for i, m in enumerate(msgs):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise ExtractInputError(f"{where}: messages[{i}] must be {{'role': str, 'content': str}}")
        if m["role"] not in ROLES:
            raise ExtractInputError(f"{where}: messages[{i}].role must be one of {', '.join(ROLES)}, got {m['role']!r}")
    if positions == "answer":
        if not any(m["role"] == "user" for m in msgs):
            raise ExtractInputError(f"{where}: --positions answer needs a user turn in messages")
        if msgs[-1]["role"] != "assistant" and max_tokens <= 1:
            raise ExtractInputError(
                f"{where}: --positions answer keeps the assistant's reply: end messages with an assistant "
                "turn, or generate one with --max-tokens > 1"
            )
    return Row(line, rid, messages=[{"role": m["role"], "content": m["content"]} for m in msgs])


def _id_key(rid: Any) -> bytes:
    """A small fixed-size key per id (the duplicate check keeps one per row, not the ids themselves)."""
    return hashlib.blake2b(json.dumps(rid).encode(), digest_size=12).digest()


def scan(src: Source, positions: str, max_tokens: int) -> int:
    """Check every line (JSON, fields, duplicate ids) before anything runs; returns the number of rows."""
    seen: dict[bytes, int] = {}
    n = 0
    for line, obj in _lines(src):
        where = _where(src, line)
        row = check_row(obj, where, positions, max_tokens, line)
        key = _id_key(row.id)
        if key in seen:
            raise ExtractInputError(f"{where}: duplicate id {row.id!r} (first on line {seen[key]})")
        seen[key] = line
        n += 1
    return n


def rows(src: Source, positions: str, max_tokens: int) -> Iterator[Row]:
    """The corpus's rows in order (already checked by `scan`)."""
    for line, obj in _lines(src):
        yield check_row(obj, _where(src, line), positions, max_tokens, line)


@dataclass
class Tokenized:
    row: Row
    token_ids: list[int]
    answer_start: int  # first position of the assistant's reply (= len(token_ids) for a plain prompt)


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def encode_prompts(tokenizer: Any, prompts: list[str]) -> list[list[int]]:
    """`tokenizer.encode(p, add_special_tokens=True)` of each prompt, in one batched call when the tokenizer
    takes a list (HF tokenizers: one call into the Rust tokenizer instead of a Python round per prompt;
    docs/decisions.md); the ids are the same."""
    if len(prompts) > 1:
        try:
            # only the ids: no attention masks or type ids (lists the garbage collector would walk)
            kw = {"add_special_tokens": True, "return_attention_mask": False, "return_token_type_ids": False}
            ids = tokenizer(prompts, **kw)["input_ids"]
        except (TypeError, KeyError, AttributeError, NotImplementedError):
            ids = None  # not a batching HF tokenizer: one prompt at a time
        if isinstance(ids, list) and len(ids) == len(prompts):
            return [i if type(i) is list else list(i) for i in ids]
    return [list(tokenizer.encode(p, add_special_tokens=True)) for p in prompts]


def tokenize(tokenizer: Any, batch: Iterable[Row]) -> list[Tokenized]:
    """Token ids as vLLM makes them: `LLM.generate(prompt)` adds the tokenizer's special tokens, `LLM.chat`
    renders the chat template (with the generation prompt when the last turn is not the assistant's) and
    adds none. The reply starts after the conversation up to the last user turn, rendered with the
    generation prompt (the assistant's header is not part of the reply)."""
    batch = list(batch)
    prompt_ids = iter(encode_prompts(tokenizer, [r.prompt for r in batch if r.prompt is not None]))
    out = []
    for row in batch:
        if row.prompt is not None:
            ids = next(prompt_ids)
            out.append(Tokenized(row, ids, len(ids)))
            continue
        msgs = row.messages or []
        open_turn = msgs[-1]["role"] != "assistant"
        text = tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=open_turn)
        ids = list(tokenizer.encode(text, add_special_tokens=False))
        users = [i for i, m in enumerate(msgs) if m["role"] == "user"]
        if not users or open_turn:
            start = len(ids)
        else:
            head = tokenizer.apply_chat_template(msgs[: users[-1] + 1], tokenize=False, add_generation_prompt=True)
            start = _common_prefix(ids, list(tokenizer.encode(head, add_special_tokens=False)))
        out.append(Tokenized(row, ids, start))
    return out
