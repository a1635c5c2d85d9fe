"""Micro-kernel tile functions compiled once, on their own, their object code cached.

A jitted loop that runs a tile calls it by name, through an external declaration
in its own LLVM module, instead of carrying the tile's body.  Numba links a
callee's module into every caller and optimises and code-generates it again
there, so a body held in the loop's module was compiled once per loop, and again
in each function calling that loop (docs/kernels.md, "Compile time on a cold
cache").  Here each tile is compiled once; its object code goes to
``<cache>/tiles/<sources digest>/``, named by the tile and the host CPU, and its
address is registered with LLVM's symbol table (``llvmlite.binding.add_symbol``)
before any code calling it is compiled or loaded from Numba's cache:

* :func:`load_cached`, when a template asks for its micro-kernels (module
  import), loads every tile already in the cache: a caller loaded from Numba's
  cache can only call a tile that some earlier process compiled, and stored,
  before that caller was compiled.  A tile asked for but not stored yet is looked
  for again before each entry is loaded from Numba's cache
  (``ground.linking.before_load``): another process may have stored it, and
  callers of it, since.
* :func:`prefetch`, at the same moment, asks a helper process
  (:mod:`tilegemm.kernels.tilebuild`) for a tile that is not cached; the helper
  writes and compiles it while this process types and lowers the loops that call
  it, so on two cores a cold call overlaps the two.  (A thread would not: llvmlite
  serialises every LLVM call of a process behind one lock, Numba's included.)
* :func:`define`, when a caller is compiled, takes the helper's object code
  (waiting for it if the helper has started on it, else compiling the tile
  here), or compiles the tile without a helper (``TILEGEMM_TILE_HELPER=0``, or no
  helper could start).

The digest of the kernel sources and a per-folder ``EPOCH`` token go into every
generated module's header (:func:`header`): a new tilegemm version, or the tiles
folder deleted while generated modules stayed, rewrites the generated modules,
which makes Numba's cache of them stale, so no cached caller outlives its tiles.
"""
import functools
import hashlib
import os
import pickle
import secrets
import struct
import subprocess
import sys
import threading

import llvmlite
import llvmlite.binding as llvm
import llvmlite.ir as ir

from tilegemm.ground import linking, loader

_ready = {}  # symbol -> its object code
_compiled = set()  # the symbols this process compiled rather than loaded
_wanted = set()  # the symbols asked for before they were stored
_builds = {}  # symbol -> its _Build, sent to the helper and not yet taken
_builds_lock = threading.Lock()
_helper = []  # the helper process, once started (None: it could not start)
#: How long a caller waits for the helper's copy of a tile it has started.
HELPER_WAIT_SECONDS = 60.0


@functools.lru_cache(maxsize=1)
def engine_digest():
    """Hash of every source the generated modules and tiles compile in.

    Numba's cache checks only the generated file itself; writing this digest into
    it makes any change to the kernel generators, templates, packing or ground
    contracts invalidate the cached machine code.
    """
    here = os.path.dirname(os.path.abspath(__file__))
    root = os.path.dirname(here)
    return loader.digest(loader.python_files(here) + loader.python_files(os.path.join(root, "packing"))
                         + loader.python_files(os.path.join(root, "ground")))


def _folder():
    return os.path.join(loader.cache_dir(), "tiles", engine_digest())


def epoch():
    """The tiles folder's token, created with the folder (the first process wins)."""
    path = os.path.join(_folder(), "EPOCH")
    try:
        with open(path) as f:
            token = f.read().strip()
        if token:
            return token
    except OSError:
        pass
    loader.write_first(path, secrets.token_hex(8).encode())
    with open(path) as f:
        return f.read().strip()


def header():
    """The lines every generated module starts with (see the module docstring)."""
    return f"# engine sources digest: {engine_digest()}; tiles epoch: {epoch()}\n"


def _codegen():
    from numba.core.registry import cpu_target
    return cpu_target.target_context.codegen()


def _target():
    """Numba's ``(triple, CPU name, features)``: tiles and their callers agree."""
    return _codegen().magic_tuple()


def _machine():
    return target_machine(*_target())


@functools.lru_cache(maxsize=None)
def target_machine(triple, cpu, features):
    """LLVM's target machine for Numba's ``(triple, cpu, features)``."""
    llvm.initialize_native_target()
    llvm.initialize_native_asmprinter()
    return llvm.Target.from_triple(triple).create_target_machine(
        cpu=cpu, features=features, opt=3, reloc="default", codemodel="jitdefault")


@functools.lru_cache(maxsize=1)
def _engine():
    """The execution engine that holds every tile's machine code (process-wide)."""
    return llvm.create_mcjit_compiler(llvm.parse_assembly(""), _machine())


def _path(symbol):
    machine = repr((_target(), llvmlite.__version__)).encode()
    return os.path.join(_folder(), f"{symbol}_{hashlib.sha256(machine).hexdigest()[:12]}.o")


def _lock():
    from numba.core.compiler_lock import global_compiler_lock
    return global_compiler_lock  # LLVM's state is shared with Numba's compiles: one lock


def load_cached(symbol):
    """Register ``symbol`` from the cache if it is there; whether it is now ready."""
    if symbol in _ready:
        return True
    with _lock():
        if symbol not in _ready:
            try:
                with open(_path(symbol), "rb") as f:
                    obj = f.read()
            except OSError:
                _wanted.add(symbol)
                return False
            _register(symbol, obj)
    return True


def _load_stored():
    """Register the tiles asked for before they were stored that are stored now."""
    with _lock():
        for symbol in [s for s in _wanted if s not in _ready]:
            load_cached(symbol)
        _wanted.difference_update(_ready)


linking.before_load(_load_stored)


class _Build:
    """A tile sent to the helper: whether it has started, then its object code."""

    def __init__(self):
        self.started = False
        self.done = threading.Event()
        self.obj = None


def prefetch(symbol, spec):
    """Register ``symbol`` from the cache, or ask the helper process to compile it.

    ``spec`` is what the helper needs to write the function: the name of its writer
    in ``tilebuild.WRITERS`` (``"tile"`` for a micro-kernel), then the writer's
    arguments.
    """
    if load_cached(symbol):
        return
    helper = _helper_process()
    if helper is None:
        return
    with _builds_lock:
        if symbol in _ready or symbol in _builds:
            return
        _builds[symbol] = _Build()
        try:
            send(helper.stdin, (symbol, spec, _target()))
        except (OSError, ValueError):  # the helper has gone: define() compiles it here
            _builds.pop(symbol, None)


def _helper_process():
    """The helper process, started on first use; None where it cannot run."""
    with _builds_lock:
        if not _helper:
            _helper.append(_start_helper())
        return _helper[0]


def _start_helper():
    if os.environ.get("TILEGEMM_TILE_HELPER", "1") == "0" or not sys.executable:
        return None
    try:
        # The helper never starts a helper of its own.
        process = subprocess.Popen([sys.executable, "-m", "tilegemm.kernels.tilebuild"],
                                   stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                   stderr=subprocess.DEVNULL,
                                   env=dict(os.environ, TILEGEMM_TILE_HELPER="0"))
    except OSError:
        return None
    threading.Thread(target=_read_replies, args=(process,), name="tilegemm-tiles",
                     daemon=True).start()
    return process


def _read_replies(process):
    """Record the helper's replies; at its end, release every caller waiting on it."""
    try:
        while (reply := receive(process.stdout)) is not None:
            symbol, state, payload = reply
            with _builds_lock:
                build = _builds.get(symbol)
                if build is not None and state == "started":
                    build.started = True
            if build is None or state == "started":
                continue
            if state == "done":
                try:
                    loader.write_atomic(_path(symbol), payload)
                except OSError:  # an unwritable cache: the object code serves this process
                    pass
                build.obj = payload
            build.done.set()
    except (OSError, ValueError, EOFError):
        pass
    idle = process.wait() == 0  # it ran out of work; a broken helper is not started again
    with _builds_lock:
        if _helper and _helper[0] is process:
            if idle:
                _helper.clear()
            else:
                _helper[0] = None
        for build in _builds.values():
            build.done.set()


def _forget_helper():
    """In a forked child: the helper's pipes belong to the parent."""
    _helper.clear()
    _builds.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_helper)


