"""The register tile of a product: the GEMM's, a narrow or wide product's own, a
small item's (a batch's, a small 2-D product's), each with its kernel and blocking,
chosen once per dtype and shape."""
import functools

import numpy as np

from tilegemm.ground.contracts import round_up
from tilegemm.kernels.registry import get_kernel, lanes_of, runnable_isas
from tilegemm.tuning.blocking import blocking, register_tiles
from tilegemm.tuning.machine import ISA_SHAPE, detect

#: Kernel and blocking choices, per dtype, width and item shape (cleared by
#: ``kernels.driver.reset_plans``).
PLANS = {}


def kernel_for(dtype, n=None):
    """(kernel, blocking) for a product with ``n`` columns, looked up once per process.

    The default tile (``n`` None or wide) is the widest that fits the registers.
    A product narrower than its NR would spend most of each tile on zero padding,
    so when the register tile was not overridden a narrower one is taken: the
    smallest NR (a multiple of the vector width) that covers ``n``.  A wider one
    that is no multiple of NR may take a tile that pads fewer columns
    (:func:`snug_tile`).
    """
    plan = PLANS.get((dtype, n))  # products are cached under their width
    if plan is not None:
        return plan
    plan = PLANS.get(dtype)
    if plan is None:
        plan = PLANS[dtype] = (get_kernel(dtype), blocking(dtype))
    blk = plan[1]
    if n is None or (n >= blk.nr and n % blk.nr == 0) or not derived_tile(blk):
        return plan
    tiles = register_tiles(detect().vector_registers, blk.lanes)
    if n < blk.nr:
        mr, nr = min((t for t in tiles if t[1] >= n), key=lambda t: t[1])
    else:
        mr, nr = snug_tile(tiles, n, blk)
    if (mr, nr) != (blk.mr, blk.nr):
        plan = PLANS.get((dtype, mr, nr))
        if plan is None:
            plan = PLANS[(dtype, mr, nr)] = (get_kernel(dtype, mr, nr),
                                              blocking(dtype, mr=mr, nr=nr))
    if len(PLANS) >= 4096:         # bounded: widths come and go
        PLANS.clear()
    PLANS[(dtype, n)] = plan
    return plan


def snug_tile(tiles, n, blk):
    """The register tile for products of ``n`` columns, more than the default tile's NR
    and not a multiple of it: of the tiles nearly as fast as the default (FMAs per
    load at least 0.9 of its), the one whose panels pad the fewest columns, unless
    the default's pad at most a sixteenth of ``n`` more.  On AVX-512 float32 (one
    thread, same process): 196x96x576 on 6x64 tiles (over 128 columns) 146 us, on
    9x48 108 (numpy 141); 14x32 tiles, whose 14 broadcasts a k step cost more,
    ran 196x64x384 in 58 us against 6x64's 49."""
    def per_load(t):
        vectors = t[1] // blk.lanes
        return t[0] * vectors / (t[0] + vectors)
    fast = [t for t in tiles if per_load(t) >= 0.9 * per_load((blk.mr, blk.nr))]
    best = min(fast, key=lambda t: round_up(n, t[1]))
    if 16 * (round_up(n, blk.nr) - round_up(n, best[1])) <= n:
        return blk.mr, blk.nr
    return best


def derived_tile(blk):
    """Whether ``blk``'s register tile was derived from the machine, not set through
    ``TILEGEMM_MR``/``TILEGEMM_NR`` (only a derived tile is swapped for a shape's own)."""
    return blk.source["mr"] == blk.source["nr"] == "derived"


#: Products up to this many rows and columns (batch items, small 2-D products) get a
#: register tile chosen for their shape (:func:`item_kernel`); larger ones the GEMM's
#: own (:func:`kernel_for`).
SMALL_ITEM = 64


@functools.lru_cache(maxsize=None)
def _item_tile(dtype_name, m, n):
    """(ISA, MR, NR) for products of m x n, over every ISA this host runs (see item_kernel)."""
    best = None
    for isa in runnable_isas():
        bits, registers = ISA_SHAPE[isa]
        lanes = lanes_of(isa, dtype_name)
        for nv in range(1, 5):
            nr = nv * lanes
            top = min(16, (registers - nv - 1) // nv)
            if top < 2:
                continue
            # Few row counts, so that varied shapes share a few compiled kernels.
            rows_choices = {top} | {r for r in (2, 4, 8, 16) if r <= top}
            mr = min(rows_choices, key=lambda r: (round_up(m, r), -r))
            # Per k step: vector FMAs, then lanes wasted past n, then the broadcasts of A
            # and vector loads of B that feed them (fewer for wider tiles).
            rows, cols = round_up(m, mr), round_up(n, nr)
            cost = (rows * cols // lanes, cols - n, rows * (cols // nr) + (rows // mr) * cols // lanes)
            if best is None or cost < best[0]:
                best = (cost, isa, mr, nr)
    return best[1:]


def item_kernel(dtype, m, n):
    """The kernel and blocking for m x n products: a batch's items, a small 2-D product.

    Small items pick, over every ISA the host runs, the register tile with the fewest
    vector FMAs per k step for their shape, then the fewest padded lanes (an 8-column
    float32 product takes an 8-lane AVX2 tile on an AVX-512 host, so B needs no edge
    panel), then the fewest broadcasts and loads.  MR is the tile's largest or a power
    of two (one that divides m where one does), so that varied shapes share a few
    kernels (at most 5 per NR) rather than compile one each.  Larger items, and any
    tile set through ``TILEGEMM_MR``/``TILEGEMM_NR``, take the GEMM's tile
    (:func:`kernel_for`).
    """
    dtype = np.dtype(dtype)
    if m > SMALL_ITEM or n > SMALL_ITEM or not derived_tile(kernel_for(dtype)[1]):
        return kernel_for(dtype, n)
    # Cached with the other plans: the blocking reads the environment's overrides,
    # which costs more than a batch of small products.
    key = ("item", dtype, m, n)
    plan = PLANS.get(key)
    if plan is None:
        isa, mr, nr = _item_tile(dtype.name, m, n)
        # Their packed path takes only KC from the blocking (MC, NC cover the whole item).
        plan = PLANS[key] = (get_kernel(dtype, mr, nr, isa), blocking(dtype))
    return plan
