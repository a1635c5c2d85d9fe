"""``python -m tilegemm dask``: tilegemm as dask's block kernel on a LocalCluster.

    python -m tilegemm dask [--n 16384] [--batch 256] [--workers 2] [--repeats 2]
        [--out DIR]

Starts a ``distributed.LocalCluster`` of ``--workers`` processes of one thread each
on this machine (loopback), gives each worker its share of the cores
(:func:`tilegemm.dask.set_worker_threads`) and times, in alternating rounds:

* an n x n x n float32 product: dask's own ``A @ B`` (numpy blocks, BLAS on one
  thread per worker as distributed sets it), ``tilegemm.dask.matmul`` on the same
  chunks, ``tilegemm.dask.matmul(rechunk=True)`` (the blocking model's chunks), and
  one local ``tilegemm.matmul`` call on all cores in this process;
* ResNet-18's conv2_x layer (64 -> 64, 3x3, 56 x 56) over a batch of ``--batch``
  images: ``tilegemm.dask.conv2d`` (32 images a chunk) against one local
  ``tilegemm.conv2d`` call.

Every kernel is compiled or loaded first, on small operands.  Operands are generated on the workers and held there (persisted) before timing;
results stay on the workers (the time ends when every block is computed), so
neither the operands' nor the result's trip to this process is timed.  Each
cluster row also gives the share of the workers' thread time spent computing
tasks and idle (the scheduler's overhead, waits for data), and in parentheses the
time blocks spent moving between workers (overlapping both), from distributed's
task stream.  Writes ``dask.md`` and ``dask.json``
to ``--out``.
"""
import argparse
import json
import os
import platform
import sys
import time

import numpy as np

#: Images per chunk of the convolution's batch.
CONV_CHUNK = 32


def build_parser():
    p = argparse.ArgumentParser(prog="tilegemm dask",
                                description="tilegemm as the block kernel of dask arrays on "
                                            "a LocalCluster, against dask's numpy blocks and "
                                            "one local call.")
    p.add_argument("--n", type=int, default=16384, help="square product size (16384)")
    p.add_argument("--batch", type=int, default=256, help="images of ResNet-18 conv2_x (256)")
    p.add_argument("--workers", type=int, default=2, help="worker processes (2)")
    p.add_argument("--repeats", type=int, default=2, help="rounds of every party (2)")
    p.add_argument("--out", default="tilegemm-dask", help="output folder (./tilegemm-dask)")
    return p


def _shares(stream, seconds, slots):
    """Shares of the workers' thread time: computing tasks, and neither computing
    nor waiting on a task (idle: the scheduler's overhead, waits for data); and the
    time blocks spent moving between workers, which overlaps both."""
    compute = transfer = 0.0
    for task in stream:
        for span in task.get("startstops", ()):
            length = span["stop"] - span["start"]
            if span["action"] == "compute":
                compute += length
            elif span["action"] == "transfer":
                transfer += length
    total = seconds * slots
    return {"compute": compute / total, "idle": max(0.0, 1 - compute / total),
            "transfer": transfer / total}


def _cluster_time(client, make):
    """Seconds to compute ``make()`` on the cluster (kept there), and its shares."""
    from distributed import get_task_stream, wait
    slots = sum(w["nthreads"] for w in client.scheduler_info()["workers"].values())
    with get_task_stream(client) as stream:
        start = time.perf_counter()
        result = make().persist()
        wait(result)
        seconds = time.perf_counter() - start
    del result
    return seconds, _shares(stream.data, seconds, slots)


def _local_time(call):
    start = time.perf_counter()
    call()
    return time.perf_counter() - start


