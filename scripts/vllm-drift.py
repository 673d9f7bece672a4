#!/usr/bin/env python3
"""Ahead-of-time drift report: does a vLLM release still have every internal our compat layer touches?

    scripts/vllm-drift.py VERSION [--baseline 0.32.0] [--out REPORT.md]

Downloads the vLLM wheel of VERSION and of the baseline (the version the suite tests) without dependencies,
reads their Python sources with `ast` (nothing of vLLM is imported or run: the wheel needs no GPU, no torch),
and checks each touch found in `vllm_worker/compat/*.py`:
- every `from vllm.X import Y` / `import vllm.X` (the module, the name in it),
- every `require(obj, "attr", where)` and `wrap(cls, "name", ...)` (the attribute on the module or class that
  `obj` names, or, for an instance, on the class `where` names),
- every `alias.attr` read on an imported vLLM module or class,
- every `VLLM_*` switch we look up in `vllm.envs`,
- the V2 runner's internals that `compat/runner_v2.py` checks by their code (`_uses`: a function reads a name)
  and by their fields (`_fields`).
For a function or method it compares the parameter list with the baseline's. Exit status: 0 when nothing is
missing, 1 when something the baseline has is missing in VERSION (a signature change alone is reported, not
fatal: the compat code decides whether it matters, and its own tests fail loudly on the installed vLLM).
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import os
import re
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
COMPAT = ROOT / "vllm_worker" / "compat"
CACHE = Path(os.environ.get("VLLM_DRIFT_CACHE", Path.home() / ".cache" / "inspect-lens" / "vllm-drift"))
PLATFORM = (
    "--only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64 "
    "--platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64"
).split()

# `where` texts of require() on instances -> the vLLM class they mean (module, class). Names that occur once in
# vLLM are found by the index; these are the ambiguous or renamed ones.
WHERE_CLASS = {
    "V2 GPUModelRunner": ("vllm.v1.worker.gpu.model_runner", "GPUModelRunner"),
    "GPUModelRunner": ("vllm.v1.worker.gpu_model_runner", "GPUModelRunner"),
    "InputBatch": ("vllm.v1.worker.gpu_input_batch", "InputBatch"),
    "InputBuffers": ("vllm.v1.worker.gpu.input_batch", "InputBuffers"),
    "CudaGraphManager": ("vllm.v1.worker.gpu.cudagraph_utils", "CudaGraphManager"),
    "LLM": ("vllm.entrypoints.llm", "LLM"),
    "LLMEngine": ("vllm.v1.engine.llm_engine", "LLMEngine"),
    "AsyncLLM": ("vllm.v1.engine.async_llm", "AsyncLLM"),
    "ModelConfig": ("vllm.config.model", "ModelConfig"),
    "VllmConfig": ("vllm.config.vllm", "VllmConfig"),
    "ParallelConfig": ("vllm.config.parallel", "ParallelConfig"),
    "EngineCoreRequest": ("vllm.v1.engine", "EngineCoreRequest"),
}
_CLASS_RE = re.compile(r"^class (\w+)\b", re.M)
# `type(x).__name__` as `where`: the classes such an x is in vLLM
DYNAMIC_WHERE = {
    ("runner.py", "runner"): ["GPUModelRunner"],
    ("runner_v2.py", "runner"): ["V2 GPUModelRunner"],
    ("requests.py", "engine_client"): ["AsyncLLM"],
}


@dataclasses.dataclass(frozen=True)
class Touch:
    """One thing our compat layer needs from vLLM: `module` (dotted), optional `cls`, optional `attr`."""

    kind: str  # module | name | attr | env | uses | field
    module: str
    cls: str | None
    attr: str | None
    site: str  # compat file:line

    def label(self) -> str:
        target = self.module + (f":{self.cls}" if self.cls else "") + (f".{self.attr}" if self.attr else "")
        if self.kind == "uses":
            return f"{self.module}:{self.cls} reads `{self.attr}`"
        if self.kind == "env":
            return f"vllm.envs `{self.attr}`"
        return target


# ---------------------------------------------------------------------------------------------- wheels


def wheel_source(version: str) -> Path:
    """vLLM VERSION's Python files, unpacked once into the cache."""
    dest = CACHE / f"vllm-{version}"
    if (dest / "vllm" / "__init__.py").exists():
        return dest
    wheels = CACHE / "wheels"
    wheels.mkdir(parents=True, exist_ok=True)
    found = list(wheels.glob(f"vllm-{version}-*.whl"))
    if not found:
        cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", *PLATFORM, "-d", str(wheels)]
        subprocess.run([*cmd, f"vllm=={version}"], check=True)
        found = list(wheels.glob(f"vllm-{version}-*.whl"))
    with zipfile.ZipFile(found[0]) as z:
        for name in z.namelist():
            if name.startswith("vllm/") and name.endswith(".py"):
                z.extract(name, dest)
    return dest


