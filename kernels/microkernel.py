"""The micro-kernel generator: one function emits every MR x NR kernel as LLVM vector IR.

Numba's own vectoriser turns a register tile into gathers or 256-bit code on this
class of CPU, so the kernel body is written directly with llvmlite: for each k,
NR/lanes vector loads of the packed B row, one broadcast per packed A element and
MR*(NR/lanes) ``llvm.fma`` calls into accumulators.  The accumulators live in
allocas that LLVM's mem2reg promotes to registers, so the k loop runs with no
memory traffic beyond the two packed panels.

Every flavour (:class:`Flavour`) is a Numba ``intrinsic`` whose arguments
:data:`ARGUMENTS` lists; the packed one is::

    ukernel(kc, a, a_off, b, b_off, c, c_off, ldc, alpha, beta, bias, bias_off, epi)

* ``a``/``b``: 1-D packed buffers; the panels start at ``a_off``/``b_off``.
  A's panel holds MR values per k, B's NR values per k (zero padded).
* ``c``: any array; the tile's first element is ``c_off`` elements from
  ``c``'s data pointer, rows are ``ldc`` elements apart, columns contiguous.
* ``C = alpha*A*B + beta*C``; ``beta == 0`` never reads C.
* ``epi`` selects the fused epilogue: ``EPI_BIAS_ROW`` adds ``bias[bias_off+i]``,
  ``EPI_BIAS_COL`` adds ``bias[bias_off+j]``, then ``EPI_RELU`` / ``EPI_RELU6``.
  The bias is read only when its flag is set (MR or NR values from ``bias_off``).
"""
import collections
import enum
import inspect

import llvmlite.ir as ir
import numpy as np
from numba import types
from numba.core import cgutils
from numba.core.registry import cpu_target
from numba.extending import intrinsic

from tilegemm.ground.contracts import EPI_BIAS_COL, EPI_RELU, EPI_RELU6, cdiv
from tilegemm.kernels import tilelib
from tilegemm.kernels.ir import (NUMBA_FLOAT, activation, check_mask_width, constant_flags,
                                 data_ptr, epilogue, fma, load_bias, load_vector,
                                 masked_load_call, nullcontext, prefetch_line, splat,
                                 store_vector, vector_ptr)

#: k steps per iteration of the micro-kernel's main loop.
UNROLL = 4

#: Epilogues each tile writes in straight-line code of its own (with alpha = 1): the
#: convolutions' bias per output channel, alone or with relu/relu6.  Tested per vector,
#: the flags' selects became a branch per vector and the bias spilled to the stack:
#: 9-10% of a 1x1 layer of 16-32 input channels (Zen 3).
FAST_EPILOGUES = (EPI_BIAS_COL, EPI_BIAS_COL | EPI_RELU, EPI_BIAS_COL | EPI_RELU6)

#: Independent accumulators a k loop needs to keep the FMA units busy: FMA latency
#: (4 cycles on Zen 3 and Skylake) times FMA ports (2).  Tiles with fewer accumulators
#: (2x16 or 6x8 with 8 lanes) keep several sets, alternated by k step and added up
#: after the loop (docs/kernels.md: a single set halves a 2x16 tile's speed).
FMA_CHAINS = 8


