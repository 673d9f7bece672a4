"""The workers' RPC surface is the contract in `protocol.rpc`: the extension implements exactly its methods
with its signatures, and the frontend and server name methods only through its constants."""

import inspect
import re
from pathlib import Path

from vllm_worker.protocol import rpc

ROOT = Path(__file__).resolve().parents[2]


def _extension_methods() -> dict[str, inspect.Signature]:
    from vllm_worker.worker.extension import LensWorkerExtension

    return {
        n: inspect.signature(f) for n, f in vars(LensWorkerExtension).items() if n.startswith("lens_") and callable(f)
    }


def test_the_extension_implements_exactly_the_contract():
    got = _extension_methods()
    assert set(got) == rpc.METHODS
    for name in rpc.METHODS:
        want = inspect.signature(getattr(rpc.LensWorkerRpc, name))
        assert list(got[name].parameters) == list(want.parameters), name
        for p, q in zip(got[name].parameters.values(), want.parameters.values()):
            assert (p.annotation, p.default, p.kind) == (q.annotation, q.default, q.kind), f"{name}.{p.name}"
        assert got[name].return_annotation == want.return_annotation, name


def test_the_constants_name_every_method_once():
    names = {v for k, v in vars(rpc).items() if k.isupper() and isinstance(v, str)}
    assert names == rpc.METHODS
    assert len(names) == len([k for k, v in vars(rpc).items() if k.isupper() and isinstance(v, str)])


def test_no_method_is_called_by_a_string_of_its_own():
    """The package calls workers only through the contract's names (tests and benchmarks may spell them)."""
    called = re.compile(r"""rpc(?:_async)?\([^)]*?["']lens_\w+["']""")
    offenders = []
    for path in (ROOT / "vllm_worker").rglob("*.py"):
        if path.name == "rpc.py" and path.parent.name == "protocol":
            continue
        text = path.read_text()
        offenders += [f"{path.relative_to(ROOT)}: {m.group(0)}" for m in called.finditer(text)]
    assert offenders == []
