"""The int8 GEMM: which int8 kernel this host runs, its blocking, and the 2-D driver call.

:func:`int8_kind` chooses from what the CPU has *and* what Numba's target lets LLVM
emit (a process whose Numba target is forced to an older CPU must not get VNNI
code): ``vnni`` at the ISA's width where available, else ``madd``, and
``generic`` with ``TILEGEMM_ISA=generic``.  :func:`int8_kind_for` chooses per B:
``maddubs`` instead of ``madd`` on AVX2 when B's values are proved to fit it.
:func:`matrix_kind_for` chooses for a matrix product: ``amx`` (AMX tile products)
where the CPU has AMX-INT8, Linux grants the process its tile state and the product
fills the 32 x 32 tiles, else :func:`int8_kind_for`'s; :func:`taps_kind_for` for a
convolution on the taps kernel (``amx`` where its tiles waste little).
:func:`get_int8_kernel` writes one module per kind from ``kernels/_int8.py``;
:func:`qgemm_into` runs it.
"""
import ctypes
import functools
import math
import os
import platform
import sys
import threading

import numpy as np

from tilegemm.ground import loader
from tilegemm.ground.contracts import cdiv, round_up
from tilegemm.ground.threads import get_num_threads
from tilegemm.ground.workspace import aligned_empty, buffers
from tilegemm.kernels import tilelib
from tilegemm.kernels.pool import NO_GATE, run_shares
from tilegemm.kernels.requant import NOT_FOLDED
from tilegemm.kernels.widen import widen_rows
from tilegemm.kernels.int8 import A_BLOCKS, BYTE_KINDS, GROUP, KSTEP, MADDUBS_B_LIMIT, TILES
from tilegemm.kernels.int8_taps import amx_places, amx_rows
from tilegemm.tuning.machine import detect

_TEMPLATE = __file__.replace("qgemm.py", "_int8.py")
_lock = threading.Lock()


#: What a target named by its CPU alone (``NUMBA_CPU_NAME`` without features) is
#: assumed to have, per ISA: the float kernels' needs, and no dot-product extension.
ISA_BASE_FEATURES = {"avx512": {"avx2", "avx512bw", "avx512vl"}, "avx2": {"avx2"}, "generic": set()}


def target_features():
    """The CPU features LLVM compiles for in this process (Numba's target), as a set of
    names such as ``"avx512vnni"``: the features Numba passes, else the host's when it
    compiles for the host, else :data:`ISA_BASE_FEATURES` of the detected ISA."""
    import llvmlite.binding as llvm
    _triple, cpu, features = tilelib._target()
    if features:
        return {f[1:] for f in features.split(",") if f.startswith("+")}
    if cpu in ("", "host", llvm.get_host_cpu_name()):
        return {name for name, on in llvm.get_host_cpu_features().items() if on}
    return ISA_BASE_FEATURES[detect().isa]


@functools.lru_cache(maxsize=1)
def amx_permitted():
    """Whether this process may use AMX tile data: Linux (5.16 on) hands a process the
    large tile state only when asked (``arch_prctl(ARCH_REQ_XCOMP_PERM,
    XFEATURE_XTILEDATA)``, once, for all its threads); an AMX instruction without it
    is a fatal signal.  ``TILEGEMM_AMX=0`` says no without asking."""
    if os.environ.get("TILEGEMM_AMX", "1") == "0":
        return False
    if (sys.platform != "linux" or platform.machine() not in ("x86_64", "AMD64")
            or sys.maxsize <= 2**32):       # a 32-bit process: 158 is another syscall there
        return False
    sys_arch_prctl, req_xcomp_perm, xtiledata = 158, 0x1023, 18
    try:
        return ctypes.CDLL(None, use_errno=True).syscall(sys_arch_prctl, req_xcomp_perm,
                                                         xtiledata) == 0
    except (OSError, AttributeError):
        return False


@functools.lru_cache(maxsize=1)
def runnable_int8_kinds():
    """Every ``(kind, bits)`` this process can run, best first: ``amx`` where the CPU,
    Numba's target and Linux allow it (asking Linux for the tile state), then
    :func:`vector_int8_kinds`.  Read once per process."""
    have = target_features()
    amx = (detect().isa == "avx512" and {"amx-int8", "amx-tile", "avx512bw", "avx512vl"} <= have
           and amx_permitted())
    return ((("amx", 512),) if amx else ()) + vector_int8_kinds()