def _gemm_parties(client, n, workers):
    import dask.array as da
    from distributed import wait

    import tilegemm
    import tilegemm.dask as tdd
    chunks = da.core.normalize_chunks("auto", (n, n), dtype=np.float32)
    rng = da.random.default_rng(0)
    A = rng.standard_normal((n, n), dtype=np.float32, chunks=chunks).persist()
    B = rng.standard_normal((n, n), dtype=np.float32, chunks=chunks).persist()
    a, b = (np.random.default_rng(s).standard_normal((n, n), dtype=np.float32) for s in (1, 2))
    wait([A, B])
    parties = {
        "dask A @ B (numpy blocks)": lambda: _cluster_time(client, lambda: A @ B),
        "tilegemm.dask.matmul, same chunks": lambda: _cluster_time(
            client, lambda: tdd.matmul(A, B)),
        "tilegemm.dask.matmul, rechunk=True": lambda: _cluster_time(
            client, lambda: tdd.matmul(A, B, rechunk=True)),
        "tilegemm.matmul, one local call": lambda: (_local_time(lambda: tilegemm.matmul(a, b)),
                                                    None),
    }
    rechunked = tdd.matmul_chunks(n, n, n, np.float32, parallelism=workers)
    return parties, {"dask chunks": [chunks[0][0], chunks[1][0]],
                     "rechunk=True chunks (m, n, k)": [c[0] for c in rechunked]}


def _conv_parties(client, batch):
    import dask.array as da
    from distributed import wait

    import tilegemm
    import tilegemm.dask as tdd
    rng = np.random.default_rng(3)
    w = (rng.standard_normal((64, 64, 3, 3)) * 0.06).astype(np.float32)
    shape = (batch, 64, 56, 56)
    X = da.random.default_rng(4).standard_normal(
        shape, dtype=np.float32, chunks=(CONV_CHUNK, 64, 56, 56)).persist()
    x = np.random.default_rng(5).standard_normal(shape, dtype=np.float32)
    wait(X)
    local = tilegemm.ConvWeights(w)
    parties = {
        "tilegemm.dask.conv2d": lambda: _cluster_time(
            client, lambda: tdd.conv2d(X, w, padding=1, activation="relu")),
        "tilegemm.conv2d, one local call": lambda: (_local_time(
            lambda: tilegemm.conv2d(x, local, padding=1, activation="relu")), None),
    }
    return parties, {"chunk": CONV_CHUNK}


def _warm_up(client):
    """Compile (or load) every kernel the parties use, here and on every worker, on
    small operands."""
    import dask.array as da

    import tilegemm
    import tilegemm.dask as tdd
    a = np.ones((512, 512), np.float32)
    x = np.ones((2, 64, 56, 56), np.float32)
    w = np.ones((64, 64, 3, 3), np.float32)
    A = da.from_array(a, chunks=256)
    X = da.from_array(x, chunks=(1, 64, 56, 56))
    for _ in range(2):                      # the same tasks reach both workers
        (A @ A).compute()
        tdd.matmul(A, A).compute()
        tdd.matmul(A, A, rechunk=True).compute()
        tdd.conv2d(X, w, padding=1, activation="relu").compute()
    tilegemm.matmul(a, a)
    tilegemm.conv2d(x, tilegemm.ConvWeights(w), padding=1, activation="relu")


def small_call_us(n=64, calls=2000):
    """Median microseconds of one ``tilegemm.matmul`` of n x n float32, under this
    task's thread limit (run in a task on a worker, or here)."""
    import tilegemm
    import tilegemm.dask as tdd
    a = np.ones((n, n), np.float32)
    out = np.empty_like(a)
    limit = tdd.task_threads()
    with tilegemm.thread_limit(limit or tilegemm.get_num_threads()):
        times = []
        for _ in range(calls):
            start = time.perf_counter()
            tilegemm.matmul(a, a, out=out)
            times.append(time.perf_counter() - start)
    return float(np.median(times) * 1e6)


def _call_here():
    """A small product's time per call in this process on one thread, before the
    cluster starts (its scheduler runs in this process)."""
    import tilegemm
    with tilegemm.thread_limit(1):
        small_call_us()                     # compile or load
        return min(small_call_us() for _ in range(5))


def _call_on_workers(client):
    """The same in a task on each worker (best of 5 tasks)."""
    workers = {}
    for address in client.scheduler_info()["workers"]:
        futures = [client.submit(small_call_us, pure=False, workers=[address])
                   for _ in range(5)]
        workers[address] = min(client.gather(futures))
    return workers


def _rounds(parties, repeats, flops):
    """Every party once per round, the rounds alternating the parties."""
    times = {name: [] for name in parties}
    shares = {}
    for round_ in range(repeats):
        for name, party in parties.items():
            seconds, share = party()
            print(f"  round {round_ + 1}: {name}: {seconds:.3f} s", file=sys.stderr)
            times[name].append(seconds)
            if share is not None and seconds == min(times[name]):
                shares[name] = share
    return {name: {"seconds": min(t), "all": t, "gflops": flops / min(t) / 1e9,
                   "shares": shares.get(name)} for name, t in times.items()}


