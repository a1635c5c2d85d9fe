"""Convolution benchmarks: each algorithm and torch on the CLI's layers.

Skipped when ``tilegemm.conv2d`` does not exist; an algorithm that does not apply
to a layer (ValueError, e.g. Winograd on a 1x1) is skipped with the reason.
Figures are effective GFLOPS (direct-convolution flops / time).
"""
import pytest

from tilegemm import bench_conv

AVAILABLE, REASON = bench_conv.conv_available()
pytestmark = pytest.mark.skipif(not AVAILABLE, reason=REASON or "conv available")


@pytest.mark.parametrize("party", ("torch",) + bench_conv.ALGORITHMS)
def test_conv(timed, conv_case, party):
    x, w = bench_conv._operands(conv_case)
    ly = conv_case.layer
    if party == "torch":
        fn = bench_conv._torch_party(x, w, ly)
        if fn is None:
            pytest.skip("torch is not installed")
    else:
        fn = bench_conv._ours(x, w, ly, party)
        seconds, reason = bench_conv._probe(fn)
        if seconds is None:
            pytest.skip(f"{party} does not apply: {reason}")
    group = f"conv {conv_case.dtype} {ly.name} N={conv_case.batch} {conv_case.threads}t"
    timed(fn, conv_case.flops, conv_case.dtype, conv_case.threads, group)
