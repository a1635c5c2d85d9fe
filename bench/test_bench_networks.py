"""Network benchmarks: ResNet-18, MobileNetV2 and VGG-11 (built with onnx.helper,
random weights) on tilegemm with the layout DP's plan and all-NCHW, onnxruntime on
the same model and torch on the same optimized graph, one party per test.

Figures are latency (pytest-benchmark's times) for the whole batch; for the parties
interleaved in one run use ``python -m tilegemm run MODEL --both-plans``.
Options: ``--tg-threads 1,2``, ``--tg-quick`` (ResNet-18 only, batch 1).
"""
import numpy as np
import pytest

onnx = pytest.importorskip("onnx")

from tilegemm.tools import timing  # noqa: E402
from tilegemm.tools.zoo import MODELS  # noqa: E402

PARTIES = ("tilegemm", "tilegemm NCHW", "onnxruntime", "torch")


def _cases(config):
    quick = config.getoption("--tg-quick")
    threads = config.getoption("--tg-threads")
    threads = [int(t) for t in threads.split(",")] if threads else sorted({1, timing.max_threads()})
    models = ("resnet18",) if quick else tuple(MODELS)
    batches = (1,) if quick else (1, 8)
    return [(m, b, t) for m in models for b in batches for t in threads
            if not (m == "vgg11" and b > 1)]


def pytest_generate_tests(metafunc):
    if "net_case" in metafunc.fixturenames:
        cases = _cases(metafunc.config)
        metafunc.parametrize("net_case", cases, ids=[f"{m}-N{b}-{t}t" for m, b, t in cases])


_built = {}


def _model(name):
    if name not in _built:
        proto = MODELS[name][0]()
        _built[name] = (proto, proto.SerializeToString())
    return _built[name]


@pytest.mark.parametrize("party", PARTIES)
def test_network(benchmark, net_case, party):
    import tilegemm
    from tilegemm.tools.peers import Unavailable, onnxruntime_peer, torch_peer
    name, batch, threads = net_case
    proto, data = _model(name)
    x = np.random.default_rng(0).standard_normal((batch,) + MODELS[name][1]).astype(np.float32)
    with timing.pinned_threads(threads):
        net = tilegemm.load_onnx(proto, layout_transform=party != "tilegemm NCHW")
        try:
            fn = {"tilegemm": lambda: net, "tilegemm NCHW": lambda: net,
                  "onnxruntime": lambda: onnxruntime_peer(data, "x", threads),
                  "torch": lambda: torch_peer(net.graph, threads)}[party]()
        except Unavailable as why:
            pytest.skip(str(why))
        fn(x)                                    # plans, compiles, warms the caches
        benchmark.group = f"{name} N={batch} {threads}t"
        benchmark.pedantic(fn, args=(x,), rounds=5, iterations=1, warmup_rounds=1)
