"""Convolution benchmarks: each algorithm and torch on the CLI's layers.

An algorithm that does not apply to a layer (ValueError, e.g. Winograd on a
1x1) is skipped with the reason.
Figures are effective GFLOPS (direct-convolution flops / time).
"""
import pytest

from tilegemm.tools import conv_suite


@pytest.mark.parametrize("party", ("torch",) + conv_suite.ALGORITHMS)
def test_conv(timed, conv_case, party):
    x, w = conv_suite.operands(conv_case)
    ly = conv_case.layer
    if party == "torch":
        fn = conv_suite.torch_party(x, w, ly)
        if fn is None:
            pytest.skip("torch is not installed")
    else:
        fn = conv_suite.tilegemm_party(x, w, ly, party)
        seconds, reason = conv_suite.probe(fn)
        if seconds is None:
            pytest.skip(f"{party} does not apply: {reason}")
    group = f"conv {conv_case.dtype} {ly.name} N={conv_case.batch} {conv_case.threads}t"
    timed(fn, conv_case.flops, conv_case.dtype, conv_case.threads, group)
