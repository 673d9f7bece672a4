"""Which Inspect AI inspect-lens supports, and the ONE list of Inspect internals it relies on.

`vllm-lens/<model>` is Inspect's own vLLM provider (`inspect_ai.model._providers.vllm.VLLMAPI`, a private
module) with a few overrides, so it leans on members Inspect does not promise to keep. Every such member is
listed in `MEMBERS` below and reached through the helpers of this module; `check()` (run when the provider
is created) verifies that each is there with the shape we use and raises `LensIncompatibleInspect` naming
what moved, instead of a confusing failure deep inside an eval. In the spirit of `vllm_worker.compat`.

Supported: decided by what the provider uses, not by a version number. `TESTED` is the range of inspect-ai
releases where these member checks and the provider's tests passed (scripts/inspect-matrix.sh; the table is
in docs/compatibility.md). A newer release whose members all check out runs, with a
`LensUntestedInspectWarning` naming the newest tested one; one that moved a member is refused naming it; an
older release than the oldest tested is refused naming the range (`INSPECT_LENS_SKIP_VERSION_CHECK=1` lets it
through that range check only: the members are still checked).
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import os
import re
import warnings
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Iterator

if TYPE_CHECKING:  # for type checkers only; at run time `VLLMAPI` is resolved (and checked) by __getattr__
    from inspect_ai.model._providers.vllm import VLLMAPI

TESTED = ((0, 3, 265), (0, 3, 285))  # [oldest, newest] inspect-ai the matrix passed, on (major, minor, patch)
SPEC = "inspect-ai>=0.3.265,<=0.3.285"  # the same range, as the `inspect` extra pins it
SKIP_VERSION_ENV = "INSPECT_LENS_SKIP_VERSION_CHECK"

VLLM_MODULE = "inspect_ai.model._providers.vllm"
SAMPLES_MODULE = "inspect_ai.log._samples"
LORA_MODULE = "inspect_ai.model._providers._vllm_lora"


class LensIncompatibleInspect(RuntimeError):
    """The installed Inspect AI is older than the tested range, or lacks an internal inspect-lens needs."""


class LensUntestedInspectWarning(UserWarning):
    """The installed Inspect AI is newer than the newest tested one; every internal inspect-lens uses is there."""


@dataclass(frozen=True)
class Member:
    """An Inspect member inspect-lens touches: `module`:`path` (dotted below the module), and its shape.
    An "attribute" is one the class's `__init__` sets on each instance (`VLLMAPI.server_args`)."""

    module: str
    path: str
    used_for: str
    kind: str = "callable"  # "class" | "callable" | "coroutine" (an async function) | "attribute" (see above)
    params: tuple[str, ...] = ()  # leading parameters (after self), in order
    var_keyword: bool = False  # also accepts **kwargs
    code_names: tuple[str, ...] = ()  # globals / attributes its code must refer to
    code_consts: tuple[str, ...] = ()  # literals its code must contain

    @property
    def name(self) -> str:
        return f"{self.module}.{self.path}"


