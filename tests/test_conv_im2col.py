"""im2col (conv/im2col.py): implicit im2col packers against the explicit matrix, and the
path that packs B panels from the image."""
import dataclasses
import sys

import numba
import numpy as np
import pytest

import tilegemm
from conv_cases import CASES, RNG, guarded_pages, numba_threads, record_arg, run_case
from jitted import trampoline
from reference import reference_conv
from tilegemm.conv import engine
from tilegemm.conv import im2col as im2col_path
from tilegemm.conv.params import conv_params
from tilegemm.kernels import driver
from tilegemm.packing.im2col import im2col, pack_b_im2col


# --- implicit im2col packers against the explicit matrix ------------------------------

def _params(C, H, W, geom):
    """ConvParams of one C x H x W image and ``geom``'s kernel, with its four paddings."""
    p = conv_params((1, C, H, W), (1, C) + geom["kernel"], geom["stride"],
                    (geom["padding"][0], geom["padding"][2]), geom["dilation"])
    return dataclasses.replace(p, bottom=geom["padding"][1], right=geom["padding"][3])


def _assert_panels(buf, block, NR):
    """``buf`` holds ``block`` (kc x nc of the patch matrix) as NR-column panels, zero-padded."""
    kc, nc = block.shape
    for q in range(-(-nc // NR)):
        panel = buf[q * NR * kc:(q + 1) * NR * kc].reshape(kc, NR)
        want = np.zeros((kc, NR))
        want[:, :min(NR, nc - q * NR)] = block[:, q * NR:(q + 1) * NR]
        np.testing.assert_array_equal(panel, want)


@pytest.mark.parametrize("geom", [
    dict(kernel=(3, 3), stride=(1, 1), padding=(1, 1, 1, 1), dilation=(1, 1)),
    dict(kernel=(2, 5), stride=(2, 3), padding=(0, 1, 2, 1), dilation=(2, 1)),
])
def test_pack_b_im2col_matches_explicit(geom):
    C, H, W, NR = 3, 7, 9, 16
    x = RNG.standard_normal((C, H, W))
    col = im2col(x, geom["kernel"], geom["stride"], geom["padding"], geom["dilation"])
    p = _params(C, H, W, geom)
    assert col.shape == (C * p.kh * p.kw, p.Ho * p.Wo)
    for p0, kc, j0, nc in [(0, col.shape[0], 0, col.shape[1]), (2, 5, 3, 20), (7, 4, 5, 1)]:
        kc = min(kc, col.shape[0] - p0)
        nc = min(nc, col.shape[1] - j0)
        buf = np.full(-(-nc // NR) * NR * kc, np.nan)
        trampoline(pack_b_im2col)(x.reshape(-1), 0, (0, H * W, W, 1), p.geom(), p0, kc, j0, nc, NR, buf)
        _assert_panels(buf, col[p0:p0 + kc, j0:j0 + nc], NR)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("geom", [
    dict(kernel=(3, 3), stride=(1, 1), padding=(1, 1, 1, 1), dilation=(1, 1), W=9),
    dict(kernel=(3, 2), stride=(1, 1), padding=(2, 0, 3, 1), dilation=(2, 3), W=40),
    dict(kernel=(2, 5), stride=(2, 3), padding=(0, 1, 2, 1), dilation=(2, 1), W=9),
    # Horizontal stride 2: every-other-pixel vector copies, runs longer than a vector.
    dict(kernel=(3, 3), stride=(2, 2), padding=(1, 1, 1, 1), dilation=(1, 1), W=75),
    dict(kernel=(7, 7), stride=(2, 2), padding=(3, 3, 3, 3), dilation=(1, 1), W=40),
    dict(kernel=(3, 2), stride=(1, 2), padding=(0, 2, 1, 0), dilation=(1, 3), W=38),
])
def test_vector_pack_b_im2col_matches_explicit(dtype, geom):
    """The generated NCHW packer (vector row copies) writes the explicit patch matrix."""
    from tilegemm.conv import engine
    mod = engine.family_module("im2col", dtype)
    NR = engine.gemm_kernel(dtype)[0].nr
    C, H, W = 3, 7, geom["W"]
    x = RNG.standard_normal((C, H, W)).astype(dtype)
    col = im2col(x, geom["kernel"], geom["stride"], geom["padding"], geom["dilation"])
    p = _params(C, H, W, geom)
    for p0, kc, j0, nc in [(0, col.shape[0], 0, col.shape[1]), (2, 5, 3, 20), (7, 4, 5, 1)]:
        kc = min(kc, col.shape[0] - p0)
        nc = min(nc, col.shape[1] - j0)
        buf = np.full(-(-nc // NR) * NR * kc, np.nan, dtype)
        mod.pack_b_im2col_rows(x.reshape(-1), 0, (0, H * W, W, 1), p.geom(), p0, kc, j0, nc, buf,
                               True)
        _assert_panels(buf, col[p0:p0 + kc, j0:j0 + nc], NR)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="guard pages via mprotect")
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_im2col_batch_reads_stay_inside_the_input(dtype):
    """im2col over a batch with a partial last panel per image: the left column's
    unmasked loads (masked sum), the batched tails' packing, the masked loads and the
    stride-split copies all stay inside the images (a fault would crash)."""
    C = 2048 // np.dtype(dtype).itemsize                    # 2*C*9*13 values fill pages
    shape = (2, C, 9, 13)
    x, buf = guarded_pages(shape, dtype)
    x[...] = np.random.default_rng(0).standard_normal(shape)
    w = np.random.default_rng(1).standard_normal((7, C, 3, 3)).astype(dtype)
    for stride, padding in ((1, 1), (1, (2, 1)), (1, "same"), (2, 1), ((1, 2), 1)):
        got = tilegemm.conv2d(x, w, stride=stride, padding=padding, algorithm="im2col")
        pad = 1 if padding == "same" else padding
        want = reference_conv(x.astype(np.float64), w.astype(np.float64), stride=stride,
                              padding=pad)
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * np.abs(want).max())


@pytest.mark.parametrize("shape", [((3, 32, 24, 24), (20, 1, 1), {}),
                                   ((2, 16, 23, 23), (10, 3, 3), dict(padding=1))])
def test_im2col_packing_path_cuts_pixel_blocks_for_threads(shape, monkeypatch):
    """All threads: the packing path's images are cut into several pixel blocks."""
    blocks = record_arg(monkeypatch, "im2col_nchw_tasks", 1, field="n_jc")
    with numba_threads(numba.config.NUMBA_NUM_THREADS):
        run_case(shape, "im2col", "NCHW", np.float32, bias=True, activation="relu",
                 path="im2col.packed")
    assert blocks and all(n > 1 for n in blocks) == (numba.config.NUMBA_NUM_THREADS > 1)


def test_pointwise_path_cuts_pixel_blocks_for_threads(monkeypatch):
    """All threads: the 1x1 NCHW path's images are cut into several pixel blocks."""
    blocks = record_arg(monkeypatch, "im2col_pointwise_tasks", 1, field="n_jc")
    with numba_threads(numba.config.NUMBA_NUM_THREADS):
        run_case(((3, 32, 24, 24), (20, 1, 1), {}), "im2col", "NCHW", np.float32, bias=True,
                 activation="relu", path="im2col.pointwise")
    assert blocks and all(n > 1 for n in blocks) == (numba.config.NUMBA_NUM_THREADS > 1)


def test_pointwise_nchw_reads_the_image_in_place_with_few_output_channels():
    """Up to the GEMM's STREAM_ROWS output channels a group, or on small planes, a 1x1
    NCHW layer reads the image in place; else it packs it (the packed path).  NHWC:
    one register tile of output channels a group is a plain GEMM; more go to the
    rows kernel, whose weights are packed once."""
    rows = driver.STREAM_ROWS
    nr = engine.host_target(np.float32).nr
    few = tilegemm.conv_plan((1, 256, 56, 56), (rows, 256, 1, 1))
    grouped = tilegemm.conv_plan((1, 256, 56, 56), (4 * rows, 64, 1, 1), groups=4)
    many = tilegemm.conv_plan((1, 64, 56, 56), (rows + 1, 64, 1, 1))
    nhwc = tilegemm.conv_plan((1, 56, 56, 64), (nr, 64, 1, 1), layout="NHWC")
    nhwc_wide = tilegemm.conv_plan((1, 56, 56, 64), (nr + 1, 64, 1, 1), layout="NHWC")
    assert few.route == grouped.route == nhwc.route == "im2col.pointwise"
    assert nhwc_wide.route == "im2col.rows"
    assert "in place" in few.path
    assert many.route == "im2col.packed" and "packed as B" in many.path
    side = int(im2col_path.IN_PLACE_PIXELS ** 0.5)
    small = tilegemm.conv_plan((1, 64, side, side), (rows + 1, 64, 1, 1))
    assert small.route == "im2col.pointwise"


# NCHW layers the taps path serves, through the packing path instead (the one for
# stride-split copies over SHIFTED_MAX_BYTES).
PACKED = [name for name, (_, (_, kh, kw), kw_args) in CASES.items()
          if (kh, kw, kw_args.get("stride", 1)) != (1, 1, 1)]


@pytest.mark.parametrize("name", PACKED)
def test_im2col_packing_path(name, monkeypatch):
    calls = record_arg(monkeypatch, "im2col_nchw_tasks", 1)
    run_case(CASES[name], "im2col", "NCHW", np.float32, bias=True, activation="relu",
             path="im2col.packed")
    assert calls
