"""Compose our worker extension with a user-supplied `worker_extension_cls`.

vLLM takes one extension class by qualified name. When the user already set one, we point vLLM at
`vllm_worker.worker.composed.<their.module:Class>`; this module's `__getattr__` builds (once) a class that
inherits from both, so neither side is clobbered.
"""

from __future__ import annotations

import functools
import importlib

from vllm_worker.worker.extension import LensWorkerExtension

SEP = ":"
PREFIX = __name__ + "."


def name_for(user_qualname: str) -> str:
    return PREFIX + user_qualname.replace(".", SEP)


@functools.cache
def _compose(encoded: str) -> type:
    module, _, cls_name = encoded.replace(SEP, ".").rpartition(".")
    user_cls = getattr(importlib.import_module(module), cls_name)
    return type(f"LensWith{cls_name}", (LensWorkerExtension, user_cls), {})


def __getattr__(name: str) -> type:
    if SEP not in name:
        raise AttributeError(name)
    return _compose(name)
