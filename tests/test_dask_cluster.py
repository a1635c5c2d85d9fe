"""tilegemm.dask on a real ``distributed.LocalCluster``: two worker processes on this
machine (loopback only), started and closed by the fixture.  Results equal to the
local functions, weights and networks built once per worker, each worker's threads
within its share of the cores, and a worker killed mid-computation."""
import json
import os
import signal
import time

import dask.array as da
import numpy as np
import pytest
from distributed import Client, LocalCluster, get_task_stream

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
    with get_task_stream(client) as stream:
        got = c.compute()
    np.testing.assert_allclose(got, tilegemm.matmul(a, b), rtol=0,
                               atol=64 * np.finfo(np.float32).eps * np.abs(a @ b).max())
    assert {task["worker"] for task in stream.data} == set(_workers(client))


def test_each_worker_gets_its_share_of_the_cores(client):
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    threads = tdd.set_worker_threads(client)          # two workers of one thread here
    assert sorted(threads) == _workers(client)
    assert set(threads.values()) == {max(1, cores // 2)}
    # and tasks run with that limit
    seen = client.gather(client.map(lambda i: (tdd.task_threads(), tilegemm.get_num_threads()),
                                    range(4), pure=False))
    assert all(t == max(1, cores // 2) for t, _ in seen)


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
    deadline = time.monotonic() + 30
    while not any(client.processing().values()) and time.monotonic() < deadline:
        time.sleep(0.01)
    victim = _workers(client)[0]
    assert not future.done()
    os.kill(pids[victim], signal.SIGKILL)
    got = future.result(timeout=120)
    np.testing.assert_allclose(got, a @ b, rtol=1e-12, atol=1e-10)
    client.wait_for_workers(2, timeout=60)
    assert pids[victim] not in client.run(os.getpid).values()


def test_the_benchmark_command_reports_every_party(tmp_path):
    from tilegemm.tools import cli
    assert cli.main(["dask", "--n", "300", "--batch", "2", "--repeats", "1",
                     "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "dask.json").read_text())
    assert set(report["gemm"]) == {"dask A @ B (numpy blocks)", "tilegemm.dask.matmul, same chunks",
                                   "tilegemm.dask.matmul, rechunk=True",
                                   "tilegemm.matmul, one local call"}
    for row in list(report["gemm"].values()) + list(report["conv"].values()):
        assert row["seconds"] > 0 and row["gflops"] > 0
        if row["shares"] is not None:
            share = row["shares"]
            assert abs(share["compute"] + share["idle"] - 1) < 1e-9 or share["idle"] == 0
    assert len(report["64^3 call us"]["workers"]) == 2
    text = (tmp_path / "dask.md").read_text()
    assert "300^3 float32 product" in text and "x dask numpy" in text
    assert cli.main(["dask", "--n", "0"]) == 2
