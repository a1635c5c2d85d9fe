"""The taps kernel paths (conv/taps.py, conv/planes.py): tails, stride-split copies,
panel masks, groups, threads, and reads around the image edges."""
import numba
import numpy as np
import pytest

import tilegemm
from conv_cases import RNG, numba_threads, record_arg, run_case, shapes_of, tolerance
from jitted import trampoline
from reference import reference_conv
from tilegemm.conv import engine, paths
from tilegemm.conv.params import conv_params
from tilegemm.ground.contracts import round_up


# (input NCHW, (K, kh, kw), keyword arguments) served by the stride-split im2col path:
# output rows written straight (1x1 stride 2, whole panels) with and without a partial
# row panel, channels in two k blocks, dilation with asymmetric padding and strides.
TAPS_CASES = {
    "direct_rows": ((2, 16, 16, 16), (24, 1, 1), dict(stride=2)),
    "direct_partial_rows": ((2, 16, 16, 16), (20, 1, 1), dict(stride=2)),
    "two_k_blocks": ((1, 130, 10, 10), (70, 3, 3), dict(padding=1)),
    "dilated_strided": ((2, 8, 12, 13), (9, 3, 3), dict(dilation=2, padding=(1, 2),
                                                       stride=(2, 1))),
    "column_blocks": ((1, 4, 15, 16), (300, 3, 3), dict(padding=1)),
    "many_channels": ((2, 64, 19, 23), (10, 3, 3), dict(padding=1)),
}


# Grouped layers on the same path: each group's weights packed on their own, tasks over
# (group, image).  4 in / 4 out per group (ResNeXt's shape: the 4-row kernel writes
# straight, tail columns batched over the images), a stride-split copy per group with a
# partial row panel, a zero-padded copy, few pixels with 2 rows a group.
GROUPED_TAPS = {
    "resnext": ((3, 32, 9, 17), (32, 3, 3), dict(padding=1, groups=8)),
    "strided_copy": ((2, 24, 11, 12), (21, 3, 3), dict(stride=2, padding=1, groups=3)),
    "padded_copy": ((2, 12, 12, 12), (20, 3, 3), dict(stride=2, groups=2)),
    "two_rows": ((2, 16, 5, 6), (16, 3, 3), dict(padding=1, groups=8)),
}


@pytest.mark.parametrize("name", list(TAPS_CASES))
def test_taps_path(name, monkeypatch):
    from tilegemm.conv import taps as taps_mod
    shape = TAPS_CASES[name]
    # A small C block forces several column blocks on the last case.
    monkeypatch.setattr(taps_mod, "TAPS_C_BYTES", 1 << 16)
    p = conv_params(*shapes_of(shape), **shape[2])
    assert taps_mod.serves(p)
    run_case(shape, "im2col", "NCHW", np.float32, bias=True, activation="relu",
             path="im2col.taps")