class Flavour(enum.Enum):
    """How a micro-kernel reads A and B and how much of C it writes.

    * ``PACKED``: packed panels of A and B, the full MR x NR tile of C.
    * ``STRIDED``: A and B read where they lie, ``A[i, p]`` at ``a_off + i*a_rs +
      p*a_cs`` and row ``p`` of B's NR contiguous columns at ``b_off + p*ldb``:
      products small enough to skip packing.  Its last argument ``b_next`` asks,
      at each k step, for the cache line ``b_next`` elements past the start of
      B's row ``p`` (a line of the next column of tiles, which the caller spreads
      over a column's tiles): B's rows lie a page or more apart, beyond the reach
      of the hardware prefetchers, and are read from memory once, by the first
      tile of their column.  ``b_next = 0`` asks for nothing new.
    * ``*_EDGE``: two trailing arguments ``rows, cols``: only ``C[:rows, :cols]`` is
      read and written (rows skipped, columns masked) and the bias is read only
      there; the kernel still reads full panels of A and B.
    * ``TAPS``: a sum of ``ntaps`` products in one tile, for convolution taps: the
      packed A panel at ``a_off + t*a_tap`` times the ``kc`` rows of B at ``b_off +
      taps[t] + p*ldb``; the accumulators stay in registers across taps, C is
      updated once.  ``sched`` (``ntaps + 2`` integers) masks the taps.  Where
      ``sched[t] >= 0``, the B rows of tap ``t`` are read with the NR lanes at
      ``masks[mask_off + sched[t]:]`` (integers of the float's width, each lane 0 or
      -1) as a load mask: lanes off read as zero and their memory is never touched;
      taps with ``sched[t] < 0`` run unmasked.  The sum of the first
      ``sched[ntaps]`` taps is then ANDed with the lanes at ``masks[mask_off +
      sched[ntaps + 1]:]``: a cheaper mask for taps whose every read stays in
      memory.  Only for finite weights: zero padding times an infinite weight is
      NaN, which a masked load gives and the AND would not.
    * ``ROWS``: a sum of ``ntaps`` products whose A rows are read in place, each
      from its own offset (channels-last convolution): the MR rows at ``a_off +
      offs[o_off + t*o_step + i]`` (``kc`` contiguous values each; a negative offset
      reads the first ``kc`` values of ``zeros`` instead: the padding) times the
      packed B panel at ``b_off + t*b_tap``.
    * ``ROWS_STRIDED``: as ``ROWS``, a row's ``kc`` values ``a_cs`` apart, in the
      image and in ``zeros`` alike (channels-first convolution).

    The value names the tile's LLVM function.
    """

    PACKED = "packed"
    STRIDED = "strided"
    EDGE = "packed_edge"
    STRIDED_EDGE = "strided_edge"
    ROWS = "rows"
    ROWS_EDGE = "rows_edge"
    ROWS_STRIDED = "rows_strided"
    ROWS_STRIDED_EDGE = "rows_strided_edge"
    TAPS = "taps"

    @property
    def edge(self):
        """Whether the flavour writes only ``C[:rows, :cols]``."""
        return self.value.endswith("_edge")


#: Argument kinds of the table below: an integer, the tile's float, an array.
INT, FLOAT, ARRAY = "intp", "float", "array"

_C_ARGS = "c[] c_off ldc alpha: beta: bias[] bias_off epi"
_ROWS_ARGS = "offs[] o_off o_step ntaps zeros[] b[] b_off b_tap"


def _arguments(spec):
    """``"kc a[] alpha:"`` -> ``(("kc", INT), ("a", ARRAY), ("alpha", FLOAT))``."""
    kinds = {"[]": ARRAY, ":": FLOAT}
    out = []
    for word in spec.split():
        suffix = word[-2:] if word.endswith("[]") else word[-1:] if word.endswith(":") else ""
        out.append((word[:len(word) - len(suffix)], kinds.get(suffix, INT)))
    return tuple(out)


#: Each flavour's arguments, in order, as (name, kind): the one statement of every
#: micro-kernel's signature, from which its typing function is built.
ARGUMENTS = {
    Flavour.PACKED: _arguments(f"kc a[] a_off b[] b_off {_C_ARGS}"),
    Flavour.STRIDED: _arguments(f"kc a[] a_off a_rs a_cs b[] b_off ldb {_C_ARGS} b_next"),
    Flavour.EDGE: _arguments(f"kc a[] a_off b[] b_off {_C_ARGS} rows cols"),
    Flavour.STRIDED_EDGE: _arguments(f"kc a[] a_off a_rs a_cs b[] b_off ldb {_C_ARGS} rows cols"),
    Flavour.ROWS: _arguments(f"kc a[] a_off {_ROWS_ARGS} {_C_ARGS}"),
    Flavour.ROWS_EDGE: _arguments(f"kc a[] a_off {_ROWS_ARGS} {_C_ARGS} rows cols"),
    Flavour.ROWS_STRIDED: _arguments(f"kc a[] a_off a_cs {_ROWS_ARGS} {_C_ARGS}"),
    Flavour.ROWS_STRIDED_EDGE: _arguments(f"kc a[] a_off a_cs {_ROWS_ARGS} {_C_ARGS} rows cols"),
    Flavour.TAPS: _arguments("kc a[] a_off a_tap b[] b_off ldb taps[] ntaps masks[] mask_off "
                             f"sched[] {_C_ARGS}"),
}


