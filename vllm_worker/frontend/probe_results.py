"""The probe scores of a finished sample, as callers get them: `activations["probe_scores"][name]`, a float32
`(n_positions, n_out)` tensor over the positions of captures (0 .. prompt + generated - 2), and
`activations["probe_aggregates"][name]` = {aggregate name: (n_out,) float32} over the positions the
request chose (by default those whose forward pass produced a generated token: the last prompt position
onward)."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch

from vllm_worker.probes.aggregation import aggregates_many, aggregates_stacked
from vllm_worker.protocol import probe_wire
from vllm_worker.protocol.host_threads import one_thread


def _dense(pos: np.ndarray, n: int, scores: torch.Tensor) -> torch.Tensor:
    """Scores by position 0 .. max (`n`: max + 1); a position no worker scored is NaN (never a silent shift)."""
    if len(pos) == n:  # every position once, sorted (the workers sort): as it is
        return scores
    out = torch.full((n, scores.shape[1]), math.nan, dtype=torch.float32)
    out[torch.from_numpy(pos.copy())] = scores  # (a copy: `pos` may be read-only bytes)
    return out


def _positions(pos: bytes, seen: dict) -> tuple[np.ndarray, int]:
    """A probe's positions and their max + 1: read in place (no tensor of their own: callers see only the
    scores by position). `seen`: a part's positions by their bytes (its probes at one site, often at all,
    have the same ones: read once)."""
    got = seen.get(pos)
    if got is None:
        arr = np.frombuffer(pos, dtype=np.int64)
        got = seen[pos] = (arr, int(arr.max()) + 1 if len(arr) else 0)
    return got


def chosen(n: int, prompt_len: int, positions: Any) -> torch.Tensor | slice:
    """The positions (< n) that aggregates are taken over: a range as a slice (a view, no copy)."""
    if positions == "all":
        return slice(0, n)
    if positions == "prompt":
        return slice(0, min(n, prompt_len))
    if positions == "generated":
        return slice(max(prompt_len - 1, 0), n)
    return torch.tensor([p for p in positions if p < n], dtype=torch.long)


def _decoded(raw: bytes, ns: list[int], ks: list[int], flats: list[torch.Tensor]) -> list[torch.Tensor]:
    """Each `(n, n_out)` scores of one part's probes (their bytes one after another, rows and widths) as a
    view of one writable buffer for the part (one copy of its bytes, one tensor made), not a buffer and a
    tensor per probe; a part's own buffer, so a caller keeping one request's outputs keeps no other
    request's. The buffer, flat, goes to `flats` (the aggregates read them all together)."""
    if not raw:
        return [torch.empty((n, k), dtype=torch.float32) for n, k in zip(ns, ks)]
    flat = torch.frombuffer(bytearray(raw), dtype=torch.float32)
    flats.append(flat)
    n0, k0 = ns[0], ks[0]
    if k0 and ns.count(n0) == len(ns) and ks.count(k0) == len(ks):  # one shape (W10's): views in one call
        return list(flat.view(-1, n0, k0).unbind(0))
    if k0 and ks.count(k0) == len(ks):  # one width
        return list(flat.view(-1, k0).split(ns))
    return [t.view(n, k) for t, n, k in zip(flat.split([n * k for n, k in zip(ns, ks)]), ns, ks)]


Outputs = tuple[dict[str, torch.Tensor], dict[str, dict[str, torch.Tensor]]]


def probe_outputs(parts: list[dict], wanted: dict[str, dict[str, Any]], prompt_len: int) -> Outputs:
    """(probe_scores, probe_aggregates) of one sample from its workers' parts (one pipeline stage holds each
    probe's layers: `frontend.probes.check_local`)."""
    return probe_outputs_many([(parts, wanted, prompt_len)])[0]


def probe_outputs_many(samples: list[tuple[list[dict], dict[str, dict[str, Any]], int]]) -> list[Outputs]:
    """`probe_outputs` of every (parts, wanted, prompt_len) sample of a fetch: every sample's scores decoded
    from one buffer, then every sample's and probe's aggregates computed together (`aggregates_stacked`
    reading that buffer in place when every series has one shape and span; else `aggregates_many`). Per
    item only flat lists (of bytes, ints, tensors): no tuple per (request, probe) that lives through the
    call's young collections (docs/decisions.md, tailgc). In one torch thread (`host_threads`): the copies
    and reductions are small, and waking torch's pool for each cost more than the work (docs/decisions.md,
    coltail). The same bits as in the pool, where each output is one thread's sum — except a lone output over
    32768+ positions, which the pool split: in one thread it gets the bits it gets in a batch."""
    with one_thread():
        return _outputs_many(samples)


def _outputs_many(samples: list[tuple[list[dict], dict[str, dict[str, Any]], int]]) -> list[Outputs]:
    got = _uniform(samples)
    return got if got is not None else _outputs_general(samples)


def _uniform(samples: list[tuple[list[dict], dict[str, dict[str, Any]], int]]) -> list[Outputs] | None:
    """`_outputs_general`'s result for a fetch's usual case, or None (nothing made) when it is not that case:
    each sample one part, its probes (one block, or an item each) those of the one `wanted` all samples
    share, in its order, of one width, every probe's positions 0 .. n - 1 for the same n, one prompt length
    and one named choice of positions. Then a sample's scores are views of its part's buffer and its probes
    are consecutive items, so the general path's per-item lists, walk by name and item lookups are not
    needed: one pass checks, one makes the views, the aggregates are one stacked call over the same tensor
    (the same bits)."""
    parts0 = samples[0][0] if samples else None
    if not parts0 or len(parts0) != 1:
        return None
    wanted0, got0 = samples[0][1], parts0[0].get("probes")
    if type(got0) is not dict or not got0:
        return None
    plan = _plan(wanted0)
    if plan is None or plan[0] != list(got0) or plan[1].count(plan[1][0]) != len(plan[1]):
        return None
    names = plan[0]
    m = len(names)
    blocked = probe_wire.BLOCK in parts0[0]
    raws: list[bytes] = []
    poss: list[bytes] = []
    ks: list[int] = []  # every probe's width, sample after sample
    for parts, wanted, prompt_len in samples:
        if len(parts) != 1 or wanted is not wanted0 or prompt_len != samples[0][2]:
            return None
        part = parts[0]
        got = part.get("probes")
        if type(got) is not dict or list(got) != names or (probe_wire.BLOCK in part) is not blocked:
            return None
        try:  # (the parts' own checks: the general path raises what they raise, naming the field)
            if blocked:  # `probe_wire.pack_block`'s form: {name: n_out} and one buffer
                pos, raw, _, got_ks = probe_wire.unpack_block(got, part[probe_wire.BLOCK], "probe_scores")
                poss.append(pos)
                ks += got_ks
            else:  # an item a probe (`probe_wire.pack`)
                own: list[bytes] = []
                probe_wire.unpack_into(got, "probe_scores", poss, own, [], ks)
                raw = own[0] if m == 1 else b"".join(own)
        except ValueError:
            return None
        raws.append(raw)
    k0 = ks[0]
    if k0 <= 0 or ks.count(k0) != len(ks):
        return None
    seen: dict[bytes, tuple[np.ndarray, int]] = {}
    n0 = -1
    for pos in poss:  # (each probe's scores are as many rows as its positions: `unpack_*` checked)
        arr, n = _positions(pos, seen)
        if len(arr) != n or n != n0 and n0 != -1:
            return None
        n0 = n
    if n0 <= 0:
        return None
    sel = chosen(n0, samples[0][2], plan[2])
    if type(sel) is not slice:
        return None
    flats = [torch.frombuffer(bytearray(raw), dtype=torch.float32) for raw in raws]
    out: list[Outputs] = [(dict(zip(names, f.view(m, n0, k0).unbind(0))), {}) for f in flats]
    whole = torch.cat(flats).view(len(flats) * m, n0, k0)
    aggs = aggregates_stacked(whole[:, sel].contiguous(), [plan[1][0]] * len(whole))
    for j, (_, mine) in enumerate(out):
        mine.update(zip(names, aggs[j * m : (j + 1) * m]))
    return out


def _outputs_general(samples: list[tuple[list[dict], dict[str, dict[str, Any]], int]]) -> list[Outputs]:
    poss: list[bytes] = []  # per item (a probe of a part): its positions' bytes,
    ns: list[int] = []  # rows
    ks: list[int] = []  # and width;
    flats: list[torch.Tensor] = []  # per part with scores, its items' scores one after another
    decoded: list[torch.Tensor] = []
    for parts, _, _ in samples:
        for part in parts:
            got = part.get("probes")
            if not got:
                continue
            if probe_wire.BLOCK in part:  # the part's probes in one block (`probe_wire.pack_block`)
                pos, raw, n, got_ks = probe_wire.unpack_block(got, part[probe_wire.BLOCK], "probe_scores")
                poss += [pos] * len(got_ks)
                ns += [n] * len(got_ks)
                ks += got_ks
                decoded += _decoded(raw, ns[-len(got_ks) :], got_ks, flats)
                continue
            first = len(ns)
            item_raws: list[bytes] = []
            probe_wire.unpack_into(got, "probe_scores", poss, item_raws, ns, ks)
            if item_raws:
                decoded += _decoded(b"".join(item_raws), ns[first:], ks[first:], flats)
    seen: dict[bytes, tuple[np.ndarray, int]] = {}  # positions by their bytes (often the same ones)
    picks: dict[tuple[int, int, str], slice | torch.Tensor] = {}  # `chosen` of a named choice, by (n, prompt)
    out: list[Outputs] = []
    series: list[torch.Tensor] = []  # each (sample, wanted probe)'s scores by position,
    wanted_aggs: list[list[str]] = []  # its aggregates,
    at: list[int] = []  # the item it is when read in place (-1: not),
    sels: list[Any] = []  # and its positions chosen
    plans: dict[int, tuple | None] = {}  # `_plan` of each `wanted` (equal asks share one object)
    k = 0
    for parts, wanted, prompt_len in samples:
        scores: dict[str, torch.Tensor] = {}
        item: dict[str, int] = {}
        rows = -1  # a sample of one block read in place: its probes' rows
        for part in parts:
            names = part.get("probes") or ()
            if names and probe_wire.BLOCK in part:  # a block: its probes' positions are the same ones
                m = len(names)
                arr, n = _positions(poss[k], seen)
                if len(arr) == n:
                    scores.update(zip(names, decoded[k : k + m]))
                    item.update(zip(names, range(k, k + m)))
                    rows = n if len(parts) == 1 else -1
                else:
                    scores.update((name, _dense(arr, n, d)) for name, d in zip(names, decoded[k : k + m]))
                k += m
                continue
            for name in names:
                arr, n = _positions(poss[k], seen)
                if len(arr) == n:  # `_dense` as it is: the item's own scores
                    scores[name] = decoded[k]
                    item[name] = k
                else:
                    scores[name] = _dense(arr, n, decoded[k])
                k += 1
        plan = None
        if rows >= 0:
            wid = id(wanted)
            plan = plans[wid] if wid in plans else plans.setdefault(wid, _plan(wanted))
        if plan is not None and all(name in item for name in plan[0]):
            # (every probe one named choice over the block's rows: the walk below, per sample not per probe)
            names, aggs, choice = plan
            pk = (rows, prompt_len, choice)
            sel = picks.get(pk)
            if sel is None:
                sel = picks[pk] = chosen(rows, prompt_len, choice)
            series += [scores[name] for name in names]
            wanted_aggs += aggs
            at += [item[name] for name in names] if type(sel) is slice else [-1] * len(names)
            sels += [sel] * len(names)
            out.append((scores, {}))
            continue
        for name, opts in wanted.items():
            s = scores.get(name)
            if s is None:
                raise RuntimeError(f"inspect-lens: no worker returned the scores of probe {name!r}")
            choice = opts.get("positions", "generated")
            if type(choice) is str:  # a range: the same slice for every series of its length and prompt
                pk = (s.shape[0], prompt_len, choice)
                sel = picks.get(pk)
                if sel is None:
                    sel = picks[pk] = chosen(s.shape[0], prompt_len, choice)
            else:
                sel = chosen(s.shape[0], prompt_len, choice)
            series.append(s)
            wanted_aggs.append(opts["aggregate"])
            at.append(item.get(name, -1) if type(sel) is slice else -1)
            sels.append(sel)
        out.append((scores, {}))
    done = iter(_aggregates(series, wanted_aggs, at, sels, (flats, ns, ks)))
    for (_, wanted, _), (_, aggs) in zip(samples, out):
        for name in wanted:
            aggs[name] = next(done)
    return out


def _plan(wanted: dict[str, dict[str, Any]]) -> tuple[list[str], list[list[str]], str] | None:
    """(names, their aggregates, the named choice of positions) when every probe of `wanted` takes the same
    named choice (`generated`, `prompt`, `all`); None otherwise."""
    choices = [opts.get("positions", "generated") for opts in wanted.values()]
    if not choices or type(choices[0]) is not str or choices.count(choices[0]) != len(choices):
        return None
    return list(wanted), [opts["aggregate"] for opts in wanted.values()], choices[0]


def _aggregates(
    series: list[torch.Tensor], wanted: list[list[str]], at: list[int], sels: list[Any], items: tuple[list, ...]
) -> list[dict[str, torch.Tensor]]:
    """The aggregates `wanted` of each series over its chosen positions `sels` (`at`: the item it is, -1 if
    none; `items`: the parts' score buffers (`_decoded`), each item's rows and widths): when every series is
    an item of one shape with the same slice of positions, the stacked series are that slice of the buffers
    joined as one `(items, n, n_out)` tensor, copied once — the tensor `aggregates_many` would stack, so the
    same bits — instead of a slice per series and a stack of them."""
    flats, ns, ks = items
    sl = sels[0] if sels else None
    one_shape = bool(ns) and ks[0] > 0 and ns.count(ns[0]) == len(ns) and ks.count(ks[0]) == len(ks)
    if one_shape and flats and type(sl) is slice and -1 not in at and sels.count(sl) == len(sels):
        whole = torch.cat(flats).view(len(ns), ns[0], ks[0])
        x = whole[:, sl] if at == list(range(len(ns))) else whole[torch.tensor(at)][:, sl]
        return aggregates_stacked(x.contiguous(), wanted)
    return aggregates_many([(s[sel], w) for s, w, sel in zip(series, wanted, sels)])
