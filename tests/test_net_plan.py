"""Layout plans of networks: the DP's choice, plans given by hand (every step that
can in NHWC), the disk cache of timed costs, and the plan-free NCHW mode."""
import os

import numpy as np
import pytest

pytest.importorskip("onnx")

import tilegemm  # noqa: E402
from tilegemm.net.layout import solve  # noqa: E402
from net_models import MODELS, assert_close, random_input  # noqa: E402
from net_reference import run_reference  # noqa: E402


@pytest.fixture(autouse=True)
def _own_costs(tmp_path, monkeypatch):
    """A cost file of the test's own (the kernels' cache stays where it is)."""
    monkeypatch.setenv("TILEGEMM_NET_COSTS", str(tmp_path / "net-costs.json"))


@pytest.mark.parametrize("name", sorted(MODELS))
def test_every_step_that_can_runs_nhwc_and_the_result_holds(name):
    build, shape = MODELS[name]
    model = build()
    net = tilegemm.load_onnx(model)
    x = random_input(shape)
    feeds = {"x": x}
    plan = net.plan(feeds)
    dp_seconds, _ = solve(plan.problem)
    assert dp_seconds <= min(plan.nchw_seconds, plan.nhwc_seconds) * (1 + 1e-12)
    # The DP's plan and both single-layout plans ran whole, with the timed algorithm
    # choices and with conv2d's own; the fastest runs.
    assert set(plan.measured) == {"dp", "nchw", "nhwc", "dp auto", "nchw auto", "nhwc auto"}
    assert plan.measured[plan.name] == min(plan.measured.values())
    nhwc = plan.single("NHWC")
    assert "NHWC" in nhwc.values()
    forced = net.plan(feeds, nhwc)
    assert forced.layouts == [nhwc[s.node.name] for s in net.steps]
    before = x.copy()
    got = net.run(feeds)
    np.testing.assert_array_equal(x, before)
    for key, value in run_reference(model, feeds).items():
        assert_close(got[key], value)


def test_a_plan_by_hand_is_checked():
    net = tilegemm.load_onnx(MODELS["resnet"][0]())
    feeds = {"x": random_input(MODELS["resnet"][1])}
    with pytest.raises(ValueError, match="no steps named"):
        net.plan(feeds, {"nowhere": "NHWC"})
    with pytest.raises(ValueError, match=r"'Gemm_\d+' \(Gemm\) runs in \['NCHW'\]"):
        net.plan(feeds, {s.node.name: "NHWC" for s in net.steps if s.node.op == "Gemm"})


def test_timed_costs_are_cached_on_disk(tmp_path, monkeypatch):
    model = MODELS["mobilenet"][0]()
    feeds = {"x": random_input(MODELS["mobilenet"][1])}
    first = tilegemm.load_onnx(model).plan(feeds)
    path = tmp_path / "net-costs.json"
    stamp = os.stat(path).st_mtime_ns, path.read_bytes()
    net = tilegemm.load_onnx(model)
    runs = []
    execute = type(net).execute
    monkeypatch.setattr(type(net), "execute",
                        lambda self, *args, **kw: runs.append(kw) or execute(self, *args, **kw))
    again = net.plan(feeds)       # nothing new to time: no write, and no step runs
    assert not runs
    assert (os.stat(path).st_mtime_ns, path.read_bytes()) == stamp
    assert again.layouts == first.layouts and again.seconds == first.seconds
    assert again.choices == first.choices
    for key, value in run_reference(model, feeds).items():
        assert_close(net.run(feeds)[key], value)
    # Another input shape has no recorded shapes: it runs the network to time it.
    runs.clear()
    net.plan({"x": random_input((1,) + tuple(MODELS["mobilenet"][1][1:]))})
    assert {"keep": True} in runs


def test_a_new_shape_plans_and_without_layout_transform_nothing_plans():
    model = MODELS["resnet"][0]()
    net = tilegemm.load_onnx(model)
    plain = tilegemm.load_onnx(model, layout_transform=False)
    assert not plain.layout_transform
    for batch in (1, 2):
        x = random_input((batch, 3, 32, 32), seed=batch)
        expected = run_reference(model, {"x": x})[model.graph.output[0].name]
        assert_close(net(x), expected)
        assert_close(plain(x), expected)


