"""The body of every micro-kernel tile function, written with llvmlite: the
accumulators of one MR x NR tile (:class:`TileBody`), the k loop over packed, strided,
tapped or row-offset operands, and the update of C with its epilogue.

:mod:`tilegemm.kernels.microkernel` states each flavour's arguments and builds the
functions; this module writes what they compute (:func:`emit_tile`,
:func:`emit_panels`).
"""
import functools

import llvmlite.ir as ir
import numpy as np
from numba import types
from numba.core import cgutils

from tilegemm.ground.contracts import EPI_BIAS_COL, cdiv
from tilegemm.kernels.ir import (FAST_EPILOGUES, NUMBA_FLOAT, activation, by_epilogue,
                                 constant_flags, epilogue, fma, load_bias, load_vector,
                                 masked_load_call, nullcontext, prefetch_line, splat,
                                 store_vector, vector_ptr)

#: k steps per iteration of the micro-kernel's main loop.
UNROLL = 4

#: Independent accumulators a k loop needs to keep the FMA units busy: FMA latency
#: (4 cycles on Zen 3 and Skylake) times FMA ports (2).  Tiles with fewer accumulators
#: (2x16 or 6x8 with 8 lanes) keep several sets, alternated by k step and added up
#: after the loop (docs/kernels.md: a single set halves a 2x16 tile's speed).
FMA_CHAINS = 8


def emit_tile(context, builder, shape, args, valid=None, taps=None, rows=None, b_next=None):
    """The body shared by every kernel flavour: prefetch C, the k loop, the C update.

    ``args``: the tile function's :class:`~tilegemm.kernels.microkernel.TileArgs` (the strides a flavour fixes
    already constants).  ``valid = (rows, cols)`` limits every access to C and the bias to that corner.
    ``taps = (ntaps, a_tap, tap_ptr, mask_ptr, sched_ptr)`` repeats the k loop once per
    tap, masked or not; ``rows = (ntaps, offs_ptr, o_step, zeros_ptr, b_tap)`` once per tap
    with A's rows at their own offsets (see :class:`~tilegemm.kernels.microkernel.Flavour`).  ``b_next``: the
    strided flavour's prefetch offset.
    """
    tile = TileBody(context, builder, shape, args.kc, args.a_rs, args.a_cs, args.ldb, b_next)
    tile.prefetch_c(args.c_ptr, args.ldc)
    if rows is not None:
        tile.row_taps(args.a_ptr, args.b_ptr, *rows)
    elif taps is None:
        tile.k_loop(tile.a_rows_at(args.a_ptr), args.b_ptr)
    else:
        tile.masked_taps(args.a_ptr, args.b_ptr, *taps)
    tile.add_sets()
    tile.update_c(args.c_ptr, args.ldc, args.alpha, args.beta, args.bias_ptr, args.epi, valid)


def emit_panels(context, builder, shape, args, rows, panels):
    """The ``ROWS_PANELS`` body: :func:`emit_tile`'s rows tile once per panel, its
    sums zeroed again each time.  ``rows`` as there, ``panels = (count, o_panel)``."""
    ntaps, offs_ptr, o_step, zeros_ptr, b_tap = rows
    count, o_panel = panels
    tile = TileBody(context, builder, shape, args.kc, args.a_rs, args.a_cs, args.ldb)
    c_panel = builder.mul(tile.const(tile.mr), args.ldc)
    with cgutils.for_range(builder, count) as loop:
        q = loop.index
        c_q = builder.gep(args.c_ptr, [builder.mul(q, c_panel)])
        tile.zero()
        tile.prefetch_c(c_q, args.ldc)
        tile.row_taps(args.a_ptr, args.b_ptr, ntaps,
                      builder.gep(offs_ptr, [builder.mul(q, o_panel)]), o_step, zeros_ptr, b_tap)
        tile.add_sets()
        tile.update_c(c_q, args.ldc, args.alpha, args.beta, args.bias_ptr, args.epi, None)