class Source:
    """One vLLM version's sources, parsed on demand."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self._trees: dict[str, ast.Module | None] = {}
        self._class_index: dict[str, list[str]] | None = None

    def path(self, module: str) -> Path | None:
        base = self.root / module.replace(".", "/")
        for p in (base.with_suffix(".py"), base / "__init__.py"):
            if p.exists():
                return p
        return None

    def tree(self, module: str) -> ast.Module | None:
        if module not in self._trees:
            p = self.path(module)
            self._trees[module] = ast.parse(p.read_text(encoding="utf-8")) if p else None
        return self._trees[module]

    def classes(self) -> dict[str, list[str]]:
        """Class name -> modules defining it at top level (a text scan: parsing every file would be slow)."""
        if self._class_index is None:
            index: dict[str, list[str]] = {}
            for p in self.root.rglob("*.py"):
                mod = ".".join(p.relative_to(self.root).with_suffix("").parts).removesuffix(".__init__")
                for m in _CLASS_RE.finditer(p.read_text(encoding="utf-8", errors="replace")):
                    index.setdefault(m.group(1), []).append(mod)
            self._class_index = index
        return self._class_index

    def top_level(self, module: str, name: str) -> ast.AST | str | None:
        """The definition of `name` in `module` (a node), 'reexport:<module>' / 'lazy', or None."""
        if self.path(f"{module}.{name}"):
            return f"submodule:{module}.{name}"
        tree = self.tree(module)
        if tree is None:
            return None
        lazy = False
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node.name == name:
                if node in tree.body:
                    return node
            elif isinstance(node, (ast.Assign, ast.AnnAssign)) and _module_level(tree, node):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                if any(isinstance(t, ast.Name) and t.id == name for t in targets):
                    return node
            elif isinstance(node, ast.ImportFrom) and _module_level(tree, node):
                for a in node.names:
                    if a.name == "*" and node.module is not None:
                        src = _absolute(module, node.module, node.level, self.path(module))
                        if src != module and self.top_level(src, name) is not None:
                            return f"reexport:{src}:{name}"
                    elif (a.asname or a.name) == name and node.module:
                        src = _absolute(module, node.module, node.level, self.path(module))
                        return f"reexport:{src}:{a.name}"
            elif isinstance(node, ast.Constant) and node.value == name:
                lazy = True
        has_getattr = any(isinstance(n, ast.FunctionDef) and n.name == "__getattr__" for n in tree.body)
        return "lazy" if lazy and has_getattr else None

    def resolve(self, module: str, name: str, depth: int = 0) -> tuple[str, ast.AST | None] | None:
        """Follow re-exports to (defining module, node); node None for a lazily provided name."""
        found = self.top_level(module, name)
        if found is None:
            return None
        if isinstance(found, str):
            if found.startswith("reexport:") and depth < 8:
                _, src, orig = found.split(":")
                return self.resolve(src, orig, depth + 1) or (module, None)
            return (module, None)
        return (module, found)

    def class_node(self, module: str, cls: str) -> tuple[str, ast.ClassDef] | None:
        r = self.resolve(module, cls)
        if r and isinstance(r[1], ast.ClassDef):
            return r[0], r[1]
        mods = self.classes().get(cls, [])
        if len(mods) == 1:
            tree = self.tree(mods[0])
            node = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls)  # type: ignore[union-attr]
            return mods[0], node
        return None

    def member(self, module: str, cls: str, attr: str, depth: int = 0) -> ast.AST | str | None:
        """How class `cls` provides `attr`: a def node, 'field', 'self-assigned', 'inherited-unknown', or None."""
        found = self.class_node(module, cls)
        if found is None:
            return None
        mod, node = found
        for item in node.body:
            if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)) and item.name == attr:
                return item
            if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name) and item.target.id == attr:
                return "field"
            if isinstance(item, ast.Assign) and any(isinstance(t, ast.Name) and t.id == attr for t in item.targets):
                return "field"
        for sub in ast.walk(node):
            if isinstance(sub, ast.Attribute) and sub.attr == attr and isinstance(sub.ctx, ast.Store):
                if isinstance(sub.value, ast.Name) and sub.value.id == "self":
                    return "self-assigned"
        unknown = False
        for base in node.bases:
            bname = base.attr if isinstance(base, ast.Attribute) else getattr(base, "id", None)
            if not bname or depth > 6:
                continue
            bmod = _import_source(self.tree(mod), mod, bname, self.path(mod)) or mod
            if not bmod.startswith("vllm"):
                if bname not in ("object", "Generic", "Protocol", "ABC"):
                    unknown = True
                continue
            got = self.member(bmod, bname, attr, depth + 1)
            if got is not None and got != "inherited-unknown":
                return got
            unknown = unknown or got == "inherited-unknown"
        if any(isinstance(i, ast.FunctionDef) and i.name == "__getattr__" for i in node.body):
            return "inherited-unknown"
        return "inherited-unknown" if unknown else None


def _module_level(tree: ast.Module, node: ast.AST) -> bool:
    """Whether `node` sits at module level (also inside `if TYPE_CHECKING:` / try blocks)."""
    stack: list[ast.AST] = list(tree.body)
    while stack:
        n = stack.pop()
        if n is node:
            return True
        if isinstance(n, (ast.If, ast.Try)):
            stack.extend(n.body + n.orelse + getattr(n, "handlers", []) + getattr(n, "finalbody", []))
        elif isinstance(n, ast.ExceptHandler):
            stack.extend(n.body)
    return False


def _absolute(module: str, target: str | None, level: int, path: Path | None) -> str:
    if not level:
        return target or ""
    pkg = module.split(".") if path and path.name == "__init__.py" else module.split(".")[:-1]
    pkg = pkg[: len(pkg) - (level - 1)] if level > 1 else pkg
    return ".".join(pkg + ([target] if target else []))


def _import_source(tree: ast.Module | None, module: str, name: str, path: Path | None) -> str | None:
    if tree is None:
        return None
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            for a in node.names:
                if (a.asname or a.name) == name:
                    return _absolute(module, node.module, node.level, path)
    return None


def signature(node: ast.AST | str | None) -> str | None:
    """A function's parameter list as text (names, kinds, which have defaults), else None."""
    if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        return None
    a = node.args
    pos = a.posonlyargs + a.args
    first_default = len(pos) - len(a.defaults)
    parts = [p.arg + ("=" if i >= first_default else "") for i, p in enumerate(pos)]
    if a.posonlyargs:
        parts.insert(len(a.posonlyargs), "/")
    if a.vararg:
        parts.append("*" + a.vararg.arg)
    elif a.kwonlyargs:
        parts.append("*")
    parts += [k.arg + ("=" if d is not None else "") for k, d in zip(a.kwonlyargs, a.kw_defaults)]
    if a.kwarg:
        parts.append("**" + a.kwarg.arg)
    return "(" + ", ".join(parts) + ")"