def test_steady_state_runs_reuse_their_activation_buffers():
    """After the first run of a shape, a run allocates its outputs and what numpy
    allocates inside a few steps, not every activation: its peak traced memory stays
    well below the activations' total. A new plan for the shape starts afresh."""
    import tracemalloc
    build, shape = MODELS["resnet"]
    net = tilegemm.load_onnx(build())
    x = random_input((4,) + shape[1:])
    feeds = {"x": x}
    expected = net(x)
    activations = []
    net.run(feeds, profile=activations)
    total = sum(np.prod(e[2][0]) * 4 for e in activations if e[2] and e[2][0])
    tracemalloc.start()
    got = net(x)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    np.testing.assert_array_equal(got, expected)
    assert peak < 0.35 * total, (peak, total)
    every = net.plan(feeds)
    net.plan(feeds, every.single("NHWC"))
    for _ in range(2):
        np.testing.assert_allclose(net(x), expected, rtol=1e-4, atol=1e-5)
    assert net(x) is not net(x)                    # outputs are the caller's own


def test_a_pointwise_residual_sums_in_its_epilogue_into_the_skip_buffer():
    """MobileNetV2's projection (1x1, NHWC: one GEMM with beta = 1) takes the skip
    tensor's reused buffer for its result from the second run on; the values hold."""
    build, shape = MODELS["mobilenet"]
    model = build()
    net = tilegemm.load_onnx(model)
    x = random_input(shape)
    feeds = {"x": x}
    plan = net.plan(feeds, net.plan(feeds).single("NHWC"))
    fused = [s for s, layout in zip(net.steps, plan.layouts)
             if s.node.epilogue.get("residual") and layout == "NHWC"]
    assert fused
    expected = run_reference(model, feeds)[model.graph.output[0].name]
    for _ in range(3):
        assert_close(net(x), expected)
    # Few output channels run the plain GEMM, more than the tile's NR the rows kernel;
    # both sum in place.
    nr = tilegemm.conv.engine.host_target(np.float32).nr
    for k, path in ((8, "im2col.pointwise"), (nr + 24, "im2col.rows")):
        w = random_input((k, 24, 1, 1), seed=k)
        conv = tilegemm.conv.PreparedConv((2, 7, 7, 24), w, np.ones(k, np.float32),
                                          layout="NHWC", activation="relu")
        assert conv.accumulates and conv.path == path
        skip = random_input((2, 7, 7, k), seed=3)
        x2 = random_input((2, 7, 7, 24), seed=4)
        want = np.maximum(tilegemm.conv2d(x2, w, np.ones(k, np.float32), layout="NHWC")
                          + skip, 0)
        assert conv(x2, skip, out=skip) is skip
        np.testing.assert_allclose(skip, want, rtol=1e-5, atol=1e-5)


def test_a_steps_kernel_is_part_of_its_cost_signature():
    """A quantized conv's weights choose its int8 kernel (7-bit weights: ``maddubs`` on
    AVX2), so the disk cache of timed costs keys on it: the same shapes with other
    weights are timed anew, not given the other kernel's cost."""
    from types import SimpleNamespace

    from tilegemm.net.planning import step_signature

    def step(kernel=None):
        run = SimpleNamespace() if kernel is None else SimpleNamespace(kernel=kernel)
        return SimpleNamespace(node=SimpleNamespace(op="QLinearConv", attrs={}, epilogue={}),
                               run=run)
    args = [np.zeros((1, 8, 9, 9), np.uint8), np.zeros((8, 8, 3, 3), np.int8)]
    full = step_signature(step("madd 256"), args, "NHWC")
    seven = step_signature(step("maddubs 256"), args, "NHWC")
    assert full != seven and full.endswith("madd 256") and seven.endswith("maddubs 256")
    assert step_signature(step(), args, "NHWC").endswith("NHWC")
