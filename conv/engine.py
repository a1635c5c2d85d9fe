"""Running convolutions on the GEMM engine: compiled drivers, buffers, prepared weights, threads.

* :func:`family_module` -- the compiled drivers of one family (im2col, rows, taps,
  planes, Winograd, direct), written from ``conv/_tile_<family>.py`` on first use:
  per GEMM kernel for the families that run its micro-kernel, per (dtype, ISA)
  for the direct family, so a layer compiles only what it runs.
  Each template has a configuration block that the engine fills in (MR and NR
  become compile-time constants and Numba caches the machine code per module) and
  a ``SOURCE_HASH``, a digest of the sources the code inlines, so a change in any
  of them writes a new module.  Each driver is a *task* function over disjoint
  pieces of the output; ``*_tasks`` runs tasks taken one at a time from a counter
  shared by the Python threads of a call (``next_task``), each thread with its own
  buffers (the code releases the GIL); the packed weights are prepared once by
  the caller and shared read-only.
* :func:`prepared` -- a small cache of weights already transformed and packed, keyed
  on the weight array and checked against a copy of its contents, so repeated
  calls with the same weights skip the work and weights changed in place are
  never served stale.
* ``thread_buffers`` (:mod:`tilegemm.ground.workspace`) -- per-thread scratch, reused;
  ``launch_tasks`` (:mod:`tilegemm.kernels.tasks`) -- a task loop on one or several threads.
"""
import collections
import os
import threading
import weakref

import numpy as np

from tilegemm.ground import loader
from tilegemm.ground.contracts import cdiv, jit, round_up
from tilegemm.ground.threads import get_num_threads
from tilegemm.ground.workspace import thread_buffers  # noqa: F401 (the paths' scratch)
from tilegemm.kernels import tilelib
from tilegemm.kernels.tiles import derived_tile, kernel_for
from tilegemm.kernels.pool import run_shares
from tilegemm.kernels.tasks import launch_tasks  # noqa: F401 (the paths' task loops on threads)
from tilegemm.kernels.registry import get_kernel, lanes_of
from tilegemm.tuning.blocking import register_tiles
from tilegemm.tuning.machine import detect

_HERE = os.path.dirname(os.path.abspath(__file__))


def gemm_kernel(dtype, columns=None):
    """(kernel, blocking) the GEMM engine uses for ``dtype`` (for a product of fewer
    ``columns`` than its widest tile's NR, a narrower tile)."""
    return kernel_for(np.dtype(dtype), columns)


#: Another tile replaces the GEMM's for a layer only when it is expected this much
#: faster (:func:`filling_kernel`): each tile shape is a module of its own to compile.
FILL_GAIN = 1.2
#: Fewest rows of such a tile: four rows give the FMA units enough independent sums
#: (a 4x24 AVX2 tile: 12 chains, 7 loads a k step for 12 FMAs).
FILL_MIN_MR = 4


def filling_kernel(dtype, columns):
    """The GEMM kernel for a tile loop over ``columns`` output columns: the GEMM's own,
    or the register tile of the same register file expected fastest on them (lanes
    used, times FMAs over loads a k step: a 4x24 AVX2 tile runs 24 channels whole
    where 6x16 runs 16 and then 8 in a half-empty tile) when that is :data:`FILL_GAIN`
    faster.  Only where the GEMM's tile was derived, not set by
    ``TILEGEMM_MR``/``TILEGEMM_NR``."""
    kernel, blk = gemm_kernel(dtype)
    key = (kernel.name, columns)
    chosen = _filling.get(key)
    if chosen is None:
        chosen = _filling[key] = _filling_tile(kernel, blk, columns)
    return chosen


_filling = {}


def _filling_tile(kernel, blk, columns):
    if not derived_tile(blk) or columns <= 0:
        return kernel

    def speed(tile):
        # Lanes used, times the tile's FMAs over its k step's issue slots (as many
        # FMAs as loads a cycle: a tall narrow tile's broadcasts outnumber its FMAs).
        mr, nr = tile
        fmas, loads = mr * nr // blk.lanes, mr + nr // blk.lanes
        return columns / round_up(columns, nr) * fmas / max(fmas, loads)
    best = max((t for t in register_tiles(detect().vector_registers, blk.lanes)
                if t[0] >= FILL_MIN_MR), key=speed)
    if speed(best) < FILL_GAIN * speed((kernel.mr, kernel.nr)):
        return kernel
    return get_kernel(kernel.dtype, best[0], best[1], kernel.isa)


