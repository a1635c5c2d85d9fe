"""Jitted callers that call inner functions by symbol (ground/linking.py), across processes.

A caller loaded from Numba's cache names its callees' symbols; these tests run
fresh processes on one cache folder and check that every load finds them: after a
normal first run, when the callee's cache entry was compiled again in another
process under another symbol, and when a plain ``numba.njit`` caller (which links
the callee's code) shares the callee.
"""
import glob
import os
import pickle
import subprocess
import sys
import textwrap

import pytest
from numba.core import serialize

_CALLEES = '''
from tilegemm.ground.contracts import inner_jit

@inner_jit
def scaled(a, i, s):
    return a[i] * s

@inner_jit
def twice(a, i):
    return scaled(a, i, 2.0)
'''

_MODULE = '''
import numba
from tilegemm.ground.contracts import jit
from linked_callees import scaled, twice

@jit
def total(a):
    s = 0.0
    for i in range(a.size):
        s += twice(a, i)
    return s

@numba.njit(cache=True)
def plain_total(a):
    s = 0.0
    for i in range(a.size):
        s += twice(a, i) + scaled(a, i, 1.0)
    return s
'''

_RUN = '''
import sys
sys.path.insert(0, {folder!r})
import numpy as np
from numba.core import event
compiled = []
class Listener(event.Listener):
    def on_start(self, ev):
        compiled.append(ev.data["dispatcher"].py_func.__name__)
    def on_end(self, ev):
        pass
event.register("numba:compile", Listener())
{prelude}
import linked_sample as m
a = np.arange(10.0)
print(m.total(a), m.plain_total(a), [c.fndesc.mangled_name for c in m.twice.overloads.values()])
print(sorted(set(compiled)))
'''


def _run(folder, prelude=""):
    env = dict(os.environ, NUMBA_CACHE_DIR=str(folder / "cache"))
    code = _RUN.format(folder=str(folder), prelude=textwrap.dedent(prelude))
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    *_, results, compiled = done.stdout.strip().splitlines()
    total, plain, symbols = results.split(" ", 2)
    assert float(total) == 90.0 and float(plain) == 135.0
    return compiled, symbols


@pytest.fixture
def folder(tmp_path):
    (tmp_path / "linked_callees.py").write_text(_CALLEES)
    (tmp_path / "linked_sample.py").write_text(_MODULE)
    return tmp_path


def test_a_cached_caller_loads_its_callees_first(folder):
    assert _run(folder)[0] == "['plain_total', 'scaled', 'total', 'twice']"
    assert _run(folder)[0] == "[]"


def test_a_callee_compiled_again_elsewhere_keeps_the_cached_caller_working(folder):
    first = _run(folder)[1]
    for path in glob.glob(str(folder / "cache" / "**" / "linked_callees.twice-*"),
                          recursive=True):
        os.remove(path)
    # Compiled again after other functions, ``twice`` gets another symbol; the cached
    # ``total`` still names the first one.
    prelude = """
    import numba
    for k in range(5):
        numba.njit(lambda x: x + 1)(k)
    """
    compiled, symbols = _run(folder, prelude)
    assert compiled == "['<lambda>', 'twice']" and symbols != first
    assert _run(folder) == ("[]", symbols)


def test_a_callee_whose_result_type_changed_recompiles_its_cached_callers(folder):
    _run(folder)
    # Numba's cache of linked_sample does not see linked_callees change; the cached
    # ``total`` would call ``twice`` as returning a float.
    (folder / "linked_callees.py").write_text(
        _CALLEES.replace("return scaled(a, i, 2.0)", "return int(scaled(a, i, 2.0))"))
    compiled = _run(folder)[0]
    assert "'total'" in compiled and "'twice'" in compiled
    # (A plain numba.njit caller keeps the callee's old code: Numba's own limit.)


def test_an_index_naming_another_signatures_entry_is_a_miss(folder):
    # Two processes saving entries of one function at once can leave its index naming
    # the data file of another signature: here the index is swapped by hand.
    _run(folder, "import numpy as np, linked_sample\nlinked_sample.total(np.arange(10))")
    (index,) = glob.glob(str(folder / "cache" / "**" / "linked_sample.total-*.nbi"),
                         recursive=True)
    with open(index, "rb") as f:
        version = pickle.load(f)
        stamp, overloads = pickle.loads(f.read())
    assert len(overloads) == 2
    first, second = overloads
    overloads[first], overloads[second] = overloads[second], overloads[first]
    with open(index, "wb") as f:
        pickle.dump(version, f, protocol=-1)
        f.write(serialize.dumps((stamp, overloads)))
    # ``total`` for a float array would otherwise run the int array's code.
    assert _run(folder)[0] == "['total']"
