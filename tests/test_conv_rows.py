"""The rows kernel path (conv/rows.py): NHWC pixels read in place, NCHW layers it wins,
tasks split for threads."""
import numba
import numpy as np
import pytest

from conv_cases import ZEN4_AVX512, numba_threads, record_arg, run_case
from tilegemm.conv.params import conv_params


# NHWC layers of the rows path (every NHWC layer but 1x1 stride 1 and the planes path's):
# channels in several KC blocks and output channels in several NC blocks (forced by
# small cache shares below), a partial last row panel of pixels and NR panel of
# channels, strides, dilation, rectangular kernels, grouped strided layers, padding
# wider than the kernel reaches.
ROWS = {
    "blocks": ((2, 40, 7, 9), (37, 3, 3), dict(padding=1)),
    "stride2": ((3, 9, 13, 11), (20, 3, 3), dict(stride=2, padding=1)),
    "stem": ((1, 3, 19, 23), (16, 7, 7), dict(stride=2, padding=3)),
    "dilated_rect": ((2, 6, 12, 10), (5, 2, 5), dict(padding=(3, 4), dilation=(3, 2),
                                                     stride=(1, 2))),
    "grouped_s2": ((2, 24, 9, 9), (36, 3, 3), dict(stride=2, padding=1, groups=3)),
    "grouped_wide": ((2, 32, 7, 9), (128, 3, 3), dict(padding=1, groups=2)),
    "wide_padding": ((1, 4, 3, 2), (3, 3, 3), dict(padding=(3, 2))),
}


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("name", list(ROWS))
def test_nhwc_im2col_reads_pixels_in_place(name, threads, dtype, monkeypatch):
    _run_rows_path(ROWS[name], "NHWC", threads, dtype, "relu6", monkeypatch)


def _run_rows_path(shape, layout, threads, dtype, activation, monkeypatch):
    """``run_case`` of ``shape`` on the rows path with and without bias and activation,
    with cache shares that force several blocks and tasks, checking the path ran."""
    from tilegemm.conv import rows as rows_mod
    # KC of about 20 channels for 3x3 kernels, NR-column NC blocks, a row panel a task.
    monkeypatch.setattr(rows_mod, "ROWS_A_L1", 1 / 16)
    monkeypatch.setattr(rows_mod, "ROWS_B_L2", 1 / 2048)
    monkeypatch.setattr(rows_mod, "ROWS_A_L2", 1 / 4096)
    x_shape, (K, _, _), kwargs = shape
    tasks = record_arg(monkeypatch, f"rows_{layout.lower()}_tasks", 1, dtype, field="ntasks",
                       columns=K // kwargs.get("groups", 1))
    with numba_threads(threads):
        run_case(shape, "im2col", layout, dtype, bias=True, activation=activation,
                 path="im2col.rows")
        run_case(shape, "im2col", layout, dtype, bias=False, path="im2col.rows")
    assert tasks and all(n > 1 for n in tasks)


# NCHW layers of the rows path (one group, enough channels, small output planes):
# channels in several KC blocks, output channels in several NC blocks and a partial
# last NR panel ("edge"), tasks that cross images, strides, dilation, rectangular
# kernels, no padding.
ROWS_NCHW = {
    "edge": ((3, 48, 5, 5), (90, 3, 3), dict(padding=1)),
    "stride2": ((3, 48, 13, 11), (64, 3, 3), dict(stride=2, padding=1)),
    "k5": ((2, 64, 9, 8), (64, 5, 5), dict(padding=2)),
    "dilated_rect": ((2, 48, 12, 10), (64, 2, 5), dict(padding=(3, 4), dilation=(3, 2),
                                                      stride=(1, 2))),
    "valid": ((2, 48, 6, 6), (64, 3, 3), dict(padding=0)),
}


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("name", list(ROWS_NCHW))
def test_nchw_im2col_on_the_rows_kernel(name, threads, dtype, monkeypatch):
    from tilegemm.conv import rows as rows_mod
    shape = ROWS_NCHW[name]
    (N, C, H, W), (K, kh, kw), kw_args = shape
    p = conv_params((N, C, H, W), (K, C, kh, kw), kw_args.get("stride", 1),
                    kw_args["padding"], kw_args.get("dilation", 1), 1, "NCHW")
    # On a 6x64 tile (AVX-512 float32) auto takes this path; other tiles may not.
    assert rows_mod.nchw_applies(p, dtype, ZEN4_AVX512)
    _run_rows_path(shape, "NCHW", threads, dtype, "relu", monkeypatch)


@pytest.mark.parametrize("layout, tasks", [("NCHW", "rows_nchw_tasks"),
                                            ("NHWC", "rows_nhwc_tasks")])
def test_rows_tasks_split_the_output_channels_for_threads(layout, tasks, monkeypatch):
    """Weights larger than the image, all threads: tasks take parts of the output
    channels too (each pixel block would stream all the weights), and still add up."""
    parts = record_arg(monkeypatch, tasks, 1, field="parts")
    shape = ((2, 64, 5, 4), (200, 3, 3), dict(padding=1))
    with numba_threads(numba.config.NUMBA_NUM_THREADS):
        run_case(shape, "im2col", layout, np.float32, bias=True, activation="relu")
    assert parts and all(n > 1 for n in parts) == (numba.config.NUMBA_NUM_THREADS > 1)


def test_nchw_rows_kernel_takes_the_layers_it_wins():
    """ResNet-18's 3x3 layers (small planes, 64+ channels) take the rows kernel; few
    channels, output channels that leave its tiles emptier, large planes, groups and
    1x1 layers stay on the taps kernel or GEMM."""
    from tilegemm.conv.rows import nchw_applies

    def ok(x, w, stride=1, padding=1, groups=1):
        return nchw_applies(conv_params(x, w, stride, padding, 1, groups, "NCHW"), np.float32,
                            ZEN4_AVX512)

    for c, hw in ((64, 56), (128, 28), (256, 14), (512, 7)):
        assert ok((8, c, hw, hw), (c, c, 3, 3))
    assert ok((8, 128, 28, 28), (256, 128, 3, 3), stride=2)
    assert not ok((2, 64, 224, 224), (64, 64, 3, 3))            # a large plane
    assert not ok((8, 128, 28, 28), (96, 128, 3, 3))            # 96 of 128 lanes
    assert not ok((8, 16, 56, 56), (16, 16, 3, 3))              # few channels
    assert not ok((8, 256, 28, 28), (256, 8, 3, 3), groups=32)
    assert not ok((8, 256, 56, 56), (64, 256, 1, 1), padding=0)