@functools.lru_cache(maxsize=1)
def vector_int8_kinds():
    """Every vector ``(kind, bits)`` this process can run, best first: the detected
    ISA's (``TILEGEMM_ISA`` if forced) and every narrower one's.  Read once per
    process, like the machine itself (asking LLVM costs a product of 256 x 256)."""
    isa = detect().isa
    have = target_features()
    out = []
    if isa == "avx512" and {"avx512bw", "avx512vl"} <= have:
        if "avx512vnni" in have:
            out.append(("vnni", 512))
        out.append(("madd", 512))
    if isa in ("avx512", "avx2") and "avx2" in have:
        if "avxvnni" in have or {"avx512vnni", "avx512vl"} <= have:
            out.append(("vnni", 256))
        out.append(("madd", 256))
        out.append(("maddubs", 256))    # for a B proved to fit (int8_kind_for)
    out.append(("generic", 128))
    return tuple(out)


def int8_kind():
    """The ``(kind, bits)`` of this process's vector int8 kernel for any B (see the module
    docstring): the convolutions' where :func:`taps_kind_for` does not choose
    ``amx``, and the patches path's.  Never asks Linux for the AMX tile state (that
    is :func:`runnable_int8_kinds`, which ``taps_kind_for`` and ``matrix_kind_for``
    call)."""
    return vector_int8_kinds()[0]


#: ``amx`` serves products whose m and n both reach this: its tile is 32 x 32, and a
#: thinner product would leave most of each tile product unused.
AMX_MIN_SIDE = 32


def matrix_kind_for(b, b_zero_point=0, m=AMX_MIN_SIDE):
    """The ``(kind, bits)`` of the int8 kernel for an ``m``-row product with ``b``:
    ``amx`` where this process can run it and m and B's n reach
    :data:`AMX_MIN_SIDE`, else :func:`int8_kind_for`."""
    if (runnable_int8_kinds()[0][0] == "amx" and m >= AMX_MIN_SIDE
            and b.shape[-1] >= AMX_MIN_SIDE):
        return runnable_int8_kinds()[0]
    return int8_kind_for(b, b_zero_point)


def int8_kind_for(b, b_zero_point=0):
    """The ``(kind, bits)`` of the int8 kernel for products with ``b`` (int8 or uint8):
    :func:`int8_kind`, or ``maddubs`` where that is ``madd`` at 256 bits and every
    value of B as ``maddubs`` packs it lies within +-``MADDUBS_B_LIMIT``, where its
    saturating pair sums are exact (1.2x the pair products' peak on Zen 3, and half
    their panel bytes)."""
    kind = int8_kind()
    if kind != ("madd", 256) or b.size == 0:
        return kind
    return ("maddubs", 256) if _fits_maddubs(b, b_zero_point) else kind


def _fits_maddubs(b, b_zero_point):
    """Whether every value of ``b`` as ``maddubs`` packs it lies within +-MADDUBS_B_LIMIT."""
    add = _b_add("maddubs", b.dtype, b_zero_point)
    return b.size == 0 or (-MADDUBS_B_LIMIT <= int(b.min()) + add
                           and int(b.max()) + add <= MADDUBS_B_LIMIT)


def _check_maddubs(b, b_zero_point):
    """A ValueError unless ``b`` fits ``maddubs`` (see :func:`int8_kind_for`)."""
    add = _b_add("maddubs", b.dtype, b_zero_point)
    if not _fits_maddubs(b, b_zero_point):
        raise ValueError(f"the maddubs kernel needs B's values within +-{MADDUBS_B_LIMIT} "
                         f"(after adding {add}); use int8_kind_for(b)")


