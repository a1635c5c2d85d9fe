"""Input checks shared by the public faces (:mod:`tilegemm.api`, :mod:`tilegemm.conv.api`).

Every function takes the public function's name (``func``) and the argument's
name (``name``) and raises ``TypeError`` or ``ValueError`` with a message that
starts ``"{func}: "``, so users see the function they called.  Imports only
numpy and the standard library.
"""
import collections
import functools
import math
import numbers

import numpy as np

#: The dtypes tilegemm computes in.
FLOAT_DTYPES = (np.dtype(np.float32), np.dtype(np.float64))


# --------------------------------------------------------------------------- arrays

def check_float_dtype(x, name, func):
    """``x`` when its dtype is float32 or float64; in the machine's byte order, a copy if not.

    Byte-swapped input (``>f4`` on a little-endian machine, e.g. read from a file)
    is converted, never refused and never misread: the kernels load native values.

    Raises
    ------
    TypeError
        For any other dtype, saying how to cast.
    """
    if x.dtype not in FLOAT_DTYPES:
        if x.dtype.kind == "f" and not x.dtype.isnative and x.dtype.newbyteorder("=") in FLOAT_DTYPES:
            return x.astype(x.dtype.newbyteorder("="))
        raise TypeError(f"{func}: {name} has dtype {x.dtype}; tilegemm computes in float32 and "
                        "float64 only (cast with .astype(np.float32) or np.float64)")
    return x


def refuse_masked(x, name, func):
    """Return ``x`` unless it is a masked array (whose mask would be silently ignored).

    Raises
    ------
    TypeError
        For a ``numpy.ma.MaskedArray``.
    """
    if isinstance(x, np.ma.MaskedArray):
        raise TypeError(f"{func}: {name} is a masked array; pass .filled(value) or .data")
    return x


def as_array(x, name, func):
    """``x`` itself when it is an ndarray (subclasses included), else ``numpy.asarray(x)``.

    Raises
    ------
    TypeError
        When numpy cannot make an array of ``x`` (e.g. a ragged list).
    """
    if isinstance(x, np.ndarray):
        return x
    try:
        return np.asarray(x)
    except (TypeError, ValueError) as e:
        raise TypeError(f"{func}: {name} is not array-like ({e})") from None


def float_array(x, name, func):
    """:func:`as_array` then :func:`check_float_dtype`: an array of float32 or float64.

    ndarray subclasses are returned as they are, anything else is converted.
    """
    return check_float_dtype(as_array(x, name, func), name, func)


def plain_float_array(x, name, func):
    """A plain ndarray of float32 or float64: masked arrays refused, other subclasses
    (``np.matrix``) seen as plain arrays (a view) so that their operators do not apply.
    """
    x = np.asarray(refuse_masked(x, name, func))
    return check_float_dtype(x, name, func)


# --------------------------------------------------------------------------- matmul shapes

#: numpy.matmul's view of two operands (:func:`matmul_shapes`).
MatmulShapes = collections.namedtuple("MatmulShapes", "a2 b2 m k n batch shape out_shape")


def matmul_shapes(a, b, func):
    """numpy.matmul's shape rules for ``a @ b``: 1-D operands promoted (``a2``, ``b2``),
    the broadcast batch, the full result ``shape`` and the ``out_shape`` with the
    promoted axes removed.

    Raises
    ------
    ValueError
        0-d operands, mismatched inner dimensions, batch shapes that do not broadcast.
    """
    if a.ndim == 0 or b.ndim == 0:
        raise ValueError(f"{func}: operands must be at least 1-D, got shapes {a.shape} and {b.shape}")
    a2 = a[np.newaxis, :] if a.ndim == 1 else a
    b2 = b[:, np.newaxis] if b.ndim == 1 else b
    (m, k), (k2, n) = a2.shape[-2:], b2.shape[-2:]
    if k != k2:
        raise ValueError(f"{func}: shapes {a.shape} and {b.shape} are not aligned: "
                         f"{k} (last dim of a) != {k2} (dim -2 of b)")
    try:
        batch = np.broadcast_shapes(a2.shape[:-2], b2.shape[:-2])
    except ValueError:
        raise ValueError(f"{func}: batch dimensions of shapes {a.shape} and {b.shape} "
                         "do not broadcast") from None
    shape = batch + (m, n)
    squeeze = ((-2,) if a.ndim == 1 else ()) + ((-1,) if b.ndim == 1 else ())
    out_shape = tuple(d for i, d in enumerate(shape) if i - len(shape) not in squeeze)
    return MatmulShapes(a2, b2, m, k, n, batch, shape, out_shape)


