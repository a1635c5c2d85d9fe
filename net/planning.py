"""A network's layout plan for one input shape: which layout each step runs in.

:func:`plan_layouts` runs the network once in NCHW keeping every tensor, times each
step in each layout it supports on those very tensors (a "fast run") and each
conversion a 4-D tensor could need, and hands the tables to the layout DP
(:func:`tilegemm.net.layout.solve`).  The DP's plan and the two single-layout plans
then each run the whole network a few times, and the fastest runs.  The times are
cached on disk
(``net-costs.json`` in the tilegemm cache directory, or the file
``TILEGEMM_NET_COSTS`` names) keyed by the machine, the
library's code and each step's signature, with the shapes of that NCHW run's
tensors, so loading the same model again plans without timing, or running,
anything.
"""
import hashlib
import importlib.metadata
import os
import time
from dataclasses import dataclass

import numpy as np

from tilegemm.ground.jsonfile import load_json, save_json
from tilegemm.ground.loader import cache_dir, digest, python_files
from tilegemm.ground.threads import get_num_threads
from tilegemm.net.layers import LAYOUTS, convert, converted_shape
from tilegemm.net.layout import Op, Problem, plan_cost, solve
from tilegemm.tuning.machine import detect

FILE_NAME = "net-costs.json"
#: Timed runs of a step per layout (the fastest is kept), after one warm-up call.
REPEATS = 3
#: Rounds of the whole-run check (each plan once a round, alternating): six plans of
#: which a busy machine can favour one by chance in a few rounds.
WHOLE_RUN_ROUNDS = 5


@dataclass
class LayoutPlan:
    """The layout of each step (in step order), and the DP's figures: ``seconds``
    (its predicted time), ``nchw_seconds`` (all steps NCHW, the traditional plan),
    ``nhwc_seconds`` (every step that can NHWC, the other single-layout plan),
    ``problem`` (the cost tables; None for a plan given by hand), ``choices`` (per
    step, the conv algorithm timed fastest in its layout; None: conv2d's ``auto``),
    ``measured`` (whole runs of the DP's plan and of both single-layout plans, each
    with the timed algorithm choices and with conv2d's ``auto``: "dp", "nchw", "nhwc",
    "dp auto", ...) and ``name``, the one of them that runs: the fastest measured."""

    layouts: list
    seconds: float = 0.0
    nchw_seconds: float = 0.0
    nhwc_seconds: float = 0.0
    problem: object = None
    choices: list = None        # per step: (algorithm, Winograd tile) timed fastest, or None
    measured: dict = None       # {"dp"|"nchw"|"nhwc"[ auto]: best seconds of a whole run}
    name: str = "given"         # which of them runs

    def single(self, layout):
        """``{step name: layout}`` running every step that can in ``layout`` (the rest
        NCHW): the single-layout plan to hand to :meth:`Network.plan`."""
        return {op.name: layout if layout in op.layouts else "NCHW" for op in self.problem.ops}


def digest_text(text):
    """A short hash of ``text``."""
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _code_key():
    """The machine and the code the times describe."""
    m = detect()
    try:
        version = importlib.metadata.version("tilegemm")
    except importlib.metadata.PackageNotFoundError:
        version = "unknown"
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    code = digest([p for folder in ("conv", "kernels", "net")
                   for p in python_files(os.path.join(here, folder))])
    return (f"{m.brand} | {m.isa} | L1d {m.l1d_bytes} | L2 {m.l2_bytes} | "
            f"{get_num_threads()} thread(s) | tilegemm {version} {code}")


def costs_path():
    """The file of timed costs: ``TILEGEMM_NET_COSTS``, else ``net-costs.json`` in
    the cache directory."""
    return os.environ.get("TILEGEMM_NET_COSTS") or os.path.join(cache_dir(), FILE_NAME)