MEMBERS: tuple[Member, ...] = (
    Member(VLLM_MODULE, "VLLMAPI", "the base class of inspect_lens.provider.VLLMLensAPI", kind="class"),
    Member(
        VLLM_MODULE,
        "VLLMAPI.__init__",
        "VLLMLensAPI.__init__ forwards model_name and every -M argument",
        params=("model_name",),
        var_keyword=True,
    ),
    Member(
        VLLM_MODULE,
        "VLLMAPI.server_args",
        "VLLMLensAPI._start_server reads -M enable_lora from the server arguments",
        kind="attribute",
    ),
    Member(
        VLLM_MODULE,
        "VLLMAPI._init_base_url",
        "inspect_lens.oracle_fit.served_base_model asks a server given by --model-base-url which model it serves",
        kind="attribute",
    ),
    Member(
        VLLM_MODULE,
        "VLLMAPI.base_model",
        "inspect_lens.oracle_fit.served_base_model: the base model of vllm-lens/<base>[:<adapter>]",
        kind="attribute",
    ),
    Member(
        VLLM_MODULE,
        "VLLMAPI._start_server",
        "overridden by VLLMLensAPI._start_server to start `vllm-lens serve` (it builds `vllm serve ...` and "
        "hands it to the module's start_local_server, with --enable-lora / --max-lora-rank from the shared "
        "server state that VLLMLensAPI.prepare_lora sets)",
        params=("model_path", "port"),
        code_names=("start_local_server", "server_args", "_server", "enable_lora", "max_lora_rank"),
        code_consts=("vllm", "serve", "enable_lora", "max_lora_rank"),
    ),
    Member(
        VLLM_MODULE,
        "VLLMAPI._server",
        "VLLMLensAPI.prepare_lora: the state of the server shared per base model (LoRA settings, URL, process)",
        kind="attribute",
    ),
    *(
        Member(
            LORA_MODULE,
            f"VLLMServer.{field}",
            f"VLLMLensAPI.prepare_lora / _route_lora read or set the shared server state's {field}",
            kind="attribute",
        )
        for field in ("enable_lora", "max_lora_rank", "base_url", "process")
    ),
    Member(
        VLLM_MODULE,
        "start_local_server",
        "swapped for the duration of _start_server to replace the `vllm` executable by `vllm-lens`",
        params=("base_cmd",),
    ),
    Member(
        VLLM_MODULE,
        "VLLMAPI._ensure_server_started",
        "VLLMLensAPI.lens_client / LoRA routing start the (lazy) server before talking to it",
        kind="coroutine",
    ),
    Member(VLLM_MODULE, "VLLMAPI._server_root", "VLLMLensAPI.lens_client / LoRA routing: the server's root URL"),
    Member(
        VLLM_MODULE,
        "VLLMAPI.resolve_stream",
        "overridden by VLLMLensAPI so requests asking for results are never streamed",
        params=("config",),
    ),
    Member(
        SAMPLES_MODULE,
        "sample_active",
        "inspect_lens.scorers saves a trained probe beside the running eval's log (ActiveSample.log_location)",
    ),
)

_BY_PATH = {m.path: m for m in MEMBERS}

# Names VLLMLensAPI adds (attributes and methods): Inspect's VLLMAPI must not use them itself.
OWN_NAMES = (
    "_allow_remote_hooks",
    "_lora_loaded",
    "_lens_info",
    "_lora_lock",
    "_lora_lock_loop",
    "lens_info",
    "lens_client",
    "_lens_args",
    "_route_lora",
    "prepare_lora",
)


# -- version -----------------------------------------------------------------------------------------------


def inspect_version() -> tuple[int, ...]:
    from importlib.metadata import PackageNotFoundError, version

    try:
        raw = version("inspect_ai")
    except PackageNotFoundError:
        import inspect_ai

        raw = getattr(inspect_ai, "__version__", "")
    m = re.match(r"(\d+)\.(\d+)(?:\.(\d+))?", raw or "")
    if not m:
        raise LensIncompatibleInspect(f"cannot read the Inspect AI version ({raw!r}); inspect-lens needs {SPEC}")
    return tuple(int(g or 0) for g in m.groups())


def _fmt(v: tuple[int, ...]) -> str:
    return ".".join(map(str, v))


def support(v: tuple[int, ...]) -> str:
    """How inspect-lens treats Inspect AI `v`: "older" (than the tested range: refused), "tested", or "newer"
    (than the newest tested: allowed, with a warning, when the member checks pass)."""
    oldest, newest = TESTED
    v = tuple(v) + (0,) * (3 - len(v))
    if v < oldest:
        return "older"
    return "newer" if v > newest else "tested"


def _skip_version() -> bool:
    return os.environ.get(SKIP_VERSION_ENV, "").lower() in ("1", "true", "yes", "on")


def check_version(v: tuple[int, ...] | None = None) -> tuple[int, ...]:
    """`v` (default: the installed version), unless it is older than the tested range."""
    v = inspect_version() if v is None else v
    if support(v) == "older" and not _skip_version():
        oldest, newest = TESTED
        raise LensIncompatibleInspect(
            f"inspect-lens is tested with Inspect AI {_fmt(oldest)} to {_fmt(newest)} ({SPEC}); found {_fmt(v)}, "
            f"older than that range. Install a tested one with `pip install '{SPEC}'`, or set {SKIP_VERSION_ENV}=1 "
            "to try this version anyway (the Inspect internals inspect-lens uses are still checked)."
        )
    return v