# --------------------------------------------------------------------------- destinations

def check_out(out, shape, dtype, func, name="out"):
    """Validate a destination array; returns it as a plain ndarray view (writes land in it).

    Parameters
    ----------
    out : object
        The destination the caller passed.
    shape : tuple of int
        The result's exact shape.
    dtype : numpy.dtype
        The result's exact dtype.
    func, name : str
        For the messages.

    Raises
    ------
    TypeError
        ``out`` is not an ndarray (or is a masked array), or has another dtype.
    ValueError
        ``out`` has another shape or is read-only.
    """
    if not isinstance(out, np.ndarray) or isinstance(out, np.ma.MaskedArray):
        raise TypeError(f"{func}: {name} must be a numpy.ndarray, got {type(out).__name__}")
    if out.shape != tuple(shape):
        raise ValueError(f"{func}: {name} has shape {out.shape}, expected {tuple(shape)}")
    if out.dtype != dtype:
        swapped = out.dtype.kind == "f" and out.dtype.newbyteorder("=") == dtype
        raise TypeError(f"{func}: {name} has dtype {out.dtype}, expected {dtype}"
                        + (" in the machine's byte order" if swapped else ""))
    if not out.flags.writeable:
        raise ValueError(f"{func}: {name} is read-only")
    return out.view(np.ndarray)


def overlaps(out, *inputs):
    """Whether ``out`` may share memory with any of ``inputs`` (then compute into a temporary)."""
    return any(np.may_share_memory(out, x) for x in inputs)


# --------------------------------------------------------------------------- scalars

def check_choice(value, choices, name, func):
    """Require ``value`` to be one of ``choices`` (strings, or None when listed).

    Raises
    ------
    ValueError
        Naming the choices.
    """
    if not (value is None or isinstance(value, str)) or value not in choices:
        raise ValueError(f"{func}: unknown {name} {value!r}; expected one of "
                         + ", ".join(repr(c) for c in choices))


def real_scalar(x, name, func, dtype=None):
    """A real number (bools refused) as a Python float.

    With ``dtype``, a finite value must stay finite when cast to it.

    Raises
    ------
    TypeError
        ``x`` is not a real number, or is a bool.
    ValueError
        ``x`` is too large for ``dtype``.
    """
    # Python floats first: the common case skips the abstract-class check, and
    # only a value past the dtype's largest finite one pays for a numpy cast.
    if type(x) is not float and (isinstance(x, (bool, np.bool_))
                                 or not isinstance(x, numbers.Real)):
        raise TypeError(f"{func}: {name} must be a real number, got {type(x).__name__}")
    try:
        value = float(x)
    except OverflowError:
        limit = "a float" if dtype is None else dtype
        raise ValueError(f"{func}: {name}={x} is too large for {limit}") from None
    if dtype is not None and math.isfinite(value) and abs(value) > _largest(dtype):
        with np.errstate(over="ignore"):          # the error below says it
            overflows = not np.isfinite(dtype.type(value))
        if overflows:
            raise ValueError(f"{func}: {name}={x} is too large for {dtype}")
    return value


@functools.lru_cache(maxsize=None)
def _largest(dtype):
    """The largest finite value of a float ``dtype``, as a Python float (values up
    to half an ulp past it still round to it)."""
    return float(np.finfo(dtype).max)


def check_flag(x, name, func):
    """A real boolean (``True``/``False`` or a numpy bool) as ``bool``.

    Raises
    ------
    TypeError
        For anything else, BLAS-style ``'N'``/``'T'`` strings included.
    """
    if not isinstance(x, (bool, np.bool_)):
        raise TypeError(f"{func}: {name} must be True or False, got {x!r} "
                        "(BLAS-style 'N'/'T' strings are not accepted)")
    return bool(x)


def check_threads(threads, func, name="threads"):
    """A thread count: None (the default), or an int of at least 1.

    Raises
    ------
    TypeError
        Not an int (bools refused).
    ValueError
        Below 1.
    """
    if threads is None:
        return None
    if isinstance(threads, (bool, np.bool_)) or not isinstance(threads, numbers.Integral):
        raise TypeError(f"{func}: {name} must be an int, got {threads!r}")
    if threads < 1:
        raise ValueError(f"{func}: {name} must be at least 1, got {threads}")
    return int(threads)
