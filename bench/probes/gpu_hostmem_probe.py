"""ON THE LENT H200: how fast the CPU reads pinned (cudaHostAlloc) memory vs pageable memory, and how
fast it writes fresh vs prefaulted shared-memory files (issue 10's capture tail). Prints PROBE lines."""

import json
import os
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

N = 331 << 20


def bw(f, n=N):
    t = time.perf_counter()
    f()
    return round(n / (time.perf_counter() - t) / 1e9, 2)


pinned = torch.empty(N, dtype=torch.uint8, pin_memory=True)
pinned.fill_(1)
page = torch.empty(N, dtype=torch.uint8)
page.fill_(1)
dst = torch.empty(N, dtype=torch.uint8)
dst.fill_(0)
res = {}
res["pinned_to_page_np"] = bw(lambda: np.copyto(dst.numpy(), pinned.numpy()))
res["page_to_page_np"] = bw(lambda: np.copyto(dst.numpy(), page.numpy()))
res["pinned_to_page_torch"] = bw(lambda: dst.copy_(pinned))
res["page_to_pinned_np"] = bw(lambda: np.copyto(pinned.numpy(), page.numpy()))
dev = torch.empty(N, dtype=torch.uint8, device="cuda")
torch.cuda.synchronize()


def d2h(t):
    t.copy_(dev, non_blocking=True)
    torch.cuda.synchronize()


res["d2h_pinned"] = bw(lambda: d2h(pinned))
res["d2h_page"] = bw(lambda: d2h(page))
# registered (cudaHostRegister) pageable memory: is the CPU side fast to read?
reg = torch.empty(N, dtype=torch.uint8)
reg.fill_(1)
rc = torch.cuda.cudart().cudaHostRegister(reg.data_ptr(), N, 0)
res["register_rc"] = int(rc) if not isinstance(rc, tuple) else [int(x) for x in rc]
res["d2h_registered"] = bw(lambda: d2h(reg))
res["registered_to_page_np"] = bw(lambda: np.copyto(dst.numpy(), reg.numpy()))


# shm files
def shm(prefault):
    p = f"/dev/shm/probe-{prefault}"
    fd = os.open(p, os.O_CREAT | os.O_RDWR, 0o600)
    os.posix_fallocate(fd, 0, N)
    os.close(fd)
    t = torch.from_file(p, shared=True, size=N, dtype=torch.uint8)
    if prefault:
        t[::4096].zero_()
    os.unlink(p)
    return t


s0 = shm(False)
res["page_to_fresh_shm"] = bw(lambda: np.copyto(s0.numpy(), page.numpy()))
s1 = shm(True)
res["page_to_prefaulted_shm"] = bw(lambda: np.copyto(s1.numpy(), page.numpy()))
s2 = shm(True)
res["pinned_to_prefaulted_shm"] = bw(lambda: np.copyto(s2.numpy(), pinned.numpy()))


def par(src, k=8):
    out = torch.empty(N, dtype=torch.uint8)
    out.fill_(0)
    step = N // k
    with ThreadPoolExecutor(k) as ex:
        list(
            ex.map(
                lambda i: np.copyto(out.numpy()[i * step : (i + 1) * step], src.numpy()[i * step : (i + 1) * step]),
                range(k),
            )
        )


res["pinned_to_page_8thr"] = bw(lambda: par(pinned))
res["page_to_page_8thr"] = bw(lambda: par(page))
print("PROBE " + json.dumps(res), flush=True)