def constant_strides(flavour, mr, nr, a_step):
    """``(a_rs, a_cs, ldb)`` each flavour fixes at build time (None: an argument).

    Constants fold into the tile's addressing: a packed panel's rows are 1 apart and
    its k steps ``mr`` (A) or ``nr`` (B); the rows flavours read each A row from its
    own pointer (``a_rs`` 0) and packed B.
    """
    if flavour in (Flavour.PACKED, Flavour.EDGE):
        return 1, mr, nr
    if flavour in (Flavour.ROWS, Flavour.ROWS_EDGE):
        return 0, 1, nr
    if flavour in (Flavour.ROWS_STRIDED, Flavour.ROWS_STRIDED_EDGE):
        return 0, None, nr
    if flavour is Flavour.TAPS:
        return 1, a_step, None
    return None, None, None


#: One tile function: its symbol, LLVM type, body writer (``body(builder, fn)``), the
#: strides it fixes (:func:`constant_strides`) and its short name (flavour, A's step).
Tile = collections.namedtuple("Tile", "symbol fnty body strides name")


def tile_function(dtype_name, mr, nr, lanes, flavour, a_step):
    """The tile function of an ``mr x nr`` tile of ``dtype_name`` (see :func:`make_microkernel`).

    Plain values in, so that the helper process of :mod:`tilegemm.kernels.tilebuild`
    writes the same tile from the spec it is sent.
    """
    dtype = np.dtype(dtype_name).type
    flavour = Flavour(flavour)
    if nr % lanes:
        raise ValueError(f"NR={nr} is not a multiple of the vector width {lanes}")
    if a_step is not None and (flavour is not Flavour.TAPS or a_step < mr):
        raise ValueError(f"a_step={a_step} needs the taps flavour and at least mr={mr} rows")
    a_step = mr if a_step is None else a_step
    shape = (dtype, mr, nr, lanes)
    name = flavour.value + (f"_a{a_step}" if a_step != mr else "")  # A's stride is in the body
    strides = constant_strides(flavour, mr, nr, a_step)

    def body(builder, fn):
        _define_tile(builder, fn, shape, flavour, strides)

    return Tile(f"tilegemm_{np.dtype(dtype).name}_tile_{mr}x{nr}_l{lanes}_{name}",
                _tile_type(dtype, flavour), body, strides, name)


