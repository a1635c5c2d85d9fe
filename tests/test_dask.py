"""tilegemm.dask on dask's local schedulers: results equal to the local functions
for every chunking (ragged edges, spatial chunks with halos), the chunks the blocking
model chooses, the threads a task takes, and clear errors for bad input.
The distributed cluster is tested in test_dask_cluster.py."""
import threading

import dask
import dask.array as da
import dask.system
import numpy as np
import pytest
from hypothesis import given, strategies as st

import tilegemm
import tilegemm.dask as tdd
from fuzz_settings import fuzz_settings
from guard import GUARD_PAGES, guarded_empty
from net_models import assert_close, random_input, resnet

SCHEDULERS = ("sync", "threads")


def _rng(seed=0):
    return np.random.default_rng(seed)


def _close(got, expected, dtype):
    eps = np.finfo(dtype).eps
    scale = max(float(np.max(np.abs(expected), initial=0.0)), 1.0)
    np.testing.assert_allclose(got, expected, rtol=0, atol=64 * eps * scale)


@pytest.mark.parametrize("scheduler", SCHEDULERS)
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_matmul_of_ragged_chunks_equals_the_local_product(scheduler, dtype):
    rng = _rng()
    a = rng.standard_normal((301, 257)).astype(dtype)
    b = rng.standard_normal((257, 190)).astype(dtype)
    c = tdd.matmul(da.from_array(a, chunks=(100, 60)), da.from_array(b, chunks=(60, 77)))
    assert c.chunks == ((100, 100, 100, 1), (77, 77, 36))
    got = c.compute(scheduler=scheduler)
    assert got.dtype == dtype and got.shape == (301, 190)
    _close(got, a.astype(np.float64) @ b, dtype)


def test_mismatched_k_chunks_are_rechunked_to_a_s():
    rng = _rng(1)
    a, b = rng.standard_normal((40, 90)), rng.standard_normal((90, 30))
    c = tdd.matmul(da.from_array(a, chunks=(20, 25)), da.from_array(b, chunks=(40, 30)))
    _close(c.compute(scheduler="sync"), a @ b, np.float64)


def test_batches_broadcast_and_vectors_as_in_numpy():
    rng = _rng(2)
    x = rng.standard_normal((5, 1, 30, 40))
    y = rng.standard_normal((3, 40, 20))
    v = rng.standard_normal(40)
    X = da.from_array(x, chunks=(2, 1, 16, 13))
    Y = da.from_array(y, chunks=(2, 13, 7))
    for got, expected in ((tdd.matmul(X, Y), x @ y), (tdd.matmul(X, v), x @ v),
                          (tdd.matmul(v, Y), v @ y), (tdd.matmul(v, v), v @ v)):
        assert got.shape == expected.shape
        _close(got.compute(scheduler="threads"), expected, np.float64)


def test_numpy_operands_and_mixed_dtypes():
    rng = _rng(3)
    a = rng.standard_normal((64, 48)).astype(np.float32)
    b = rng.standard_normal((48, 20))
    c = tdd.matmul(a, b)                       # numpy in: wrapped as one chunk each
    assert c.dtype == np.float64 and c.numblocks == (1, 1)
    _close(c.compute(scheduler="sync"), a.astype(np.float64) @ b, np.float64)


