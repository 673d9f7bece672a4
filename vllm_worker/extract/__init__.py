"""Bulk extraction: a corpus of prompts or chats through the engine, activations at chosen hook points
and layers streamed to safetensors shards with an index, in bounded host memory, resumable; and the
reader for what it writes. Runs in the frontend process (the one that owns the `vllm.LLM`); the reader
needs neither vLLM nor an engine.

    from vllm_worker.extract import extract, open
    extract(llm, "prompts.jsonl", "acts/", layers=[10, 15], points=["resid_post"], positions="last")
    ds = open("acts/"); ds.get("row-7")["resid_post"]          # (2, 1, d_model), memory-mapped

`vllm-lens extract MODEL --input prompts.jsonl --layers 10,15 --out acts/` is the same from the shell.
Details: docs/extraction.md.
"""

from __future__ import annotations

from vllm_worker.extract.inputs import ExtractInputError
from vllm_worker.extract.reader import Extraction, open_extraction
from vllm_worker.extract.run import extract  # imports vLLM only when called

open = open_extraction  # `vllm_worker.extract.open(DIR)` (shadows the builtin inside this namespace only)

__all__ = ["Extraction", "ExtractInputError", "extract", "open", "open_extraction"]