def make_microkernel(dtype, mr, nr, lanes, flavour=Flavour.PACKED, a_step=None):
    """Build the intrinsic for an ``mr x nr`` tile of ``dtype`` with ``lanes``-wide vectors.

    Parameters
    ----------
    dtype : numpy.float32 or numpy.float64
    mr, nr : int
        Register tile; ``nr`` must be a multiple of ``lanes``.
    lanes : int
        Elements per vector register.
    flavour : Flavour
        How A and B are read and how much of C is written; its arguments are
        ``ARGUMENTS[flavour]`` (see :class:`Flavour`).
    a_step : int, optional
        ``TAPS`` only: A's packed panels hold ``a_step`` values per k (default
        ``mr``), so a kernel of fewer rows can run the first ``mr`` rows of panels
        packed for a taller one (the last, partial row panel of C).

    Returns
    -------
    numba intrinsic, callable from jitted code only.
    """
    dtype = np.dtype(dtype).type
    flavour = Flavour(flavour)
    spec = (np.dtype(dtype).name, mr, nr, lanes, flavour.value, a_step)
    tile = tile_function(*spec)
    strides, name = tile.strides, tile.name
    names = [n for n, _ in ARGUMENTS[flavour]]
    # Registered now if cached (a caller loaded from Numba's cache needs it), else
    # compiled by the helper process while the first caller is (see tilelib).
    tilelib.prefetch(tile.symbol, ("tile",) + spec)

    def emit(context, builder, sig, args):
        arg = dict(zip(names, args))
        arg_type = dict(zip(names, sig.args))
        intp = context.get_value_type(types.intp)

        def ptr(array, offset=None):
            at = arg[offset] if offset else ir.Constant(intp, 0)
            return data_ptr(context, builder, arg_type[array], arg[array], at)

        a_rs, a_cs, ldb = (arg.get(n) if s is None else ir.Constant(intp, s)
                           for n, s in zip(("a_rs", "a_cs", "ldb"), strides))
        extra = ()
        if flavour is Flavour.TAPS:
            extra = (arg["ntaps"], arg["a_tap"], ptr("taps"), ptr("masks", "mask_off"),
                     ptr("sched"))
        elif flavour is Flavour.STRIDED:
            extra = (arg["b_next"],)
        elif "offs" in arg:
            extra = (arg["ntaps"], ptr("offs", "o_off"), arg["o_step"], ptr("zeros"), arg["b_tap"])
        valid = (arg["rows"], arg["cols"]) if flavour.edge else ()
        args = TileArgs(arg["kc"], ptr("a", "a_off"), a_rs, a_cs, ptr("b", "b_off"), ldb,
                        ptr("c", "c_off"), arg["ldc"], arg["alpha"], arg["beta"],
                        ptr("bias", "bias_off"), arg["epi"])
        tilelib.call(builder, tile, list(args) + list(valid) + list(extra))
        return context.get_dummy_value()

    ukernel = intrinsic(_typing(flavour, dtype, emit))
    ukernel.__name__ = f"{np.dtype(dtype).char}_ukernel_{mr}x{nr}_{name}"
    return ukernel


def _typing(flavour, dtype, emit):
    """The intrinsic's typing function, its parameters spelled out from ``ARGUMENTS``.

    Numba reads an intrinsic's parameter names from the typing function's Python
    signature (to bind a call's arguments), so the generic ``*args`` function below
    carries the table's names as its ``__signature__``.
    """
    spec = ARGUMENTS[flavour]
    nb_float = NUMBA_FLOAT[dtype]
    kind_type = {INT: types.intp, FLOAT: nb_float}

    def typing(typingctx, *args):
        if len(args) != len(spec):
            raise TypeError(f"the {flavour.value} micro-kernel takes {len(spec)} arguments "
                            f"({', '.join(n for n, _ in spec)}), got {len(args)}")
        given = {n: t for (n, _), t in zip(spec, args)}
        if "offs" in given:
            _check_offsets(given["offs"], given["zeros"], given["a"])
        if "masks" in given:
            check_mask_width(given["masks"], dtype)
            _check_index_array("taps", given["taps"])
            _check_index_array("sched", given["sched"])
        return types.void(*(kind_type.get(kind, t) for (_, kind), t in zip(spec, args))), emit

    param = inspect.Parameter
    typing.__signature__ = inspect.Signature(
        [param(n, param.POSITIONAL_OR_KEYWORD) for n in ["typingctx"] + [n for n, _ in spec]])
    return typing


def _check_index_array(name, array):
    if not (isinstance(array, types.Array) and array.dtype == types.intp):
        raise TypeError(f"{name} must be an array of intp, got {array}")


def _check_offsets(offs, zeros, a):
    _check_index_array("row offsets", offs)
    if not (isinstance(zeros, types.Array) and zeros.dtype == a.dtype):
        raise TypeError(f"the zero row must be an array of {a.dtype}, got {zeros}")


#: The IR values every flavour's tile function takes first, in this order; the
#: edge flavours' ``(rows, cols)`` and the taps or rows flavour's own follow.
TileArgs = collections.namedtuple(
    "TileArgs", "kc a_ptr a_rs a_cs b_ptr ldb c_ptr ldc alpha beta bias_ptr epi")


