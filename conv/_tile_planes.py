"""Template for the planes drivers (NHWC groups copied as planes, then the taps kernel), bound to one micro-kernel.

Written once per GEMM kernel (MR, NR, ISA) by
:func:`tilegemm.conv.engine.family_module`, which states what every template shares
(the configuration block, task loops over a shared counter).  Importable as is
(float32 6x64).
"""
import numpy as np

from tilegemm.conv import engine
from tilegemm.ground.contracts import imin, jit
from tilegemm.kernels.sync import next_task

# --- configuration ---
DTYPE = np.float32
MR = 6
NR = 64
ISA = "avx512"
SOURCE_HASH = ""
# --- end configuration ---

_SHARED = engine.template_module("shared", DTYPE, isa=ISA)
_TAPS = engine.template_module("taps", DTYPE, MR, NR, ISA)
transpose_copy = _SHARED.transpose_copy
taps_block = _TAPS.taps_block
ZERO = _SHARED.ZERO


# --- im2col without patches, NHWC grouped: each group's channels copied as planes ---------
#
# In NHWC a group's few channels are interleaved with every other group's, so the
# taps kernel cannot read them in place.  A task (image, group) copies the group's
# channels into planes (a per-thread buffer laid out as an NCHW image of ``Cg``
# channels), runs the taps kernel over them exactly as on an NCHW image read in
# place (stride 1, the output as wide as the image), and writes each block of C
# back interleaved: the copies are of one group of one image, never the whole array.


@jit
def planes_tasks(counter, plan, grid, x, apack, epilogue, out, bufs):
    """Tasks (image, block of ``G`` groups) taken from ``counter`` until ``ntasks`` are out.

    ``plan`` is :func:`tilegemm.conv.planes.planes_plan`'s record (its names here),
    ``grid`` ``(taps, masks, sched)``, ``epilogue`` ``(bias, bias_group, epi)``,
    ``bufs`` the thread's ``(xq, cbuf)``.

    Group ``g``'s packed weights start at ``apack[g*a_group]``, its bias at
    ``bias[g*bias_group]``; ``taps``, ``masks`` and ``sched`` are those of an NCHW
    image of ``Cg`` channels read in place (``pixels`` per input plane, ``out_pixels``
    per output plane: the grid is the output plane, as wide as the input's but not
    necessarily as high).  A block's groups
    are copied together, so each pixel's run of their channels is read whole, and
    written back together: for each block of ``NCB`` output pixels, group ``i`` of
    the block writes its whole row panels into ``cbuf`` from row ``i*Kg`` (the next
    group's rows overwrite the padding rows), so the block's output channels are
    consecutive rows, then into ``out`` (NHWC, ``K`` channels).  ``cbuf`` holds
    ``(G - 1)*Kg + Mp`` rows of ``NCB``.
    """
    r = plan[0]
    bias, bias_group, epi = epilogue
    xq, cbuf = bufs
    ntasks, groups, G, a_group, C, pixels = r.ntasks, r.groups, r.G, r.a_group, r.C, r.pixels
    out_pixels, Cg, ntaps, Mp, Kg, K = r.out_pixels, r.Cg, r.ntaps, r.Mp, r.Kg, r.K
    KC, MC, NCB = r.KC, r.MC, r.NCB
    blocks = (groups + G - 1) // G
    while True:
        task = next_task(counter)
        if task >= ntasks:
            break
        n, g0 = task // blocks, task % blocks * G
        ng = imin(G, groups - g0)
        transpose_copy(x, n * pixels * C + g0 * Cg, C, pixels, ng * Cg, xq, 0, pixels)
        for j0 in range(0, out_pixels, NCB):
            cols = imin(NCB, out_pixels - j0)
            for i in range(ng):
                g = g0 + i
                taps_block((xq, i * Cg * pixels, pixels), grid, ntaps, (Cg, KC, MC),
                           (apack, g * a_group, Mp), (ZERO, Mp, ZERO, ZERO), (j0, cols),
                           (cbuf, ZERO, NCB), (cbuf[i * Kg * NCB:], NCB),
                           (bias, g * bias_group, epi))
            transpose_copy(cbuf, 0, NCB, ng * Kg, cols, out,
                           (n * out_pixels + j0) * K + g0 * Kg, K)
