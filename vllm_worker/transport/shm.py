"""Where shared memory lives, and whether worker and frontend share it.

Captures cross from a worker to the frontend through files under /dev/shm instead of the engine's
message pipe, where serialising, sending, receiving and decoding large captures took most of a fetch
(docs/decisions.md). The files are the result pool's segments (`result_pool`). Used only when the frontend asks for it and runs
on the same machine (same boot id); otherwise the bytes travel over RPC. `VLLM_LENS_SHM=0` turns it off.
"""

from __future__ import annotations

import functools
import os
import socket
import time

from vllm_worker import envs

PREFIX = "inspect-lens-"
POOL_TAG = "-pool"  # in result-pool segment names: `inspect-lens-<pid>-pool<id>-<n>` (`sweep_stale` parses the pid)


DIR_CHECK_S = 1.0  # how long a check that `shm_dir()` is a writable directory is trusted


def shm_dir() -> str:
    """`VLLM_LENS_SHM_DIR`, read when asked (envs: one rule for every setting)."""
    return envs.get("VLLM_LENS_SHM_DIR")


_dir_checked: list = [-1e9, False]  # [time.monotonic() of the last check, its answer]


def host_id() -> str | None:
    """This machine's identity (hostname + boot id), or None when shared memory is not usable here. Asked
    for every new request that captures: the identity is read once per process, the directory checked at
    most once per DIR_CHECK_S (two system calls otherwise per request; a directory that goes away only
    makes the worker fall back to RPC)."""
    if not envs.get("VLLM_LENS_SHM"):
        return None
    now = time.monotonic()
    if now - _dir_checked[0] > DIR_CHECK_S:
        where = shm_dir()
        _dir_checked[:] = [now, os.path.isdir(where) and os.access(where, os.W_OK)]
    if not _dir_checked[1]:
        return None
    return _machine()


@functools.cache
def _machine() -> str | None:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        return None
    return f"{socket.gethostname()}|{boot}"


def sweep_stale() -> int:
    """Remove capture files of processes that no longer exist (an engine that died before its results
    were read); returns how many."""
    gone = 0
    where = shm_dir()
    try:
        names = [f for f in os.listdir(where) if f.startswith(PREFIX)]
    except OSError:
        return 0
    for f in names:
        try:
            pid = int(f[len(PREFIX) :].split("-", 1)[0])  # `<pid>-<uuid>` or `<pid>-pool<id>-<n>`
        except ValueError:
            continue
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            discard(os.path.join(where, f))
            gone += 1
        except PermissionError:
            pass
    return gone


def discard(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass
