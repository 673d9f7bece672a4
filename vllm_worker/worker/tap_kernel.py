"""The tap kernel of the graph-safe path (`graph`): capture and steering of one site, one program per row
(and per d_model-wide piece of an mlp_post row), reading the control table and the steering entries.
Imported by `graph_kernels.make_tap_kernel` only where Triton is (its helpers are module functions: the
kernel calls them, compiled or in Triton's interpreter alike)."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def tap_kernel(
    h_ptr,
    r_ptr,
    ctl_ptr,
    base_ptr,
    stage_ptr,
    a_ptr,
    b_ptr,
    bflag_ptr,
    gate_ptr,
    op_ptr,
    nxt_ptr,
    lo_ptr,
    hi_ptr,
    col,
    max_rows,
    d,
    w,
    stride_h,
    stride_r,
    HAS_R: tl.constexpr,
    BLOCK: tl.constexpr,
    WIDE: tl.constexpr = False,  # an mlp_post tap's launch: a row may be a whole row's (`_whole_row`)
):
    i = tl.program_id(0)
    # piece j of a row wider than d (mlp_post): values [j*d, j*d + d) are site column col + j, so one
    # launch serves every piece of the tap (a launch per piece cost every step, idle ones too); 0 elsewhere
    j = tl.program_id(1)
    c = ((col + j) * max_rows + i) * 2
    slot = tl.load(ctl_ptr + c)
    ent = tl.load(ctl_ptr + c + 1)
    if (slot >= 0) | (ent >= 0):
        if WIDE:  # (mlp_post taps: a row's chain may be a whole row's, `interventions.WHOLE`)
            whole = ent < -1  # (false)
            if ent >= 0:
                whole = tl.load(op_ptr + ent) >= 8
            if whole:
                if j == 0:  # piece 0's program serves every piece; the others' have nothing to do
                    _whole_row(
                        h_ptr + i.to(tl.int64) * stride_h,
                        ctl_ptr + (col * max_rows + i) * 2,
                        base_ptr,
                        stage_ptr,
                        a_ptr,
                        b_ptr,
                        bflag_ptr,
                        gate_ptr,
                        op_ptr,
                        nxt_ptr,
                        lo_ptr,
                        hi_ptr,
                        ent,
                        max_rows,
                        d,
                        w,
                        tl.num_programs(1),
                        BLOCK,
                    )
            else:
                _piece(
                    h_ptr,
                    r_ptr,
                    base_ptr,
                    stage_ptr,
                    a_ptr,
                    b_ptr,
                    bflag_ptr,
                    gate_ptr,
                    op_ptr,
                    nxt_ptr,
                    lo_ptr,
                    hi_ptr,
                    i,
                    j,
                    slot,
                    ent,
                    d,
                    w,
                    stride_h,
                    stride_r,
                    HAS_R,
                    BLOCK,
                )
        else:
            _piece(
                h_ptr,
                r_ptr,
                base_ptr,
                stage_ptr,
                a_ptr,
                b_ptr,
                bflag_ptr,
                gate_ptr,
                op_ptr,
                nxt_ptr,
                lo_ptr,
                hi_ptr,
                i,
                j,
                slot,
                ent,
                d,
                w,
                stride_h,
                stride_r,
                HAS_R,
                BLOCK,
            )


@triton.jit
def _piece(
    h_ptr,
    r_ptr,
    base_ptr,
    stage_ptr,
    a_ptr,
    b_ptr,
    bflag_ptr,
    gate_ptr,
    op_ptr,
    nxt_ptr,
    lo_ptr,
    hi_ptr,
    i,
    j,
    slot,
    ent,
    d,
    w,
    stride_h,
    stride_r,
    HAS_R: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """Piece j of row i (the whole row at most sites): its entry's chain, then its capture."""
    offs = tl.arange(0, BLOCK)
    # the piece's width: d, fewer values (router logits, an mlp_post row's last piece) in a d-wide row
    m = offs < tl.minimum(w - j * d, d)
    hp = h_ptr + i.to(tl.int64) * stride_h + j * d + offs
    h = tl.load(hp, mask=m, other=0.0)
    if HAS_R:  # (single-piece sites only: j is 0)
        r = tl.load(r_ptr + i.to(tl.int64) * stride_r + offs, mask=m, other=0.0).to(tl.float32)
    else:
        r = tl.zeros([BLOCK], dtype=tl.float32)
    if ent >= 0:
        # the entry's chain, in order (`interventions`): float32 throughout, rounded once
        x = h.to(tl.float32)
        while ent >= 0:
            e = ent.to(tl.int64) * d
            a = tl.load(a_ptr + e + offs, mask=m, other=0.0).to(tl.float32)
            op = tl.load(op_ptr + ent)
            if op == 0:  # add: A + B * |stream|
                if tl.load(bflag_ptr + ent) != 0:
                    s = x + r
                    nrm = tl.sqrt(tl.sum(s * s, axis=0))
                    a += tl.load(b_ptr + e + offs, mask=m, other=0.0).to(tl.float32) * nrm
                x = x + a * tl.load(gate_ptr + ent)  # 1, or a probe action's gate (0 until fired)
            elif op == 3:  # set: A + B * stream (B: 1 where kept)
                keep = tl.load(b_ptr + e + offs, mask=m, other=0.0).to(tl.float32)
                x = a + keep * (x + r) - r
            else:  # ablate (1) / cap (2): the projection on the unit direction A moved
                s = x + r
                p = tl.sum(s * a, axis=0)
                q = p * 0.0
                if op == 2:
                    q = tl.minimum(tl.maximum(p, tl.load(lo_ptr + ent)), tl.load(hi_ptr + ent))
                x = x + (q - p) * a
            ent = tl.load(nxt_ptr + ent)
        h = x.to(h.dtype)
        tl.store(hp, h, mask=m)
    if slot >= 0:
        out = (h.to(tl.float32) + r).to(stage_ptr.dtype.element_ty)
        at = slot.to(tl.int64) + tl.load(base_ptr).to(tl.int64)
        tl.store(stage_ptr + at * d + offs, out, mask=m)


@triton.jit
def _whole_row(
    row_ptr,
    ctl_ptr,
    base_ptr,
    stage_ptr,
    a_ptr,
    b_ptr,
    bflag_ptr,
    gate_ptr,
    op_ptr,
    nxt_ptr,
    lo_ptr,
    hi_ptr,
    head,
    max_rows,
    d,
    w,
    pieces,
    BLOCK: tl.constexpr,
):
    """A whole mlp_post row's chain (`interventions.WHOLE`: step k's piece jj at entry head_k + jj) over
    every piece, then its capture (each piece's slot from its column). Nothing is written before the
    last pass: pass k replays steps 0..k-1 from the row as it came, with their scalars (a norm, a
    projection moved) kept in registers, to find step k's — float32 throughout, rounded once, no scratch
    memory; at most 8 steps (`interventions.MAX_WHOLE_STEPS`). Each piece is read in two halves
    (`HALF`): whole d-wide vectors held 11 more registers than the per-piece path, in every program of
    the launch, idle ones included (fewer programs per SM)."""
    HALF: tl.constexpr = BLOCK // 2
    offs = tl.arange(0, HALF)
    sidx = tl.arange(0, 8)
    coef = tl.zeros([8], dtype=tl.float32)
    n_steps = head * 0
    e = head
    while e >= 0:
        n_steps += 1
        e = tl.load(nxt_ptr + e)
    e = head
    t = head * 0
    while t <= n_steps:
        last = t == n_steps
        more = t < n_steps
        opk = head * 0
        need = last
        if more:
            opk = tl.load(op_ptr + e).to(tl.int32) & 7
            need = (opk == 1) | (opk == 2) | ((opk == 0) & (tl.load(bflag_ptr + e) != 0))
        if need:
            acc = tl.sum(coef * 0.0, axis=0)
            for sp in range(0, 2 * pieces):  # (piece jj's half from value lo)
                jj = sp // 2
                lo = (sp % 2) * HALF
                m = lo + offs < tl.minimum(w - jj * d, d)
                x = tl.load(row_ptr + jj * d + lo + offs, mask=m, other=0.0).to(tl.float32)
                e2 = head
                k = head * 0
                while k < t:  # steps 0..t-1 (`graph_kernels`' chain walk, each scalar from its pass)
                    o2 = tl.load(op_ptr + e2).to(tl.int32) & 7
                    pe = (e2 + jj).to(tl.int64) * d + lo
                    a = tl.load(a_ptr + pe + offs, mask=m, other=0.0).to(tl.float32)
                    cf = tl.sum(tl.where(sidx == k, coef, 0.0), axis=0)
                    if o2 == 0:  # add: A + B * |row| (the norm: its pass's scalar)
                        if tl.load(bflag_ptr + e2) != 0:
                            a += tl.load(b_ptr + pe + offs, mask=m, other=0.0).to(tl.float32) * cf
                        x = x + a * tl.load(gate_ptr + e2)
                    elif o2 == 3:  # set: A + B * row
                        x = a + tl.load(b_ptr + pe + offs, mask=m, other=0.0).to(tl.float32) * x
                    else:  # ablate / cap: the projection moved by its pass's scalar
                        x = x + cf * a
                    e2 = tl.load(nxt_ptr + e2)
                    k += 1
                if last:
                    h = x.to(row_ptr.dtype.element_ty)
                    tl.store(row_ptr + jj * d + lo + offs, h, mask=m)
                    slot = tl.load(ctl_ptr + jj * max_rows * 2)
                    if slot >= 0:
                        at = slot.to(tl.int64) + tl.load(base_ptr).to(tl.int64)
                        tl.store(stage_ptr + at * d + lo + offs, h.to(stage_ptr.dtype.element_ty), mask=m)
                elif opk == 0:
                    acc += tl.sum(x * x, axis=0)
                else:
                    pe = (e + jj).to(tl.int64) * d + lo
                    acc += tl.sum(x * tl.load(a_ptr + pe + offs, mask=m, other=0.0).to(tl.float32), axis=0)
            if more:
                if opk == 0:
                    val = tl.sqrt(acc)
                else:
                    q = acc * 0.0
                    if opk == 2:
                        q = tl.minimum(tl.maximum(acc, tl.load(lo_ptr + e)), tl.load(hi_ptr + e))
                    val = q - acc
                coef = tl.where(sidx == t, val, coef)
        if more:
            e = tl.load(nxt_ptr + e)
        t += 1
