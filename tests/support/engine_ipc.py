"""A request as vLLM's engine core receives it from the multiprocess client: encoded by vLLM's msgpack
encoder, sent over zmq without copies and decoded by its decoder, so tests see what vLLM's own serialisation
makes of our payload (views of the received frames, extension types) rather than our guess of it."""

from __future__ import annotations

import zmq
from vllm.v1.engine import EngineCoreRequest
from vllm.v1.serial_utils import MsgpackDecoder, MsgpackEncoder


def through_zmq(req: EngineCoreRequest) -> tuple[EngineCoreRequest, list]:
    """(the request decoded as the engine core's input thread gets it, the frames it was read from)."""
    ctx = zmq.Context()
    push, pull = ctx.socket(zmq.PUSH), ctx.socket(zmq.PULL)
    pull.bind("inproc://lens-engine-ipc")
    push.connect("inproc://lens-engine-ipc")
    try:
        push.send_multipart(MsgpackEncoder().encode(req), copy=False)
        frames = pull.recv_multipart(copy=False)
    finally:
        push.close(linger=0)
        pull.close(linger=0)
        ctx.term()  # (the received frames own their memory; left to the collector it warns "Unclosed context")
    return MsgpackDecoder(EngineCoreRequest).decode(frames), frames
