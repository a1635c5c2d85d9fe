"""The matrix-vector products ``matmul`` sends straight to compiled code.

A product with one row or one column reads its matrix once, so it has no use for
the GEMM's packing and blocking: :func:`matvec_into` calls the matrix-vector loops
of the kernel module (``matvec`` / ``vecmat`` in ``kernels/_tile.py``) directly,
and shares a large matrix among threads by blocks of rows.
"""
from tilegemm.ground.threads import get_num_threads
from tilegemm.ground.workspace import buffers, share_blocks
from tilegemm.kernels.driver import GEMV_SERIAL_ELEMENTS, kernel_for
from tilegemm.kernels.pool import run_native_shares


def matvec_into(mat, vec, y, vec_first):
    """``y = mat @ vec`` (or ``vec @ mat`` with ``vec_first``) for a C-contiguous 2-D
    ``mat`` and contiguous 1-D ``vec`` and ``y`` of one float dtype, sizes checked by
    the caller; returns ``y``.

    The matrix-vector product without :func:`gemm_into`'s plan: one jitted call
    (``matvec`` / ``vecmat`` in ``kernels/_tile.py``), no pack buffer.  A matrix big
    enough to share (``GEMV_SERIAL_ELEMENTS`` per thread) is cut into blocks of rows
    whose share blocks one jitted call writes (``matvec_blocks``), run as native
    shares; ``vec @ mat``'s partial sums are added to y here.
    """
    kern = kernel_for(mat.dtype, 1)[0]
    threads = mat.size // GEMV_SERIAL_ELEMENTS
    if threads >= 2:
        threads = min(threads, get_num_threads())
    if threads >= 2:
        n = y.size
        # x @ A: threads past the first sum into this thread's buffer (A @ x: unread).
        partial = buffers("matvec", ((threads - 1) * n,), y.dtype)[0] if vec_first else y
        shares = kern.shares
        block, rows = share_blocks("matvec", threads, shares.SERIAL_SLOTS)
        shares.matvec_blocks(block, mat, vec, y, vec_first, partial)
        run_native_shares(shares.share_address("serial_gemv"), rows)
        if vec_first:
            for t in range(threads - 1):
                y += partial[t * n:(t + 1) * n]
    elif vec_first:
        kern.module.vecmat(vec, mat, y)
    else:
        kern.module.matvec(mat, vec, y)
    return y
