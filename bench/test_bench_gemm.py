"""GEMM benchmarks: tilegemm, numpy and torch for every case of the CLI's suite.

``pytest bench/test_bench_gemm.py --benchmark-only [--tg-quick]``; each case is one
pytest-benchmark group holding the three parties.
"""
import pytest

from tilegemm.tools import gemm_suite, timing

PARTIES = ("tilegemm", "numpy", "torch")


@pytest.mark.parametrize("party", PARTIES)
def test_gemm(timed, gemm_case, party):
    if party == "torch" and timing.torch_module() is None:
        pytest.skip("torch is not installed")
    a, b = gemm_suite.operands(gemm_case)
    parties, _ = gemm_suite.gemm_parties(gemm_case, a, b, peers=PARTIES[1:])
    group = f"gemm {gemm_case.dtype} {gemm_case.shape} {gemm_case.threads}t"
    timed(parties[party], gemm_case.flops, gemm_case.dtype, gemm_case.threads, group)


def test_first_call(benchmark, first_call_dtype):
    """A fresh process, empty then warm Numba cache (``extra_info`` has the split)."""
    benchmark.group = "first call in a fresh process"
    result = benchmark.pedantic(gemm_suite.first_call, args=(first_call_dtype,),
                                rounds=1, iterations=1)
    benchmark.extra_info.update(cold=result["cold"], warm=result["warm"])
