"""Rungs 0-3, 5 and 6 of the ladder (rung 4, the generated register tile, is in
:mod:`tilegemm.ladder.register_tile`).  Each computes ``C = A @ B`` and changes one
thing from the rung before it; see the table in :mod:`tilegemm.ladder`.
"""
import numba
import numpy as np

from tilegemm.ground.contracts import JIT
from tilegemm.kernels.driver import gemm_into
from tilegemm.packing import pack_a, pack_b


# --------------------------------------------------------------------------- rung 0
@numba.njit(**JIT)
def naive_ijk(a, b, c):
    """Rung 0: the textbook triple loop, ``i`` then ``j`` then ``k``.

    The innermost loop walks ``a[i, p]`` along a row (unit stride) but ``b[p, j]``
    down a column: consecutive iterations are ``n`` elements apart, so every one
    touches a new cache line and, for large ``n``, a new page.  Each line of B is
    fetched for one useful element; the loop runs at memory latency, not at the
    speed of arithmetic.
    """
    m, k = a.shape
    n = b.shape[1]
    for i in range(m):
        for j in range(n):
            c[i, j] = 0
            for p in range(k):
                c[i, j] += a[i, p] * b[p, j]


# --------------------------------------------------------------------------- rung 1
@numba.njit(**JIT)
def loop_ikj(a, b, c):
    """Rung 1: the same arithmetic with the loops in ``i, k, j`` order.

    Change: ``j`` is now innermost, so the loop reads a row of B and updates a row
    of C, both with unit stride, while ``a[i, p]`` is a constant.  Every byte of a
    fetched cache line is used, and the loop vectorises (one vector FMA updates
    several C elements).  What it still ignores: each ``i`` streams all of B
    through the caches again, so once B outgrows L2 the rate falls to what
    L3 or memory can deliver.
    """
    m, k = a.shape
    n = b.shape[1]
    c[:, :] = 0
    for i in range(m):
        for p in range(k):
            a_ip = a[i, p]
            for j in range(n):
                c[i, j] += a_ip * b[p, j]


# --------------------------------------------------------------------------- rung 2
@numba.njit(**JIT)
def blocked(a, b, c, KC, MC, NC):
    """Rung 2: cache blocking, the BLIS loops jc (NC), pc (KC), ic (MC) around rung 1.

    Change: the ``i, k, j`` loop runs over one block at a time.  The ``KC x NC``
    panel of B (sized to L2) is reused by all ``m`` rows before the next panel is
    touched, so B comes from memory once per ``jc``/``pc`` step instead of once per
    row of A.  The ``MC x KC`` block of A and a row of C are small enough to stay
    close in L1/L2 while a panel row of B streams past.  Assumes positive block sizes.
    """
    m, k = a.shape
    n = b.shape[1]
    c[:, :] = 0
    for jc in range(0, n, NC):
        j_end = min(jc + NC, n)
        for pc in range(0, k, KC):
            p_end = min(pc + KC, k)
            for ic in range(0, m, MC):
                for i in range(ic, min(ic + MC, m)):
                    c_row = c[i, jc:j_end]  # row views: indices from 0, so the loop vectorises
                    for p in range(pc, p_end):
                        a_ip = a[i, p]
                        b_row = b[p, jc:j_end]
                        for j in range(j_end - jc):
                            c_row[j] += a_ip * b_row[j]


# --------------------------------------------------------------------------- rung 3
#: Rung 3's tile, fixed when the module is compiled (Numba reads module globals as
#: constants): the sums live in a local ``LOCAL_MR x LOCAL_NR`` array, and a row of it,
#: 64 values, is whole vectors that LLVM updates with no scalar remainder.  (A
#: constant row of 16 is unrolled into scalar code before it is vectorised; a row
#: length known only at run time costs a vector loop's setup per row.  The library's
#: tile taken that way ran 1.45x slower at n = 1024 on AVX-512, 4.7x with AVX2 code.)
LOCAL_MR, LOCAL_NR = 4, 64


#: Rung 3's tile is compiled without fastmath's "contract": a fused multiply-add
#: would wait for its sum to come back from the local array before it could start,
#: where a separate multiply goes ahead and only the add waits.  With the
#: contraction the rung ran 24-26 GFLOPS on an AVX2 EPYC (Zen 3), no faster than
#: rung 2; without it 30-34 (n = 1024, the same process).
TILE_JIT = dict(JIT, fastmath=set(JIT["fastmath"]) - {"contract"})


@numba.njit(**TILE_JIT)
def tile_in_local_array(kc, a_panel, b_panel, c, mr, nr):
    """``c[:mr, :nr] += (a_panel @ b_panel)[:mr, :nr]`` for one ``LOCAL_MR x LOCAL_NR`` tile.

    ``a_panel`` is a packed A micro-panel (``kc x LOCAL_MR``, k-major), ``b_panel`` a
    packed B micro-panel (``kc x LOCAL_NR``, k-major), ``c`` a 2-D view whose corner
    the tile covers.  The sums stay in ``acc``, an array local to the call, for the
    whole ``kc`` loop: for each ``p`` a row of B is multiplied by each of the
    ``LOCAL_MR`` A values and added to a row of ``acc``.  Local, of constant size, it
    overlaps nothing LLVM can see, so each row update is plain vector code; C is read
    and written once per tile.
    """
    acc = np.zeros((LOCAL_MR, LOCAL_NR), c.dtype)
    for p in range(kc):
        for i in range(LOCAL_MR):
            a_ip = a_panel[p * LOCAL_MR + i]
            for j in range(LOCAL_NR):
                acc[i, j] += a_ip * b_panel[p * LOCAL_NR + j]
    for i in range(mr):
        for j in range(nr):
            c[i, j] += acc[i, j]