def warn_if_untested(v: tuple[int, ...]) -> None:
    """A `LensUntestedInspectWarning` when `v` is newer than the newest tested version."""
    if support(v) == "newer":
        warnings.warn(
            LensUntestedInspectWarning(
                f"Inspect AI {_fmt(v)} is newer than the newest inspect-lens is tested with ({_fmt(TESTED[1])}); "
                "every Inspect internal inspect-lens uses is present, so it runs. If something misbehaves, "
                f"`pip install '{SPEC}'`."
            ),
            stacklevel=3,
        )


# -- members -----------------------------------------------------------------------------------------------


def _moved(what: str) -> LensIncompatibleInspect:
    try:
        found = _fmt(inspect_version())
    except LensIncompatibleInspect:
        found = "unknown"
    return LensIncompatibleInspect(
        f"Inspect AI internal moved: {what} (inspect-ai {found}; inspect-lens is tested with {SPEC}). "
        f"Run `pip install '{SPEC}'`, or adapt inspect_lens/_compat.py to this Inspect."
    )


def _module(name: str) -> Any:
    try:
        return importlib.import_module(name)
    except ImportError as e:
        raise _moved(f"module {name} cannot be imported ({e})") from e


class _Missing(Exception):
    pass


def _lookup(member: Member) -> Any:
    try:
        obj = importlib.import_module(member.module)
    except ImportError as e:
        raise _Missing(f"module {member.module} cannot be imported ({e}; needed for: {member.used_for})") from e
    where = member.module
    parts = member.path.split(".")
    for i, part in enumerate(parts):
        if member.kind == "attribute" and i == len(parts) - 1:
            code = _code(getattr(obj, "__init__", None))
            if code is None or part not in code.co_names:
                raise _Missing(
                    f"{where}.{part} not found (no longer set by {where}.__init__; needed for: {member.used_for})"
                )
            return None  # an instance attribute: nothing to return from the class
        if not hasattr(obj, part):
            raise _Missing(f"{where}.{part} not found (needed for: {member.used_for})")
        obj, where = getattr(obj, part), f"{where}.{part}"
    return obj


def _resolve(path: str) -> Any:
    """The member `path` of `MEMBERS`, or a `LensIncompatibleInspect` naming it."""
    member = _BY_PATH[path]
    try:
        return _lookup(member)
    except _Missing as e:
        raise _moved(str(e)) from None


def _code(obj: Any) -> Any:
    return getattr(inspect.unwrap(obj), "__code__", None)