# ---------------------------------------------------------------------------------------------- our side

_V2 = "vllm.v1.worker.gpu.model_runner"
_V2_IB = "vllm.v1.worker.gpu.input_batch"
_V2_CG = "vllm.v1.worker.gpu.cudagraph_utils"
_SCHED = "vllm.v1.core.sched.output"
# compat/runner_v2.internals() checks these by code and fields (`_uses`, `_fields`); `v2_table_gaps` keeps this
# table honest: a string that function checks and this table lacks is reported.
V2_CHECKS: list[tuple[str, str, str, str | None, tuple[str, ...]]] = [
    ("uses", _V2, "GPUModelRunner", "execute_model", ("dispatch_cg_and_sync_dp", "run_fullgraph")),
    ("uses", _V2, "GPUModelRunner", "execute_model", ("execute_model_state", "cudagraph_manager")),
    ("uses-any", _V2, "GPUModelRunner", "prepare_inputs|gather_batch_req_state", ("sort_batch_req_ids",)),
    ("field", _V2, "ExecuteModelState", None, ("input_batch",)),
    ("field", _V2_IB, "InputBatch", None, ("req_ids", "query_start_loc_np", "num_computed_tokens_np", "positions")),
    ("uses", _V2_IB, "InputBuffers", "__init__", ("positions",)),
    ("uses", _V2_CG, "CudaGraphManager", "dispatch", ("_candidates",)),
    ("field", _SCHED, "SchedulerOutput", None, ("scheduled_new_reqs", "scheduled_cached_reqs")),
    ("field", _SCHED, "SchedulerOutput", None, ("num_scheduled_tokens", "total_num_scheduled_tokens")),
    ("field", _SCHED, "SchedulerOutput", None, ("scheduled_spec_decode_tokens", "finished_req_ids")),
    ("field", _SCHED, "NewRequestData", None, ("req_id", "prompt_token_ids", "sampling_params", "num_computed_tokens")),
    ("field", _SCHED, "CachedRequestData", None, ("req_ids", "num_computed_tokens")),
]


