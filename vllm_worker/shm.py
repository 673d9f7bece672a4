"""Captures handed from a worker to the frontend through shared memory instead of the RPC pipe.

A worker assembles a request's capture tensor directly in a file under /dev/shm and returns its name;
the frontend maps the file and unlinks it. That removes the copies of the bytes through the engine's
message pipe (serialise, send, receive, decode), which dominated large captures (measured on the H200:
~30 s of 43 s for 10.5 GB). Used only when the frontend asks for it and runs on the same machine (same
boot id), and only when the space can be reserved up front (`posix_fallocate`: a full tmpfs is an
ordinary error, never a SIGBUS); otherwise the bytes travel over RPC as before. `VLLM_LENS_SHM=0` turns
it off.
"""

from __future__ import annotations

import os
import socket
import uuid

import torch

SHM_DIR = os.environ.get("VLLM_LENS_SHM_DIR", "/dev/shm")
PREFIX = "inspect-lens-"


def host_id() -> str | None:
    """This machine's identity (hostname + boot id), or None when shared memory is not usable here."""
    if os.environ.get("VLLM_LENS_SHM", "1").strip().lower() in ("0", "false", "no"):
        return None
    if not os.path.isdir(SHM_DIR) or not os.access(SHM_DIR, os.W_OK):
        return None
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        return None
    return f"{socket.gethostname()}|{boot}"


def alloc(shape: tuple[int, ...], dtype: torch.dtype) -> tuple[torch.Tensor, str] | None:
    """A zero-filled tensor backed by a new shared-memory file, or None if the space is not there."""
    numel = 1
    for s in shape:
        numel *= s
    nbytes = numel * torch.empty((), dtype=dtype).element_size()
    if nbytes == 0:
        return None
    path = os.path.join(SHM_DIR, f"{PREFIX}{os.getpid()}-{uuid.uuid4().hex}")
    try:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    except OSError:
        return None
    try:
        os.posix_fallocate(fd, 0, nbytes)
    except OSError:
        os.close(fd)
        os.unlink(path)
        return None
    os.close(fd)
    t = torch.from_file(path, shared=True, size=numel, dtype=dtype).view(shape)
    return t, path


def own_files() -> int:
    """Per-request capture files this process created that still exist (none is left once results are
    read); the result pool's segments (`result_pool`) are not counted."""
    mine = f"{PREFIX}{os.getpid()}-"
    try:
        return sum(1 for f in os.listdir(SHM_DIR) if f.startswith(mine) and "-pool" not in f)
    except OSError:
        return 0


def sweep_stale() -> int:
    """Remove capture files of processes that no longer exist (an engine that died before its results
    were read); returns how many."""
    gone = 0
    try:
        names = [f for f in os.listdir(SHM_DIR) if f.startswith(PREFIX)]
    except OSError:
        return 0
    for f in names:
        try:
            pid = int(f[len(PREFIX):].split("-", 1)[0])  # `<pid>-<uuid>` or `<pid>-pool<id>-<n>`
        except ValueError:
            continue
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            discard(os.path.join(SHM_DIR, f))
            gone += 1
        except PermissionError:
            pass
    return gone


def load(path: str, shape: list[int], dtype: torch.dtype) -> torch.Tensor:
    """Map a file written by `alloc` (our own worker's) and unlink it: the mapping keeps the data."""
    if os.path.dirname(path) != SHM_DIR or not os.path.basename(path).startswith(PREFIX):
        raise ValueError(f"inspect-lens: refusing to load {path!r} (not a capture file)")
    numel = 1
    for s in shape:
        numel *= s
    try:
        t = torch.from_file(path, shared=False, size=numel, dtype=dtype).view(shape)
    finally:
        os.unlink(path)
    return t


def discard(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass
