"""The global layout choice: dynamic programming over the cuts of a network's
topological order, a pure function of profiled cost tables.

The ops run in order 0..n-1.  Op ``i`` runs in one layout of ``ops[i].layouts``;
it reads its inputs in that layout and writes its outputs in it.  A tensor is in
one layout at a time: a reader that wants another layout pays for converting it
(``convert_cost``), and later readers find it converted.  The cut after op ``i``
is crossed by the live tensors (written at or before ``i``, read after it, graph
outputs included); its *state* is the layout of each.  Then

    T[i+1][s'] = min over states s of cut i and layouts c of op i+1 of
                 T[i][s] + (conversions of op i+1's inputs from s to c) + O[i+1][c]

where ``s'`` is ``s`` with op i+1's inputs in ``c``, its outputs added in ``c`` and
the tensors no later op reads dropped.  After the last op the graph outputs are
converted to the layouts asked for; the cheapest final state, followed back
through the recorded choices, gives every op's layout.

Pruning: state ``j`` of a cut is dropped when another state ``i`` has ``T_i +
Distance(i, j) < T_j`` (``Distance`` is the cost of converting cut ``i`` into cut
``j``): whatever follows ``j`` can follow ``i`` for no more, as long as converting
a tensor directly never costs more than through a third layout (always true with
two layouts).
"""
import itertools
from dataclasses import dataclass


@dataclass(frozen=True)
class Op:
    """An op of the problem: its name, the tensors it reads and writes, its layouts."""

    name: str
    reads: tuple
    writes: tuple
    layouts: tuple


@dataclass
class Problem:
    """A layout problem: ops in topological order, the graph inputs' layouts, the
    layouts the outputs must end in, ``op_cost[(op index, layout)]`` and
    ``convert_cost[(tensor, from, to)]`` in seconds."""

    ops: list
    inputs: dict
    outputs: dict
    op_cost: dict
    convert_cost: dict

    def last_reads(self):
        """``{tensor: index of the last op reading it}`` (graph outputs: ``len(ops)``)."""
        last = {}
        for i, op in enumerate(self.ops):
            for t in op.reads:
                last[t] = i
        for t in self.outputs:
            last[t] = len(self.ops)
        return last

    def convert(self, tensor, src, dst):
        return 0.0 if src == dst else self.convert_cost[(tensor, src, dst)]


def _step(problem, last, i, state, layout):
    """``(cost, next state)`` of running op ``i`` in ``layout`` from cut ``state``
    (a tuple of (tensor, layout) pairs, sorted); ``last`` is ``problem.last_reads()``."""
    op = problem.ops[i]
    current = dict(state)
    cost = problem.op_cost[(i, layout)]
    for t in dict.fromkeys(op.reads):
        cost += problem.convert(t, current[t], layout)
        current[t] = layout
    for t in op.writes:
        current[t] = layout
    return cost, tuple(sorted((t, l) for t, l in current.items() if last.get(t, -1) > i))


def _distance(problem, a, b):
    return sum(problem.convert(t, la, lb) for (t, la), (_, lb) in zip(a, b))


def _prune(problem, states):
    """Drop the states another one reaches more cheaply by converting."""
    kept = {}
    ordered = sorted(states.items(), key=lambda kv: kv[1][0])
    for s, entry in ordered:
        if any(entry2[0] + _distance(problem, s2, s) < entry[0] for s2, entry2 in kept.items()):
            continue
        kept[s] = entry
    return kept


def solve(problem, prune=True):
    """``(seconds, [layout of each op])``: the cheapest plan of ``problem``."""
    last = problem.last_reads()
    start = tuple(sorted((t, l) for t, l in problem.inputs.items() if last.get(t, -1) >= 0))
    states = {start: (0.0, None)}          # state -> (T, (previous state, layout))
    history = []
    for i, op in enumerate(problem.ops):
        following = {}
        for s, (cost, _) in states.items():
            for layout in op.layouts:
                step, nxt = _step(problem, last, i, s, layout)
                if nxt not in following or cost + step < following[nxt][0]:
                    following[nxt] = (cost + step, (s, layout))
        states = _prune(problem, following) if prune else following
        history.append(states)
    best, end = min((cost + sum(problem.convert(t, l, problem.outputs[t]) for t, l in s), s)
                    for s, (cost, _) in states.items())
    layouts = []
    for states in reversed(history):
        end, layout = states[end][1]
        layouts.append(layout)
    return best, layouts[::-1]


def plan_cost(problem, layouts):
    """Seconds of running ``problem`` with op ``i`` in ``layouts[i]`` (convert on read,
    outputs converted at the end): what :func:`solve` minimises."""
    current = dict(problem.inputs)
    total = 0.0
    for i, (op, layout) in enumerate(zip(problem.ops, layouts)):
        total += problem.op_cost[(i, layout)]
        for t in dict.fromkeys(op.reads):
            total += problem.convert(t, current[t], layout)
            current[t] = layout
        current.update((t, layout) for t in op.writes)
    return total + sum(problem.convert(t, current[t], l) for t, l in problem.outputs.items())


def brute_force(problem):
    """``(seconds, layouts)`` over every assignment (for tests: exponential)."""
    return min((plan_cost(problem, list(choice)), list(choice))
               for choice in itertools.product(*(op.layouts for op in problem.ops)))
