"""The layout DP against exhaustive enumeration on random small graphs with
branches, with and without pruning."""
import numpy as np
import pytest

from tilegemm.net.layout import Op, Problem, brute_force, plan_cost, solve

LAYOUTS = ("NCHW", "NHWC")


def random_problem(rng, n_ops, layouts=LAYOUTS):
    """Ops in topological order reading one or two earlier tensors (branches and
    joins), some ops fixed to one layout, random costs."""
    tensors, ops = ["x"], []
    for i in range(n_ops):
        k = int(rng.integers(1, 3))
        reads = tuple(rng.choice(tensors, size=min(k, len(tensors)), replace=False))
        fixed = rng.random() < 0.25
        allowed = (layouts[int(rng.integers(len(layouts)))],) if fixed else layouts
        ops.append(Op(f"op{i}", reads, (f"t{i}",), allowed))
        tensors.append(f"t{i}")
    read = {t for op in ops for t in op.reads}
    outputs = {t: "NCHW" for t in tensors[1:] if t not in read} or {tensors[-1]: "NCHW"}
    op_cost = {(i, l): float(rng.uniform(0.1, 2.0)) for i, op in enumerate(ops) for l in op.layouts}
    # Conversions: with two layouts any costs satisfy the triangle inequality the
    # pruning relies on; with more, a tensor's size times the layouts' distance on a line.
    convert = {}
    for t in tensors:
        size = float(rng.uniform(0.05, 1.5))
        for a in layouts:
            for b in layouts:
                if a != b:
                    gap = abs(layouts.index(a) - layouts.index(b))
                    convert[(t, a, b)] = (float(rng.uniform(0.05, 1.5)) if len(layouts) == 2
                                          else size * gap)
    return Problem(ops, {"x": "NCHW"}, outputs, op_cost, convert)


@pytest.mark.parametrize("seed", range(60))
def test_dp_finds_the_exhaustive_optimum(seed):
    rng = np.random.default_rng(seed)
    layouts = LAYOUTS if seed % 3 else LAYOUTS + ("NCHW8c",)
    problem = random_problem(rng, int(rng.integers(1, 9 if seed % 3 else 7)), layouts)
    best, layouts = brute_force(problem)
    for prune in (True, False):
        cost, chosen = solve(problem, prune=prune)
        assert cost == pytest.approx(best, rel=1e-12, abs=1e-12)
        assert plan_cost(problem, chosen) == pytest.approx(cost, rel=1e-12, abs=1e-12)
        assert all(layout in op.layouts for layout, op in zip(chosen, problem.ops))


def test_a_cheap_layout_behind_a_costly_conversion_is_taken_only_when_it_pays():
    """Two convs in a chain: NHWC saves 1 per op, converting the input costs 1.5 and
    the output back 1.5: two NHWC ops in a row save 2 < 3, four save 4 > 3."""
    def chain(n):
        ops = [Op(f"c{i}", (f"t{i}",), (f"t{i + 1}",), LAYOUTS) for i in range(n)]
        op_cost = {(i, l): 2.0 if l == "NCHW" else 1.0 for i in range(n) for l in LAYOUTS}
        convert = {(f"t{i}", a, b): 1.5 for i in range(n + 1) for a in LAYOUTS for b in LAYOUTS
                   if a != b}
        return Problem(ops, {"t0": "NCHW"}, {f"t{n}": "NCHW"}, op_cost, convert)
    assert solve(chain(2))[1] == ["NCHW", "NCHW"]
    cost, layouts = solve(chain(4))
    assert layouts == ["NHWC"] * 4 and cost == pytest.approx(4 * 1.0 + 3.0)
