"""Hook state as the frontend gets it: tensors moved to the host and cut to their own storage, then
cloudpickled (bytes our own worker makes for the frontend that owns them)."""

from __future__ import annotations

from typing import Any

import torch

from vllm_worker.worker import edits


def to_cpu(obj: Any) -> Any:
    """`obj` with every tensor on the host, each in storage of its own (dicts, lists and tuples walked)."""
    if isinstance(obj, torch.Tensor):
        t = obj.detach().to("cpu")
        # a view of a larger tensor (a hook's `h` is one of the tap's stream sum) would pickle all of it
        return t.clone() if t.untyped_storage().nbytes() > t.nbytes else t
    if isinstance(obj, edits.SavedRow):  # `ctx.save_rows`: this request's row, split off here
        return obj.to_cpu()
    if isinstance(obj, dict):
        return {k: to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(to_cpu(v) for v in obj)
    return obj


def pickle_saved(obj: Any) -> bytes:
    """Hook state, tensors on CPU, as cloudpickle bytes: produced by our own worker, read by the
    frontend that owns it (the HTTP layer converts to JSON before anything leaves the server)."""
    import cloudpickle

    return cloudpickle.dumps(to_cpu(obj))
