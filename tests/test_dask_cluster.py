"""tilegemm.dask on a real ``distributed.LocalCluster``: two worker processes on this
machine (loopback only), started and closed by the fixture.  Results equal to the
local functions, weights and networks built once per worker, each worker's threads
within its share of the cores, and a worker killed mid-computation."""
import os
import signal
import time

import dask.array as da
import dask.system
import numpy as np
import pytest
from distributed import Client, LocalCluster

import tilegemm
import tilegemm.dask as tdd
from net_models import assert_close, mobilenet, random_input


@pytest.fixture(scope="module")
def client():
    cluster = LocalCluster(n_workers=2, threads_per_worker=1, processes=True,
                           host="127.0.0.1", dashboard_address=":0")
    with Client(cluster) as c:
        yield c
    cluster.close()


def _workers(client):
    return sorted(client.scheduler_info()["workers"])


def test_matmul_on_the_cluster_equals_the_local_product(client):
    rng = np.random.default_rng(0)
    a = rng.standard_normal((600, 500)).astype(np.float32)
    b = rng.standard_normal((500, 310)).astype(np.float32)
    c = tdd.matmul(da.from_array(a, chunks=(250, 200)), da.from_array(b, chunks=(200, 170)))
    got = c.compute()
    np.testing.assert_allclose(got, tilegemm.matmul(a, b), rtol=0,
                               atol=64 * np.finfo(np.float32).eps * np.abs(a @ b).max())


def test_each_worker_gets_its_share_of_the_cores(client):
    share = max(1, int(dask.system.CPU_COUNT) // 2)      # two workers of one thread here
    threads = tdd.set_worker_threads(client)
    assert sorted(threads) == _workers(client)
    assert set(threads.values()) == {share}
    # and every task takes that limit
    seen = client.gather(client.map(lambda i: tdd.task_threads(), range(4), pure=False))
    assert all(n == share for n in seen), seen


def test_conv_weights_prepared_once_per_worker(client):
    rng = np.random.default_rng(1)
    w = rng.standard_normal((16, 8, 3, 3)).astype(np.float32)
    x = rng.standard_normal((12, 8, 14, 14)).astype(np.float32)
    before = client.run(tdd.worker_builds)
    y = tdd.conv2d(da.from_array(x, chunks=(1, 8, 14, 14)), w, padding=1, activation="relu")
    np.testing.assert_allclose(y.compute(), tilegemm.conv2d(x, w, padding=1, activation="relu"),
                               rtol=1e-5, atol=1e-4)
    after = client.run(tdd.worker_builds)
    built = {addr: after[addr]["conv"] - before[addr]["conv"] for addr in after}
    assert all(n <= 1 for n in built.values()) and sum(built.values()) >= 1, built


def test_run_network_loads_one_network_per_worker(client):
    net = tilegemm.load_onnx(mobilenet())
    x = random_input((6, 4, 15, 15))
    before = client.run(tdd.worker_builds)
    got = tdd.run_network(net, da.from_array(x, chunks=(1, 4, 15, 15))).compute()
    assert_close(got, net(x))
    after = client.run(tdd.worker_builds)
    built = [after[addr]["network"] - before[addr]["network"] for addr in after]
    assert all(n <= 1 for n in built) and sum(built) >= 1, built


def test_a_worker_killed_mid_computation_is_retried(client):
    # generated on the workers, chunk by chunk, the same values each time
    A = da.random.RandomState(2).standard_normal((1200, 1200), chunks=150)
    B = da.random.RandomState(3).standard_normal((1200, 1200), chunks=150)
    a, b = client.compute([A, B], sync=True)
    future = client.compute(tdd.matmul(A, B))
    pids = client.run(os.getpid)
    deadline = time.monotonic() + 60
    busy = []
    while not busy and time.monotonic() < deadline:
        busy = [worker for worker, keys in client.processing().items() if keys]
        time.sleep(0.005)
    assert busy and not future.done(), "the product never ran or ended before the kill"
    victim = busy[0]
    os.kill(pids[victim], signal.SIGKILL)
    got = future.result(timeout=120)
    np.testing.assert_allclose(got, a @ b, rtol=1e-12, atol=1e-10)
    client.wait_for_workers(2, timeout=60)
    assert pids[victim] not in client.run(os.getpid).values()

