"""A loaded network: its optimized graph as a list of steps, run with numpy arrays.

Each step is a node's run function (:mod:`tilegemm.net.registry`) with the names of
the tensors it reads and writes.  A tensor is dropped after its last reader, its
buffer reused by a later step (:mod:`tilegemm.net.memory`), so a run holds only the
activations still needed.
"""
import threading
import time
from dataclasses import dataclass

import numpy as np

from tilegemm.net import layers, memory, ops, planning, quantized, registry  # noqa: F401 (builders)
from tilegemm.net.graph import from_onnx, read_model, validated
from tilegemm.net.layers import convert, converted_shape
from tilegemm.net.memory import Buffers
from tilegemm.net.passes import optimize


@dataclass
class Step:
    """One node ready to run: its function, the tensors it reads and writes, and the
    tensors no later step reads (dropped after it)."""

    node: object
    run: object
    inputs: list
    outputs: list
    frees: list


class Network:
    """A network loaded by :func:`tilegemm.load_onnx`; call it on arrays.

    Attributes
    ----------
    inputs : list of TensorInfo
        Name, shape (None or a name for a symbolic dimension) and dtype of each input.
    outputs : list of str
        Output names, in the model's order.
    graph : Graph
        The optimized graph (folded, fused) that runs.
    steps : list of Step
        The graph's nodes ready to run, in order.
    layout_transform : bool
        Whether each input shape gets its layout plan (:meth:`plan`) on its first run;
        without, every step runs NCHW.
    """

    def __init__(self, graph, layout_transform=True):
        self.graph = graph
        self.inputs = list(graph.inputs)
        self.outputs = list(graph.outputs)
        self.layout_transform = layout_transform
        self.steps = self._build()
        self._plans = {}                   # input shapes -> LayoutPlan
        self._planning = threading.Lock()
        self._shapes = {}                  # input shapes -> (plan, each step's output shapes)
        self._local = threading.local()    # this thread's Buffers per input shapes

    def _build(self):
        constants = self.graph.constants
        last = {}
        for i, node in enumerate(self.graph.nodes):
            for name in node.inputs:
                last[name] = i
        steps = []
        for i, node in enumerate(self.graph.nodes):
            frees = [n for n in dict.fromkeys(node.inputs)
                     if n and last.get(n) == i and n not in constants and n not in self.outputs]
            steps.append(Step(node, registry.build(node, constants.get), list(node.inputs),
                              list(node.outputs), frees))
        return steps

    def plan(self, feeds, layouts=None):
        """The :class:`~tilegemm.net.planning.LayoutPlan` that runs inputs of the shapes
        of ``feeds``, made now and kept for that shape.

        ``layouts`` (``{node name: layout}``, the rest NCHW) sets it by hand;
        otherwise each step is timed in each layout it supports (on these inputs,
        the times cached on disk per machine and library version) and the layout
        DP (:mod:`tilegemm.net.layout`) chooses.
        """
        fed = self._feeds(feeds)
        with self._planning:
            chosen = planning.plan_layouts(self, fed, layouts)
            key = _shape_key(fed)
            self._plans[key] = chosen       # recorded shapes of another plan no longer serve
        return chosen

    def _plan_for(self, fed):
        """The plan that runs these inputs: the one :meth:`plan` made for their shape,
        else (planning a new shape first) the layout DP's, or None (all NCHW) without
        ``layout_transform``."""
        key = _shape_key(fed)
        plan = self._plans.get(key)
        if plan is not None or not self.layout_transform:
            return plan
        with self._planning:
            plan = self._plans.get(key)
            if plan is None:
                plan = self._plans[key] = planning.plan_layouts(self, fed)
        return plan

    def execute(self, fed, plan=None, profile=None, keep=False, memory=None, trace=None):
        """Run the steps on checked inputs ``fed``, step ``i`` in ``plan.layouts[i]``
        with its ``plan.choices[i]`` (all NCHW, conv2d's auto, when ``plan`` is None),
        converting a tensor when a step wants it in another layout;
        returns every activation still held (all of them with ``keep``; constants are
        in ``graph.constants``), outputs NCHW.

        ``memory`` is ``(Buffers, shapes)``: ``shapes[i]`` the (shape, dtype) of step
        ``i``'s outputs, used to take each output's buffer from the
        :class:`~tilegemm.net.memory.Buffers`; or ``(None, list)``: record the
        shapes into the list.  ``trace`` (a list) receives what ran, for :func:`replay`."""
        values = dict(fed)                  # activations only: constants stay apart
        where = {}                          # tensor -> layout, when not NCHW
        buffers, shapes = memory if memory is not None else (None, None)
        recording = buffers is None and shapes is not None
        for i, step in enumerate(self.steps):
            layout = "NCHW" if plan is None else plan.layouts[i]
            args = [self._operand(values, where, n, layout, buffers, trace) for n in step.inputs]
            run = planning.function(step, layout, None if plan is None or not plan.choices
                                    else plan.choices[i])
            out = None
            if buffers is not None and not recording and getattr(run, "writes_into", False) \
                    and not any(n in self.outputs for n in step.outputs):
                out = self._in_place(step, run, values, buffers, shapes[i]) or [
                    buffers.take(*spec) for spec in shapes[i]]
            extra = {} if out is None else {"out": out}
            if getattr(run, "sums_in_place", False) and self._owned(step, 3, values, buffers):
                extra["residual_free"] = True
            t0 = time.perf_counter() if profile is not None else 0.0
            results = run(*args, **extra)
            if profile is not None:
                profile.append((step.node, time.perf_counter() - t0,
                                [None if a is None else np.shape(a) for a in args], layout,
                                None if plan is None or not plan.choices else plan.choices[i]))
            if recording:
                shapes.append([(np.shape(r), np.asarray(r).dtype) for r in results])
            if trace is not None:
                fetch = tuple(n if n in values else self.graph.constants.get(n)
                              for n in step.inputs)
                # A step may offer a faster form for later runs on these very buffers.
                replay_form = getattr(run, "replay_form", None)
                fast = replay_form(*args, **extra) if replay_form is not None else None
                trace.append((fast or run, fetch, extra, step.outputs, step.frees))
            self._store(values, where, step, results, layout)
            if not keep:
                self._free(values, step.frees, buffers, out, results)
        for name in self.outputs:
            if name in values:
                values[name] = convert(values[name], where.get(name, "NCHW"), "NCHW")
                if trace is not None:
                    trace.append((name, where.get(name, "NCHW"), "NCHW", None))
        return values

    def _operand(self, values, where, name, layout, buffers, trace=None):
        """Input ``name`` of a step running in ``layout``, converted (and kept so) when
        it is in another layout."""
        if not name:
            return None
        if name not in values:
            return self.graph.constants[name]
        src = where.get(name, "NCHW")
        if src != layout:
            x = values[name]
            out = None if buffers is None else buffers.take(
                converted_shape(x.shape, src, layout), x.dtype)
            values[name] = convert(x, src, layout, out)
            where[name] = layout
            if trace is not None:
                trace.append((name, src, layout, out))
            if buffers is not None:
                buffers.give(x, values.values())
        return values[name]

    def _in_place(self, step, run, values, buffers, spec):
        """``[input 0's buffer]`` when an elementwise step may write over its input (the
        same shape and dtype, :meth:`_owned`), else None."""
        if not getattr(run, "elementwise", False) or len(spec) != 1 \
                or not self._owned(step, 0, values, buffers):
            return None
        x = values[step.inputs[0]]
        return [x] if (x.shape, x.dtype) == spec[0] and x.flags.c_contiguous else None

    def _owned(self, step, index, values, buffers):
        """Whether a step may write into the buffer of its input ``index``: a reused
        buffer (never an input's or the caller's), read by no later step, no live view
        of it."""
        name = step.inputs[index] if index < len(step.inputs) else ""
        if buffers is None or not name or name not in step.frees:
            return False
        r = values[name]
        return (buffers.owned.get(id(r)) is r
                and sum(np.may_share_memory(v, r) for v in values.values()) == 1)

    def _store(self, values, where, step, results, layout):
        for name, value in zip(step.outputs, results):
            if name:
                values[name] = value
                where[name] = layout

    def _free(self, values, frees, buffers, out, results):
        """Drop the tensors no later step reads, their buffers back to the pool (and a
        buffer the step was given but did not write its result into)."""
        dead = [values.pop(name) for name in frees]
        if buffers is None:
            return
        live = list(values.values())
        for a in dead + [b for b, r in zip(out or (), results) if b is not r]:
            if isinstance(a, np.ndarray):
                buffers.give(a, live)

    def _feeds(self, feeds):
        if not isinstance(feeds, dict):
            raise TypeError(f"Network.run: feeds must be a dict {{name: array}}, "
                            f"got {type(feeds).__name__}")
        names = {t.name for t in self.inputs}
        unknown = sorted(set(feeds) - names)
        if unknown:
            raise ValueError(f"Network.run: {unknown} are not inputs of this network "
                             f"(inputs: {sorted(names)})")
        values = {}
        for info in self.inputs:
            if info.name not in feeds:
                raise ValueError(f"Network.run: input {info.name!r} is missing")
            values[info.name] = _checked(info, feeds[info.name])
        return values

    def run(self, feeds, profile=None):
        """Outputs for ``feeds``.

        Parameters
        ----------
        feeds : dict
            ``{input name: array_like}`` for every input.  Float inputs may come in
            any float dtype; they are cast to the model's.
        profile : list, optional
            When given, one ``(node, seconds, input shapes, layout, conv algorithm)`` is
            appended per step run.

        Returns
        -------
        dict
            ``{output name: ndarray}``.

        Raises
        ------
        TypeError
            A non-dict ``feeds``, or an input of a non-float dtype where the model
            takes floats.
        ValueError
            A missing or unknown input, or one of the wrong rank or fixed dimensions.
        """
        fed = self._feeds(feeds)
        key = _shape_key(fed)
        plan = self._plan_for(fed)
        buffers, shapes, trace = self._memory(key, plan)
        if trace and profile is None:
            values = replay(trace, fed)
        else:
            # Recorded into a list of its own: a run that raises leaves no partial trace.
            recording = [] if buffers is not None and profile is None else None
            values = self.execute(fed, plan, profile, memory=(buffers, shapes), trace=recording)
            if recording:
                trace[:] = recording
        if buffers is None:                                   # recorded: later runs reuse
            self._shapes[key] = (plan, shapes)
        # An output that is a constant, or a view of an input or of a reused buffer, is
        # copied: callers own it.
        return {name: np.array(values[name], copy=any(
                    np.may_share_memory(values[name], x) for x in fed.values())
                    or (buffers is not None and buffers.holds(values[name])))
                if name in values else self.graph.constants[name].copy()
                for name in self.outputs}

    def _memory(self, key, plan):
        """``(buffers, shapes, trace)`` for inputs of ``key`` run by ``plan``: this
        thread's buffers, the shapes recorded under that plan and this thread's trace
        of a run on those buffers (empty until one is recorded); or ``(None, list,
        None)``: record the shapes into the list (kept once complete)."""
        recorded, shapes = self._shapes.get(key, (None, None))
        if shapes is None or recorded is not plan:
            return None, [], None
        mine = self._local.__dict__.setdefault("buffers", {})
        if key not in mine or mine[key][0] is not shapes:      # a new plan: new buffers
            largest = max((int(np.prod(shape)) * np.dtype(dtype).itemsize
                           for step in shapes for shape, dtype in step), default=0)
            mine[key] = (shapes, Buffers(memory.CHUNK_TENSORS * largest), [])
        return mine[key][1], shapes, mine[key][2]

    def describe(self, node, shapes, layout="NCHW", choice=None):
        """``(algorithm, flops)`` of ``node`` run in ``layout`` (a conv with ``choice``)
        on inputs of ``shapes`` (a profile entry's): the conv path that runs it, or ""
        and 0 for an operator without one."""
        step = next(s for s in self.steps if s.node is node)
        describe = getattr(step.run, "describe", None)
        if describe is None:
            return "", 0
        return describe(layout, *shapes) if choice is None else describe(layout, *shapes,
                                                                          choice=choice)

    def __call__(self, x):
        """The output for ``x`` (a tuple of outputs if the model has several), for a
        model with one input; ``run`` takes several."""
        if len(self.inputs) != 1:
            raise TypeError(f"Network: this model takes {len(self.inputs)} inputs "
                            f"{[t.name for t in self.inputs]}; call run({{name: array}})")
        results = self.run({self.inputs[0].name: x})
        out = tuple(results[name] for name in self.outputs)
        return out[0] if len(out) == 1 else out

    def __repr__(self):
        ins = ", ".join(f"{t.name}{list(t.shape)}" for t in self.inputs)
        return f"Network({len(self.steps)} steps, inputs: {ins}, outputs: {self.outputs})"


