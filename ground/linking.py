"""Jitted functions that call each other by symbol instead of carrying each other's code.

Numba links the whole module of every jitted callee into each caller, where it is
optimised and code-generated again: a 7x7 stem's first call compiled its phase
copy once for itself and once more inside the task loop.  Here a callee made by
:func:`tilegemm.ground.contracts.inner_jit` is compiled once: its address is
registered with LLVM under its symbol (``llvmlite.binding.add_symbol``) and
callers made by ``inner_jit`` or :func:`jit` declare it without linking its code.

A caller's object code then names symbols that must exist before it is loaded
from Numba's cache.  Its cache entry stores the callees it names (module,
qualified name, signature, symbol); loading the entry first loads those, each
registered under the symbol the caller knows as well (a callee compiled in
another process has the same code under another name), and a callee that cannot
be found makes the entry a miss, compiled afresh.  Any other caller (a plain
``numba.njit``, a ``numba.cfunc``) links the callee's code and the code of every
callee that names, as Numba would: its own cache entry stays whole.  A C entry
point that should not carry its callees' code is a :func:`jit` function's C
wrapper instead (``contracts.c_entry``).

Object code may also name symbols registered apart from Numba (the tiles of
``kernels.tilelib``).  Another process may store such a symbol, and then an entry
naming it, after this process last looked for it: :func:`before_load` hooks run
after an entry is read and before it is loaded, of a :func:`jit` function or of a
plain ``numba.njit`` one given them by :func:`guard_plain_caches`.  (An entry loaded
while a symbol it names is unregistered gets every external symbol of its object,
the CPython API's included, at address zero: LLVM reports the failed lookup
nowhere.)  An entry written for another signature (two processes saving entries of
one function at once can leave the index naming another's data file) is a miss.
"""
import collections
import sys

import llvmlite.binding as llb
from numba.core import event, sigutils
from numba.core.caching import CompileResultCacheImpl, FunctionCache
from numba.core.registry import CPUDispatcher

#: A callee a caller's code names: ``symbol`` as the caller knows it, ``restype`` as
#: it was compiled then (the caller's calls assume it).
Callee = collections.namedtuple("Callee", "module qualname args restype symbol")

_Frame = collections.namedtuple("_Frame", "dispatcher callees")

#: The compiles under way, innermost last (Numba compiles under one lock).
_compiling = []


class _CompileListener(event.Listener):
    def on_start(self, ev):
        _compiling.append(_Frame(ev.data["dispatcher"], {}))

    def on_end(self, ev):
        _compiling.pop()


event.register("numba:compile", _CompileListener())


class _Unresolved(Exception):
    """A cached caller's callee is gone: the entry counts as a miss."""


class LinkedDispatcher(CPUDispatcher):
    """A dispatcher whose calls to inner functions go by symbol (see the module)."""

    #: Whether callers reach this function by its symbol rather than its code.
    by_symbol = False

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.callees = {}               # overload args -> {symbol: Callee}

    def enable_caching(self):
        self._cache = _LinkedCache(self)

    def add_overload(self, cres):
        super().add_overload(cres)
        args = tuple(cres.signature.args)
        frame = _compiling[-1] if _compiling else None
        if frame is not None and frame.dispatcher is self:
            self.callees[args] = dict(frame.callees)    # compiled here, not loaded
        if self.by_symbol:
            _register(cres.fndesc.mangled_name, cres)
        for _, impl in self.targetctx._defns[cres.entry_point].versions:
            impl.libs = _Links(self, args)


class _Links:
    """What a call to one overload links into the caller being lowered; Numba reads
    it as the ``libs`` of the call's implementation."""

    def __init__(self, dispatcher, args):
        self.dispatcher, self.args = dispatcher, args

    def __iter__(self):
        disp, args = self.dispatcher, self.args
        frame = _compiling[-1] if _compiling else None
        if frame is not None and isinstance(frame.dispatcher, LinkedDispatcher):
            if disp.by_symbol:
                cres = disp.overloads[args]
                symbol = cres.fndesc.mangled_name
                frame.callees[symbol] = Callee(disp.py_func.__module__, disp.py_func.__qualname__,
                                               args, cres.signature.return_type, symbol)
                return iter(())
            frame.callees.update(disp.callees.get(args, {}))
            return iter((disp.overloads[args].library,))
        return iter(_closure(disp, args, set()))