#: The machine facts that decide which path serves a layer: the vector width in
#: elements, the GEMM register tile, and the per-core caches.  Routing functions
#: take one explicitly (tests pass made-up machines); :func:`host_target` is the host's.
Target = collections.namedtuple("Target", "lanes mr nr l1d_bytes l2_bytes")


_targets = {}


def host_target(dtype):
    """The :data:`Target` of this machine for ``dtype`` (as detected or overridden).

    Kept per GEMM kernel (a new plan, e.g. after ``TILEGEMM_NR`` changed, names
    another): every conv2d call routes through it."""
    kernel, _ = gemm_kernel(dtype)
    target = _targets.get(kernel.name)
    if target is None:
        machine = detect()
        target = _targets[kernel.name] = Target(kernel.lanes, kernel.mr, kernel.nr,
                                                machine.l1d_bytes, machine.l2_bytes)
    return target


#: Names a plan's record gives :meth:`ConvParams.geom`'s values and the strides.
GEOM = ("H", "W", "Ho", "Wo", "kh", "kw", "sy", "sx", "py", "px", "dy", "dx")
STRIDES = ("xs_n", "xs_c", "xs_h", "xs_w", "os_n", "os_k", "os_h", "os_w")


def record(p=None, **numbers):
    """A plan's numbers as one read-only record (a one-element structured array of int64).

    A task loop takes the plan whole as this one argument and reads ``plan[0].name``:
    Numba types it from its dtype at C speed, where a namedtuple would cost a
    Python-level look at every field on every call.  Built once per plan (cached).
    With :class:`ConvParams` ``p``, the record also holds its geometry (:data:`GEOM`)
    and the input and output strides (:data:`STRIDES`).
    """
    if p is not None:
        numbers.update(zip(GEOM, p.geom()))
        numbers.update(zip(STRIDES, p.input_strides() + p.output_strides()))
    rec = np.zeros(1, np.dtype([(name, np.int64) for name in numbers]))
    for name, value in numbers.items():
        rec[0][name] = value
    rec.flags.writeable = False
    return rec


def balanced_kc(k, kc_max):
    """KC no larger than ``kc_max`` that cuts ``k`` into equal blocks (no runt last block)."""
    return cdiv(k, cdiv(k, kc_max))


# --- generated drivers, one template per family ---------------------------------------

#: Families written per GEMM kernel (MR, NR, ISA): they run its micro-kernel.
GEMM_FAMILIES = ("im2col", "rows", "taps", "planes", "winograd")
#: Families written per (dtype, ISA): ``shared`` (copies several families call) and
#: ``direct`` (direct and depthwise convolution, no micro-kernel).
ISA_FAMILIES = ("shared", "direct")
#: Families whose template takes an output tile size (``TILE``), and its default.
TILED_FAMILIES = {"winograd": 2}
#: The other templates (and conv modules) each family's template compiles in.
_INLINES = {"shared": (), "direct": ("_tile_shared.py",), "im2col": ("_tile_shared.py",),
            "rows": ("_tile_shared.py",), "winograd": (),
            "taps": ("_tile_shared.py", "taps.py"),
            "planes": ("_tile_shared.py", "_tile_taps.py", "taps.py")}
_KERNELS = os.path.join(os.path.dirname(_HERE), "kernels")
_GROUND = os.path.join(os.path.dirname(_HERE), "ground")


def _template(family):
    return os.path.join(_HERE, f"_tile_{family}.py")


def _source_hash(family, kernel):
    """Digest of every source ``family``'s generated code inlines: a change rewrites the module.

    A GEMM kernel's module is named with a digest of the kernels, packing and
    ground sources; a family without one hashes the kernels and ground sources.
    """
    paths = [_template(family)] + [os.path.join(_HERE, f) for f in _INLINES[family]]
    if kernel is not None:
        paths.append(kernel.module.__file__)
    else:
        paths += loader.python_files(_KERNELS) + loader.python_files(_GROUND)
    return loader.digest(paths)