def _scopes(tree: ast.Module) -> list[ast.AST]:
    return [tree] + [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]


def _own_nodes(scope: ast.AST) -> list[ast.AST]:
    """The nodes of `scope` outside the functions nested in it."""
    out: list[ast.AST] = []
    stack = list(ast.iter_child_nodes(scope))
    while stack:
        n = stack.pop()
        out.append(n)
        if not isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            stack.extend(ast.iter_child_nodes(n))
    return out


def _loop_strings(nodes: list[ast.AST]) -> list[tuple[ast.For, list[str]]]:
    """`for NAME in ("a", "b")` loops of a scope, with their strings."""
    out = []
    for n in nodes:
        if isinstance(n, ast.For) and isinstance(n.target, ast.Name) and isinstance(n.iter, (ast.Tuple, ast.List)):
            vals = [e.value for e in n.iter.elts if isinstance(e, ast.Constant) and isinstance(e.value, str)]
            if vals and len(vals) == len(n.iter.elts):
                out.append((n, vals))
    return out


def _bound(name: str, at: ast.AST, loops: list[tuple[ast.For, list[str]]]) -> list[str]:
    """The strings loop variable `name` takes where node `at` is (the innermost enclosing loop)."""
    line = getattr(at, "lineno", -1)
    inside = [
        (f, v)
        for f, v in loops
        if getattr(f.target, "id", None) == name and f.lineno <= line <= (f.end_lineno or f.lineno)
    ]
    return max(inside, key=lambda fv: fv[0].lineno)[1] if inside else []