def test_taps_tails_split_only_when_too_few_for_the_threads():
    """The tails GEMM (columns past each image's last whole panel) is cut by rows between
    threads only when there are fewer tails GEMMs than threads: every share packs the
    tails again.  Two 25x25 images of 256 channels (one tails GEMM a group): one group
    split, 32 groups not."""
    from tilegemm.conv import taps as taps_mod
    kernel, blk = engine.gemm_kernel(np.float32)
    for groups, split in ((1, 2), (32, 1)):
        p = conv_params((2, 256, 25, 25), (256, 256 // groups, 3, 3), 1, 1, 1, groups)
        KC = taps_mod.taps_kc(p, kernel.mr, kernel.nr, 4, 32 << 10)
        Mp = round_up(p.Kg, kernel.mr)
        plan = taps_mod.taps_plan(p, "<f4", 2, True, kernel.mr, kernel.nr, KC, Mp, blk.mc,
                                  taps_mod.TAPS_C_BYTES, taps_mod.TAPS_TAIL_COLUMNS,
                                  engine.TASKS_PER_THREAD)
        assert plan.q_end < 25 * 25 and plan.tail_parts == split


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("name", list(GROUPED_TAPS))
def test_grouped_im2col_runs_every_group_in_one_task_loop(name, threads, dtype, monkeypatch):
    from tilegemm.conv import taps as taps_mod
    shape = GROUPED_TAPS[name]
    groups = record_arg(monkeypatch, "taps_tasks", 1, dtype, field="groups")
    assert taps_mod.serves(conv_params(*shapes_of(shape), **shape[2]))
    with numba_threads(threads):
        run_case(shape, "im2col", "NCHW", dtype, bias=True, activation="relu6",
                 path="im2col.taps")
        run_case(shape, "im2col", "NCHW", dtype, bias=False, path="im2col.taps")
    # Every thread's task loop gets all the groups (no launch per group).
    assert groups and set(groups) == {shape[2]["groups"]}


# NHWC grouped layers the planes path serves (stride 1, the output as wide as the image):
# groups copied a cache line of channels at a time, depthwise (one channel a group), a
# dilated 5x5, a last block of fewer groups, several column blocks.
PLANES = {
    "resnext": ((3, 32, 9, 17), (32, 3, 3), dict(padding=1, groups=8)),
    "two_rows": ((2, 16, 5, 6), (16, 3, 3), dict(padding=1, groups=8)),
    "depthwise": ((2, 24, 7, 9), (24, 3, 3), dict(padding=1, groups=24)),
    "dilated_5x5": ((1, 12, 11, 10), (6, 5, 5), dict(padding=4, dilation=2, groups=3)),
    "partial_block": ((2, 72, 6, 7), (36, 3, 3), dict(padding=1, groups=36)),
    "column_blocks": ((1, 8, 30, 31), (6, 3, 3), dict(padding=1, groups=2)),
}


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("name", list(PLANES))
def test_grouped_nhwc_im2col_copies_groups_as_planes(name, threads, dtype, monkeypatch):
    from tilegemm.conv import taps as taps_mod
    monkeypatch.setattr(taps_mod, "TAPS_C_BYTES", 1 << 12)   # several column blocks
    shape = PLANES[name]
    (N, C, H, W), (K, kh, kw), kw_args = shape
    p = conv_params((N, H, W, C), (K, C // kw_args["groups"], kh, kw), layout="NHWC", **kw_args)
    assert paths.serves("im2col.planes", p, dtype)
    blocks = record_arg(monkeypatch, "planes_tasks", 1, dtype, field="G")  # groups a task
    with numba_threads(threads):
        run_case(shape, "im2col", "NHWC", dtype, bias=True, activation="relu",
                 path="im2col.planes")
        run_case(shape, "im2col", "NHWC", dtype, bias=False, path="im2col.planes")
    assert blocks and all(1 <= g <= kw_args["groups"] for g in blocks)


@pytest.mark.parametrize("name", ["many_channels", "direct_rows", "two_k_blocks"])
@pytest.mark.parametrize("c_bytes", [1 << 12, 1 << 19])
def test_taps_path_shares_one_image_between_threads(name, c_bytes, monkeypatch):
    """One image, all threads: each takes a part of the image's column blocks."""
    from tilegemm.conv import taps as taps_mod
    monkeypatch.setattr(taps_mod, "TAPS_C_BYTES", c_bytes)
    (_, C, H, W), (K, kh, kw), kw_args = TAPS_CASES[name]
    shape = ((1, C, H, W), (K, kh, kw), kw_args)
    with numba_threads(numba.config.NUMBA_NUM_THREADS):
        run_case(shape, "im2col", "NCHW", np.float32, bias=True, activation="relu6")


@pytest.mark.parametrize("name, expected", [("many_channels", "FLAT"), ("strided_copy", "PHASED"),
                                            ("padded_copy", "PADDED")])
def test_taps_loop_is_told_its_layout_by_none_arguments(name, expected, monkeypatch):
    """The task loop gets no image copy for the in-place layout and a padding flag only
    for the padded one (Numba compiles only the branches a layout takes)."""
    from tilegemm.conv import taps as taps_mod
    shape = {**TAPS_CASES, **GROUPED_TAPS}[name]
    layout = taps_mod.layout_of(conv_params(*shapes_of(shape), **shape[2]))
    assert layout == getattr(taps_mod, expected)
    copies = record_arg(monkeypatch, "taps_tasks", 9)
    padded = record_arg(monkeypatch, "taps_tasks", 10)
    run_case(shape, "im2col", "NCHW", np.float32, bias=True, path="im2col.taps")
    assert copies and padded
    assert all((xq is None) == (layout == taps_mod.FLAT) for xq in copies)
    assert all((flag is None) == (layout != taps_mod.PADDED) for flag in padded)


@pytest.mark.parametrize("c_bytes", [1 << 12, 1 << 19])
def test_taps_path_cuts_a_batch_into_parts(c_bytes, monkeypatch):
    """Several images read in place, all threads: images are cut into parts for balance."""
    from tilegemm.conv import taps as taps_mod
    monkeypatch.setattr(taps_mod, "TAPS_C_BYTES", c_bytes)
    parts = record_arg(monkeypatch, "taps_tasks", 1, field="parts")
    _, (K, kh, kw), kw_args = TAPS_CASES["many_channels"]
    with numba_threads(numba.config.NUMBA_NUM_THREADS):
        run_case(((3, 64, 19, 23), (K, kh, kw), kw_args), "im2col", "NCHW", np.float32,
                 bias=True, activation="relu")
    assert parts and all(n > 1 for n in parts) == (numba.config.NUMBA_NUM_THREADS > 1)


def test_taps_kc_counts_the_rows_each_channel_reads():
    from tilegemm.conv import taps as taps_mod
    s1 = conv_params((8, 64, 56, 56), (64, 64, 3, 3), padding=1)
    s2 = conv_params((8, 64, 56, 56), (128, 64, 3, 3), stride=2, padding=1)
    # 6x16 float32 tile, 32 KiB L1d, half of it per block.  Stride 1: 3 rows of 18
    # values (+ a line) and 6*9 weights = 624 bytes a channel, 26 -> 3 blocks of 22.
    assert taps_mod.taps_kc(s1, 6, 16, 4, 32768) == 22
    # Stride 2: six rows of 17 values in the phase planes = 1008 bytes, 16 channels.
    assert taps_mod.taps_kc(s2, 6, 16, 4, 32768) == 16
    # Channels a whole number of pages apart fall on the same L1 sets: 8 ways, 8
    # channels (VGG-16 conv1_2); 200x200 channels are 160000 bytes apart, their rows
    # on 16 set positions, so the L1 budget decides.
    vgg = conv_params((1, 64, 224, 224), (64, 64, 3, 3), padding=1)
    assert taps_mod.taps_kc(vgg, 6, 16, 4, 32768) == 8
    assert taps_mod.taps_kc(vgg, 6, 16, 4, 49152) == 11   # 12 ways: 6 blocks of <= 11
    wide = conv_params((1, 64, 200, 200), (64, 64, 3, 3), padding=1)
    assert taps_mod.taps_kc(wide, 6, 16, 4, 32768) == 22
    # 7x7: 2240 bytes a channel would give 7; never below 8.
    big = conv_params((1, 100, 9, 9), (4, 100, 7, 7), padding=3)
    assert taps_mod.taps_kc(big, 6, 16, 4, 32768) == 8


@pytest.mark.parametrize("N, H, W", [(2, 32, 32), (3, 16, 32), (2, 16, 64)])
@pytest.mark.parametrize("K", [13, 64])
def test_im2col_output_channels_a_page_apart(N, H, W, K):
    """Output channels a whole number of 2 or 4 KiB apart: a tile's rows would share L1
    sets, so C goes through a buffer and is copied out (bias, relu6, partial row
    panels)."""
    from tilegemm.conv import taps as taps_mod
    assert taps_mod.aliasing(H * W * 4, 6)
    x = RNG.standard_normal((N, 64, H, W)).astype(np.float32)
    w = RNG.standard_normal((K, 64, 3, 3)).astype(np.float32)
    b = RNG.standard_normal(K).astype(np.float32)
    expected = reference_conv(x, w, b, padding=1, activation="relu6")
    got = tilegemm.conv2d(x, w, b, padding=1, activation="relu6", algorithm="im2col")
    np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-4)


def test_aliasing_counts_rows_on_the_same_sets():
    from tilegemm.conv import taps as taps_mod
    from tilegemm.tuning.machine import l1_alias_period
    assert l1_alias_period(224 * 224 * 4) == 1                     # 49 pages apart
    assert l1_alias_period(112 * 112 * 4) == 4                     # 12.25 pages
    assert l1_alias_period(56 * 56 * 4) == 16
    assert taps_mod.aliasing(224 * 224 * 4, 6)                  # six rows on one set
    assert not taps_mod.aliasing(112 * 112 * 4, 6)             # two per set
    assert not taps_mod.aliasing(56 * 56 * 4, 6)


def test_panel_masks_mark_what_lies_outside_the_image():
    from tilegemm.conv import taps as taps_mod
    p = conv_params((1, 2, 3, 5), (4, 2, 3, 3), padding=1)      # grid: 3 rows of 5
    masks, sched = taps_mod.panel_masks(p, 8, np.float32, group=False)
    assert masks.dtype == np.int32 and sched.shape == (2, 9 + 2)
    assert (sched[:, 9] == 0).all()                               # no masked sum

    # Taps column by column: tap j*3 + i is kernel row i, column j.
    def lanes(panel, tap):
        at = sched[panel, tap]
        return [1] * 8 if at < 0 else list(masks[at:at + 8] != 0)

    # Panel 0: grid columns 0-7 = row 0 (columns 0-4), row 1 (columns 0-2).
    assert lanes(0, 4) == [1] * 8                                 # centre tap
    assert lanes(0, 1) == [0, 1, 1, 1, 1, 0, 1, 1]               # reads column - 1
    assert lanes(0, 7) == [1, 1, 1, 1, 0, 1, 1, 1]               # reads column + 1
    assert lanes(0, 3) == [0, 0, 0, 0, 0, 1, 1, 1]               # reads the row above
    # Panel 1: grid columns 8-15 = row 1 (3, 4), row 2 (0-4), then past the grid.
    assert lanes(1, 4) == [1, 1, 1, 1, 1, 1, 1, 0]
    assert lanes(1, 5) == [1, 1, 0, 0, 0, 0, 0, 0]               # reads the row below
    # Patterns are stored once each.
    assert len({tuple(masks[i:i + 8]) for i in range(0, masks.size, 8)}) == masks.size // 8


def test_panel_masks_mask_the_sum_of_the_left_column_where_its_reads_stay_inside():
    from tilegemm.conv import taps as taps_mod
    p = conv_params((1, 2, 6, 5), (4, 2, 3, 3), padding=1)      # grid: 6 rows of 5
    masks, sched = taps_mod.panel_masks(p, 8, np.float32)
    _, loads = taps_mod.panel_masks(p, 8, np.float32, group=False)
    # Panel 0 holds row 0, whose row above lies outside the image: no masked sum.
    # Panel 1 (rows 1-3, row starts at grid columns 10 and 15): taps 0-2 (column - 1)
    # wrap only into rows 0-4, share one pattern, and are summed then masked once.
    assert sched[0, 9] == 0 and (sched[0, :9] == loads[0, :9]).all()
    assert sched[1, 9] == 3
    assert (sched[1, :3] == -1).all() and (sched[1, 3:9] == loads[1, 3:9]).all()
    assert list(masks[sched[1, 10]:sched[1, 10] + 8] != 0) == [1, 1, 0, 1, 1, 1, 1, 0]
    assert (sched[1, 10] == loads[1, :3]).all()


@pytest.mark.parametrize("H, W", [(9, 13), (7, 7), (14, 14), (5, 3)])
@pytest.mark.parametrize("column", [0, -1])
def test_wrapped_reads_never_reach_the_output(H, W, column):
    """Inf and NaN in an image's first (last) column: in the stride-1 layout the taps
    left (right) of the other end of the neighbouring rows read them through the row's
    edge, and those outputs must stay finite."""
    x = RNG.standard_normal((2, 64, H, W)).astype(np.float32)
    x[:, ::3, :, column] = np.inf
    x[:, 1::3, 1:, column] = np.nan
    x[:, 2::3, ::2, column] = -np.inf
    w = RNG.standard_normal((8, 64, 3, 3)).astype(np.float32)
    expected = reference_conv(x, w, padding=1)
    got = tilegemm.conv2d(x, w, padding=1, algorithm="im2col")
    assert np.isfinite(expected[:, :, :, -1 - column]).all()
    np.testing.assert_array_equal(np.isnan(got), np.isnan(expected))
    np.testing.assert_array_equal(np.isinf(got), np.isinf(expected))
    finite = np.isfinite(expected)
    np.testing.assert_allclose(got[finite], expected[finite], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("N, H, W", [(2, 7, 7), (3, 9, 13), (5, 14, 14), (2, 3, 5), (4, 1, 17),
                                     (1, 7, 9), (20, 3, 5)])
@pytest.mark.parametrize("C, K", [(64, 13), (80, 6)])
@pytest.mark.parametrize("threads", [1, 2])
def test_im2col_batched_tails(N, H, W, C, K, threads):
    """The grid columns after each image's last whole panel, run as GEMMs over the
    batch: partial row panels, several channel blocks, bias and activation fused on
    the last, grids shorter than a panel, several GEMMs (20 images of 15 columns),
    one thread or two."""
    import numba
    x = RNG.standard_normal((N, C, H, W)).astype(np.float32)
    w = RNG.standard_normal((K, C, 3, 3)).astype(np.float32)
    b = RNG.standard_normal(K).astype(np.float32)
    expected = reference_conv(x, w, b, padding=1, activation="relu6")
    before = numba.get_num_threads()
    numba.set_num_threads(min(threads, numba.config.NUMBA_NUM_THREADS))
    try:
        got = tilegemm.conv2d(x, w, b, padding=1, activation="relu6", algorithm="im2col")
    finally:
        numba.set_num_threads(before)
    np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("shape, kw_args", [
    ((2, 64, 56, 56), dict(stride=2, padding=1)),
    ((3, 64, 23, 19), dict(stride=2, padding=1)),
    ((2, 64, 24, 20), dict(stride=2, padding=2, dilation=2)),
    ((2, 64, 21, 21), dict(stride=3, padding=1)),
    ((2, 64, 16, 16), dict(stride=(2, 1), padding=1)),
    ((2, 64, 16, 17), dict(stride=(1, 2), padding=1)),
    ((1, 64, 2, 2), dict(stride=2, padding=1)),
])
@pytest.mark.parametrize("threads", [1, 2])
def test_im2col_unpadded_phase_copy(shape, kw_args, threads, monkeypatch):
    """Strided layers whose phase planes are as wide as the output: an unpadded copy read
    through load masks and masked sums, tiles stored straight into the output."""
    import numba
    from tilegemm.conv import taps as taps_mod
    K = 13
    p = conv_params(shape, (K, shape[1], 3, 3), **kw_args)
    assert taps_mod.layout_of(p) == taps_mod.PHASED and taps_mod.serves(p)
    x = RNG.standard_normal(shape).astype(np.float32)
    w = RNG.standard_normal((K, shape[1], 3, 3)).astype(np.float32)
    b = RNG.standard_normal(K).astype(np.float32)
    expected = reference_conv(x, w, b, activation="relu6", **kw_args)
    before = numba.get_num_threads()
    numba.set_num_threads(min(threads, numba.config.NUMBA_NUM_THREADS))
    try:
        got = tilegemm.conv2d(x, w, b, activation="relu6", _path="im2col.taps", **kw_args)
    finally:
        numba.set_num_threads(before)
    np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("column", [0, 1, -1, -2])
def test_wrapped_reads_never_reach_the_output_of_a_strided_layer(column):
    """Inf and NaN in one image column of a stride-2 layer: the unpadded phase planes'
    masked sums read neighbouring rows' values, which must not reach the output."""
    x = RNG.standard_normal((2, 64, 14, 18)).astype(np.float32)
    x[:, ::2, :, column] = np.inf
    x[:, 1::2, 1:, column] = np.nan
    w = RNG.standard_normal((8, 64, 3, 3)).astype(np.float32)
    expected = reference_conv(x, w, stride=2, padding=1)
    got = tilegemm.conv2d(x, w, stride=2, padding=1, algorithm="im2col")
    assert np.isfinite(expected).any()
    np.testing.assert_array_equal(np.isnan(got), np.isnan(expected))
    np.testing.assert_array_equal(np.isinf(got), np.isinf(expected))
    finite = np.isfinite(expected)
    np.testing.assert_allclose(got[finite], expected[finite], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("H, W, sy, sx, py, px", [
    (5, 7, 1, 1, 1, 1), (6, 37, 1, 2, 1, 1), (9, 40, 2, 2, 1, 0), (4, 3, 2, 2, 2, 3),
    (7, 19, 3, 3, 1, 1), (3, 70, 1, 2, 0, 5), (6, 56, 2, 2, 0, 0), (5, 33, 2, 2, 0, 0),
    (4, 18, 2, 2, 1, 1), (3, 10, 2, 2, 0, 0)])
@pytest.mark.parametrize("spill", [False, True])
def test_phase_split_matches_numpy(dtype, H, W, sy, sx, py, px, spill):
    """The stride-split padded copy, vector rows (stride 1 and 2, whole vectors, the
    last one overlapped or masked) and scalar (3) alike; with ``spill`` nothing is
    written past a vector after the last channel."""
    mod = engine.family_module("shared", dtype)
    C = 3
    x = np.random.default_rng(H * W).standard_normal((C, H, W)).astype(dtype)
    Hq, Wq = -(-(H + 2 * py) // sy), -(-(W + 2 * px) // sx)
    chan = sy * sx * Hq * Wq
    slack = mod.LANES if spill else 0
    xq = np.full(C * chan + slack + 5, 9.0, dtype)
    trampoline(mod.phase_split)(x.reshape(-1), (0, H * W, W), (C, H, W), (sy, sx, py, px), (Hq, Wq, chan),
                    xq, spill)
    padded = np.zeros((C, Hq * sy, Wq * sx), dtype)
    padded[:, py:py + H, px:px + W] = x
    for a in range(sy):
        for b in range(sx):
            got = xq[:C * chan].reshape(C, sy * sx, Hq, Wq)[:, a * sx + b]
            np.testing.assert_array_equal(got, padded[:, a::sy, b::sx], err_msg=f"phase ({a}, {b})")
    assert np.all(xq[C * chan + slack:] == 9.0), "phase_split wrote past its channels"


@pytest.mark.parametrize("K", [8, 10, 14, 16, 9, 11])
@pytest.mark.parametrize("N", [1, 2])
def test_taps_path_last_row_panel(K, N):
    """Output channels leaving 2 or 4 rows of a 6-row tile (8, 10, 14, 16) take the short
    kernels straight into the output, others (9, 11) the C buffer; with a partial last
    column panel (13x13 grid: 169 columns) for one image, batched tails for two."""
    C, H = 64, 13
    x = RNG.standard_normal((N, C, H, H)).astype(np.float32)
    w = RNG.standard_normal((K, C, 3, 3)).astype(np.float32)
    b = RNG.standard_normal(K).astype(np.float32)
    expected = reference_conv(x, w, b, padding=1, activation="relu6")
    got = tilegemm.conv2d(x, w, b, padding=1, activation="relu6", algorithm="im2col")
    assert np.abs(got - expected).max() <= tolerance(x, w, np.float32)
