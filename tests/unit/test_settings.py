"""One settings table: every VLLM_LENS_* variable the code reads is in it, the docs show exactly it, and
it is parsed one way (errors name the variable)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from vllm_worker import envs
from vllm_worker.plugin import cli

ROOT = Path(__file__).resolve().parents[2]


def test_every_variable_the_code_mentions_is_in_the_table():
    found = set()
    for path in (ROOT / "vllm_worker").rglob("*.py"):
        found |= set(re.findall(r"VLLM_LENS_[A-Z0-9_]+", path.read_text()))
    assert found == set(envs.SETTINGS), found ^ set(envs.SETTINGS)


def test_docs_show_the_generated_table():
    text = (ROOT / "docs" / "settings.md").read_text()
    table = text.split("<!-- settings table: generated -->\n", 1)[1].split("<!-- end of settings table -->", 1)[0]
    assert table == envs.markdown_table(), "docs/settings.md is stale: python -m vllm_worker.envs"


def test_one_parser_for_every_kind(monkeypatch):
    for raw, want in (
        ("1", True),
        ("true", True),
        ("YES", True),
        ("on", True),
        ("0", False),
        ("no", False),
        ("", False),
        (None, False),
    ):
        assert envs.parse("VLLM_LENS_DISABLE", raw) is want
    assert envs.parse("VLLM_LENS_SHM", None) is True
    with pytest.raises(ValueError, match="VLLM_LENS_DISABLE: expected 1/0"):
        envs.parse("VLLM_LENS_DISABLE", "maybe")
    with pytest.raises(ValueError, match="VLLM_LENS_MAX_CAPTURE_GB: must be positive"):
        envs.parse("VLLM_LENS_MAX_CAPTURE_GB", "0")
    with pytest.raises(ValueError, match="VLLM_LENS_STAGE_MB: expected a number"):
        envs.parse("VLLM_LENS_STAGE_MB", "lots")
    with pytest.raises(ValueError, match="VLLM_LENS_MAX_PERSISTENT_RESULTS: expected a whole number"):
        envs.parse("VLLM_LENS_MAX_PERSISTENT_RESULTS", "2.5")
    monkeypatch.setenv("VLLM_LENS_MAX_STORED_GB", "2")
    assert envs.limit("VLLM_LENS_MAX_STORED_GB") == 2 << 30
    assert envs.limit("VLLM_LENS_SHM_POOL_GB") == 2 << 30  # its default follows the stored limit
    monkeypatch.setenv("VLLM_LENS_SHM_POOL_GB", "0.5")
    assert envs.limit("VLLM_LENS_SHM_POOL_GB") == 1 << 29
    assert set(envs.limits()) == {
        "VLLM_LENS_MAX_PAYLOAD_MB",
        "VLLM_LENS_MAX_VECTORS_MB",
        "VLLM_LENS_MAX_CAPTURE_GB",
        "VLLM_LENS_MAX_STORED_GB",
        "VLLM_LENS_MAX_PERSISTENT_RESULTS",
    }


def test_serve_flags_come_from_the_table():
    assert cli.OUR_FLAGS == {"--allow-remote-hooks": "VLLM_LENS_ALLOW_REMOTE_HOOKS"}
    assert set(cli.LIMIT_FLAGS.values()) == set(envs.limits()) | {
        "VLLM_LENS_POINTS",
        "VLLM_LENS_SAE_DIR",
        "VLLM_LENS_PROBE_DIR",
    }


def test_settings_follow_the_environment_while_parsing_is_remembered(monkeypatch):
    """`get` reads the environment on every call (tests and operators change limits at run time); only the
    parsing of a text already seen is remembered, and a bad value is an error every time."""
    monkeypatch.delenv("VLLM_LENS_MAX_STORED_GB", raising=False)
    monkeypatch.delenv("VLLM_LENS_SHM_POOL_GB", raising=False)
    assert envs.limit("VLLM_LENS_MAX_CAPTURE_GB") == 4 << 30
    monkeypatch.setenv("VLLM_LENS_MAX_CAPTURE_GB", "2")
    assert envs.limit("VLLM_LENS_MAX_CAPTURE_GB") == 2 << 30
    monkeypatch.setenv("VLLM_LENS_MAX_CAPTURE_GB", "1")
    assert envs.limit("VLLM_LENS_MAX_CAPTURE_GB") == 1 << 30
    monkeypatch.setenv("VLLM_LENS_MAX_CAPTURE_GB", "2")
    assert envs.limit("VLLM_LENS_MAX_CAPTURE_GB") == 2 << 30
    monkeypatch.delenv("VLLM_LENS_MAX_CAPTURE_GB")
    assert envs.limit("VLLM_LENS_MAX_CAPTURE_GB") == 4 << 30
    for _ in range(2):
        monkeypatch.setenv("VLLM_LENS_MAX_CAPTURE_GB", "-1")
        with pytest.raises(ValueError, match="VLLM_LENS_MAX_CAPTURE_GB: must be positive"):
            envs.get("VLLM_LENS_MAX_CAPTURE_GB")
    # a computed default follows the setting it is computed from (the pool keeps what may be stored, also when blank)
    assert envs.limit("VLLM_LENS_SHM_POOL_GB") == 8 << 30
    monkeypatch.setenv("VLLM_LENS_SHM_POOL_GB", " ")
    monkeypatch.setenv("VLLM_LENS_MAX_STORED_GB", "3")
    assert envs.limit("VLLM_LENS_SHM_POOL_GB") == 3 << 30
    monkeypatch.setenv("VLLM_LENS_MAX_STORED_GB", "5")
    assert envs.limit("VLLM_LENS_SHM_POOL_GB") == 5 << 30


# Module constants read from a setting at import that wait for their modules' owners (issue #40, part B):
# each is named here so that no new one can appear unnoticed; the list only shrinks.
FROZEN_PENDING: set[tuple[str, str]] = set()


def _frozen_settings() -> set[tuple[str, str]]:
    """(module, name) of every module-level name assigned from `get` / `limit` / `given` of envs."""
    import ast

    found = set()
    for path in sorted((ROOT / "vllm_worker").rglob("*.py")):
        rel = str(path.relative_to(ROOT))
        if rel == "vllm_worker/envs.py":
            continue
        tree = ast.parse(path.read_text())
        for node in tree.body:
            if not isinstance(node, (ast.Assign, ast.AnnAssign)) or node.value is None:
                continue
            for call in ast.walk(node.value):
                if not isinstance(call, ast.Call):
                    continue
                f = call.func
                named = isinstance(f, ast.Name) and f.id in ("get", "limit", "given")
                named |= (
                    isinstance(f, ast.Attribute)
                    and f.attr in ("get", "limit", "given")
                    and (isinstance(f.value, ast.Name) and f.value.id == "envs")
                )
                if named and call.args and isinstance(call.args[0], ast.Constant):
                    if str(call.args[0].value).startswith("VLLM_LENS_"):
                        targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                        found |= {(rel, t.id) for t in targets if isinstance(t, ast.Name)}
    return found


def test_settings_are_read_when_asked_never_frozen_at_import():
    """envs' one rule: a setting is read where it is used, so changing the environment acts on what is
    done after it (a setting that sizes something made once acts on what is made after)."""
    assert _frozen_settings() <= FROZEN_PENDING, _frozen_settings() - FROZEN_PENDING


def test_settings_changed_after_import_take_effect(monkeypatch, tmp_path):
    from vllm_worker.transport import early, shm
    from vllm_worker.worker import faults, fetch

    monkeypatch.setenv("VLLM_LENS_SHM_DIR", str(tmp_path))
    assert shm.shm_dir() == str(tmp_path)
    monkeypatch.setenv("VLLM_LENS_EARLY_INTERVAL_MS", "250")
    assert early.interval_s() == 0.25
    monkeypatch.setenv("VLLM_LENS_ASSEMBLY_THREADS", "3")
    assert fetch.max_threads() == 3 and fetch.assembly_threads(1 << 40) == 3
    monkeypatch.setenv("VLLM_LENS_INJECT_FAULT", "plan")
    with pytest.raises(faults.InjectedFault):
        faults.check("plan")
    monkeypatch.delenv("VLLM_LENS_DIRECT_POOL", raising=False)
    assert envs.given("VLLM_LENS_DIRECT_POOL") is None and envs.get("VLLM_LENS_DIRECT_POOL") is True
    monkeypatch.setenv("VLLM_LENS_DIRECT_POOL", "0")
    assert envs.given("VLLM_LENS_DIRECT_POOL") is False