def replay(trace, fed):
    """A run recorded by :meth:`Network.execute` (``trace``), again on inputs ``fed``.

    A run on one thread's buffers makes the same choices every time (the buffer each
    step writes into, the conversions, what runs in place): they depend on shapes
    and on which tensor is still read, never on values.  Replaying the steps with
    those choices skips deciding them again, the Python cost of every step that a
    small layer's time does not hide.
    """
    values = dict(fed)
    for entry in trace:
        if len(entry) == 4:                          # a layout conversion
            name, src, dst, out = entry
            values[name] = convert(values[name], src, dst, out)
            continue
        run, fetch, extra, outputs, frees = entry
        results = run(*[values[n] if n.__class__ is str else n for n in fetch], **extra)
        for name, value in zip(outputs, results):
            if name:
                values[name] = value
        for name in frees:
            del values[name]
    return values


def _shape_key(fed):
    return tuple((name, x.shape, x.dtype.str) for name, x in fed.items())


def _checked(info, value):
    """An input array: the model's dtype, its rank and fixed dimensions."""
    x = np.asarray(value)
    if info.dtype.kind == "f":
        if x.dtype.kind != "f":
            raise TypeError(f"Network.run: input {info.name!r} must be a float array "
                            f"({info.dtype}), got {x.dtype}")
        x = x.astype(info.dtype, copy=False)
    elif x.dtype != info.dtype:
        raise TypeError(f"Network.run: input {info.name!r} must be {info.dtype}, got {x.dtype}")
    if x.ndim != len(info.shape) or any(isinstance(d, int) and d > 0 and d != s
                                        for d, s in zip(info.shape, x.shape)):
        raise ValueError(f"Network.run: input {info.name!r} must have shape "
                         f"{tuple(d if isinstance(d, int) and d > 0 else '?' for d in info.shape)}"
                         f", got {x.shape}")
    return x


def load_onnx(model, *, layout_transform=True):
    """Load an ONNX model as a :class:`Network`.

    Parameters
    ----------
    model : str, os.PathLike, bytes or onnx.ModelProto
        The model (opset 13 or later; older ones are converted).
    layout_transform : bool
        Choose each step's layout (NCHW or NHWC) for each input shape on its first
        run, by timing the steps and the conversions on this machine and solving the
        layout DP (times cached on disk).  False runs every step NCHW.

    Returns
    -------
    Network
        ``net(x)`` for a one-input model, ``net.run({name: array})`` in general.

    Raises
    ------
    ImportError
        Without the ``onnx`` package (``pip install 'tilegemm[onnx]'``).
    TypeError, FileNotFoundError, ValueError
        Not a model, no such file, or a file that is not valid ONNX.
    NotImplementedError
        An operator or attribute tilegemm does not run, naming the node.
    """
    graph = from_onnx(validated(read_model(model), registry.known))
    for node in graph.nodes:                  # unsupported operators fail before any pass
        registry.check(node)
    return Network(optimize(graph), layout_transform)
