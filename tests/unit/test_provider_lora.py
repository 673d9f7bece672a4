"""`VLLMLensAPI.prepare_lora`: a server the provider is still to start gets `--enable-lora` and a
`--max-lora-rank` vLLM accepts from the adapter's config; a given server is left alone. No engine, no
server: the command is caught where Inspect would launch it (tests/inspect/test_evals.py runs it for real)."""

from __future__ import annotations

import json
import uuid

import pytest

from inspect_lens import _compat
from inspect_lens.provider import VLLMLensAPI, server_lora_rank


def _adapter(tmp_path, r) -> str:
    d = tmp_path / f"adapter-r{r}"
    d.mkdir()
    (d / "adapter_config.json").write_text(json.dumps({"r": r, "peft_type": "LORA"}))
    return str(d)


@pytest.fixture
def fresh_api():
    """Providers on base models no one else uses (Inspect shares server state per base model)."""
    from inspect_ai.model._providers._vllm_lora import _vllm_servers

    names: list[str] = []

    def make(**kw) -> VLLMLensAPI:
        names.append(f"/nowhere/lens-test-{uuid.uuid4().hex}")
        return VLLMLensAPI(names[-1], **kw)

    yield make
    for n in names:
        _vllm_servers.pop(n, None)


class _Launched(Exception):
    pass


def test_a_server_still_to_start_gets_lora_with_the_adapters_rank(fresh_api, tmp_path, monkeypatch):
    monkeypatch.delenv("VLLM_BASE_URL", raising=False)
    # the provider sets it for the server it starts: restored after the test (later servers of this
    # process must not inherit it)
    monkeypatch.setenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "False")
    monkeypatch.delenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING")
    api = fresh_api()
    server = _compat.lora_server(api)
    assert (server.enable_lora, server.max_lora_rank) == (False, None)
    assert api.prepare_lora(_adapter(tmp_path, 4)) is True
    assert (server.enable_lora, server.max_lora_rank) == (True, 8)  # 4 is not a rank vLLM accepts: 8 is
    assert api.prepare_lora(_adapter(tmp_path, 32)) is True
    assert api.prepare_lora(_adapter(tmp_path, 16)) is True  # never lowered: every adapter must fit
    assert server.max_lora_rank == 32
    no_config = tmp_path / "no-config"
    no_config.mkdir()
    assert api.prepare_lora(no_config) is True and server.max_lora_rank == 32  # rank unknown: LoRA on

    launched: dict = {}

    def catch(orig):
        def start_local_server(base_cmd, *args, **kwargs):
            launched.update(cmd=base_cmd, **kwargs)
            raise _Launched

        return start_local_server

    with _compat.replaced_start_local_server(catch), pytest.raises(_Launched):
        api._start_server(api.base_model, None)
    assert launched["cmd"][0].endswith("vllm-lens") and launched["cmd"][1:3] == ["serve", api.base_model]
    assert launched["server_args"]["enable_lora"] is True and launched["server_args"]["max_lora_rank"] == 32
    import os

    assert os.environ["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] == "True"  # adapters loadable per request


def test_a_given_server_is_left_alone(fresh_api, tmp_path, monkeypatch):
    monkeypatch.delenv("VLLM_BASE_URL", raising=False)
    adapter = _adapter(tmp_path, 8)
    for api in (fresh_api(base_url="http://127.0.0.1:9/v1"), fresh_api(port=9)):
        assert api.prepare_lora(adapter) is False
        assert (_compat.lora_server(api).enable_lora, _compat.lora_server(api).max_lora_rank) == (False, None)
    monkeypatch.setenv("VLLM_BASE_URL", "http://127.0.0.1:9/v1")
    api = fresh_api()
    assert api.prepare_lora(adapter) is False and _compat.lora_server(api).enable_lora is False
    monkeypatch.delenv("VLLM_BASE_URL")
    running = fresh_api()
    _compat.lora_server(running).base_url = "http://127.0.0.1:9/v1"  # started (without LoRA) by an earlier request
    assert running.prepare_lora(adapter) is False and _compat.lora_server(running).enable_lora is False


def test_ranks_round_up_to_what_vllm_serve_accepts():
    got = {r: server_lora_rank(r) for r in (1, 2, 8, 9, 16, 17, 300, 320, 512, 1024)}
    assert got == {1: 1, 2: 8, 8: 8, 9: 16, 16: 16, 17: 32, 300: 320, 320: 320, 512: 512, 1024: 1024}
