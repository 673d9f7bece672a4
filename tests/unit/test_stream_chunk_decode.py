"""`decode_stream_chunk`: one streamed chunk's probe scores per choice index, its error note, the final
chunk's results, and choices with none of these left out (the server's side: tests/http/test_probes_http.py)."""

from __future__ import annotations

import torch

from vllm_worker import decode_stream_chunk
from vllm_worker.protocol.wire import tensor_to_json


def test_scores_errors_and_final_results_by_choice_index():
    pos, rows = torch.tensor([7, 8]), torch.randn(2, 3)
    chunk = {
        "choices": [
            {
                "index": 2,
                "text": "a",
                "probe_scores": {"p": {"positions": tensor_to_json(pos), "scores": tensor_to_json(rows)}},
            },
            {"index": 0, "text": "b", "probe_scores_error": "inspect-lens internal error: X: y"},
            {"index": 1, "text": "c"},
        ]
    }
    got = decode_stream_chunk(chunk)
    assert set(got) == {0, 2}
    assert torch.equal(got[2]["probe_scores"]["p"]["positions"], pos)
    assert torch.equal(got[2]["probe_scores"]["p"]["scores"], rows)
    assert got[0] == {"probe_scores_error": "inspect-lens internal error: X: y"}
    final = {"choices": [{"index": 0, "activations": {"probe_scores": {"p": tensor_to_json(rows)}}}]}
    assert torch.equal(decode_stream_chunk(final)[0]["activations"]["probe_scores"]["p"], rows)
    assert decode_stream_chunk({"choices": []}) == {} and decode_stream_chunk({}) == {}
