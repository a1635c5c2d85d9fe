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
from numba.core.registry import cpu_target
from numba.extending import intrinsic

from tilegemm.kernels import tilelib
from tilegemm.kernels.ir import NUMBA_FLOAT, check_mask_width, data_ptr
from tilegemm.kernels.tilebody import FMA_CHAINS, UNROLL, emit_panels, emit_tile  # noqa: F401


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
    * ``ROWS_PANELS``: ``panels`` full ``ROWS`` tiles one under the other in one
      call, panel ``q``'s offsets at ``o_off + q*o_panel`` and its C at ``c_off +
      q*MR*ldc``: a layer of short k loops (a 1x1 layer of few channels) pays the
      call, the argument set-up and the pixel loop's control once per run of
      panels instead of once per tile.

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
    ROWS_PANELS = "rows_panels"
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
    Flavour.ROWS_PANELS: _arguments(f"kc a[] a_off {_ROWS_ARGS} {_C_ARGS} panels o_panel"),
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
    if flavour in (Flavour.ROWS, Flavour.ROWS_EDGE, Flavour.ROWS_PANELS):
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
            if flavour is Flavour.ROWS_PANELS:
                extra += (arg["panels"], arg["o_panel"])
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
        if flavour is Flavour.ROWS_PANELS:
            params += [intp, intp]
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
    args = TileArgs(*p[:n])
    if flavour is Flavour.ROWS_PANELS:
        emit_panels(cpu_target.target_context, builder, shape, args, tail[:5], tail[5:])
    else:
        emit_tile(cpu_target.target_context, builder, shape, args,
                   valid=tuple(p[n:n + n_valid]) or None,
                   taps=tail if flavour is Flavour.TAPS else None,
                   rows=tail if flavour not in (Flavour.TAPS, Flavour.STRIDED) else None,
                   b_next=tail[0] if flavour is Flavour.STRIDED else None)
    builder.ret_void()


