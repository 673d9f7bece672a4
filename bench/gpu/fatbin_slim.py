"""Zero the GPU code a Hopper run never loads, so a CUDA library compresses to a fraction for the device.

A CUDA shared library keeps its kernels in the ELF section `.nv_fatbin`: containers of entries, one per
target (a cubin for one `sm_XX`, or PTX for one `compute_XX`). The driver picks, per container, the cubin of
the device's exact architecture, else JIT-compiles the newest PTX not above it. On an H200 (sm_90) every other
cubin, and every PTX above 90, is dead weight. Rewriting the ELF to drop them would move every offset; instead
their payload bytes are zeroed in place (headers kept, file size unchanged), which xz then squeezes to nothing.
A container whose only usable entry would be removed is left whole, so nothing that could load does not.

Usage: python3 fatbin_slim.py ARCH FILE... (in place; prints bytes zeroed per file). Only the standard library.
"""

from __future__ import annotations

import struct
import sys

FATBIN_MAGIC = 0xBA55ED50
KIND_PTX = 1
KIND_CUBIN = 2


def _section(data: bytes, name: bytes) -> tuple[int, int] | None:
    """(offset, size) of the ELF64 section called `name`, or None."""
    if data[:4] != b"\x7fELF" or data[4] != 2:
        return None
    shoff = struct.unpack_from("<Q", data, 0x28)[0]
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", data, 0x3A)
    str_off = struct.unpack_from("<Q", data, shoff + shstrndx * shentsize + 0x18)[0]
    for i in range(shnum):
        base = shoff + i * shentsize
        name_off = struct.unpack_from("<I", data, base)[0]
        end = data.index(b"\0", str_off + name_off)
        if data[str_off + name_off : end] == name:
            off, size = struct.unpack_from("<QQ", data, base + 0x18)
            return off, size
    return None


def _entries(data: bytearray, start: int, size: int) -> list[tuple[int, int, int, int]]:
    """(payload offset, payload size, kind, arch) of one container's entries."""
    out = []
    pos, end = start, start + size
    while pos + 64 <= end:
        kind, _ver, hsize = struct.unpack_from("<HHI", data, pos)
        psize = struct.unpack_from("<Q", data, pos + 8)[0]
        arch = struct.unpack_from("<I", data, pos + 28)[0]
        if kind not in (KIND_PTX, KIND_CUBIN) or hsize < 64 or pos + hsize + psize > end:
            break
        out.append((pos + hsize, psize, kind, arch))
        pos += hsize + psize
    return out


def _keep(entries: list[tuple[int, int, int, int]], arch: int) -> set[int]:
    """Indices the driver could choose for `arch`: its cubin if present, else the PTX it would JIT."""
    cubins = {i for i, e in enumerate(entries) if e[2] == KIND_CUBIN and e[3] == arch}
    if cubins:
        return cubins
    ptx = [(e[3], i) for i, e in enumerate(entries) if e[2] == KIND_PTX and e[3] <= arch]
    if ptx:
        best = max(a for a, _ in ptx)
        return {i for a, i in ptx if a == best}
    return set(range(len(entries)))  # nothing usable: leave the container as it was


def slim(path: str, arch: int) -> tuple[int, int]:
    """Zero the unusable entries of `path` in place; returns (bytes zeroed, containers seen)."""
    with open(path, "rb") as f:
        data = bytearray(f.read())
    sec = _section(data, b".nv_fatbin")
    if sec is None:
        return 0, 0
    off, size = sec
    pos, end, zeroed, seen = off, off + size, 0, 0
    while pos + 16 <= end:
        magic, _ver, hsize, fsize = struct.unpack_from("<IHHQ", data, pos)
        if magic != FATBIN_MAGIC:
            pos += 8
            continue
        seen += 1
        entries = _entries(data, pos + hsize, fsize)
        keep = _keep(entries, arch)
        for i, (poff, psize, _k, _a) in enumerate(entries):
            if i not in keep:
                data[poff : poff + psize] = bytes(psize)
                zeroed += psize
        pos += hsize + fsize
        pos += (-pos) % 8
    with open(path, "wb") as f:
        f.write(data)
    return zeroed, seen


def main(argv: list[str]) -> int:
    arch = int(argv[1])
    for path in argv[2:]:
        zeroed, seen = slim(path, arch)
        print(f"{path}: {seen} fatbins, {zeroed / 1e6:.1f} MB zeroed")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