def test_rechunk_cuts_cache_block_multiples_within_the_task_memory():
    m, n, k = 1000, 5000, 3000
    blocks = tilegemm.tuning.blocking(np.float32)
    limit = 8 << 20
    mc, nc, kc = tdd.matmul_chunks(m, n, k, np.float32, task_memory=limit, parallelism=4)
    assert sum(mc) == m and sum(nc) == n and sum(kc) == k
    for chunks, step, tile in ((mc, blocks.mc, blocks.mr), (nc, blocks.nc, blocks.nr),
                               (kc, blocks.kc, 16)):
        # whole cache blocks, or where one does not fit the memory, a power-of-two
        # fraction of one in whole register tiles (a large L2's NC: 20480 columns)
        unit = step
        while chunks[0] < unit and unit > tile:
            unit = max(tile, unit // 2 // tile * tile)
        assert all(size % unit == 0 for size in chunks[:-1]), (chunks, step, unit)
        # even chunks, unless they are down to one cache block
        assert chunks[-1] <= chunks[0] and (4 * chunks[-1] >= 3 * chunks[0] or chunks[0] == unit)
    assert 4 * (mc[0] * kc[0] + kc[0] * nc[0] + mc[0] * nc[0]) <= limit
    assert len(mc) * len(nc) >= 4
    # room for everything: one chunk each, once there are blocks of C for every slot
    assert tdd.matmul_chunks(100, 100, 100, parallelism=1) == ((100,), (100,), (100,))
    assert tdd.matmul_chunks(16384, 16384, 16384, task_memory="1GiB", parallelism=1) \
        != tdd.matmul_chunks(16384, 16384, 16384, task_memory="128MiB", parallelism=1)


def test_rechunked_product_is_right():
    rng = _rng(4)
    a = rng.standard_normal((700, 1300)).astype(np.float32)
    b = rng.standard_normal((1300, 90)).astype(np.float32)
    c = tdd.matmul(a, b, rechunk=True, task_memory="1MiB")
    assert len(c.chunks[0]) > 1
    _close(c.compute(scheduler="threads"), a.astype(np.float64) @ b, np.float32)


def test_tree_sum_over_many_k_blocks():
    rng = _rng(5)
    a, b = rng.standard_normal((9, 200)), rng.standard_normal((200, 7))
    c = tdd.matmul(da.from_array(a, chunks=(9, 10)), da.from_array(b, chunks=(10, 7)),
                   split_every=3)
    _close(c.compute(scheduler="sync"), a @ b, np.float64)


@pytest.mark.parametrize("a, b, error, text", [
    (np.ones((3, 4), np.int32), np.ones((4, 2)), TypeError, "int32"),
    (np.ones((3, 4)), np.ones((4, 2), np.complex128), TypeError, "complex128"),
    (np.ones((3, 4)), np.ones((5, 2)), ValueError, "do not match"),
    (np.ones((2, 3, 4)), np.ones((3, 4, 2)), ValueError, "broadcast"),
    (np.float64(1.0), np.ones((2, 2)), ValueError, "scalar"),
])
def test_matmul_bad_input(a, b, error, text):
    with pytest.raises(error, match=text):
        tdd.matmul(a, b)


def test_bad_options():
    a = da.ones((4, 4), chunks=2)
    with pytest.raises(ValueError, match="task_memory"):
        tdd.matmul_chunks(10, 10, 10, task_memory=0)
    with pytest.raises(ValueError, match="task_memory"):
        tdd.matmul(a, a, task_memory=-1)
    with pytest.raises(ValueError, match="parallelism"):
        tdd.matmul_chunks(10, 10, 10, parallelism=0)
    with pytest.raises(ValueError, match="split_every"):
        tdd.matmul(a, a, split_every=1)
    with pytest.raises(TypeError, match="threads"):
        tdd.matmul(a, a, threads="2")
    unknown = a[a[:, 0] > 0]                                   # rows of unknown count
    with pytest.raises(ValueError, match="unknown"):
        tdd.matmul(unknown, a)


def test_rechunk_cuts_batches_to_the_task_memory():
    rng = _rng(12)
    a = rng.standard_normal((40, 30, 20))
    b = rng.standard_normal((40, 20, 10))
    limit = 4 * 8 * (30 * 20 + 20 * 10 + 30 * 10)
    c = tdd.matmul(a, b, rechunk=True, task_memory=limit)
    mc, nc, kc = tdd.matmul_chunks(30, 10, 20, np.float64, task_memory=limit)
    items = limit // (8 * (mc[0] * kc[0] + kc[0] * nc[0] + mc[0] * nc[0]))
    assert c.chunks[1:] == (mc, nc) and 4 <= c.chunks[0][0] == min(40, items)
    _close(c.compute(scheduler="threads"), a @ b, np.float64)


def test_nan_and_inf_propagate():
    a = np.ones((6, 8))
    a[1, 3], a[4, 0] = np.nan, np.inf
    b = np.ones((8, 5))
    got = tdd.matmul(da.from_array(a, chunks=(3, 3)), da.from_array(b, chunks=(3, 2)))
    np.testing.assert_array_equal(got.compute(scheduler="sync"), a @ b)


def _chunking(draw, extent):
    if extent == 0:
        return (0,)
    cuts = draw(st.lists(st.integers(1, max(1, extent - 1)), max_size=3, unique=True))
    bounds = [0] + sorted(c for c in cuts if 0 < c < extent) + [extent]
    return tuple(b - a for a, b in zip(bounds, bounds[1:])) or (extent,)


@st.composite
def _products(draw):
    m, n, k = (draw(st.integers(0, 70)) for _ in range(3))
    batch_a = draw(st.sampled_from([(), (1,), (3,), (2, 1)]))
    batch_b = draw(st.sampled_from([(), (1,), (3,), (1, 3)]))
    if len(batch_a) == 2 and batch_b == (3,):
        batch_a = (2, 3)
    dtype = draw(st.sampled_from([np.float32, np.float64]))
    chunks_a = tuple(_chunking(draw, e) if e > 1 else (e,) for e in batch_a)
    chunks_b = tuple(_chunking(draw, e) if e > 1 else (e,) for e in batch_b)
    return (batch_a, batch_b, m, n, k, dtype,
            [chunks_a + (_chunking(draw, m), _chunking(draw, k)),
             chunks_b + (_chunking(draw, k), _chunking(draw, n))])


@fuzz_settings(scale=0.25)
@given(_products())
def test_fuzz_matmul_against_numpy(case):
    batch_a, batch_b, m, n, k, dtype, (chunks_a, chunks_b) = case
    rng = _rng(m * 7 + n * 3 + k)
    a = rng.standard_normal(batch_a + (m, k)).astype(dtype)
    b = rng.standard_normal(batch_b + (k, n)).astype(dtype)
    a0, b0 = a.copy(), b.copy()
    got = tdd.matmul(da.from_array(a, chunks=chunks_a), da.from_array(b, chunks=chunks_b))
    expected = a.astype(np.float64) @ b
    assert got.shape == expected.shape
    _close(got.compute(scheduler="sync"), expected, dtype)
    np.testing.assert_array_equal(a, a0)
    np.testing.assert_array_equal(b, b0)


@pytest.mark.skipif(not GUARD_PAGES, reason="no mmap/mprotect here")
@pytest.mark.parametrize("where", ["after", "before"])
def test_blocks_against_guard_pages(where):
    rng = _rng(6)
    a = guarded_empty((67, 45), np.float32, where=where)
    b = guarded_empty((45, 33), np.float32, where=where)
    x = guarded_empty((3, 5, 13, 11), np.float32, where=where)
    a[...] = rng.standard_normal(a.shape)
    b[...] = rng.standard_normal(b.shape)
    x[...] = rng.standard_normal(x.shape)
    c = tdd.matmul(da.from_array(a, chunks=(30, 20)), da.from_array(b, chunks=(20, 16)))
    _close(c.compute(scheduler="sync"), a.astype(np.float64) @ b, np.float32)
    w = rng.standard_normal((4, 5, 3, 3)).astype(np.float32)
    y = tdd.conv2d(da.from_array(x, chunks=(2, 5, 6, 5)), w, padding=1)
    _close(y.compute(scheduler="sync"), tilegemm.conv2d(x, w, padding=1), np.float32)


@st.composite
def _conv_layers(draw):
    kh, kw = draw(st.integers(1, 4)), draw(st.integers(1, 4))
    sy, sx = draw(st.integers(1, 3)), draw(st.integers(1, 3))
    dy, dx = draw(st.integers(1, 2)), draw(st.integers(1, 2))
    py, px = draw(st.integers(0, 2)), draw(st.integers(0, 2))
    h = draw(st.integers(max(1, dy * (kh - 1) + 1 - 2 * py), 20))
    w = draw(st.integers(max(1, dx * (kw - 1) + 1 - 2 * px), 20))
    n, c = draw(st.integers(1, 3)), draw(st.integers(1, 5))
    layout = draw(st.sampled_from(["NCHW", "NHWC"]))
    chunks = (_chunking(draw, n), (c,), _chunking(draw, h), _chunking(draw, w))
    if layout == "NHWC":
        chunks = (chunks[0], chunks[2], chunks[3], chunks[1])
    return dict(shape=(n, c, h, w), kernel=(kh, kw), stride=(sy, sx), dilation=(dy, dx),
                padding=(py, px), layout=layout, chunks=chunks)


@fuzz_settings(scale=0.25)
@given(_conv_layers())
def test_fuzz_conv2d_windows_against_the_local_call(case):
    n, c, h, w = case["shape"]
    rng = _rng(n + 3 * c + 5 * h + 7 * w)
    x = rng.standard_normal((n, c, h, w)).astype(np.float32)
    if case["layout"] == "NHWC":
        x = np.ascontiguousarray(x.transpose(0, 2, 3, 1))
    weight = rng.standard_normal((3, c) + case["kernel"]).astype(np.float32)
    geometry = dict(stride=case["stride"], padding=case["padding"],
                    dilation=case["dilation"], layout=case["layout"])
    expected = tilegemm.conv2d(x, weight, **geometry)
    got = tdd.conv2d(da.from_array(x, chunks=case["chunks"]), weight, **geometry)
    assert got.shape == expected.shape
    _close(got.compute(scheduler="sync"), expected, np.float32)


CONV_CASES = [dict(padding=1), dict(stride=2, padding=1), dict(padding=2, dilation=2),
              dict(padding="same"), dict(stride=(2, 3), padding=(0, 2)),
              dict(groups=4, padding=1)]


@pytest.mark.parametrize("kw", CONV_CASES, ids=lambda kw: ",".join(f"{k}={v}" for k, v in kw.items()))
@pytest.mark.parametrize("chunks", [(2, 16, 23, 19), (2, 16, 8, 7), (1, 5, 5, 19), (3, 16, 4, 6)])
def test_conv2d_by_batch_and_spatial_chunks(kw, chunks):
    rng = _rng(7)
    x = rng.standard_normal((5, 16, 23, 19)).astype(np.float32)
    w = rng.standard_normal((8, 16 // kw.get("groups", 1), 3, 3)).astype(np.float32)
    bias = rng.standard_normal(8).astype(np.float32)
    expected = tilegemm.conv2d(x, w, bias, activation="relu", **kw)
    y = tdd.conv2d(da.from_array(x, chunks=chunks), w, bias, activation="relu", **kw)
    assert y.shape == expected.shape and y.chunks[0] == da.from_array(x, chunks=chunks).chunks[0]
    _close(y.compute(scheduler="threads"), expected, np.float32)


@pytest.mark.parametrize("rows", [(1, 9), (9, 1), (1, 1, 8), (4, 6)])
def test_conv2d_chunks_in_the_padding(rows):
    # 1x1 kernel, padding 2: the first and last output rows read only zeros
    rng = _rng(10)
    x = rng.standard_normal((2, 3, 10, 7)).astype(np.float32)
    w = rng.standard_normal((4, 3, 1, 1)).astype(np.float32)
    expected = tilegemm.conv2d(x, w, padding=2)
    got = tdd.conv2d(da.from_array(x, chunks=(1, 3, rows, (3, 4))), w, padding=2)
    assert got.shape == expected.shape
    _close(got.compute(scheduler="sync"), expected, np.float32)


def test_conv2d_options_and_dtypes_as_conv2d():
    rng = _rng(11)
    x = rng.standard_normal((2, 4, 8, 8)).astype(np.float32)
    w = rng.standard_normal((3, 4, 3, 3)).astype(np.float32)
    bias = rng.standard_normal(3)                               # float64: float64 result
    y = tdd.conv2d(da.from_array(x, chunks=(1, 4, 8, 8)), w, bias, padding=1)
    assert y.dtype == tilegemm.conv2d(x, w, bias, padding=1).dtype == np.float64
    xh = np.ascontiguousarray(x.transpose(0, 2, 3, 1))
    lower = tdd.conv2d(da.from_array(xh, chunks=(1, 4, 8, 4)), tilegemm.ConvWeights(w),
                       padding=1, layout="nhwc", algorithm="winograd", winograd_tile=2)
    _close(lower.compute(scheduler="sync"), tilegemm.conv2d(xh, w, padding=1, layout="NHWC"),
           np.float32)
    # the weights are frozen when the graph is built: later changes do not reach it
    w2 = w.copy()
    y2 = tdd.conv2d(da.from_array(x, chunks=(1, 4, 8, 8)), w2, padding=1)
    w2[...] = 0
    _close(y2.compute(scheduler="sync"), tilegemm.conv2d(x, w, padding=1), np.float32)


def test_conv2d_nhwc_and_numpy_input():
    rng = _rng(8)
    x = rng.standard_normal((3, 12, 10, 16)).astype(np.float32)
    w = rng.standard_normal((24, 16, 3, 3)).astype(np.float32)
    expected = tilegemm.conv2d(x, w, padding=1, layout="NHWC")
    got = tdd.conv2d(da.from_array(x, chunks=(2, 5, 4, 8)), w, padding=1, layout="NHWC")
    _close(got.compute(scheduler="threads"), expected, np.float32)
    whole = tdd.conv2d(x, w, padding=1, layout="NHWC")      # numpy: one image a chunk
    assert whole.chunks[0] == (1, 1, 1)
    _close(whole.compute(scheduler="sync"), expected, np.float32)


@pytest.mark.parametrize("call, error, text", [
    (lambda x, w: tdd.conv2d(x, w, residual=x), TypeError, "residual"),
    (lambda x, w: tdd.conv2d(x, w[:, :3]), ValueError, "channel"),
    (lambda x, w: tdd.conv2d(x.astype(np.int32), w), TypeError, "int32"),
    (lambda x, w: tdd.conv2d(x[0], w), ValueError, "4-D"),
    (lambda x, w: tdd.conv2d(x, w, stride=0), ValueError, "stride"),
    (lambda x, w: tdd.conv2d(x, w, np.ones(2, np.float32)), ValueError, "bias"),
    (lambda x, w: tdd.conv2d(x, w.astype(np.int8)), TypeError, "int8"),
    (lambda x, w: tdd.conv2d(x, w, activation="tanh"), ValueError, "activation"),
    (lambda x, w: tdd.conv2d(x, w, stride=2, algorithm="winograd"), ValueError, "winograd"),
    (lambda x, w: tdd.conv2d(x, w, threads=0), ValueError, "threads"),
])
def test_conv2d_bad_input(call, error, text):
    x = np.ones((2, 4, 8, 8), np.float32)
    with pytest.raises(error, match=text):
        call(x, np.ones((3, 4, 3, 3), np.float32))


def test_conv_weights_prepared_once_per_process():
    rng = _rng(9)
    w = rng.standard_normal((6, 4, 3, 3)).astype(np.float32)
    x = da.from_array(rng.standard_normal((8, 4, 9, 9)).astype(np.float32), chunks=(1, 4, 9, 9))
    before = tdd.worker_builds()["conv"]
    tdd.conv2d(x, w, padding=1).compute(scheduler="threads")
    tdd.conv2d(x, w, padding=1).compute(scheduler="threads")
    assert tdd.worker_builds()["conv"] == before + 1


def test_run_network_by_batch_chunks():
    net = tilegemm.load_onnx(resnet())
    x = random_input((5, 3, 32, 32))
    got = tdd.run_network(net, da.from_array(x, chunks=(2, 3, 16, 32)))
    assert got.chunks[0] == (2, 2, 1)
    assert_close(got.compute(scheduler="threads"), net(x))


def test_run_network_refuses_several_inputs():
    from onnx import TensorProto, helper
    inputs = [helper.make_tensor_value_info(name, TensorProto.FLOAT, ["N", 4]) for name in "xz"]
    output = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 4])
    graph = helper.make_graph([helper.make_node("Add", ["x", "z"], ["y"])], "two", inputs,
                              [output])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    with pytest.raises(ValueError, match="inputs"):
        tdd.run_network(model, np.ones((2, 4), np.float32))


def test_task_threads_share_the_cores():
    cores = int(dask.system.CPU_COUNT)
    assert tdd.task_threads(3) == 3
    assert tdd.task_threads() is None                 # the synchronous scheduler's caller
    seen = []
    thread = threading.Thread(target=lambda: seen.append(tdd.task_threads()))
    with dask.config.set(num_workers=1):
        thread.start()
        thread.join()
    assert seen == [cores]                            # one pool thread: every core
    seen.clear()
    thread = threading.Thread(target=lambda: seen.append(tdd.task_threads()))
    with dask.config.set(num_workers=2 * cores):
        thread.start()
        thread.join()
    assert seen == [1]