_module_lock = threading.RLock()     # a template loads the templates it calls while loaded
_modules = {}


def template_module(family, dtype, mr=0, nr=0, isa=None, tile=None):
    """The module written from ``conv/_tile_{family}.py`` for one configuration.

    Parameters
    ----------
    family : str
        One of :data:`GEMM_FAMILIES` (``mr``, ``nr`` and ``isa`` name the GEMM
        kernel) or :data:`ISA_FAMILIES` (``isa`` alone; ``mr`` and ``nr`` ignored).
    dtype : numpy dtype
    tile : int, optional
        Winograd's output tile size m (its template's ``TILE``); other families none.
    """
    dtype = np.dtype(dtype)
    key = (family, dtype, mr, nr, isa, tile)
    module = _modules.get(key)
    if module is None:
        with _module_lock:
            module = _modules.get(key)
            if module is None:
                module = _modules[key] = _load(family, dtype, mr, nr, isa, tile)
    return module


def _load(family, dtype, mr, nr, isa, tile=None):
    lanes = lanes_of(isa, dtype)
    if family in ISA_FAMILIES:
        kernel, config = None, [f"LANES = {lanes}"]
        name = f"conv_{family}_f{dtype.itemsize * 8}_{isa}"
    else:
        kernel = get_kernel(dtype, mr, nr, isa)
        config = [f"MR = {mr}", f"NR = {nr}"]
        name = f"conv_{family}_{kernel.name}"
    if tile is not None:
        config.append(f"TILE = {tile}")
        name += f"_m{tile}"
    source_hash = _source_hash(family, kernel)
    config = [f"DTYPE = np.{dtype.name}"] + config + [f"ISA = {isa!r}",
                                                      f"SOURCE_HASH = {source_hash!r}"]
    header = (f"# Generated by tilegemm.conv.engine from conv/_tile_{family}.py; "
              "do not edit.\n" + tilelib.header())
    return loader.load_generated(f"{name}_{source_hash}",
                                 loader.configured(_template(family), config, header))


def family_module(family, dtype, tile=None, columns=None):
    """The compiled drivers of ``family`` for ``dtype``'s GEMM kernel (its ISA for
    :data:`ISA_FAMILIES`; ``tile``, Winograd's output tile size; ``columns``, a GEMM
    width that takes a narrower kernel, see :func:`gemm_kernel`), loaded on first use."""
    kernel, _ = gemm_kernel(dtype, columns)
    tile = tile or TILED_FAMILIES.get(family)
    module = _by_kernel.get((family, kernel.name, tile))   # every conv2d call asks: kept cheap
    if module is None:
        if family in ISA_FAMILIES:
            module = template_module(family, dtype, isa=kernel.isa)
        else:
            module = template_module(family, dtype, kernel.mr, kernel.nr, kernel.isa, tile)
        _by_kernel[(family, kernel.name, tile)] = module
    return module


_by_kernel = {}


# --- prepared weights -----------------------------------------------------------------

#: Plain weight arrays whose prepared forms are kept (ConvWeights' are never evicted).
PREPARED_MAX = 32
_prepared = collections.OrderedDict()
_prepared_lock = threading.Lock()


class Frozen:
    """A read-only weight array and what has been built from it, kept together.

    Made by :class:`tilegemm.ConvWeights`, which owns the array and this object:
    the array never changes, so :func:`prepared` returns what it built before
    without comparing anything, and nothing is evicted while the owner lives.
    """

    __slots__ = ("array", "built", "__weakref__")

    def __init__(self, array):
        self.array, self.built = array, {}


#: id(array) -> Frozen, for as long as the Frozen object lives.
_frozen = weakref.WeakValueDictionary()


def freeze(array):
    """Register ``array`` (read-only, owned by the caller) as never changing (:class:`Frozen`)."""
    holder = Frozen(array)
    _frozen[id(array)] = holder
    return holder


