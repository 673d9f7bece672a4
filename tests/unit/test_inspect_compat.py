"""inspect_lens._compat: the installed Inspect AI has every private member inspect-lens relies on, and an
Inspect that moved one (or one older than the tested range) is refused with an error naming it; a newer one
whose members all check out runs with a warning naming the newest tested version. Versions are simulated on
the real installed Inspect, so the member checks are the real ones. No engine, no server."""

from __future__ import annotations

import importlib
import re
import sys
import warnings
from pathlib import Path

import pytest
import tomllib

from inspect_lens import _compat
from inspect_lens._compat import LensIncompatibleInspect, LensUntestedInspectWarning

ROOT = Path(__file__).resolve().parents[2]


def _owner(member: _compat.Member):
    obj = importlib.import_module(member.module)
    *parents, leaf = member.path.split(".")
    for part in parents:
        obj = getattr(obj, part)
    if isinstance(obj, type):  # the class that defines it (resolve_stream is VLLMAPI's base's)
        obj = next(k for k in obj.__mro__ if leaf in vars(k))
    return obj, leaf


def _v(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split("."))


def _fmt(v: tuple[int, ...]) -> str:
    return ".".join(map(str, v))


def test_installed_inspect_passes():
    assert _compat.check() == _compat.inspect_version()
    assert _compat.support(_compat.inspect_version()) != "older"


def test_setup_installs_a_tested_inspect():
    pins = set(re.findall(r'"inspect-ai==([0-9.]+)"', (ROOT / "scripts" / "setup.sh").read_text()))
    assert pins, "scripts/setup.sh no longer pins inspect-ai"
    for pin in pins:
        assert _compat.support(_v(pin)) == "tested", pin


def test_the_inspect_extra_and_spec_are_exactly_the_tested_range():
    oldest, newest = _compat.TESTED
    want = f"inspect-ai>={_fmt(oldest)},<={_fmt(newest)}"
    assert _compat.SPEC == want
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert [r for r in extras["inspect"] if r.startswith("inspect-ai")] == [want]


@pytest.mark.parametrize(
    ("version", "verdict"),
    [
        ((0, 3, 261), "older"),  # its members check out, but evals fail on it (docs/compatibility.md)
        ((0, 3, 260), "older"),  # lacks VLLMAPI._server_root and resolve_stream
        ((0, 2, 999), "older"),
        ((0, 3), "older"),
        ((0, 3, 286), "newer"),
        ((0, 4, 0), "newer"),
        ((1, 0, 0), "newer"),
    ],
)
def test_support_by_version(version, verdict):
    assert _compat.support(version) == verdict


def test_the_ends_of_the_tested_range_are_tested():
    oldest, newest = _compat.TESTED
    assert oldest <= newest
    assert _compat.support(oldest) == _compat.support(newest) == "tested"
    assert _compat.support(oldest[:2] + (oldest[2] - 1,)) == "older"
    assert _compat.support(newest[:2] + (newest[2] + 1,)) == "newer"


def test_a_tested_version_runs_without_warning(monkeypatch):
    monkeypatch.setattr(_compat, "inspect_version", lambda: _compat.TESTED[0])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert _compat.check() == _compat.TESTED[0]


@pytest.mark.parametrize(
    "member",
    [m for m in _compat.MEMBERS if m.kind != "attribute" and not m.path.endswith("__init__")],
    ids=lambda m: m.path,
)
def test_a_member_moved_away_is_named(monkeypatch, member):
    owner, leaf = _owner(member)
    monkeypatch.delattr(owner, leaf)
    with pytest.raises(LensIncompatibleInspect, match=re.escape(f"{member.module}.{member.path} not found")):
        _compat.check()


@pytest.mark.parametrize("member", [m for m in _compat.MEMBERS if m.kind == "attribute"], ids=lambda m: m.path)
def test_an_instance_attribute_no_longer_set_is_named(monkeypatch, member):
    *parents, attr = member.path.split(".")
    cls = importlib.import_module(member.module)
    for part in parents:  # VLLMAPI, or the VLLMServer dataclass of the shared server state
        cls = getattr(cls, part)
    orig = cls.__init__
    # the same constructor, less the one assignment
    code = orig.__code__.replace(co_names=tuple(f"{n}_gone" if n == attr else n for n in orig.__code__.co_names))
    init = type(orig)(code, orig.__globals__, orig.__name__, orig.__defaults__, orig.__closure__)
    init.__kwdefaults__ = orig.__kwdefaults__
    monkeypatch.setattr(cls, "__init__", init)
    with pytest.raises(
        LensIncompatibleInspect, match=re.escape(f"{member.module}.{member.path} not found (no longer set")
    ):
        _compat.check()


def test_a_private_method_that_changed_shape_is_named(monkeypatch):
    vllm_api = _compat.vllm_api_base()

    def _start_server(self, model, host, port=None):  # a new parameter in between
        raise AssertionError("not called")

    monkeypatch.setattr(vllm_api, "_start_server", _start_server)
    with pytest.raises(LensIncompatibleInspect, match=r"VLLMAPI\._start_server takes \(model, host, port\)"):
        _compat.check()

    monkeypatch.setattr(vllm_api, "_ensure_server_started", lambda self: None)  # no longer async
    with pytest.raises(LensIncompatibleInspect, match=r"_ensure_server_started is no longer an async function"):
        _compat.check()


