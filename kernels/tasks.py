"""Task loops shared by threads as native shares: no pool thread takes the GIL.

:func:`launch_tasks` runs ``task(counter, *args_of(t))`` on each of ``threads``
threads, the jitted task loops taking their tasks from ``counter``
(``next_task``).  Handed to a pool thread as a Python call, a share costs that
thread the GIL to start and to finish, while the caller holds it or wants it
back: a two-thread launch of an empty task took 8.5 us at best and 28 us in the
median on the 2-vCPU AVX-512 Xeon, against a layer of a small network's 30-100.
Here each thread's arguments go into a row of int64 slots (:mod:`tilegemm.kernels.native`)
and a pool thread runs them through a C function, never touching Python.

The writer of a row and its reader, a C function calling the task, are generated
from the arguments' Numba types, once per task and argument types (a module of
their own, cached like the kernels').  Arguments a row cannot carry (arrays not
C-contiguous, objects) leave the launch to Python shares (:func:`~tilegemm.kernels.pool.launch`).
"""
import hashlib
import inspect
import sys
import threading

import numba
import numpy as np
from numba import types
from numba._dispatcher import compute_fingerprint

from tilegemm.ground import loader
from tilegemm.ground.contracts import c_entry
from tilegemm.ground.workspace import share_blocks
from tilegemm.kernels import tilelib
from tilegemm.kernels.native import SHARE
from tilegemm.kernels.pool import launch, run_native_shares

#: ``(task, fingerprint of its arguments) -> (writer, address, slots)``, or None where
#: the arguments do not fit a row.
_NATIVE = {}
_lock = threading.Lock()


def launch_tasks(task, args_of, threads):
    """``task(counter, *args_of(t))`` for ``t`` in ``range(threads)``: the caller takes
    ``t = 0``, pool threads the rest, as native shares where every argument fits a
    row of slots, else as Python shares (:func:`~tilegemm.kernels.pool.launch`).

    Parameters
    ----------
    task : numba dispatcher
        A jitted task loop whose first argument is the task counter.
    args_of : callable
        ``args_of(t)``: thread ``t``'s other arguments, a tuple.  Every array they
        name must stay alive until the call returns (the caller's frame holds them).
    threads : int

    Notes
    -----
    An exception raised by a task loop running as a native share cannot reach the
    caller (Numba's C wrapper prints it); the convolutions' task loops raise none.
    """
    if threads <= 1:
        task(np.zeros(1, np.int64), *args_of(0))
        return
    shares = [args_of(t) for t in range(threads)]
    native = _native_for(task, shares)
    if native is None:
        launch(lambda t, counter: task(counter, *shares[t]), threads)
        return
    writer, address, slots = native
    counter = np.zeros(1, np.int64)
    block, rows = share_blocks(("tasks", address), threads, slots)
    for t in range(threads):
        writer(block[t], counter, *shares[t])
    run_native_shares(address, rows)


def runs_native(task, args):
    """Whether :func:`launch_tasks` runs ``task`` with arguments typed as ``args`` (every
    thread's the same) as native shares."""
    return _native_for(task, [args]) is not None


def _native_for(task, shares):
    """The native ``(writer, address, slots)`` of ``task`` for every thread's arguments
    ``shares``, or None: a task that is not a Numba dispatcher (a test's wrapper),
    arguments of no Numba type or that do not fit a row, threads whose arguments
    differ in type."""
    if not hasattr(task, "py_func"):
        return None
    try:
        prints = [compute_fingerprint(s) for s in shares]
    except (TypeError, ValueError, NotImplementedError):
        return None
    if any(p != prints[0] for p in prints[1:]):
        return None
    key = (task, prints[0])
    if key not in _NATIVE:
        with _lock:
            if key not in _NATIVE:
                _NATIVE[key] = _native(task, shares[0])
    return _NATIVE[key]