def _tile_type(dtype, flavour):
    """The LLVM type of a flavour's tile function: the :class:`TileArgs`, then the
    edge flavours' ``(rows, cols)``, then the taps, rows or strided flavour's own
    arguments."""
    context = cpu_target.target_context
    intp = context.get_value_type(types.intp)
    fl = context.get_value_type(NUMBA_FLOAT[dtype])
    fp, ip = fl.as_pointer(), intp.as_pointer()
    params = [intp, fp, intp, intp, fp, intp, fp, intp, fl, fl, fp, intp]
    if flavour.edge:
        params += [intp, intp]
    if flavour is Flavour.TAPS:
        params += [intp, intp, ip, ir.IntType(8 * np.dtype(dtype).itemsize).as_pointer(), ip]
    elif "offs" in dict(ARGUMENTS[flavour]):
        params += [intp, ip, intp, fp, intp]
    elif flavour is Flavour.STRIDED:
        params += [intp]
    return ir.FunctionType(ir.VoidType(), params)


def _define_tile(builder, fn, shape, flavour, strides):
    """The tile function's body.  The strides the flavour fixes (``strides``, from
    :func:`constant_strides`) replace their parameters, so they fold in the body; the
    others stay parameters even where a call site passes a constant, since the one
    body serves every call site."""
    p = list(fn.args)
    for at, fixed in zip((2, 3, 5), strides):
        if fixed is not None:
            p[at] = ir.Constant(p[at].type, fixed)
    n = len(TileArgs._fields)
    n_valid = 2 if flavour.edge else 0
    tail = tuple(p[n + n_valid:]) or None
    _emit_tile(cpu_target.target_context, builder, shape, TileArgs(*p[:n]),
               valid=tuple(p[n:n + n_valid]) or None,
               taps=tail if flavour is Flavour.TAPS else None,
               rows=tail if flavour not in (Flavour.TAPS, Flavour.STRIDED) else None,
               b_next=tail[0] if flavour is Flavour.STRIDED else None)
    builder.ret_void()


def _emit_tile(context, builder, shape, args, valid=None, taps=None, rows=None, b_next=None):
    """The body shared by every kernel flavour: prefetch C, the k loop, the C update.

    ``args``: the tile function's :class:`TileArgs` (the strides a flavour fixes
    already constants).  ``valid = (rows, cols)`` limits every access to C and the bias to that corner.
    ``taps = (ntaps, a_tap, tap_ptr, mask_ptr, sched_ptr)`` repeats the k loop once per
    tap, masked or not; ``rows = (ntaps, offs_ptr, o_step, zeros_ptr, b_tap)`` once per tap
    with A's rows at their own offsets (see :class:`Flavour`).  ``b_next``: the
    strided flavour's prefetch offset.
    """
    tile = _Tile(context, builder, shape, args.kc, args.a_rs, args.a_cs, args.ldb, b_next)
    tile.prefetch_c(args.c_ptr, args.ldc)
    if rows is not None:
        tile.row_taps(args.a_ptr, args.b_ptr, *rows)
    elif taps is None:
        tile.k_loop(tile.a_rows_at(args.a_ptr), args.b_ptr)
    else:
        tile.masked_taps(args.a_ptr, args.b_ptr, *taps)
    tile.add_sets()
    tile.update_c(args.c_ptr, args.ldc, args.alpha, args.beta, args.bias_ptr, args.epi, valid)


class _Tile:
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
                            self.store_fused(store, read_c, fast, FAST_EPILOGUES)

    def store_fused(self, store, read_c, fast, cases):
        """The epilogue's variants: each of ``cases`` (epilogue flags) in code of its own
        when ``fast`` (alpha is 1), the general one (flags tested per vector) otherwise."""
        builder, epi = self.builder, store[5]
        if not cases:
            self.store_tile(*store, read_c=read_c, fused=True)
            return
        hit = builder.and_(fast, builder.icmp_signed("==", epi, ir.Constant(epi.type, cases[0])))
        with builder.if_else(hit) as (then, otherwise):
            with then:
                self.store_tile(*store, read_c=read_c, fused=cases[0])
            with otherwise:
                self.store_fused(store, read_c, fast, cases[1:])

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