def compat_touches(compat: Path = COMPAT) -> list[Touch]:
    """Every vLLM touch found in the compat layer's sources."""
    out: list[Touch] = []
    for path in sorted(compat.glob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        module_aliases: dict[str, tuple[str, str | None]] = {}
        for scope in _scopes(tree):
            aliases = dict(module_aliases)  # name -> (module, class-or-None)
            nodes = _own_nodes(scope)
            for node in nodes:
                site = f"{path.name}:{getattr(node, 'lineno', 0)}"
                if isinstance(node, ast.Import):
                    for a in node.names:
                        if a.name.startswith("vllm.") or a.name == "vllm":
                            out.append(Touch("module", a.name, None, None, site))
                            if a.asname:
                                aliases[a.asname] = (a.name, None)
                elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "vllm":
                    for a in node.names:
                        out.append(Touch("name", node.module or "", None, a.name, site))
                        aliases[a.asname or a.name] = (node.module or "", a.name)
            if scope is tree:
                module_aliases = aliases
            loops = _loop_strings(nodes)
            for node in nodes:
                site = f"{path.name}:{getattr(node, 'lineno', 0)}"
                if isinstance(node, ast.Call) and getattr(node.func, "id", None) in ("require", "wrap"):
                    out += _require_touches(node, aliases, loops, site)
                elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
                    mod_cls = aliases.get(node.value.id)
                    if mod_cls and isinstance(node.ctx, ast.Load) and node.attr != "__qualname__":
                        mod, cls = mod_cls
                        out.append(Touch("attr", mod, cls, node.attr, site))
                elif isinstance(node, ast.Constant) and isinstance(node.value, str):
                    if node.value.startswith("VLLM_") and not node.value.startswith("VLLM_LENS"):
                        if node.value.isupper() and " " not in node.value:
                            out.append(Touch("env", "vllm.envs", None, node.value, site))
    for kind, mod, cls, fn, names in V2_CHECKS:
        for n in names:
            out.append(
                Touch("uses" if kind != "field" else "field", mod, cls, f"{fn}>{n}" if fn else n, "runner_v2.py")
            )
    return _dedup(out)


def _require_touches(
    call: ast.Call, aliases: dict[str, tuple[str, str | None]], loops: list[tuple[ast.For, list[str]]], site: str
) -> list[Touch]:
    if len(call.args) < 2:
        return []
    key = call.args[1]
    if isinstance(key, ast.Constant) and isinstance(key.value, str):
        attrs = [key.value]
    elif isinstance(key, ast.Name) and _bound(key.id, call, loops):
        attrs = _bound(key.id, call, loops)
    else:
        return []
    obj = call.args[0]
    where = call.args[2] if len(call.args) > 2 else None
    if isinstance(obj, ast.Name) and obj.id in aliases:
        targets = [aliases[obj.id]]
    elif isinstance(where, ast.Constant) and isinstance(where.value, str):
        w = where.value
        if w.startswith("vllm."):
            targets = [(w, None)]
        else:
            targets = [WHERE_CLASS.get(w, ("?", w))]
    elif isinstance(where, ast.Attribute) and isinstance(where.value, ast.Call) and where.value.args:
        # where = type(x).__name__: the class x is on the side of vLLM this compat module serves
        name = getattr(where.value.args[0], "id", "")
        classes = DYNAMIC_WHERE.get((site.split(":")[0], name), [])
        targets = [WHERE_CLASS[c] for c in classes]
    else:
        return []
    return [Touch("attr", mod, cls, a, site) for mod, cls in targets for a in attrs]


def _dedup(touches: list[Touch]) -> list[Touch]:
    seen: dict[tuple, Touch] = {}
    for t in touches:
        seen.setdefault((t.kind, t.module, t.cls, t.attr), t)
    return list(seen.values())


def v2_table_gaps(compat: Path = COMPAT) -> list[str]:
    """Strings that runner_v2.internals() checks and V2_CHECKS (nor a require) does not cover."""
    tree = ast.parse((compat / "runner_v2.py").read_text(encoding="utf-8"))
    fn = next(n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == "internals")
    covered = {n for *_, names in V2_CHECKS for n in names}
    covered |= {m for _, _, _, fns, _ in V2_CHECKS if fns for m in fns.split("|")}
    covered |= {
        str(c.args[1].value)
        for c in ast.walk(fn)
        if isinstance(c, ast.Call)
        and getattr(c.func, "id", None) == "require"
        and len(c.args) > 1
        and isinstance(c.args[1], ast.Constant)
    }
    loops = _loop_strings(list(ast.walk(fn)))
    covered |= {
        v
        for c in ast.walk(fn)
        if isinstance(c, ast.Call)
        and getattr(c.func, "id", None) == "require"
        and len(c.args) > 1
        and isinstance(c.args[1], ast.Name)
        for v in _bound(c.args[1].id, c, loops)
    }
    consts = {c.value for c in ast.walk(fn) if isinstance(c, ast.Constant) and isinstance(c.value, str)}
    words = {c for c in consts if c.isidentifier()}
    return sorted(
        words
        - covered
        - {"self", "scheduler_output", "intermediate_tensors", "dummy_run"}
        - {"num_tokens_per_req", "draft_tokens", "decode_query_len"}
    )


# ---------------------------------------------------------------------------------------------- checks


def look(src: Source, t: Touch) -> tuple[str, str | None]:
    """(status, signature) of touch `t` in one version: status 'ok', 'missing', 'unknown' (dynamic)."""
    if t.kind == "module":
        return ("ok" if src.path(t.module) else "missing"), None
    if t.kind == "env":
        tree = src.tree("vllm.envs")
        hit = tree is not None and any(isinstance(c, ast.Constant) and c.value == t.attr for c in ast.walk(tree))
        return ("ok" if hit else "missing"), None
    if t.module == "?":
        mods = src.classes().get(t.cls or "", [])
        if len(mods) != 1:
            return "unknown", None
        t = dataclasses.replace(t, module=mods[0])
    if t.cls and src.path(f"{t.module}.{t.cls}"):  # `from vllm.utils import torch_utils`: a submodule
        t = dataclasses.replace(t, module=f"{t.module}.{t.cls}", cls=None)
    if src.path(t.module) is None:
        return "missing", None
    if t.kind == "name" or t.cls is None:
        r = src.resolve(t.module, t.attr or "")
        if r is None:
            return "missing", None
        return "ok", signature(r[1])
    if t.kind == "field":
        got = src.member(t.module, t.cls, t.attr or "")
        return ("ok" if got in ("field", "self-assigned") or isinstance(got, ast.AST) else "missing"), None
    if t.kind == "uses":
        fns, name = (t.attr or "").split(">")
        for fn in fns.split("|"):
            node = src.member(t.module, t.cls, fn)
            if isinstance(node, ast.AST) and any(
                getattr(n, "attr", None) == name or getattr(n, "id", None) == name for n in ast.walk(node)
            ):
                return "ok", None
        return "missing", None
    if src.class_node(t.module, t.cls) is None:
        # an instance (e.g. `current_platform`): its attributes are not decidable from the source
        return ("unknown" if src.resolve(t.module, t.cls) else "missing"), None
    got = src.member(t.module, t.cls, t.attr or "")
    if got is None:
        return "missing", None
    if got == "inherited-unknown":
        return "unknown", None
    return "ok", signature(got)


# ---------------------------------------------------------------------------------------------- report


def report(version: str, baseline: str, touches: list[Touch]) -> tuple[str, int]:
    """The markdown report and the number of touches present in the baseline but missing in `version`."""
    new, base = Source(wheel_source(version)), Source(wheel_source(baseline))
    rows, moved, changed, unknown = [], 0, 0, 0
    for t in sorted(touches, key=lambda t: (t.module, t.cls or "", t.attr or "", t.kind)):
        b_status, b_sig = look(base, t)
        n_status, n_sig = look(new, t)
        if b_status == "missing" and n_status == "missing":
            verdict = "absent in both (a fallback)"
        elif n_status == "missing":
            verdict, moved = "**MISSING**", moved + 1
        elif "unknown" in (b_status, n_status):
            verdict, unknown = "not decidable statically", unknown + 1
        elif b_sig != n_sig and b_sig and n_sig:
            verdict, changed = f"**signature** {b_sig} → {n_sig}", changed + 1
        elif b_status == "missing":
            verdict = "new in this version"
        else:
            verdict = "same"
        rows.append(f"| `{t.label()}` | {t.kind} | {t.site} | {b_status} | {n_status} | {verdict} |")
    gaps = v2_table_gaps()
    head = [
        f"# vLLM {version} against {baseline}: the internals inspect-lens touches",
        "",
        f"`scripts/vllm-drift.py {version} --baseline {baseline}` (static: the wheels' Python sources read with "
        "`ast`, nothing imported). One row per touch found in `vllm_worker/compat/` (imports, `require` / `wrap` "
        "targets, attribute reads on vLLM modules and classes, `VLLM_*` switches, the V2 runner's code and fields "
        "that `compat/runner_v2.py` checks).",
        "",
        f"**{len(rows)} touches: {moved} missing in {version}, {changed} with a changed signature, "
        f"{unknown} not decidable statically** (an attribute that only a base class outside vLLM, or "
        "`__getattr__`, could provide).",
    ]
    if gaps:
        head += ["", f"runner_v2.internals() checks names this script's table lacks: {', '.join(gaps)}"]
    table = [
        "",
        "| touch | kind | where we touch it | " + baseline + " | " + version + " | verdict |",
        "|---|---|---|---|---|---|",
    ]
    return "\n".join(head + table + rows) + "\n", moved


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("version")
    ap.add_argument("--baseline", default="0.32.0", help="the version the suite tests (default 0.32.0)")
    ap.add_argument("--out", help="write the markdown report here (default: stdout)")
    args = ap.parse_args()
    md, moved = report(args.version, args.baseline, compat_touches())
    if args.out:
        Path(args.out).write_text(md, encoding="utf-8")
        print(md.split("\n\n")[2])
    else:
        print(md)
    return 1 if moved else 0


if __name__ == "__main__":
    sys.exit(main())