def test_a_constructor_that_no_longer_takes_server_args_is_named(monkeypatch):
    def __init__(self, model_name, base_url=None, port=None, api_key=None):
        raise AssertionError("not called")

    monkeypatch.setattr(_compat.vllm_api_base(), "__init__", __init__)
    with pytest.raises(LensIncompatibleInspect, match=r"VLLMAPI\.__init__ no longer accepts \*\*kwargs"):
        _compat.check()


def test_a_command_inspect_no_longer_builds_is_named(monkeypatch):
    def _start_server(self, model_path, port=None):
        cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server"]  # neither `vllm` nor `serve`
        return _compat.vllm_provider().start_local_server(cmd, server_args={})

    monkeypatch.setattr(_compat.vllm_api_base(), "_start_server", _start_server)
    with pytest.raises(
        LensIncompatibleInspect,
        match=r"_start_server no longer uses `server_args`.*"
        r"_start_server no longer contains 'serve'",
    ):
        _compat.check()


def test_a_module_moved_away_is_named(monkeypatch):
    real = importlib.import_module

    def fake(name, *args, **kwargs):
        if name == _compat.SAMPLES_MODULE:
            raise ModuleNotFoundError(f"No module named {name!r}")
        return real(name, *args, **kwargs)

    monkeypatch.setattr(_compat.importlib, "import_module", fake)
    with pytest.raises(LensIncompatibleInspect, match=re.escape(f"module {_compat.SAMPLES_MODULE} cannot be imported")):
        _compat.check()


def test_a_name_clash_with_our_subclass_is_named(monkeypatch):
    monkeypatch.setattr(_compat.vllm_api_base(), "lens_info", lambda self: None, raising=False)
    with pytest.raises(LensIncompatibleInspect, match=r"VLLMAPI now uses lens_info"):
        _compat.check()


@pytest.mark.parametrize("version", [(0, 3, 261), (0, 3, 0), (0, 2, 999)])
def test_an_older_version_is_refused_naming_the_tested_range(monkeypatch, version):
    monkeypatch.delenv(_compat.SKIP_VERSION_ENV, raising=False)
    monkeypatch.setattr(_compat, "inspect_version", lambda: version)
    with pytest.raises(LensIncompatibleInspect, match=re.escape(f"found {_fmt(version)}")) as e:
        _compat.check()
    oldest, newest = _compat.TESTED
    assert f"{_fmt(oldest)} to {_fmt(newest)}" in str(e.value)
    assert _compat.SPEC in str(e.value)
    monkeypatch.setenv(_compat.SKIP_VERSION_ENV, "1")  # the escape hatch skips the range, not the members
    assert _compat.check() == version


@pytest.mark.parametrize("version", [(0, 3, 286), (0, 4, 0), (1, 0, 0)])
def test_a_newer_version_whose_members_check_out_runs_with_a_warning(monkeypatch, version):
    monkeypatch.delenv(_compat.SKIP_VERSION_ENV, raising=False)
    monkeypatch.setattr(_compat, "inspect_version", lambda: version)
    with pytest.warns(LensUntestedInspectWarning) as got:
        assert _compat.check() == version
    [w] = got
    assert f"Inspect AI {_fmt(version)} is newer" in str(w.message)
    assert f"({_fmt(_compat.TESTED[1])})" in str(w.message)  # names the newest tested version


def test_a_newer_version_that_moved_a_member_is_refused_naming_it(monkeypatch):
    monkeypatch.setattr(_compat, "inspect_version", lambda: (0, 3, 290))
    monkeypatch.delattr(_compat.vllm_api_base(), "_server_root")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # refused, not warned about
        with pytest.raises(LensIncompatibleInspect, match=r"VLLMAPI\._server_root not found"):
            _compat.check()


def test_the_provider_warns_on_a_newer_inspect(monkeypatch):
    from inspect_lens.provider import VLLMLensAPI

    monkeypatch.setattr(_compat, "inspect_version", lambda: (0, 3, 286))
    with pytest.warns(LensUntestedInspectWarning, match=re.escape(_fmt(_compat.TESTED[1]))):
        VLLMLensAPI("some/model", base_url="http://127.0.0.1:9/v1")


def test_the_provider_is_refused_on_an_incompatible_inspect(monkeypatch):
    from inspect_lens.provider import VLLMLensAPI

    monkeypatch.delattr(_compat.vllm_api_base(), "_server_root")
    with pytest.raises(LensIncompatibleInspect, match=r"VLLMAPI\._server_root not found"):
        VLLMLensAPI("some/model", base_url="http://127.0.0.1:9/v1")


def test_every_private_inspect_access_goes_through_compat():
    """No module of inspect_lens but _compat imports a private Inspect module."""
    allowed: dict[str, set | None] = {"_compat.py": None}
    for path in (ROOT / "inspect_lens").glob("*.py"):
        found = set(re.findall(r"(inspect_ai(?:\.\w+)*\._\w+)", path.read_text()))
        if path.name in allowed:
            if allowed[path.name] is not None:
                assert found <= allowed[path.name], (path.name, found)
            continue
        assert not found, (path.name, found)
