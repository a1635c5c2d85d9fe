"""Contracts shared by every component: JIT options, epilogue codes, integer helpers.

Fast-math is opted into flag by flag. ``nnan`` and ``ninf`` are deliberately
absent: with them LLVM may assume no NaN/Inf exists and NaN would stop
propagating the way it does in numpy.  ``contract`` lets a*b+c fuse into an
FMA, ``reassoc`` lets reductions be vectorised.
"""
import os

from numba import types
from numba.extending import lower_builtin, overload, type_callable

from tilegemm.ground.linking import LinkedDispatcher

#: Fast-math flags applied to jitted loops (never nnan / ninf).
FASTMATH = {"contract", "reassoc", "nsz", "arcp", "afn"}

#: Disable Numba's on-disk cache with TILEGEMM_NO_CACHE=1 (useful when timing compiles).
CACHE = os.environ.get("TILEGEMM_NO_CACHE", "0") != "1"

#: Options for serial jitted functions.
JIT = dict(nogil=True, cache=CACHE, fastmath=FASTMATH)


class _InnerDispatcher(LinkedDispatcher):
    """A jitted function compiled without the wrappers that let Python call it,
    called from jitted code by its symbol (:mod:`tilegemm.ground.linking`)."""

    by_symbol = True

    def __call__(self, *args, **kwargs):
        # Without its CPython wrapper the compiled entry point is not callable from
        # Python: raise instead of jumping to it.
        raise TypeError(f"{self.py_func.__qualname__} runs inside jitted code only; "
                        "call it from a jitted function")


def inner_jit(fn):
    """``numba.njit(**JIT)`` for a function that only other jitted functions call.

    Numba gives every jitted function a CPython and a C wrapper and compiles them
    with it, cold, whether or not anything outside jitted code calls it; without them
    a layer's first call compiles a tenth to a third of a second sooner.  Calling the
    function from Python raises TypeError.  Callers made by ``inner_jit`` or
    :func:`jit` call it by its symbol instead of compiling its code again
    (:mod:`tilegemm.ground.linking`).
    """
    return _dispatcher(_InnerDispatcher, fn, no_cpython_wrapper=True, no_cfunc_wrapper=True)


def jit(fn):
    """``numba.njit(**JIT)`` whose calls to :func:`inner_jit` functions go by symbol
    (:mod:`tilegemm.ground.linking`): the callees' code is not compiled again inside it."""
    return _dispatcher(LinkedDispatcher, fn)


def c_entry(dispatcher, signature):
    """Address of the C function that runs ``dispatcher`` compiled for ``signature``
    (``numba.cfunc``'s, without linking the code of the callees it calls by symbol:
    made by :func:`jit`, the function declares them instead, see :func:`inner_jit`)."""
    dispatcher.compile(signature.args)
    cres = dispatcher.overloads[tuple(signature.args)]
    return cres.library.get_pointer_to_function(cres.fndesc.llvm_cfunc_wrapper_name)


def _dispatcher(cls, fn, **options):
    options = dict(JIT, nopython=True, **options)
    cache = options.pop("cache")
    dispatcher = cls(py_func=fn, locals={}, targetoptions=options)
    if cache:
        dispatcher.enable_caching()
    return dispatcher


# Fused epilogue codes, OR-ed into one ``epi`` integer: the micro-kernels, the
# packers' output transforms and the direct kernels all read the same bits.
#: Add ``bias[row]`` (one value per output row, e.g. a conv's output channel in NCHW).
EPI_BIAS_ROW = 1
#: Add ``bias[col]`` (one value per output column, e.g. NHWC or ``gemm(bias=...)``).
EPI_BIAS_COL = 2
#: Then clamp below at zero.
EPI_RELU = 4
#: Then clamp to [0, 6].
EPI_RELU6 = 8
#: Add what the output already holds (a residual) before the activation: beta = 1 for
#: the kernels that write their output in a transform (Winograd's) rather than a GEMM.
EPI_ACCUMULATE = 16


def cdiv(a, b):
    """Ceiling of ``a / b`` for non-negative ``a`` and positive ``b``."""
    return -(-a // b)


def round_up(a, m):
    """``a`` rounded up to a multiple of ``m`` (``m`` > 0)."""
    return -(-a // m) * m


# The same two functions inside jitted code (plain Python calls stay dispatcher-free).
@overload(cdiv, inline="always")
def _cdiv_jit(a, b):
    return lambda a, b: -(-a // b)


@overload(round_up, inline="always")
def _round_up_jit(a, m):
    return lambda a, m: -(-a // m) * m


def imin(a, b):
    """``min(a, b)`` of two integers; inside jitted code one compare and select.

    Numba's ``min`` and ``max`` are overloads compiled once per process and
    signature (0.02-0.05 s each, a tenth of a second of a first call); these lower
    straight to LLVM.
    """
    return a if a <= b else b


def imax(a, b):
    """``max(a, b)`` of two integers (see :func:`imin`)."""
    return a if a >= b else b


def _type_pick(context):
    def typer(a, b):
        if isinstance(a, types.Integer) and isinstance(b, types.Integer):
            unified = context.unify_types(a, b)
            if isinstance(unified, types.Integer):
                return unified
    return typer


def _lower_pick(keep):
    def lower(context, builder, sig, args):
        ty = sig.return_type
        a, b = (context.cast(builder, v, t, ty) for v, t in zip(args, sig.args))
        compare = builder.icmp_signed if ty.signed else builder.icmp_unsigned
        return builder.select(compare(keep, a, b), a, b)
    return lower


for _pick, _keep in ((imin, "<="), (imax, ">=")):
    type_callable(_pick)(_type_pick)
    lower_builtin(_pick, types.Integer, types.Integer)(_lower_pick(_keep))
