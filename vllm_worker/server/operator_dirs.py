"""Files the server loads on a caller's request (SAEs, probes) come only from a folder the operator named:
one rule for every such route."""

from __future__ import annotations

import os

from vllm_worker import envs
from vllm_worker.server.responses import BadRequest


def allowed_path(path: object, env: str, kind: str, flag: str) -> str:
    """`path` resolved inside the operator's folder (`env`, set by `flag`): 403 when no folder was named or
    the path leaves it, 400 when it is not a non-empty string. `kind` names what is loaded ("SAE")."""
    root = str(envs.get(env) or "")
    if not root:
        raise PermissionError(
            f"path: loading {kind}s over HTTP is disabled; the operator must start the server with {flag} DIR ({env})"
        )
    if not isinstance(path, str) or not path:
        raise BadRequest(400, f"path: expected a folder under the server's {kind} folder, got {path!r}", "path")
    root = os.path.realpath(root)
    full = os.path.realpath(os.path.join(root, path))
    if os.path.commonpath([root, full]) != root:
        raise PermissionError(f"path: {path!r} is outside the server's {kind} folder ({flag})")
    return full