def prepared(kind, weight, params, build):
    """``build(w)`` for this weight array, cached.

    ``build`` receives the array to build from and must read no other copy of the
    weights.  For an array registered by :func:`freeze` that is the array itself,
    kept with what was built, and never compared.  Otherwise it is a private copy
    taken first, so the copy kept for comparison describes exactly the weights that
    were built, even when another thread writes ``weight`` during the build (that
    call's own result is then undefined, later calls are right).  The key is
    ``(kind, id(weight), params)``; a hit compares the weight with that copy, so an
    array modified in place (or a new array at a recycled id) is rebuilt.  Keeps the
    last ``PREPARED_MAX`` entries.
    """
    holder = _frozen.get(id(weight))
    if holder is not None and holder.array is weight:
        value = holder.built.get((kind, params))
        if value is None:
            value = holder.built.setdefault((kind, params), build(holder.array))
        return value
    key = (kind, id(weight), weight.shape, weight.dtype.str, params)
    with _prepared_lock:
        hit = _prepared.get(key)
        if hit is not None:
            _prepared.move_to_end(key)
    if hit is not None and same_contents(hit[0], weight):
        return hit[1]
    snapshot = np.array(weight, order="C", copy=True)
    value = build(snapshot)
    with _prepared_lock:
        _prepared[key] = (snapshot, value)
        while len(_prepared) > PREPARED_MAX:
            _prepared.popitem(last=False)
    return value


#: Weights of at least this many bytes per thread are compared on several threads at
#: once: read by the calling thread alone, before the others start, the comparison
#: of large weights is a visible share of a call (docs/conv-paths.md).
COMPARE_BYTES_PER_THREAD = 1 << 20
#: Elements compared between tests for a difference: the loop inside vectorises.
_COMPARE_BLOCK = 4096


@jit
def _same_bits(a, b, lo, hi):
    """Whether ``a[lo:hi]`` and ``b[lo:hi]`` (unsigned integer views) hold the same bits."""
    for start in range(lo, hi, _COMPARE_BLOCK):
        end = min(start + _COMPARE_BLOCK, hi)
        # Slices, then a loop from 0: this form vectorises (indexing a[i] from
        # ``start`` ran at a third of the speed).
        x, y = a[start:end], b[start:end]
        diff = np.uint64(0)
        for i in range(end - start):
            diff |= np.uint64(x[i] ^ y[i])
        if diff:
            return False
    return True


def same_contents(copy, weight):
    """Whether ``weight`` holds exactly the bits of ``copy`` (same shape and dtype).

    Bits, not values: a NaN weight matches itself, and -0.0 never matches 0.0 (a
    rebuild, never a stale result).  Large arrays are cut between the threads.
    """
    uint = np.dtype(f"u{copy.itemsize}")
    a = copy.reshape(-1).view(uint)
    b = np.ascontiguousarray(weight).reshape(-1).view(uint)
    threads = weight.nbytes // COMPARE_BYTES_PER_THREAD
    if threads > 1:                    # (asking Numba costs microseconds: only if it matters)
        threads = min(get_num_threads(), threads)
    if threads <= 1:
        return _same_bits(a, b, 0, a.size)
    bounds = [a.size * t // threads for t in range(threads + 1)]
    same = [False] * threads

    def compare(t):
        same[t] = _same_bits(a, b, bounds[t], bounds[t + 1])

    run_shares(compare, [(t,) for t in range(threads)])
    return all(same)


def clear_prepared():
    """Forget every cached weight transform (frees their memory)."""
    with _prepared_lock:
        _prepared.clear()


# --- threads --------------------------------------------------------------------------

#: Below this many flops a convolution runs on one thread: starting the pool costs more.
SERIAL_FLOPS = 2 * 64 ** 3
#: With several threads, the packed and taps paths cut images into column parts
#: (pixel blocks) until there are this many tasks per thread: tasks are taken from a
#: shared counter, so finer ones even out threads the machine slows down or starts
#: late (figures in docs/conv-paths.md).  Not for layers the taps path reads from a
#: copy: every thread taking a part of an image copies all of it.
TASKS_PER_THREAD = 16


def threads_for(flops, tasks):
    """How many threads to use: the thread limit (``ground.threads``), capped by the tasks and the work."""
    if flops < SERIAL_FLOPS:
        return 1
    return max(1, min(get_num_threads(), tasks))