class CostCache:
    """Step and conversion times on disk, one table per machine and code version."""

    def __init__(self):
        self.path = costs_path()
        self.key = _code_key()
        self.stored = load_json(self.path)
        self.table = self.stored.get(self.key, {})
        self.changed = False

    def seconds(self, signature, measure):
        if signature not in self.table:
            self.table[signature] = measure()
            self.changed = True
        return self.table[signature]

    def many(self, signatures, measure):
        """``{signature: seconds}`` for several measured together (``measure()`` returns
        them all, in order) unless all are stored."""
        if any(s not in self.table for s in signatures):
            self.table.update(zip(signatures, measure()))
            self.changed = True
        return {s: self.table[s] for s in signatures}

    def save(self):
        """Write the new times; tables of this machine from older code are dropped."""
        if self.changed:
            self.stored = load_json(self.path)      # another process may have added some
            machine = self.key.rsplit(" | tilegemm ", 1)[0]
            self.stored = {k: v for k, v in self.stored.items()
                           if k == self.key or k.rsplit(" | tilegemm ", 1)[0] != machine}
            self.stored.setdefault(self.key, {}).update(self.table)
            save_json(self.path, self.stored)


def supported(step, args, outputs, constants):
    """The layouts ``step`` may run in for these operands: NCHW always; the others
    when the step offers them and every activation it reads or writes is 4-D (an
    elementwise step also needs its activations of one shape and constants of size 1)."""
    offered = getattr(step.run, "layouts", None)
    if not offered:
        return ("NCHW",)
    live = [a for n, a in zip(step.inputs, args) if n and n not in constants]
    if not live or any(np.ndim(a) != 4 for a in live + outputs):
        return ("NCHW",)
    if getattr(step.run, "elementwise", False):
        shaped = {np.shape(a) for a in live}
        if len(shaped) > 1 or any(np.size(constants[n]) != 1 for n in step.inputs
                                  if n in constants):
            return ("NCHW",)
    return tuple(layout for layout in LAYOUTS if layout in offered)


def step_signature(step, args, layout):
    """The key of ``step``'s timed cost in ``layout`` on ``args`` in the disk cache: its
    operator, attributes, fused epilogue, operand shapes and dtypes, and the kernel
    its constants choose, if any."""
    node = step.node
    shapes = [None if a is None else (np.shape(a), np.asarray(a).dtype.str) for a in args]
    attrs = sorted((k, repr(v)) for k, v in node.attrs.items())
    # a step whose kernel its constants choose (a quantized conv's 7-bit weights) says which
    kernel = getattr(step.run, "kernel", "")
    return f"{node.op} {attrs} {sorted(node.epilogue.items())} {shapes} {layout} {kernel}".rstrip()


def _time_step(step, args, layout, constants, choice=None):
    """Best seconds of ``step`` in ``layout`` (a conv with ``choice``) on ``args``
    (given NCHW), each run on fresh copies (a step may write into its residual)."""
    def fresh():
        return [a if n == "" or n in constants else convert(np.array(a), "NCHW", layout)
                for n, a in zip(step.inputs, args)]
    run = function(step, layout, choice)
    run(*fresh())                                   # compiles, plans, warms the caches
    best = float("inf")
    for _ in range(REPEATS):
        operands = fresh()
        t0 = time.perf_counter()
        run(*operands)
        best = min(best, time.perf_counter() - t0)
    return best


def _time_convert(x, src, dst):
    best = float("inf")
    for _ in range(REPEATS + 1):
        t0 = time.perf_counter()
        convert(x, src, dst)
        best = min(best, time.perf_counter() - t0)
    return best


def function(step, layout, choice=None):
    """What runs ``step`` in ``layout``: a conv's ``choice`` of algorithm, else its own."""
    if choice is not None:
        return step.run.variant(layout, choice)
    return step.run if layout == "NCHW" else step.run.layouts[layout]


