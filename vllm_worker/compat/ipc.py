"""How steering rows cross vLLM's frontend -> engine-core IPC without a copy on the engine core's side.

vLLM's `MsgpackDecoder` turns a msgpack extension of type `CUSTOM_TYPE_RAW_VIEW` into a `memoryview` of the
received frame (its `ext_hook` returns the data as it lies in the message), whereas a `bytes` value is decoded
into a fresh `bytes` object (a copy, on the thread that feeds the engine). Numpy arrays / tensors are no
use inside `SamplingParams.extra_args` (typed `Any`: the decoder never calls its `dec_hook` there, so an
array sent as an aux frame would arrive as `[dtype, shape, frame index]` with the frame out of reach).
The view is only sent where the engine core hands the request to an in-process worker (the `uni`
executor, one rank): a multiprocess executor pickles the scheduler output, and a memoryview does not
pickle. With `VLLM_ENABLE_V1_MULTIPROCESSING=0` nothing is serialised and the worker gets the `Ext` itself.
"""

from __future__ import annotations

from typing import Any

from vllm_worker.compat.version import LensIncompatibleVLLM, require


def raw_view_code() -> int:
    """The extension code vLLM's decoder answers with a view of the frame (3 on 0.26-0.33)."""
    from vllm.v1 import serial_utils

    code = require(serial_utils, "CUSTOM_TYPE_RAW_VIEW", "vllm.v1.serial_utils")
    require(serial_utils.MsgpackDecoder, "ext_hook", "MsgpackDecoder")
    if not isinstance(code, int):
        raise LensIncompatibleVLLM(f"vllm.v1.serial_utils.CUSTOM_TYPE_RAW_VIEW is {code!r}, not an int")
    return code


_CODE: list[int] = []


def raw_view(raw: bytes) -> Any:
    """`raw` as the extension the engine core decodes into a view (no copy here: the `Ext` holds `raw`)."""
    import msgspec

    if not _CODE:
        _CODE.append(raw_view_code())
    return msgspec.msgpack.Ext(_CODE[0], raw)


def rows_by_view(processor: Any) -> bool:
    """Whether requests from this input processor may carry rows as `raw_view`: the engine core's
    executor runs the one worker in its own process (nothing pickles the request's params after the IPC)."""
    pc = require(require(processor, "vllm_config", "InputProcessor"), "parallel_config", "VllmConfig")
    backend = require(pc, "distributed_executor_backend", "ParallelConfig")
    world = int(require(pc, "world_size", "ParallelConfig"))
    return backend == "uni" and world == 1