@numba.njit(**JIT)
def packed(a, b, c, KC, MC, NC, apack, bpack):
    """Rung 3: pack the A block and the B panel into contiguous micro-panels.

    Change: before they are used, the ``MC x KC`` block of A is copied into
    ``LOCAL_MR``-row micro-panels and the ``KC x NC`` panel of B into
    ``LOCAL_NR``-column micro-panels, both k-major (the reference packers of
    ``tilegemm.packing.pack``), and C is computed one tile at a time
    (:func:`tile_in_local_array`): the tile's sums stay in a small local array (L1)
    for the whole ``kc`` loop, and C is read and written once per tile and KC block
    instead of once per ``p``.  The micro-panels are read strictly in order: a B
    micro-panel stays in cache while the A micro-panels stream past, the prefetchers
    see plain streams.  The copy costs O(mk + kn) per block against O(mnk)
    arithmetic.  The blocks are rung 2's (MC rounded to ``LOCAL_MR`` rows).
    Buffers: ``apack >= ceil(MC/LOCAL_MR)*LOCAL_MR*KC``, ``bpack >=
    ceil(NC/LOCAL_NR)*LOCAL_NR*KC``; a, b, c C-contiguous.
    """
    m, k = a.shape
    n = b.shape[1]
    af, bf = a.reshape(-1), b.reshape(-1)  # flat views: pack_* take offsets and strides
    c[:, :] = 0
    for jc in range(0, n, NC):
        nc = min(NC, n - jc)
        for pc in range(0, k, KC):
            kc = min(KC, k - pc)
            pack_b(bf, pc * n + jc, n, 1, kc, nc, LOCAL_NR, bpack)
            for ic in range(0, m, MC):
                mc = min(MC, m - ic)
                pack_a(af, ic * k + pc, k, 1, mc, kc, LOCAL_MR, apack)
                for jr in range(0, nc, LOCAL_NR):          # B micro-panel: stays in cache ...
                    for ir in range(0, mc, LOCAL_MR):      # ... while A micro-panels stream
                        tile_in_local_array(kc, apack[ir * kc:(ir + LOCAL_MR) * kc],
                                            bpack[jr * kc:(jr + LOCAL_NR) * kc],
                                            c[ic + ir:, jc + jr:], min(LOCAL_MR, mc - ir),
                                            min(LOCAL_NR, nc - jr))


# --------------------------------------------------------------------------- rung 5
# Not cached on disk: ``macro_kernel`` and the packers arrive as arguments (functions
# from the generated kernel module), and Numba cannot cache code specialised on a function.
@numba.njit(**dict(JIT, cache=False))
def library_micro_kernel(a, b, c, blocks, packs, pack_a_v, pack_b_v, macro_kernel, tile, units):
    """Rung 5: the same five loops, with the library's vector-IR micro-kernel and packers.

    Change: the jr and ir loops and the micro-kernel are the library's
    ``macro_kernel`` from ``get_kernel(dtype).module`` (``kernels/_tile.py``).  Its
    micro-kernel is written as LLVM vector IR: per ``p`` it loads ``NR/lanes``
    vectors of B, broadcasts each of the ``MR`` A values and issues
    ``MR*NR/lanes`` full-width FMAs into accumulators that live in registers for
    the whole ``kc`` loop.  C is read and written once per tile and block.  The
    panels are packed by the same module's ``pack_a_v`` / ``pack_b_v``: rung 3's
    layouts, copied a vector at a time.  ``blocks`` is ``(KC, MC, NC)``, ``packs``
    ``(apack, bpack)``, ``tile`` ``(MR, NR)``; ``units`` ``(one, zero)`` are 1 and 0
    in C's dtype: beta is 0 on the first ``pc`` block (overwrite C), 1 afterwards
    (accumulate).
    """
    KC, MC, NC = blocks
    apack, bpack = packs
    MR, NR = tile
    one, zero = units
    m, k = a.shape
    n = b.shape[1]
    af, bf, cf = a.reshape(-1), b.reshape(-1), c.reshape(-1)
    for jc in range(0, n, NC):
        nc = min(NC, n - jc)
        for pc in range(0, max(k, 1), KC):   # k == 0 still makes one pass to zero C
            kc = min(KC, k - pc)
            pack_b_v(bf, pc * n + jc, n, 1, kc, nc, bpack)
            beta = zero if pc == 0 else one
            for ic in range(0, m, MC):
                mc = min(MC, m - ic)
                pack_a_v(af, ic * k + pc, k, 1, mc, kc, apack)
                # ((mc, nc, kc), A, A offset, B, B offset, C, C offset, ldc, (alpha, beta),
                #  (bias (unread: no epilogue), epilogue flags = none), (bias row, bias col))
                macro_kernel((mc, nc, kc), apack, 0, bpack, 0, cf, ic * n + jc, n, (one, beta),
                             (apack, 0), (ic, jc))


# --------------------------------------------------------------------------- rung 6
def threaded(a, b, c, threads=None):
    """Rung 6: the library's engine on every core (:func:`tilegemm.kernels.driver.gemm_into`).

    Change: the ic loop (one MC block of A per task) and the packing of the B
    panel are spread over the threads; each thread owns its A buffer and its L1/L2,
    and all threads share the packed B panel.  The driver also keeps its pack
    buffers between calls, and chooses its own paths: one thread for small products
    (``SERIAL_FLOPS``, ``SERIAL_SECONDS``) and no packing when the operands already fit in L2 (see
    ``kernels/driver.py``).  With ``threads`` cores the ceiling is
    ``threads`` times a core's peak.
    """
    return gemm_into(a, b, c, threads=threads)