def _step_cost(cache, step, args, layout, constants):
    """``(seconds, choice)``: the step's time in ``layout``; for a conv the fastest of
    the algorithms worth timing, and which."""
    def timed(choice):
        key = step_signature(step, args, layout) + ("" if choice is None else f" {choice}")
        return cache.seconds(key, lambda: _time_step(step, args, layout, constants, choice))
    if not hasattr(step.run, "choices"):
        return timed(None), None
    x = args[0]
    shape = converted_shape(np.shape(x), "NCHW", layout)
    return min(((timed(c), c) for c in step.run.choices(layout, shape, x.dtype)),
               key=lambda timed_choice: timed_choice[0])


class _Unmeasured(Exception):
    """A time the cache lacks, asked for while planning from recorded shapes."""


class _Recorded:
    """The cost cache's stored times, where a missing one raises :class:`_Unmeasured`
    (it would have to be measured on real tensors)."""

    def __init__(self, cache):
        self.table = cache.table

    def seconds(self, signature, measure):
        if signature not in self.table:
            raise _Unmeasured(signature)
        return self.table[signature]


def layout_problem(network, fed, cache):
    """``(Problem, choices, fingerprint)``: the :class:`~tilegemm.net.layout.Problem`
    of ``network`` on inputs ``fed``, ``{(step, layout): conv algorithm timed
    fastest}`` and a digest of the steps' signatures (the key of whole-run times).

    Times are measured on the tensors of a run in NCHW.  When the cache holds every
    time and the shapes of that run's tensors (keyed by :func:`graph_key`), the
    problem is built from the shapes alone: loading a model again runs nothing (the
    NCHW run also prepared each conv's NCHW weights, a second or more of a large
    model's load, often for layouts the plan then does not use)."""
    constants = network.graph.constants
    key = "shapes " + graph_key(network, fed)
    recorded = cache.table.get(key)
    if recorded is not None:
        stubs = {name: np.broadcast_to(np.zeros((), dtype), tuple(shape))
                 for name, (shape, dtype) in recorded.items()}
        try:
            return _problem(network, fed, {**constants, **stubs}, _Recorded(cache))
        except _Unmeasured:
            pass
    values = network.execute(fed, keep=True)
    cache.table[key] = {name: [list(np.shape(v)), np.asarray(v).dtype.str]
                        for name, v in values.items()}
    cache.changed = True
    return _problem(network, fed, {**constants, **values}, cache)


def graph_key(network, fed):
    """A digest of what fixes every tensor's shape: the steps (operator, attributes,
    fused epilogue, tensor names), the constants' shapes and dtypes (and the values
    of small integer ones, such as a Reshape's shape) and the inputs' shapes."""
    parts = [f"{s.node.op} {sorted((k, repr(v)) for k, v in s.node.attrs.items())} "
             f"{sorted((k, repr(v)) for k, v in s.node.epilogue.items())} "
             f"{s.inputs} {s.outputs}" for s in network.steps]
    for name, c in sorted(network.graph.constants.items()):
        c = np.asarray(c)
        small_int = c.dtype.kind in "iub" and c.size <= 64
        parts.append(f"{name} {c.shape} {c.dtype.str} {c.tolist() if small_int else ''}")
    parts += [f"{name} {np.shape(x)} {np.asarray(x).dtype.str}" for name, x in sorted(fed.items())]
    return digest_text("\n".join(parts))


def _problem(network, fed, values, cache):
    """:func:`layout_problem` on ``values`` (every tensor, or stand-ins of their
    shapes when ``cache`` holds every time)."""
    constants = network.graph.constants
    ops, op_cost, convert_cost, choices = [], {}, {}, {}
    for i, step in enumerate(network.steps):
        args = [values[n] if n else None for n in step.inputs]
        outputs = [values[n] for n in step.outputs if n]
        layouts = supported(step, args, outputs, constants)
        reads = tuple(n for n in step.inputs if n and n not in constants)
        ops.append(Op(step.node.name, reads, tuple(n for n in step.outputs if n), layouts))
        for layout in layouts:
            op_cost[(i, layout)], choices[(i, layout)] = _step_cost(cache, step, args, layout,
                                                                    constants)
    tensors = {n for op in ops for n in op.reads + op.writes}
    for name in sorted(tensors):
        x = values[name]
        if np.ndim(x) != 4:
            continue
        for src in LAYOUTS:
            for dst in LAYOUTS:
                if src != dst:
                    key = f"convert {np.shape(x)} {np.asarray(x).dtype.str} {src}->{dst}"
                    convert_cost[(name, src, dst)] = cache.seconds(
                        key, lambda: _time_convert(convert(x, "NCHW", src), src, dst))
    problem = Problem(ops, {n: "NCHW" for n in fed}, {n: "NCHW" for n in network.outputs},
                      op_cost, convert_cost)
    fingerprint = digest_text("".join(
        step_signature(step, [values[n] if n else None for n in step.inputs], "")
        for step in network.steps))
    return problem, choices, fingerprint