def _claim(symbol):
    """The helper's object code of ``symbol``, or None: not sent, not started yet
    (the caller compiles it now), or failed."""
    with _builds_lock:
        build = _builds.get(symbol)
        if build is None or not build.started:
            _builds.pop(symbol, None)
            return None
    build.done.wait(HELPER_WAIT_SECONDS)
    with _builds_lock:
        _builds.pop(symbol, None)
    return build.obj


def define(symbol, fnty, emit_body):
    """Make ``symbol``, a function of LLVM type ``fnty``, callable from jitted code.

    ``emit_body(builder, fn)`` writes its body.  Loaded from the cache if there, or
    taken from the helper process (:func:`prefetch`), else compiled and stored;
    later calls return at once.
    """
    if symbol in _ready:
        return
    with _lock():
        if symbol in _ready:
            return
        obj = _claim(symbol)
        if obj is None:
            if load_cached(symbol):
                return
            obj = _build(symbol, fnty, emit_body)
        _register(symbol, obj)
        _compiled.add(symbol)


def module_of(symbol, fnty, emit_body):
    """The LLVM module holding ``symbol``, its body written by ``emit_body``."""
    module = ir.Module(symbol)
    module.triple = _machine().triple
    module.data_layout = str(_machine().target_data)
    fn = ir.Function(module, fnty, symbol)
    emit_body(ir.IRBuilder(fn.append_basic_block("entry")), fn)
    return module


def compile_ir(text, target):
    """Object code of the module ``text`` for ``target`` ``(triple, cpu, features)``:
    LLVM's O3 pipeline without its vectorisers and unroller.  The body is vector
    code already, its k loop unrolled as written; those passes would find nothing to
    do and cost half the compile."""
    machine = target_machine(*target)
    parsed = llvm.parse_assembly(text)
    parsed.verify()
    tuning = llvm.create_pipeline_tuning_options(speed_level=3)
    tuning.loop_vectorization = tuning.slp_vectorization = tuning.loop_unrolling = False
    passes = llvm.create_pass_builder(machine, tuning)
    passes.getModulePassManager().run(parsed, passes)
    return machine.emit_object(parsed)


def _build(symbol, fnty, emit_body):
    """Compile ``symbol`` here and store its object code in the cache."""
    obj = compile_ir(str(module_of(symbol, fnty, emit_body)), _target())
    loader.write_atomic(_path(symbol), obj)
    return obj


def send(stream, message):
    """Write one message to the helper's pipe ``stream`` (a 4-byte length, a pickle)."""
    data = pickle.dumps(message)
    stream.write(struct.pack("<I", len(data)) + data)
    stream.flush()


def receive(stream):
    """The next message on the helper's pipe ``stream``, or None at its end."""
    head = stream.read(4)
    if len(head) < 4:
        return None
    return pickle.loads(stream.read(struct.unpack("<I", head)[0]))


def compiled():
    """The tile symbols this process compiled (the others it uses came from the cache)."""
    return frozenset(_compiled)


def _register(symbol, obj):
    engine = _engine()
    engine.add_object_file(llvm.ObjectFileRef.from_data(obj))
    engine.finalize_object()
    address = engine.get_function_address(symbol)
    if not address:
        raise RuntimeError(f"{symbol} is not in its object code")
    llvm.add_symbol(symbol, address)
    _ready[symbol] = obj


def call(builder, function, values):
    """Call ``function`` (a record with ``symbol``, ``fnty`` and ``body``, as
    :func:`define` takes them) with ``values``, defining it first if need be."""
    if [v.type for v in values] != list(function.fnty.args):
        raise TypeError(f"{function.symbol}: arguments of types {[str(v.type) for v in values]}, "
                        f"expected {[str(t) for t in function.fnty.args]}")
    define(function.symbol, function.fnty, function.body)
    return builder.call(declare(builder.module, function.symbol, function.fnty), values)


def declare(module, symbol, fnty):
    """The external declaration of ``symbol`` in ``module`` (added once)."""
    fn = module.globals.get(symbol)
    if fn is None:
        fn = ir.Function(module, fnty, symbol)
    return fn
