"""The Inspect matrix (scripts/inspect-matrix.sh): the provider, solver and eval tests that need no GPU, run
against other inspect-ai (and control-arena / inspect-petri) releases than the shared venv has.

Each row's packages go into an overlay folder (`pip install --target --no-deps`) put ahead of the venv on
PYTHONPATH, so the venv itself is never touched: only what the row pins, plus whatever those pins (or a
venv package depending on them, such as inspect-scout on inspect-ai) need in another version, is overlaid.
Rows run one after another (the machine's cores are shared); the table goes to stdout and to --out.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from importlib import metadata
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[1]
PY = sys.executable

# inspect-ai releases, most telling first: the newest; the oldest that passes (0.3.265); 0.3.261, whose
# members check out but whose evals fail; 0.3.255, refused (no VLLMAPI._server_root, resolve_stream); a spread
INSPECT = ("0.3.285", "0.3.265", "0.3.261", "0.3.255", "0.3.275", "0.3.280")
DEFAULT_ROWS = (
    *(f"inspect-ai=={v}" for v in INSPECT[:4]),
    "inspect-ai==0.3.285,control-arena==20.1.1",
    "inspect-ai==0.3.265,control-arena==20.1.1",
    "inspect-ai==0.3.285,control-arena==19.0.0",
    "inspect-ai==0.3.285,inspect-petri==3.1.1",
    "inspect-ai==0.3.265,inspect-petri==3.1.1",
    "inspect-ai==0.3.285,inspect-petri==3.0.11",
    *(f"inspect-ai=={v}" for v in INSPECT[4:]),
)

# what each kind of row runs: the tests that use Inspect (provider, solvers, scorers, evals) and need no GPU
INSPECT_TESTS = (
    "tests/unit/test_inspect_compat.py",
    "tests/unit/test_provider_lora.py",
    "tests/unit/test_eval_order.py",
    "tests/inspect",
    "--ignore=tests/inspect/test_control.py",
    "--ignore=tests/inspect/test_petri.py",
    "tests/http/test_http.py",
    "-k",
    "not test_http.py or inspect",
)
# venv packages built on Inspect: re-resolved when an overlaid inspect-ai no longer fits them
DEPENDENTS = {"control-arena", "inspect-petri", "inspect-scout", "inspect-swe", "inspect-k8s-sandbox"}
# requirements an older inspect-ai imports only on demand, for providers the tests do not use (Bedrock,
# SageMaker): not overlaid, since aioboto3's exact aiobotocore pin drags in an older botocore that breaks
# the venv's boto3, which transformers imports through accelerate (the tests then fail at collection)
ON_DEMAND = {"aioboto3"}
CONTROL_TESTS = ("tests/inspect/test_control.py", "tests/inspect/test_coup_probe.py")
PETRI_TESTS = ("tests/inspect/test_petri.py",)


def _pip(*args: str) -> None:
    subprocess.run([PY, "-m", "pip", "--disable-pip-version-check", "-q", *args], check=True)


def _dists(path: list[str]) -> dict[str, metadata.Distribution]:
    """The distributions importable with `path` first (the first one found for each name wins)."""
    found: dict[str, metadata.Distribution] = {}
    for d in metadata.distributions(path=path):
        name = canonicalize_name(d.metadata["Name"] or "")
        found.setdefault(name, d)
    return found


def _unmet(dist: metadata.Distribution, have: dict[str, metadata.Distribution]) -> list[Requirement]:
    out = []
    for raw in dist.requires or ():
        req = Requirement(raw)
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue
        got = have.get(canonicalize_name(req.name))
        if got is None or not req.specifier.contains(got.version, prereleases=True):
            out.append(req)
    return out


def _resolve_one(name: str, pins: list[str]) -> str:
    """The version of `name` pip picks together with `pins` (a dry run: metadata only)."""
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "r.json"
        _pip(
            "install", "--dry-run", "--ignore-installed", "--ignore-requires-python", "--only-binary=:all:",
            "--report", str(report),
            "--target", tmp, name, *pins,
        )  # fmt: skip
        for item in json.loads(report.read_text())["install"]:
            if canonicalize_name(item["metadata"]["name"]) == canonicalize_name(name):
                return str(item["metadata"]["version"])
    raise RuntimeError(f"pip resolved no version of {name} with {pins}")


def build_overlay(pins: list[str], folder: Path) -> tuple[list[str], list[str]]:
    """Install `pins` into `folder` without dependencies, then overlay what they need in another version:
    their unmet requirements (the newest fitting release), and the Inspect extensions of the venv
    (`DEPENDENTS`) that no longer fit, at the version pip resolves with the pins. Returns what was overlaid
    and the requirements still unmet (of other venv packages, reported rather than chased: a full resolve of
    e.g. boto3 against an older botocore takes pip many minutes, and the tests import none of them)."""
    done = folder / ".complete"
    if done.exists():
        overlaid, _, left = done.read_text().partition("\n--\n")
        return overlaid.split(), left.splitlines()
    folder.mkdir(parents=True, exist_ok=True)
    _pip("install", "--no-deps", "--ignore-requires-python", "--upgrade", "--target", str(folder), *pins)
    site = [p for p in sys.path if p.endswith("site-packages")]
    left: list[str] = []
    for _ in range(6):
        have = _dists([str(folder), *site])
        overlaid = _dists([str(folder)])
        todo: list[str] = []
        left = []
        for name, dist in have.items():
            unmet = _unmet(dist, have)
            if name in overlaid:
                todo += [str(r) for r in unmet if canonicalize_name(r.name) not in ON_DEMAND]
                left += [f"{name}:{r} (not installed)" for r in unmet if canonicalize_name(r.name) in ON_DEMAND]
            elif name in DEPENDENTS and any(canonicalize_name(r.name) in overlaid for r in unmet):
                todo.append(f"{name}=={_resolve_one(name, pins)}")
            else:
                left += [f"{name}:{r}" for r in unmet if canonicalize_name(r.name) in overlaid]
        if not todo:
            break
        _pip("install", "--no-deps", "--ignore-requires-python", "--upgrade", "--target", str(folder), *todo)
    else:
        raise RuntimeError(f"overlay for {pins} still has unmet requirements: {todo}")
    got = sorted(f"{canonicalize_name(d.metadata['Name'])}=={d.version}" for d in _dists([str(folder)]).values())
    done.write_text("\n".join(got) + "\n--\n" + "\n".join(left))
    return got, left


def _tests_for(pins: list[str]) -> tuple[str, ...]:
    names = {canonicalize_name(Requirement(p).name) for p in pins}
    if "control-arena" in names:
        return CONTROL_TESTS
    if "inspect-petri" in names:
        return PETRI_TESTS
    return INSPECT_TESTS


def _member_check(env: dict[str, str]) -> str:
    """What `inspect_lens._compat.check()` says under this row's packages (run in a fresh interpreter)."""
    code = (
        "import warnings; warnings.simplefilter('always')\n"
        "from inspect_lens import _compat\n"
        "try:\n    print('ok', '.'.join(map(str, _compat.check())))\n"
        "except _compat.LensIncompatibleInspect as e:\n    print('refused:', e)\n"
    )
    out = subprocess.run([PY, "-c", code], env=env, capture_output=True, text=True, cwd=ROOT)
    return (out.stdout.strip() or out.stderr.strip().splitlines()[-1]).replace("|", "/")