class TileBody:
    """The accumulators of one MR x NR tile and the steps that emit its body."""

    def __init__(self, context, builder, shape, kc, a_rs, a_cs, ldb, b_next=None):
        dtype, self.mr, nr, self.lanes = shape
        self.builder, self.kc, self.a_rs, self.a_cs, self.ldb = builder, kc, a_rs, a_cs, ldb
        self.b_next = b_next
        self.nv = nr // self.lanes
        self.fl = context.get_value_type(NUMBA_FLOAT[dtype])
        self.esize = np.dtype(dtype).itemsize
        self.vec = ir.VectorType(self.fl, self.lanes)
        self.intp = context.get_value_type(types.intp)
        zero = ir.Constant(self.vec, [0.0] * self.lanes)
        # sets[s][i][v]: partial sums over the k steps with k % len(sets) == s (see FMA_CHAINS).
        n_sets = min(UNROLL, cdiv(FMA_CHAINS, self.mr * self.nv))
        self.sets = [[[cgutils.alloca_once_value(builder, zero) for _ in range(self.nv)]
                      for _ in range(self.mr)] for _ in range(n_sets)]
        self.acc = self.sets[0]
        self.zero_v = zero

    def zero(self):
        """Every partial sum back to zero (a tile function running several tiles)."""
        for part in self.sets:
            for row in part:
                for slot in row:
                    self.builder.store(self.zero_v, slot)

    def const(self, value):
        return ir.Constant(self.intp, value)

    def prefetch_c(self, c_ptr, ldc):
        """C is read only after the k loop: start bringing its lines in now."""
        builder = self.builder
        line = 64 // self.esize
        for i in range(self.mr):
            row = builder.mul(self.const(i), ldc)
            for j in range(0, self.nv * self.lanes, line):
                prefetch_line(builder, builder.gep(c_ptr, [builder.add(row, self.const(j))]))

    def a_rows_at(self, a_ptr):
        return [self.builder.gep(a_ptr, [self.builder.mul(self.const(i), self.a_rs)])
                for i in range(self.mr)]

    def load_b(self, b_ptr, b_row, b_mask):
        """The NR values of B's row at ``b_row``, through the lane masks at ``b_mask`` if any."""
        builder, vec, lanes, esize = self.builder, self.vec, self.lanes, self.esize
        if b_mask is None:
            return [builder.load(vector_ptr(builder, b_ptr, builder.add(b_row, self.const(v * lanes)),
                                            vec), align=esize) for v in range(self.nv)]
        # The masks are re-read from L1 every k: held in registers they would take two
        # of the 16 AVX2 registers and spill an accumulator.  The empty asm hides the
        # address from LLVM, which would otherwise hoist the loads out of the loop.
        # Masked loads, not loads ANDed with the mask: lanes off may lie outside the
        # image's memory.
        m_ptr = builder.asm(ir.FunctionType(b_mask.type, [b_mask.type]), "", "=r,0", [b_mask], True)
        none = ir.Constant(b_mask.type.pointee, [0] * lanes)
        bv = []
        for v in range(self.nv):
            m = builder.load(builder.gep(m_ptr, [self.const(v)]), align=esize)
            ptr = vector_ptr(builder, b_ptr, builder.add(b_row, self.const(v * lanes)), vec)
            bv.append(masked_load_call(builder, ptr, esize, builder.icmp_signed("<", m, none)))
        return bv

    def k_step(self, k, acc, a_rows, b_ptr, b_mask):
        """One rank-1 update: NR/lanes vector loads of B, MR broadcasts of A, MR*NR/lanes FMAs."""
        builder = self.builder
        b_row = builder.mul(k, self.ldb)
        a_col = builder.mul(k, self.a_cs)
        bv = self.load_b(b_ptr, b_row, b_mask)
        if self.b_next is not None:
            prefetch_line(builder, builder.gep(b_ptr, [builder.add(b_row, self.b_next)]))
        for i in range(self.mr):
            a_splat = splat(builder, builder.load(builder.gep(a_rows[i], [a_col])), self.vec)
            for v in range(self.nv):
                builder.store(fma(builder, a_splat, bv[v], builder.load(acc[i][v])), acc[i][v])

    def k_loop(self, a_rows, b_ptr, b_mask=None):
        """The whole point of the kernel: ``kc`` rank-1 updates of the accumulators.

        ``a_rows``: a pointer to each row of A (its element k at ``k*a_cs``).
        ``b_mask``: pointer to one integer vector per B vector: every row of B is read
        through it by masked loads (lanes off read as zero and never touch memory).
        Unrolled UNROLL times (fewer loop-control uops between FMAs), then the
        remainder one k at a time.
        """
        builder, sets = self.builder, self.sets
        unroll = self.const(UNROLL)
        whole = builder.sdiv(self.kc, unroll)
        with cgutils.for_range(builder, whole) as loop:
            base = builder.mul(loop.index, unroll)
            for u in range(UNROLL):
                self.k_step(builder.add(base, self.const(u)), sets[u % len(sets)], a_rows, b_ptr,
                            b_mask)
        done = builder.mul(whole, unroll)
        with cgutils.for_range(builder, builder.sub(self.kc, done)) as loop:
            self.k_step(builder.add(done, loop.index), sets[0], a_rows, b_ptr, b_mask)

    def row_taps(self, a_ptr, b_ptr, ntaps, offs_ptr, o_step, zeros_ptr, b_tap):
        """One k loop per tap; each row of A starts where its offset says, or at the
        zero row for a negative offset (the tap falls in the padding)."""
        builder = self.builder
        with cgutils.for_range(builder, ntaps) as loop:
            t = loop.index
            at = builder.mul(t, o_step)
            a_t = []
            for i in range(self.mr):
                off = builder.load(builder.gep(offs_ptr, [builder.add(at, self.const(i))]))
                inside = builder.icmp_signed(">=", off, self.const(0))
                a_t.append(builder.select(inside, builder.gep(a_ptr, [off]), zeros_ptr))
            self.k_loop(a_t, builder.gep(b_ptr, [builder.mul(t, b_tap)]))

    def masked_taps(self, a_ptr, b_ptr, ntaps, a_tap, tap_ptr, mask_ptr, sched_ptr):
        """One k loop per tap, all into the same accumulators.

        A's panel for tap t lies t*a_tap further on, B's rows start taps[t] elements
        from b_ptr.  Taps with a load mask run a second copy of the loop, whose B
        loads are masked, so unmasked taps pay nothing.  The taps stay in the order
        A is packed in: the hardware prefetcher follows A as one stream (see
        docs/kernels.md, the taps kernel).
        """
        builder = self.builder
        ivec = ir.VectorType(ir.IntType(8 * self.esize), self.lanes)
        n_and = builder.load(builder.gep(sched_ptr, [ntaps]))
        and_off = builder.load(builder.gep(sched_ptr, [builder.add(ntaps, ir.Constant(ntaps.type, 1))]))
        with cgutils.for_range(builder, ntaps) as loop:
            t = loop.index
            a_t = builder.gep(a_ptr, [builder.mul(t, a_tap)])
            b_t = builder.gep(b_ptr, [builder.load(builder.gep(tap_ptr, [t]))])
            m_off = builder.load(builder.gep(sched_ptr, [t]))
            masked = builder.icmp_signed(">=", m_off, ir.Constant(m_off.type, 0))
            with builder.if_else(masked) as (then_masked, then_plain):
                with then_masked:
                    self.k_loop(self.a_rows_at(a_t), b_t,
                                builder.bitcast(builder.gep(mask_ptr, [m_off]), ivec.as_pointer()))
                with then_plain:
                    self.k_loop(self.a_rows_at(a_t), b_t)
            # The first n_and taps read unmasked (in bounds, but some lanes wrap round
            # a row's edge): their sum is masked once, here, instead of every load.
            group_done = builder.icmp_signed("==", builder.add(t, ir.Constant(t.type, 1)), n_and)
            with builder.if_then(group_done):
                self.and_sums(builder.bitcast(builder.gep(mask_ptr, [and_off]), ivec.as_pointer()),
                              ivec)

    def and_sums(self, keep_ptr, ivec):
        """Every partial sum ANDed with the lane masks at ``keep_ptr`` (one per vector)."""
        builder = self.builder
        keep = [builder.load(builder.gep(keep_ptr, [self.const(v)]), align=self.esize)
                for v in range(self.nv)]
        for part in self.sets:
            for i in range(self.mr):
                for v in range(self.nv):
                    bits = builder.and_(builder.bitcast(builder.load(part[i][v]), ivec), keep[v])
                    builder.store(builder.bitcast(bits, self.vec), part[i][v])

    def add_sets(self):
        """The partial sums of the k loop's alternate sets, added into the first."""
        builder, acc = self.builder, self.acc
        for part in self.sets[1:]:
            for i in range(self.mr):
                for v in range(self.nv):
                    builder.store(builder.fadd(builder.load(acc[i][v]), builder.load(part[i][v])),
                                  acc[i][v])

    def edge_masks(self, valid):
        """Per row, whether it is inside ``valid``; per vector, the lanes inside it."""
        builder, intp, lanes = self.builder, self.intp, self.lanes
        rows_ok = [builder.icmp_signed("<", self.const(i), valid[0]) for i in range(self.mr)]
        lane = ir.Constant(ir.VectorType(intp, lanes), list(range(lanes)))
        cols = splat(builder, valid[1], ir.VectorType(intp, lanes))
        masks = [builder.icmp_signed("<", builder.add(lane, splat(builder, self.const(v * lanes),
                                                                  lane.type)), cols)
                 for v in range(self.nv)]
        return rows_ok, masks

    def update_c(self, c_ptr, ldc, alpha, beta, bias_ptr, epi, valid):
        """``C = alpha*acc + beta*C`` then the epilogue, in straight-line variants (beta
        zero or not; no epilogue, one of :data:`FAST_EPILOGUES` with alpha = 1, or any
        other) so the common paths carry no per-element tests."""
        builder = self.builder
        alpha_v = splat(builder, alpha, self.vec)
        beta_v = splat(builder, beta, self.vec)
        beta_is_zero = builder.fcmp_ordered("==", beta, ir.Constant(self.fl, 0.0))
        zero_i = ir.Constant(epi.type, 0)
        rows_ok, masks = self.edge_masks(valid) if valid is not None else (None, None)
        store = (c_ptr, ldc, alpha_v, beta_v, bias_ptr, epi, rows_ok, masks)
        plain = builder.icmp_signed("==", epi, zero_i)
        fast = builder.fcmp_ordered("==", alpha, ir.Constant(self.fl, 1.0))
        with builder.if_else(beta_is_zero) as (then_zero, then_beta):
            for branch, read_c in ((then_zero, False), (then_beta, True)):
                with branch:
                    with builder.if_else(plain) as (p, f):
                        with p:
                            self.store_tile(*store, read_c=read_c, fused=False)
                        with f:
                            # FAST_EPILOGUES with alpha = 1 in code of their own.
                            by_epilogue(builder, epi, FAST_EPILOGUES, functools.partial(
                                self.store_case, store, read_c), when=fast)

    def store_case(self, store, read_c, case):
        """:meth:`store_tile` for one of :data:`FAST_EPILOGUES` (``case``) or, None, for
        any epilogue (flags tested per vector)."""
        self.store_tile(*store, read_c=read_c, fused=True if case is None else case)

    def store_tile(self, c_ptr, ldc, alpha_v, beta_v, bias_ptr, epi, rows_ok, masks, read_c,
                   fused):
        """C's tile written: ``fused`` False (no epilogue), True (flags ``epi`` tested
        per vector) or the one of :data:`FAST_EPILOGUES` that ``epi`` is (alpha is 1:
        no product by it, the column bias loaded once, the activation fixed)."""
        builder, esize = self.builder, self.esize
        known = fused is not True and fused is not False
        if fused is True:
            flags, bias_row, bias_col = load_bias(builder, epi, bias_ptr, self.mr, self.nv, self.vec,
                                                  self.intp, esize, rows_ok, masks)
        elif known:
            flags = constant_flags(fused)
            bias_col = [load_vector(builder, vector_ptr(builder, bias_ptr, self.const(v * self.lanes),
                                                        self.vec), esize, masks and masks[v])
                        for v in range(self.nv)] if fused & EPI_BIAS_COL else None
        for i in range(self.mr):
            with (builder.if_then(rows_ok[i]) if rows_ok else nullcontext()):
                row = builder.mul(self.const(i), ldc)
                for v in range(self.nv):
                    ptr = vector_ptr(builder, c_ptr, builder.add(row, self.const(v * self.lanes)),
                                     self.vec)
                    r = builder.load(self.acc[i][v])
                    if not known:
                        r = builder.fmul(alpha_v, r)
                    if read_c:
                        r = fma(builder, beta_v, load_vector(builder, ptr, esize, masks and masks[v]),
                                r)
                    if fused is True:
                        r = epilogue(builder, r, flags, bias_row, bias_col, i, v)
                    elif known:
                        if bias_col is not None:
                            r = builder.fadd(r, bias_col[v])
                        r = activation(builder, r, flags["relu"], flags["relu6"])
                    store_vector(builder, r, ptr, esize, masks and masks[v])