def _native(task, args):
    """``(writer, address, slots)`` for ``task`` called with arguments typed as
    ``args``, or None where one of them cannot go into a row (or its reader does not
    compile)."""
    module, name = task.py_func.__module__, task.py_func.__name__
    if getattr(sys.modules.get(module), name, None) is not task:
        return None                     # the module's own name must give this task
    try:
        dtypes = []
        kinds = [numba.typeof(a) for a in args]
        writes, reads, slots = _code(kinds, [f"a{i}" for i in range(len(args))], 2, dtypes)
        # The reader's cached code holds the task's: the module's name changes with
        # the task's source file and the engine's sources.
        source = loader.digest([inspect.getsourcefile(task.py_func)]) + tilelib.engine_digest()
        text = _TEMPLATE.format(
            module=module, name=name, source=source, slots=slots,
            params=", ".join(f"a{i}" for i in range(len(args))),
            dtypes="".join(f"D{i} = np.dtype({d!r})\n" for i, d in enumerate(dtypes)),
            writes="\n".join("    " + w for w in writes) or "    pass", reads=", ".join(reads))
        digest = hashlib.sha1(text.encode()).hexdigest()[:16]
        mod = loader.load_generated(f"tasks_{name}_{digest}", text)
        return mod.writer, c_entry(mod.reader, SHARE), slots
    except Exception:                   # noqa: BLE001 -- no type, no slots, no compile
        return None


_TEMPLATE = '''# Generated by tilegemm.kernels.tasks; do not edit.  Task source {source}.
import sys

import numba
import numpy as np

from tilegemm.ground.contracts import CACHE, jit
from tilegemm.kernels.native import array_at, bits_of, float_bits, put_array

task = getattr(sys.modules[{module!r}], {name!r})
SLOTS = {slots}
{dtypes}

@numba.njit(nogil=True, cache=CACHE)
def writer(v, counter, {params}):
    put_array(v, 0, counter)
{writes}


def _reader(block):
    v = numba.carray(block, SLOTS)
    task(array_at(v, 0, np.int64), {reads})


reader = jit(_reader)
'''


def _code(kinds, names, at, dtypes):
    """``(writes, reads, next slot)``: the statements that put the values ``names`` of
    Numba types ``kinds`` into slots from ``at`` on, and the expressions that read them
    back; record dtypes go into ``dtypes`` (their descriptions), read as ``D<i>``.
    TypeError for a type a row cannot carry."""
    writes, reads = [], []
    for kind, name in zip(kinds, names):
        if isinstance(kind, types.Array):
            if kind.layout != "C" or kind.ndim < 1:
                raise TypeError(f"no slots for {kind}")
            dtype = np.dtype(numba.np.numpy_support.as_dtype(kind.dtype))
            if dtype.names is not None:
                dtypes.append(dtype.descr)
                dtype_expr = f"D{len(dtypes) - 1}"
            elif dtype.kind in "biuf":
                dtype_expr = f"np.{dtype.name}"
            else:
                raise TypeError(f"no slots for {kind}")
            writes.append(f"put_array(v, {at}, {name}.reshape(-1))")
            expr = f"array_at(v, {at}, {dtype_expr})"
            at += 2
            if kind.ndim > 1:
                writes += [f"v[{at + d}] = {name}.shape[{d}]" for d in range(kind.ndim)]
                expr += ".reshape((" + "".join(f"v[{at + d}], " for d in range(kind.ndim)) + "))"
                at += kind.ndim
            reads.append(expr)
        elif isinstance(kind, types.Boolean):
            writes.append(f"v[{at}] = 1 if {name} else 0")
            reads.append(f"v[{at}] != 0")
            at += 1
        elif isinstance(kind, types.Integer):
            writes.append(f"v[{at}] = {name}")
            reads.append(f"np.{kind.name}(v[{at}])")
            at += 1
        elif isinstance(kind, types.Float):
            writes.append(f"v[{at}] = bits_of(np.float64({name}))")
            reads.append(f"np.{kind.name}(float_bits(v[{at}]))")
            at += 1
        elif isinstance(kind, types.NoneType):
            reads.append("None")
        elif isinstance(kind, (types.UniTuple, types.Tuple)):
            inner = list(kind.types)
            w, r, at = _code(inner, [f"{name}[{i}]" for i in range(len(inner))], at, dtypes)
            writes += w
            reads.append("(" + "".join(x + ", " for x in r) + ")")
        else:
            raise TypeError(f"no slots for {kind}")
    return writes, reads, at