def run_row(row: str, cache: Path, logs: Path) -> dict[str, object]:
    pins = [p.strip() for p in row.split(",") if p.strip()]
    slug = re.sub(r"[^A-Za-z0-9.]+", "_", "+".join(pins))
    folder = cache / slug
    overlaid, left = build_overlay(pins, folder)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), str(folder)) if p))
    env["INSPECT_LENS_SKIP_VERSION_CHECK"] = "1"  # the matrix finds the range: judge by members and tests
    xml = logs / f"{slug}.xml"
    log = logs / f"{slug}.log"
    members = _member_check(env)
    t0 = datetime.datetime.now()
    rc = -1  # not run: the provider refuses this Inspect, so every test would fail the same way
    xml.unlink(missing_ok=True)
    if members.startswith("ok"):
        with log.open("w") as f:
            rc = subprocess.run(
                [PY, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={xml}", *_tests_for(pins)],
                env=env, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT,
            ).returncode  # fmt: skip
    counts = {"tests": 0, "failures": 0, "errors": 0, "skipped": 0}
    if xml.exists():
        for suite in ET.parse(xml).getroot().iter("testsuite"):
            for k in counts:
                counts[k] += int(suite.get(k, 0))
    passed = counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"]
    return {
        "row": row,
        "overlaid": ", ".join(o for o in overlaid if o.split("==")[0] not in {Requirement(p).name for p in pins}),
        "left": ", ".join(left),
        "members": members,
        "passed": passed,
        "failed": counts["failures"] + counts["errors"],
        "skipped": counts["skipped"],
        "rc": rc,
        "minutes": round((datetime.datetime.now() - t0).total_seconds() / 60, 1),
        "log": str(log),
    }


def _missing(refusal: str) -> str:
    """The members a refusal names (`VLLMAPI._server_root not found`), without the advice around them."""
    found = re.findall(r"inspect_ai\.[\w.]*?\.(\w+\.\w+ (?:not found|[^(;]*?))(?: \(|;|$)", refusal)
    return "refused: " + "; ".join(found) if found else refusal[:200]


def table(results: list[dict[str, object]], commit: str, date: str) -> str:
    lines = [
        f"Ran {date} on commit {commit} (CPU, `scripts/inspect-matrix.sh`).",
        "",
        "| packages | also overlaid (venv requirements left unmet) | `_compat.check()` | passed | failed | skipped | minutes | verdict |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in results:
        ok = r["rc"] == 0 and r["failed"] == 0 and r["skipped"] == 0 and int(str(r["passed"])) > 0
        members = "ok" if str(r["members"]).startswith("ok") else _missing(str(r["members"]))
        verdict = "pass" if ok and members == "ok" else ("refused" if r["rc"] == -1 else "FAIL")
        pkgs = ", ".join(f"`{p}`" for p in str(r["row"]).split(","))
        extra = str(r["overlaid"] or "-") + (f" ({r['left']})" if r["left"] else "")
        lines.append(
            f"| {pkgs} | {extra} | {members} | {r['passed']} | {r['failed']} | {r['skipped']} "
            f"| {r['minutes']} | {verdict} |"
        )
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "rows", nargs="*", help="comma-separated pins per row, e.g. inspect-ai==0.3.265,control-arena==20.1.1"
    )
    ap.add_argument("--cache", type=Path, default=Path.home() / ".cache" / "inspect-lens" / "inspect-matrix")
    ap.add_argument("--out", type=Path, default=ROOT / "logs" / "inspect-matrix.md")
    args = ap.parse_args()
    rows = args.rows or list(DEFAULT_ROWS)
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    logs = args.out.parent / "inspect-matrix-logs"
    logs.mkdir(parents=True, exist_ok=True)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    results = []
    for row in rows:
        print(f"== {row}", flush=True)
        results.append(run_row(row, args.cache, logs))
        print(json.dumps(results[-1]), flush=True)
        args.out.write_text(table(results, commit.stdout.strip() or "unknown", stamp))
    print(args.out.read_text())
    return 0 if all(r["rc"] in (0, -1) for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
