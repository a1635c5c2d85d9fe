"""pytest-benchmark suites for tilegemm: ``pytest bench/ --benchmark-only``.

The cases, the callables timed, thread pinning, warm-up and calls per round all
come from :mod:`tilegemm.tools.timing`, :mod:`tilegemm.tools.gemm_suite` and
:mod:`tilegemm.tools.conv_suite` -- the code ``python -m tilegemm bench`` runs -- so the
two never disagree on what is measured.  pytest-benchmark times one party per
test (it cannot interleave), groups ours and the peers by case, and adds
``gflops`` / ``pct_peak`` to each result's ``extra_info``; for ratios measured
interleaved in one run, use the command line.

Options: ``--tg-quick`` (the ``bench --quick`` subset), ``--tg-sizes 64,256``,
``--tg-dtype float32``, ``--tg-threads 1``.  Time the suites under the bench lock
on shared machines: ``flock /tmp/tilegemm-bench.lock pytest bench/ --benchmark-only``.
"""
import pytest


def pytest_addoption(parser):
    group = parser.getgroup("tilegemm", "tilegemm benchmark cases")
    group.addoption("--tg-quick", action="store_true", help="the quick subset of cases")
    group.addoption("--tg-sizes", default=None, help="square GEMM sizes, e.g. 64,256")
    group.addoption("--tg-dtype", default="all", help="float32, float64 or all")
    group.addoption("--tg-threads", default=None, help="thread counts, e.g. 1,2")


def _selection(config):
    from tilegemm.tools import gemm_suite, timing
    from tilegemm.tools.options import parse_dtypes, parse_sizes, parse_threads
    quick = config.getoption("--tg-quick")
    sizes = config.getoption("--tg-sizes")
    threads = config.getoption("--tg-threads")
    return {
        "quick": quick,
        "dtypes": parse_dtypes(config.getoption("--tg-dtype")),
        "threads": parse_threads(threads) if threads else sorted({1, timing.max_threads()}),
        "sizes": parse_sizes(sizes) if sizes else (
            gemm_suite.QUICK_SQUARE_SIZES if quick else gemm_suite.SQUARE_SIZES),
        "skinny": sizes is None,
    }


def pytest_generate_tests(metafunc):
    """Parametrise ``gemm_case`` / ``conv_case`` from the command-line selection."""
    sel = _selection(metafunc.config)
    if "gemm_case" in metafunc.fixturenames:
        from tilegemm.tools.gemm_suite import gemm_cases
        cases = gemm_cases(sel["dtypes"], sel["threads"], sel["sizes"], skinny=sel["skinny"])
        metafunc.parametrize("gemm_case", cases,
                             ids=[f"{c.dtype}-{c.shape}-{c.threads}t" for c in cases])
    if "conv_case" in metafunc.fixturenames:
        from tilegemm.tools.conv_suite import conv_cases
        cases = conv_cases(sel["dtypes"], sel["threads"], quick=sel["quick"])
        metafunc.parametrize("conv_case", cases,
                             ids=[f"{c.dtype}-{c.layer.name}-N{c.batch}-{c.threads}t"
                                  for c in cases])
    if "first_call_dtype" in metafunc.fixturenames:
        metafunc.parametrize("first_call_dtype", sel["dtypes"])


@pytest.fixture
def timed(benchmark):
    """Run one party the way the CLI does and hand it to pytest-benchmark.

    Returns a function ``timed(fn, flops, dtype, threads, group, reps=5)``.
    """
    from tilegemm.tools import timing

    def run(fn, flops, dtype, threads, group, reps=5, min_time=0.05):
        benchmark.group = group
        with timing.pinned_threads(threads):
            first = timing.warm_up(fn)
            calls, _ = timing.calibrate(fn, min_time)
            benchmark.pedantic(fn, rounds=reps, iterations=calls, warmup_rounds=0)
            peak = timing.peak_gflops(dtype, threads)
        best = benchmark.stats.stats.min
        benchmark.extra_info.update(
            first_call_s=first, calls_per_round=calls, flops=flops,
            gflops=timing.gflops(flops, best), peak_gflops=peak,
            pct_peak=100 * timing.gflops(flops, best) / peak)
        return benchmark

    return run