def _given(network, fed, layouts):
    """The layouts of ``layouts`` ({node name: layout}) in step order, each checked
    against what its step supports on these inputs."""
    names = {s.node.name for s in network.steps}
    unknown = sorted(set(layouts) - names)
    if unknown:
        raise ValueError(f"Network.plan: no steps named {unknown}")
    values = dict(network.graph.constants)
    values.update(network.execute(fed, keep=True))
    chosen = []
    for step in network.steps:
        layout = layouts.get(step.node.name, "NCHW")
        args = [values[n] if n else None for n in step.inputs]
        allowed = supported(step, args, [values[n] for n in step.outputs if n],
                            network.graph.constants)
        if layout not in allowed:
            raise ValueError(f"Network.plan: step {step.node.name!r} ({step.node.op}) runs in "
                             f"{list(allowed)} here, not {layout!r}")
        chosen.append(layout)
    return chosen


def plan_layouts(network, fed, layouts=None):
    """The :class:`LayoutPlan` of ``network`` for inputs ``fed``: ``layouts``
    ({node name: layout}) if given, else the DP's choice over timed costs."""
    if layouts is not None:
        return LayoutPlan(_given(network, fed, layouts))
    cache = CostCache()
    problem, choices, fingerprint = layout_problem(network, fed, cache)
    _, dp = solve(problem)
    candidates = {"dp": dp, "nchw": ["NCHW"] * len(problem.ops),
                  "nhwc": ["NHWC" if "NHWC" in op.layouts else "NCHW" for op in problem.ops]}
    plans = {name: LayoutPlan(layouts, choices=[choices[(i, layout)]
                                                for i, layout in enumerate(layouts)])
             for name, layouts in candidates.items()}
    # Each also with conv2d's own algorithm choice: a conv timed alone, caches warm,
    # can pick an algorithm that loses inside the network (ResNet-18 at batch 8 on two
    # threads: the timed choices' all-NHWC plan ran 145 ms, auto's 126).
    plans.update({f"{name} auto": LayoutPlan(layouts) for name, layouts in candidates.items()})
    keys = [f"whole run {name} {fingerprint}" for name in plans]
    times = cache.many(keys, lambda: [_whole_run(network, fed, plans)[n] for n in plans])
    cache.save()
    measured = dict(zip(plans, times.values()))
    name = min(measured, key=lambda n: (measured[n], n != "dp"))
    chosen = plans[name]
    chosen.seconds = plan_cost(problem, chosen.layouts)
    chosen.nchw_seconds = plan_cost(problem, candidates["nchw"])
    chosen.nhwc_seconds = plan_cost(problem, candidates["nhwc"])
    chosen.problem, chosen.measured, chosen.name = problem, measured, name
    return chosen


def _whole_run(network, fed, plans):
    """``{name: best seconds}`` of whole runs of each plan, in alternating rounds."""
    best = {}
    for plan in plans.values():
        network.execute(fed, plan)                 # prepares each conv's choice
    for _ in range(WHOLE_RUN_ROUNDS):
        for name, plan in plans.items():
            t0 = time.perf_counter()
            network.execute(fed, plan)
            best[name] = min(best.get(name, float("inf")), time.perf_counter() - t0)
    return best
