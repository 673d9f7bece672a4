"""The corpus's lines as rows, without an engine: `text` is a prompt, a missing id is the line number,
and a line naming its prompt twice is refused naming the line."""

import json

import pytest

from vllm_worker.extract.inputs import ExtractInputError, rows, scan


def _write(path, lines):
    path.write_text("".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines))
    return path


def test_text_is_a_prompt_and_a_missing_id_is_the_line_number(tmp_path):
    src = _write(tmp_path / "c.jsonl", [{"text": "a b"}, "", {"id": "x", "prompt": "c"}, {"text": "d"}])
    assert scan(src, "all", 1) == 3
    got = [(r.line, r.id, r.prompt) for r in rows(src, "all", 1)]
    assert got == [(1, 1, "a b"), (3, "x", "c"), (4, 4, "d")]  # blank line 2 skipped, numbering kept


def test_a_list_source_numbers_its_rows_from_one():
    assert [r.id for r in rows([{"text": "a"}, {"id": "k", "text": "b"}], "all", 1)] == [1, "k"]


@pytest.mark.parametrize(
    "line, match",
    [
        ({"text": "a", "prompt": "a"}, "line 2: expected exactly one of prompt, text or messages"),
        ({"text": ""}, "line 2: text must be a non-empty string"),
        ({"id": 1, "text": "a"}, r"line 2: duplicate id 1 \(first on line 1\)"),  # line 1's id is 1
        ({"txt": "a"}, "line 2: unknown field txt"),
    ],
)
def test_bad_lines_are_named(tmp_path, line, match):
    src = _write(tmp_path / "c.jsonl", [{"text": "a"}, line])
    with pytest.raises(ExtractInputError, match=match):
        scan(src, "all", 1)