def _table(title, rows, peer, local):
    lines = [f"### {title}", "",
             "| party | best s | GFLOPS | x dask numpy | x local call | compute / idle "
             "(transfers) |", "|---|---|---|---|---|---|"]
    for name, row in rows.items():
        share = row["shares"]
        share_text = ("-" if share is None else
                      f"{share['compute']:.0%} / {share['idle']:.0%} ({share['transfer']:.0%})")
        vs_peer = f"{rows[peer]['seconds'] / row['seconds']:.2f}x" if peer else "-"
        lines.append(f"| {name} | {row['seconds']:.3f} | {row['gflops']:.1f} | {vs_peer} | "
                     f"{rows[local]['seconds'] / row['seconds']:.2f}x | {share_text} |")
    return "\n".join(lines)


def _overhead_text(calls):
    on_workers = ", ".join(f"{us:.1f}" for us in calls["workers"].values())
    return (f"One 64^3 float32 tilegemm.matmul (median of 2000 calls, best of 5): "
            f"{calls['here, 1 thread']:.1f} us in this process on one thread (before the "
            f"cluster started), {on_workers} us in a task on each worker.")


def _machine():
    from tilegemm import tuning
    from tilegemm.tools.provenance import commit_text, source_commit
    m = tuning.detect()
    return {"cpu": m.brand, "isa": m.isa, "cores": m.cores, "python": platform.python_version(),
            "commit": commit_text(source_commit())}


def run(args):
    from distributed import Client, LocalCluster

    import tilegemm.dask as tdd
    machine = _machine()
    here = _call_here()
    print(f"{machine['cpu']} ({machine['isa']}), {args.workers} worker processes of 1 thread",
          file=sys.stderr)
    with LocalCluster(n_workers=args.workers, threads_per_worker=1, processes=True,
                      host="127.0.0.1", dashboard_address=":0") as cluster, \
            Client(cluster) as client:
        threads = tdd.set_worker_threads(client)
        report = {"machine": machine, "workers": args.workers, "worker threads": threads,
                  "blas threads in workers": client.run(_blas_threads)}
        _warm_up(client)
        report["64^3 call us"] = {"here, 1 thread": here, "workers": _call_on_workers(client)}
        parties, report["gemm setup"] = _gemm_parties(client, args.n, args.workers)
        report["gemm"] = _rounds(parties, args.repeats, 2.0 * args.n ** 3)
        del parties
        parties, report["conv setup"] = _conv_parties(client, args.batch)
        flops = 2.0 * args.batch * 64 * 64 * 9 * 56 * 56
        report["conv"] = _rounds(parties, args.repeats, flops)
    text = "\n\n".join([
        f"{machine['cpu']} ({machine['isa']}), commit {machine['commit']}, "
        f"{args.workers} worker processes x 1 thread, tilegemm threads per task {threads}",
        _table(f"{args.n}^3 float32 product", report["gemm"], "dask A @ B (numpy blocks)",
               "tilegemm.matmul, one local call"),
        _table(f"ResNet-18 conv2_x, batch {args.batch} (effective GFLOPS)", report["conv"],
               None, "tilegemm.conv2d, one local call"),
        _overhead_text(report["64^3 call us"])])
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "dask.json"), "w") as f:
        json.dump(report, f, indent=1)
    with open(os.path.join(args.out, "dask.md"), "w") as f:
        f.write(text + "\n")
    print(text)
    return 0


def _blas_threads():
    """BLAS threads of the process (run on each worker)."""
    try:
        from threadpoolctl import threadpool_info
    except ImportError:
        return None
    return [lib["num_threads"] for lib in threadpool_info() if lib["user_api"] == "blas"]


def main(argv=None):
    args = build_parser().parse_args(argv)
    if min(args.n, args.batch, args.workers, args.repeats) < 1:
        print("tilegemm dask: --n, --batch, --workers and --repeats must be positive",
              file=sys.stderr)
        return 2
    return run(args)