@functools.lru_cache(maxsize=None)
def int8_blocking(kind, bits):
    """``(KC, MC, NC)`` for the int8 kernel: a KC x NR micro-panel of B of a third more
    than L1d (at most 2048 deep), an MC x KC block of A in a quarter of L2, a KC x NC
    panel of B in about two L2s.  Packed values take a byte each with
    ``BYTE_KINDS`` and two bytes otherwise.

    The micro-panel outgrows L1 on purpose: each tile ends with its C update and
    corrections, and a deeper k spreads them; the panel streams from L2 as the
    tiles of a column reuse it.  On the AVX-512 Xeon (48 KiB L1d, 2 MiB L2) KC =
    1024 against 384 with the panel in half of L1 ran 4% faster at n = 512 and 17%
    at 2048 (vnni), 2-14% for the other kinds.
    """
    mr, nr = TILES[(kind, bits)]
    size = 1 if kind in BYTE_KINDS else 2
    step = max(16, GROUP[kind] * KSTEP.get(kind, 1))    # KC in whole steps of the tile
    m = detect()
    if kind == "amx":
        return _amx_blocking(m, step)
    kc = max(step, min(2048, m.l1d_bytes * 4 // 3 // (nr * size)) // step * step)
    mc = max(mr, m.l2_bytes // 4 // (kc * size) // mr * mr)
    nc = max(nr, 2 * m.l2_bytes // (kc * size) // nr * nr)
    return kc, mc, nc


def _amx_blocking(m, step):
    """``(KC, MC, NC)`` for ``amx``: KC as the vector kinds' (a third more than L1d, at
    most 2048: each k block is another pass over C, which at AMX's rate costs as much
    as the products' operands), a KC x NC block of B in half of L2 and an MC x KC
    block of A in a sixteenth.  An AMX step reads 4 KB of tiles for 64 cycles of
    products, more than L2 delivers from a block that does not stay in it.  On the
    AVX-512 Xeon (48 KiB L1d, 2 MiB L2), uint8 x int8 2048^3 on one thread: 1.83 TOPS
    at (KC, MC, NC) = (2048, 64, 512), 1.44 at (1024, 128, 512), 1.66 at (2048, 256,
    256), 1.53 at (2048, 256, 2048) with A packed per NC block."""
    kc = max(step, min(2048, m.l1d_bytes * 4 // 3 // 32) // step * step)
    mc = max(32, m.l2_bytes // 16 // kc // 32 * 32)
    nc = max(32, m.l2_bytes // 2 // kc // 32 * 32)
    return kc, mc, nc


@functools.lru_cache(maxsize=None)
def _load(kind, bits):
    mr, nr = TILES[(kind, bits)]
    config = [f"KIND = {kind!r}", f"BITS = {bits}", f"MR = {mr}", f"NR = {nr}",
              f"GROUP = {GROUP[kind]}"]
    header = ("# Generated by tilegemm.kernels.qgemm from kernels/_int8.py; do not edit.\n"
              + tilelib.header())
    return loader.load_generated(f"i8_gemm_{kind}{bits}_{mr}x{nr}_{tilelib.engine_digest()}",
                                 loader.configured(_TEMPLATE, config, header))


def get_int8_kernel(kind=None, bits=None):
    """The compiled int8 GEMM module (``kernels/_int8.py``) of ``(kind, bits)``,
    default :func:`int8_kind`."""
    if kind is None:
        kind, bits = int8_kind()
    # a vector kind never asks for AMX's tile state; amx also needs it granted
    kinds = runnable_int8_kinds() if kind == "amx" else vector_int8_kinds()
    if (kind, bits) not in kinds:
        raise ValueError(f"this process cannot run the int8 kernel {kind!r} at {bits} bits "
                         f"(it runs {kinds})")
    with _lock:
        return _load(kind, bits)


#: Products of at least this many int8 operations (2 m n k) are shared among threads:
#: 2 x 320^3, about 0.15 ms at 450 GOPS (a 256^3 product ran 1.5x slower on two threads
#: than on one: handing a share to a thread costs tens of microseconds here).
SHARE_OPS = 1 << 26
#: The same for ``amx``, whose tiles finish a product 2-3x sooner: 2 x 512^3 (384^3
#: ran 0.8-0.95x as fast on two threads as on one, 512^3 1.3x).
SHARE_OPS_AMX = 1 << 28


class PackedB:
    """The panels of a B (k x n, int8 or uint8) packed once for the int8 kernel of
    ``kind``: every KC x NC block as :func:`qgemm_into` reads it, for a B that many
    products share (a quantized layer's weights).  From :func:`pack_b_once`."""

    def __init__(self, kind, shape, dtype, b_zero_point, blocks, words, col_sums):
        self.kind, self.shape, self.dtype = kind, shape, np.dtype(dtype)
        self.b_zero_point, self.blocks, self.words = b_zero_point, blocks, words
        self.col_sums = col_sums     # per column, the sum of B's packed values (int64)

    def serves(self, b, b_zero_point, kind):
        """Whether these panels are ``b``'s (its shape and dtype) for ``kind``."""
        return (self.kind == kind and self.shape == b.shape and self.dtype == b.dtype
                and self.b_zero_point == int(b_zero_point))


def _b_add(kind, b_dtype, b_zero_point):
    """What the packers add to B's values (see ``kernels/_int8.py``)."""
    if kind in BYTE_KINDS:
        return -128 if b_dtype == np.uint8 else 0
    return -int(b_zero_point)


def pack_b_once(b, b_zero_point=0, kind=None, whole_k=False):
    """:class:`PackedB` of ``b`` (k x n, int8 or uint8) for the kernel of ``kind``
    (default this host's), with the KC and NC every product with this B uses; with
    ``whole_k`` KC is all of k (a convolution on ``amx`` taps tiles: its sums then
    stay in the tile registers from the first tap to the last)."""
    kind, bits = kind or int8_kind()
    if kind == "maddubs":
        _check_maddubs(b, b_zero_point)
    mod = get_int8_kernel(kind, bits)
    k, n = b.shape
    KC, _, NC = _blocks(kind, bits, 1, n, k)
    if whole_k:
        KC = round_up(max(k, 1), 64)
    words = sum(round_up(min(NC, n - jc), mod.NR) * _groups(kind, min(KC, k - pc))
                for jc in range(0, n, NC) for pc in range(0, k, KC))
    panels = aligned_empty(max(words, 1), np.int32)   # AMX loads run 2x slower unaligned
    panels[:] = 0
    add = _b_add(kind, b.dtype, b_zero_point)
    mod.pack_b_blocks(b, KC, NC, add, panels.view(np.int8 if kind in BYTE_KINDS else np.int16))
    col_sums = np.empty(n, np.int64)
    mod.column_sums(b, add, col_sums)
    return PackedB((kind, bits), b.shape, b.dtype, int(b_zero_point), (KC, NC), panels, col_sums)


_NO_PANELS = np.zeros(0, np.int32)


def qgemm_into(a, b, c, a_zero_point, b_zero_point, kind=None, threads=None, b_panels=None,
               proved=False):
    """``c[...] = (a - a_zero_point) @ (b - b_zero_point)`` exactly, in int32.

    ``a`` (m x k) and ``b`` (k x n) int8 or uint8 2-D arrays, any strides; ``c`` a
    writeable C-contiguous m x n int32 array.
    The caller has checked the shapes and that the result fits in int32
    (``tilegemm.conv.quant.overflow_bound``).  ``kind``: a ``(kind, bits)`` of
    :func:`runnable_int8_kinds`, default this host's.  ``threads``: default
    :func:`tilegemm.get_num_threads` from ``SHARE_OPS`` operations on, else 1; the
    threads take equal blocks of rows (or of columns, when n is the longer side).
    ``proved``: B's range was checked for ``maddubs`` (:func:`int8_kind_for` chose
    it), so it is not checked again.  Returns ``c``.

    The Python work per call is kept to a few microseconds (a 256^3 product takes
    about 0.2 ms): no closures or pool hand-off on one thread.
    """
    m, k = a.shape
    n = b.shape[1]
    if m == 0 or n == 0:
        return c
    kind, bits = kind or int8_kind()
    mod, adds, alpha, beta, blocks = _product((kind, bits), (m, n, k), (a.dtype, b.dtype),
                                              (int(a_zero_point), int(b_zero_point)))
    if kind == "maddubs" and b_panels is None and not proved:
        _check_maddubs(b, b_zero_point)
    if b_panels is not None and not (b_panels.serves(b, b_zero_point, (kind, bits))
                                     and b_panels.blocks == _blocks(kind, bits, 1, n, k)[::2]):
        raise ValueError("qgemm_into: b_panels were packed for another shape, dtype, zero "
                         "point or kernel than this B's")
    panels = _NO_PANELS if b_panels is None else b_panels.words
    rc, cc = buffers(("int8 corrections", kind, bits), (m, n), np.int32)
    mod.corrections(a, b, adds, alpha, beta, rc, cc)
    if threads is None:
        share_ops = SHARE_OPS_AMX if kind == "amx" else SHARE_OPS
        threads = get_num_threads() if 2 * m * n * k >= share_ops else 1
    flat = c.reshape(-1)
    if threads == 1:
        mod.qgemm(a, b, flat, (0, n), adds, blocks, _packs(kind, bits, blocks), rc, cc,
                  _words(a, kind), panels, NO_GATE)
        return c
    gate = np.zeros(1, np.int64)

    def share(i0, i1, j0, j1):
        part = a[i0:i1]
        blocks = _blocks(kind, bits, i1 - i0, j1 - j0, k)
        mod.qgemm(part, b[:, j0:j1], flat, (i0 * n + j0, n), adds, blocks,
                  _packs(kind, bits, blocks), rc[i0:i1], cc[j0:j1], _words(part, kind), panels,
                  gate)

    # the caller's share waits for a worker's to let go of the GIL (see conv/quantized.py)
    run_shares(share, _parts(m, n, mod.MR, mod.NR, threads, rows=b_panels is not None),
               gate=gate)
    return c


@functools.lru_cache(maxsize=256)
def _product(kernel, shape, dtypes, zero_points):
    """What a :func:`qgemm_into` call of ``shape = (m, n, k)`` takes as it is: the
    kernel's module, the packers' ``adds``, the corrections' ``alpha`` and ``beta``
    and the blocks; once per kind of product (after a large product has taken the
    caches, each Python step of a call is a miss: these were a tenth of a 512^3
    product's time on the AMX Xeon)."""
    (kind, bits), (m, n, k), (a_dtype, b_dtype), (za, zb) = kernel, shape, dtypes, zero_points
    if kind in BYTE_KINDS:   # unsigned A, signed B for vpdpbusd and vpmaddubsw
        adds = (128 if a_dtype == np.int8 else 0, _b_add(kind, b_dtype, zb))
    else:                # int16 values with the zero points taken off
        adds = (-za, _b_add(kind, b_dtype, zb))
    return (get_int8_kernel(kind, bits), adds, za + adds[0], -(zb + adds[1]),
            _blocks(kind, bits, m, n, k))


def _parts(m, n, mr, nr, threads, rows=False):
    """``(i0, i1, j0, j1)`` of each thread's block of C: equal runs of whole tiles along
    the longer side (the rows with ``rows``), at most one per thread."""
    rows = rows or m >= n
    size, unit = (m, mr) if rows else (n, nr)
    count = max(1, min(threads, cdiv(size, unit)))
    step = round_up(cdiv(size, count), unit)
    cuts = [(s, min(s + step, size)) for s in range(0, size, step)]
    return [(s, e, 0, n) if rows else (0, m, s, e) for s, e in cuts]


@functools.lru_cache(maxsize=256)
def _blocks(kind, bits, m, n, k):
    """``(KC, MC, NC)`` of an m x k by k x n product: :func:`int8_blocking`'s, no larger
    than the product needs."""
    mr, nr = TILES[(kind, bits)]
    KC, MC, NC = int8_blocking(kind, bits)
    step = GROUP[kind] * KSTEP.get(kind, 1)
    return (min(KC, round_up(max(k, 1), step)), min(MC, round_up(m, mr)),
            min(NC, round_up(n, nr)))


def _groups(kind, kc):
    """Groups of k in a panel of ``kc`` values (``kernels/_int8.py`` :func:`groups`)."""
    return round_up(cdiv(kc, GROUP[kind]), KSTEP.get(kind, 1))


_local = threading.local()


def _packs(kind, bits, blocks):
    """This thread's pack buffers for ``blocks``, each as int32 words and as its packed
    values (unsigned and signed bytes for ``BYTE_KINDS``, int16 otherwise); the views are
    kept with the buffers, which grow when a product needs more."""
    KC, MC, NC = blocks
    group = GROUP[kind]
    # a slab of A_BLOCKS blocks of A (amx) only where MC is whole: a product that
    # shrank it has one block of rows
    slab = A_BLOCKS[kind] if kind in A_BLOCKS and MC == int8_blocking(kind, bits)[1] else 1
    need = (slab * MC * KC // group, NC * KC // group)
    held = getattr(_local, "packs", None)
    if held is None:
        held = _local.packs = {}
    packs = held.get((kind, bits))
    if packs is None or packs[0].size < need[0] or packs[2].size < need[1]:
        apack, bpack = buffers(("int8", kind, bits), need, np.int32)
        a_type, b_type = (np.uint8, np.int8) if kind in BYTE_KINDS else (np.int16, np.int16)
        packs = held[(kind, bits)] = (apack, apack.view(a_type), bpack, bpack.view(b_type))
    return packs


_NO_WORDS = (np.zeros((1, 0), np.uint32), np.zeros((1, 0), np.int32), 0)


def _words(a, kind):
    """``(words, signed, lda)``: A as 32-bit words (2-D, unsigned and signed views)
    and its row stride in words, when a byte kind (``vnni``, ``maddubs``) can read it
    a word at a time (rows contiguous, k and the row stride multiples of 4, rows in
    ascending order); else no words.  The tile reads the signed view from its data
    pointer, so rows further apart than k/4 words need no flat view."""
    m, k = a.shape
    if (kind in BYTE_KINDS and k % 4 == 0 and k > 0 and a.strides[1] == 1 and a.strides[0] % 4 == 0
            and a.strides[0] > 0):
        words = a.view(np.uint32)     # may be unaligned: Numba then reads it as such
        return words, words.view(np.int32), a.strides[0] // 4
    return _NO_WORDS


def taps_serve(kind, cg, groups):
    """Whether the taps kernel (``kernels/_int8.py`` :func:`qconv_taps`) runs a
    convolution of ``groups`` groups of ``cg`` channels on the int8 kernel ``kind``:
    with whole pixels' channels in its rows, ``cg`` a multiple of a word's (for
    ``amx`` of a step's, 64), or one group (zero channels added)."""
    return cg % (GROUP[kind[0]] * KSTEP.get(kind[0], 1)) == 0 or groups == 1


#: A layer takes ``amx`` taps tiles where at least this share of the pixels they compute
#: exist (:func:`~tilegemm.kernels.int8_taps.amx_rows`; ResNet-18's 3x3 stride-2 at
#: 7 x 7, 0.44: 0.10 ms against vnni's 0.20) and they compute at most AMX_WASTE times
#: its products (:func:`amx_taps_shape`).
AMX_PIXELS = 0.3
AMX_WASTE = 1.5


def amx_taps_shape(cg, groups, kernel):
    """``(multiple, kw)``: the channels per pixel an ``amx`` taps tile reads a layer of
    ``groups`` groups of ``cg`` channels with (a multiple of ``multiple``, zero channels
    added) and its kernel's width (``kernel = (kw, dx)``) made up with zero taps, so
    that every run of k is whole steps of 64 bytes; None where it cannot.

    Either the channels round up to 64, or, with one group and no dilation across
    the row, a kernel row's taps are one run and the zero taps round it up: a 7x7
    stem over 3 channels reads 16 taps of 4 (3x its products) where channels of 64
    would be 21x.  The one with fewer products."""
    kw, dx = kernel
    shapes = [(64, kw)] if cg % 64 == 0 or groups == 1 else []
    if groups == 1 and dx == 1:
        words = round_up(cg, 4) // 4
        shapes.append((4, round_up(kw, 16 // math.gcd(words, 16))))
    return min(shapes, key=lambda s: round_up(cg, s[0]) * s[1], default=None)


def taps_kind_for(kind, cg, groups, kg, geometry):
    """``(kind, multiple, kw)``: the int8 kernel the taps kernel runs a layer on and
    the shape it reads it with (:func:`amx_taps_shape`): ``amx`` where this process
    can run it, the layer's output channels per group ``kg`` reach
    :data:`AMX_MIN_SIDE` and its tiles waste little (:data:`AMX_PIXELS`,
    :data:`AMX_WASTE`; ``geometry = (kw, dx, Wp, Wo, sy, sx)``: the kernel's width
    and dilation, the padded and output widths, the stride); else the vector
    ``kind`` with channels in whole words."""
    kw, dx, Wp, Wo, sy, sx = geometry
    amx = runnable_int8_kinds()[0]
    shape = amx_taps_shape(cg, groups, (kw, dx)) if amx[0] == "amx" else None
    if (shape is None or kg < AMX_MIN_SIDE or Wo < AMX_PIXELS * amx_rows(Wp, Wo, sy, sx)
            or round_up(cg, shape[0]) * shape[1] > AMX_WASTE * cg * kw):
        return kind, GROUP[kind[0]], kw
    return (amx,) + shape


def widen_rows_into(x, n, geom, zero, rows, out, kind=None, layout="NHWC"):
    """Rows ``rows = (r0, r1)`` of image ``n`` of the int8/uint8 ``x`` (in ``layout``),
    padded (``geom = (py, px, Wp, Cp)``, ``Cp`` channels a pixel: C rounded up to the
    kind's GROUP), into the int32 words ``out``: the taps kernel's A (see
    ``kernels/widen.py`` :func:`widen_rows`), int16 ``x - zero`` padded with 0 for the
    pair kinds, unsigned bytes padded with the zero point's for the byte kinds.
    Returns the padding value, :func:`taps_into`'s ``pad``."""
    kind, bits = kind or int8_kind()
    (add, pad), wide = widening(kind, x.dtype, zero)
    widen_rows(x, n, geom, add, pad, rows[0], rows[1], out.view(wide), layout == "NCHW")
    return pad


def widening(kind, x_dtype, zero):
    """``((add, pad), dtype)``: how the taps kernel's A widens an int8/uint8 input of
    zero point ``zero`` for the kernel ``kind``: unsigned bytes ``x + 128`` (int8) or
    ``x`` (uint8) padded with the zero point's byte, as the packers make A, for the
    byte kinds; int16 ``x - zero`` padded with 0 for the pair kinds."""
    if kind in BYTE_KINDS:
        shift = 128 if np.dtype(x_dtype) == np.int8 else 0
        return (shift, int(zero) + shift), np.dtype(np.uint8)
    return (-int(zero), 0), np.dtype(np.int16)


def taps_into(xw, geom, channels, b_panels, c, pixels, cols=None, pad=0, codes=None):
    """``c`` = the int32 sums of a convolution's output pixels ``pixels = (p0, p1)``
    (and output channels ``cols = (j0, j1)``, default all, ``j0`` a multiple of the
    kernel's NR), read by the taps kernel from :func:`widen_rows_into`'s rows ``xw``
    (int32 words).

    ``geom``, ``channels``: as ``kernels/_int8.py`` :func:`qconv_taps` takes them.
    ``b_panels``: the group's :class:`PackedB` (zero point 0).  ``pad``: what
    :func:`widen_rows_into` returned, the widened value of a zero input, taken off
    through B's column sums.  ``codes = (o, mult, bias, lim)``: the codes tile writes
    the sums' codes (``kernels/requant.py`` :func:`code`, per column ``mult`` and
    ``bias``, ``lim`` as :func:`~tilegemm.kernels.requant.fold` makes it: its clips
    within the codes' range less the zero point, ValueError otherwise) into the
    int8/uint8 ``o`` instead, ``n`` per pixel from ``p0``, where k is one block.  One
    thread.  Returns whether the codes were written (always False without ``codes``).
    """
    if codes is not None and not (codes[3][4] >= codes[3][1] - codes[3][0]
                                  and codes[3][3] <= codes[3][2] - codes[3][0]):
        raise ValueError("taps_into: lim's clips must lie within the codes' range less the "
                         "zero point, as requant.fold makes them")
    kind, bits = b_panels.kind
    mod = get_int8_kernel(kind, bits)
    KC, NC = b_panels.blocks
    MC = int8_blocking(kind, bits)[1]
    kh, kw = geom[3], geom[4]
    zeros, = buffers(("int8 taps", kind, bits), (mod.MR,), np.int32)
    zeros[:] = 0
    cc = (-int(pad) * b_panels.col_sums).astype(np.int32)   # wraps as the sums do
    m = pixels[1] - pixels[0]
    places = amx_places(m, geom[2], amx_rows(geom[0], geom[2], geom[5], geom[6]))
    seg, a_at = buffers(("int8 taps offsets", kind, bits),
                        (2 * (kh * kw + 1), max(m, places if kind == "amx" else 0)), np.intp)
    part = tuple(pixels) + (tuple(cols) if cols is not None else (0, channels[2]))
    if part[2] % mod.NR:
        raise ValueError(f"taps_into: the first column {part[2]} is not a multiple of NR = "
                         f"{mod.NR}")
    written = NO_CODES if codes is None else (codes[0], 0, channels[2]) + tuple(codes[1:])
    return mod.qconv_taps(xw, geom, channels, b_panels.words, (KC, MC, NC), c, part, zeros, cc,
                          seg, a_at, written)


#: :func:`qconv_taps`'s ``codes`` when it writes sums (see ``kernels/_int8.py``).
NO_CODES = (np.zeros(0, np.uint8), 0, 0) + NOT_FOLDED