def _shape_problems(member: Member, obj: Any) -> list[str]:
    problems = []
    if member.kind == "attribute":
        return []
    if member.kind == "class":
        return [] if inspect.isclass(obj) else ["is not a class"]
    if not callable(obj):
        return ["is not callable"]
    if member.kind == "coroutine" and not inspect.iscoroutinefunction(obj):
        problems.append("is no longer an async function")
    try:
        sig = inspect.signature(obj)
    except (TypeError, ValueError):
        return problems + ["has no readable signature"]
    ps = list(sig.parameters.values())
    if "." in member.path and ps and ps[0].name == "self":
        ps = ps[1:]
    positional = [p.name for p in ps if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    if positional[: len(member.params)] != list(member.params):
        problems.append(f"takes ({', '.join(positional)}), expected ({', '.join(member.params)}, ...)")
    if member.var_keyword and not any(p.kind == p.VAR_KEYWORD for p in ps):
        problems.append("no longer accepts **kwargs")
    code = _code(obj)
    if member.code_names or member.code_consts:
        if code is None:
            problems.append("has no inspectable code")
        else:
            for n in member.code_names:
                if n not in code.co_names:
                    problems.append(f"no longer uses `{n}`")
            for c in member.code_consts:
                if c not in code.co_consts:
                    problems.append(f"no longer contains {c!r}")
    return problems


def _names_used_by(cls: type) -> set[str]:
    """Names defined on `cls`'s MRO (below `object`) or referred to by their methods' code."""
    names: set[str] = set()
    for klass in cls.__mro__[:-1]:
        names |= set(vars(klass))
        for v in vars(klass).values():
            for f in (getattr(v, "__func__", v), getattr(v, "fget", None), getattr(v, "fset", None)):
                code = _code(f) if f is not None else None
                if code is not None:
                    names |= set(code.co_names)
    return names


def check() -> tuple[int, ...]:
    """The installed Inspect is not older than `TESTED` and has every member of `MEMBERS` with its shape;
    else a `LensIncompatibleInspect` naming the range or each member that moved. A newer Inspect than the
    newest tested passes with a `LensUntestedInspectWarning`. Returns the Inspect version."""
    v = check_version()
    problems: list[str] = []
    for member in MEMBERS:
        try:
            obj = _lookup(member)
        except _Missing as e:
            problems.append(str(e))
            continue
        problems += [f"{member.name} {p} (needed for: {member.used_for})" for p in _shape_problems(member, obj)]
    if not problems:
        clash = sorted(set(OWN_NAMES) & _names_used_by(vllm_api_base()))
        if clash:
            problems.append(
                f"{VLLM_MODULE}.VLLMAPI now uses {', '.join(clash)}, names inspect_lens.provider."
                "VLLMLensAPI defines for itself"
            )
    if problems:
        raise _moved("; ".join(problems))
    warn_if_untested(v)
    return v


# -- the helpers every private access goes through ---------------------------------------------------------


def vllm_provider() -> Any:
    """Inspect's vLLM provider module (`inspect_ai.model._providers.vllm`)."""
    return _module(VLLM_MODULE)


def vllm_api_base() -> type[VLLMAPI]:
    """Inspect's `VLLMAPI` (the base class of `VLLMLensAPI`)."""
    return _resolve("VLLMAPI")


def __getattr__(name: str) -> Any:  # `from inspect_lens._compat import VLLMAPI`: a clear error if it moved
    if name == "VLLMAPI":
        return vllm_api_base()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


@contextlib.contextmanager
def replaced_start_local_server(make: Callable[[Callable[..., Any]], Callable[..., Any]]) -> Iterator[None]:
    """Within the block, the vLLM provider's `start_local_server` is `make(original)`."""
    mod = vllm_provider()
    orig = _resolve("start_local_server")
    mod.start_local_server = make(orig)
    try:
        yield
    finally:
        mod.start_local_server = orig


def base_start_server(api: Any, model_path: str, port: int | None = None) -> Any:
    """Inspect's own `VLLMAPI._start_server` on `api` (returns `(base_url, process, port)`)."""
    return vllm_api_base()._start_server(api, model_path, port)


async def ensure_server_started(api: Any) -> None:
    """Start `api`'s (lazy) server if it is not up yet (`VLLMAPI._ensure_server_started`)."""
    await api._ensure_server_started()


def server_root(api: Any) -> str:
    """`api`'s server URL without the trailing `/v1` (`VLLMAPI._server_root`)."""
    return api._server_root()


def lora_server(api: Any) -> Any:
    """The state of the server `api` shares with every provider of its base model (`VLLMAPI._server`, a
    `VLLMServer`): `enable_lora` / `max_lora_rank` (read when the provider starts it), `base_url` (None
    until started or attached), `process` (set when the provider started it)."""
    return api._server


def server_args(api: Any) -> dict[str, Any]:
    """The `-M` arguments `api` passes to the server it starts (`VLLMAPI.server_args`)."""
    return api.server_args


def init_base_url(api: Any) -> str | None:
    """The server URL `api` was given (`--model-base-url`, `-M port`), else None (`VLLMAPI._init_base_url`)."""
    return getattr(api, "_init_base_url", None)


def base_model(api: Any) -> str | None:
    """The base model of `vllm-lens/<base>[:<adapter>]` (`VLLMAPI.base_model`), else None."""
    return getattr(api, "base_model", None)


def sample_active() -> Any:
    """Inspect's running sample (`inspect_ai.log._samples.sample_active()`), or None."""
    return _resolve("sample_active")()


def active_log_location() -> str | None:
    """The running eval's log location (`ActiveSample.log_location`), or None outside a sample."""
    active = sample_active()
    return getattr(active, "log_location", None) if active else None
