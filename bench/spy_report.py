"""Summarise a py-spy raw (collapsed) profile from `BENCH_PYSPY`: per process and thread, the share of samples
in which each function is on the stack (inclusive) and on top (self). Idle samples (waits) are included when
py-spy ran with --idle, so a thread's waits show as the function it waits in.

    python bench/spy_report.py pyspy-lens-W2-0.txt [--top 25] [--thread MainThread] [--match vllm_worker]
"""

from __future__ import annotations

import argparse
import collections
import re


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("path")
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--thread", default="", help="only threads whose name contains this")
    ap.add_argument("--match", default="", help="inclusive table: only frames containing this")
    a = ap.parse_args()
    per: dict[tuple[str, str], list[tuple[list[str], int]]] = collections.defaultdict(list)
    for line in open(a.path):
        stack, _, n = line.rstrip("\n").rpartition(" ")
        if not stack:
            continue
        frames = stack.split(";")
        k = 0  # a child process's samples start with its parents' process frames: keep the innermost
        while k + 1 < len(frames) and frames[k + 1].startswith("process "):
            k += 1
        proc = re.sub(r"^process \d+:", "", frames[k])[:70]
        thread = frames[k + 1] if len(frames) > k + 1 and frames[k + 1].startswith("thread") else "?"
        if a.thread and a.thread not in thread:
            continue
        per[(proc, thread)].append((frames[k + 2 :], int(n)))
    for (proc, thread), stacks in sorted(per.items(), key=lambda kv: -sum(n for _, n in kv[1])):
        total = sum(n for _, n in stacks)
        if total < 20:
            continue
        print(f"\n=== {proc} | {thread}: {total} samples")
        inc: collections.Counter = collections.Counter()
        own: collections.Counter = collections.Counter()
        for frames, n in stacks:
            for f in set(frames):
                if a.match in f:
                    inc[f] += n
            if frames:
                own[frames[-1]] += n
        print("  inclusive:")
        for f, n in inc.most_common(a.top):
            print(f"    {100 * n / total:5.1f}%  {f[:150]}")
        print("  self:")
        for f, n in own.most_common(a.top // 2):
            print(f"    {100 * n / total:5.1f}%  {f[:150]}")


if __name__ == "__main__":
    main()