def _closure(disp, args, seen):
    """The libraries of an overload and of every callee its code names, transitively."""
    libraries = [disp.overloads[args].library]
    for callee in disp.callees.get(args, {}).values():
        if callee.symbol not in seen:
            seen.add(callee.symbol)
            inner = _dispatcher(callee)
            libraries += _closure(inner, callee.args, seen)
    return libraries


def _dispatcher(callee):
    obj = sys.modules.get(callee.module)
    for part in callee.qualname.split("."):
        obj = getattr(obj, part, None)
    if not isinstance(obj, LinkedDispatcher):
        raise _Unresolved(callee)
    return obj


def _register(symbol, cres):
    """Make ``symbol`` name the compiled function of ``cres`` for code linked later."""
    llb.add_symbol(symbol, cres.library.get_pointer_to_function(cres.fndesc.mangled_name))


def _load(callee):
    """Load (or compile) a callee named by a cached caller, under the caller's symbol."""
    disp = _dispatcher(callee)
    disp.compile(callee.args)
    cres = disp.overloads.get(callee.args)
    if cres is None or cres.signature.return_type != callee.restype:
        raise _Unresolved(callee)
    _register(callee.symbol, cres)


class _LinkedCacheImpl(CompileResultCacheImpl):
    """Numba's compile-result cache with the callees each entry names."""

    def __init__(self, dispatcher):
        super().__init__(dispatcher.py_func)
        self._dispatcher = dispatcher

    def reduce(self, cres):
        callees = self._dispatcher.callees.get(tuple(cres.signature.args), {}).values()
        # Plain tuples: an entry written by another version still unpickles.
        return ("linked", tuple(tuple(c) for c in callees), super().reduce(cres))

    def rebuild(self, target_context, payload):
        if not (isinstance(payload, tuple) and len(payload) == 3 and payload[0] == "linked"):
            raise _Unresolved("an entry from before callees were recorded")
        try:
            callees = [Callee(*fields) for fields in payload[1]]
        except TypeError:
            raise _Unresolved("an entry from another version") from None
        inner = payload[2]
        for callee in callees:
            _load(callee)
        cres = super().rebuild(target_context, inner)
        self._dispatcher.callees[tuple(cres.signature.args)] = {c.symbol: c for c in callees}
        return cres


#: Run before each cached entry is loaded (:func:`before_load`).
_before_load = []


def before_load(hook):
    """Run ``hook()`` before each cached entry read is loaded, under Numba's compiler
    lock: it registers the symbols it provides that other processes stored since."""
    _before_load.append(hook)


class _GuardedCache(FunctionCache):
    """Numba's cache, refusing an entry of another signature before rebuilding it
    (which would load its code and, for a :func:`jit` function, record its callees),
    and running the :func:`before_load` hooks between reading an entry and loading
    it: whatever the entry names was stored before the entry was."""

    def _load_overload(self, sig, target_context):
        if not self._enabled:
            return None
        data = self._cache_file.load(self._index_key(sig, target_context.codegen()))
        if data is None:
            return None
        args, _ = sigutils.normalize_signature(sig)
        if _stored_args(data) != tuple(args):
            return None
        for hook in _before_load:
            hook()
        try:
            return self._impl.rebuild(target_context, data)
        except _Unresolved:
            return None


def _stored_args(data):
    """The argument types of a cache entry's data (``CompileResult._reduce``'s fourth
    field, inside the ``"linked"`` wrapper of a :func:`jit` function); None if the
    data is of no form known here."""
    if isinstance(data, tuple) and len(data) == 3 and data[0] == "linked":
        data = data[2]
    try:
        return tuple(data[3].args)
    except (TypeError, IndexError, AttributeError):
        return None


class _LinkedCache(_GuardedCache):
    def __init__(self, dispatcher):
        super().__init__(dispatcher.py_func)
        self._impl = _LinkedCacheImpl(dispatcher)


def guard_plain_caches(namespace):
    """Give every cached plain ``numba.njit`` function in ``namespace`` (a generated
    module's globals) the :func:`before_load` hooks and the signature check."""
    for obj in list(namespace.values()):
        if (isinstance(obj, CPUDispatcher) and not isinstance(obj, LinkedDispatcher)
                and type(obj._cache) is FunctionCache):
            obj._cache = _GuardedCache(obj.py_func)
