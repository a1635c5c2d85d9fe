"""The int8 micro-kernel generator: one function emits every int8 MR x NR tile as LLVM IR.

Products of 8-bit integers are summed exactly in int32 lanes.  Both packed panels
hold 32-bit words, each word ``GROUP`` consecutive k values of one row of A or one
column of B, so one lane of a vector of B holds a column's group and one word of
A, broadcast, a row's group.  Per group of k the tile loads NR/lanes vectors of B,
broadcasts MR words of A and issues MR*NR/lanes dot-product steps into int32
accumulators held in registers, as the float micro-kernel does with FMAs.

The dot-product step is the kind's (:data:`GROUP`):

* ``vnni``: ``vpdpbusd`` (AVX512-VNNI at 512 bits, AVX-VNNI or AVX512-VNNI+VL at
  256): four products of an *unsigned* byte of A by a *signed* byte of B per lane,
  added to it.  A is packed as ``a + 128`` when it is int8, B as ``b - 128`` when
  it is uint8; the shifts and the zero points come back as row and column
  corrections added when C is first written (see ``kernels/_int8.py``).
* ``madd``: ``vpmaddwd`` then ``vpaddd``: two products of int16 per lane, the
  operands widened to int16 while packing with their zero points already
  subtracted (|a - za|, |b - zb| <= 255: the pair sums cannot saturate, unlike
  ``vpmaddubsw``'s int16 sums).  AVX2 and AVX-512 without VNNI.
* ``maddubs``: ``vpmaddubsw`` then ``vpmaddwd`` by ones then ``vpaddd``: the sum of
  ``vnni``'s four products from the same byte panels, on AVX2.  ``vpmaddubsw``
  saturates its int16 pair sums, so this kind serves only a B whose packed values
  lie within +-:data:`MADDUBS_B_LIMIT` (2 x 255 x 64 = 32640 fits int16): weights
  quantized to 7 bits, as onnxruntime's ``reduce_range`` does for hosts without
  VNNI.  :func:`tilegemm.kernels.qgemm.int8_kind_for` proves the range before
  choosing it.
* ``generic``: the same int16 pair products in plain IR, for any target.
* ``amx``: AMX tile products (``tdpbusd``, Intel AMX-INT8): a 32 x 32 block of C as
  2 x 2 accumulator tiles of 16 x 16 int32, each step 64 k values (:data:`KSTEP`
  groups) of a 32-row block of A by a 32-column block of B, 16 x 16 x 64
  multiply-adds per instruction.  The same bytes and corrections as ``vnni``; A's
  panel holds each row's :data:`KSTEP` words of a step together (an A tile's rows
  are 64 k values each), B's is ``vnni``'s (an AMX B tile is 16 groups of 16 columns'
  words).  The tile registers need a configuration, loaded by :func:`make_tile_begin`'s
  intrinsic before any tile runs, and Linux's permission (``kernels/qgemm.py``).
  Its taps tile reads a convolution's widened image in place: each A tile is 16
  output pixels whose rows lie a constant stride apart (see ``kernels/int8_taps.py``).

Every step is exact; the int32 lanes wrap modulo 2**32, and the caller proves that
the true result fits in int32 (:func:`tilegemm.conv.quant.qmatmul`), so the wrapped sum
of the exact terms is the exact result.
"""
import inspect

import llvmlite.ir as ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from tilegemm.kernels.int8_taps import TILE_PLACES
from tilegemm.kernels.ir import data_ptr, load_vector, splat, store_vector, vector_ptr

#: k values per 32-bit word of the packed panels, per kind.
GROUP = {"vnni": 4, "maddubs": 4, "madd": 2, "generic": 2, "amx": 4}

#: Groups of k per step of the tile's k loop: the panels hold k padded to whole steps.
KSTEP = {"amx": 16}

#: MC blocks of A packed at once, per kind that packs A in slabs (``kernels/_int8.py``
#: :func:`_qgemm_slabs`); the others pack one block at a time.
A_BLOCKS = {"amx": 32}

#: The kinds whose panels hold bytes: A unsigned, B signed (the others: int16).
BYTE_KINDS = ("vnni", "maddubs", "amx")

#: ``maddubs`` is exact for packed B values in [-MADDUBS_B_LIMIT, MADDUBS_B_LIMIT].
MADDUBS_B_LIMIT = 64

#: (kind, bits) -> (MR, NR): MR * NR/lanes int32 accumulators in at most three
#: quarters of the vector registers (32 at 512 bits, 16 below), the rest for B's
#: vectors and the broadcast of A.  ``madd`` at 256 bits also needs a register for
#: each ``vpmaddwd`` product before it is added: 6 x 16 (12 accumulators) spilled
#: to the stack, and 4 x 16 ran 1.04-1.7x faster on an AVX2 EPYC (Zen 3).
#: ``maddubs`` holds the ones and one pair-sum vector: 5 x 16 (15 registers) ran
#: 1.05-1.2x faster than 4 x 16 at n = 512-1024 on that EPYC; 6 x 16 spilled.
TILES = {("amx", 512): (32, 32), ("vnni", 512): (6, 64), ("madd", 512): (6, 64),
         ("vnni", 256): (6, 16),
         ("madd", 256): (4, 16), ("maddubs", 256): (5, 16), ("generic", 128): (4, 8)}

#: The tile's arguments, in order (``a``, ``b``, ``c``, ``rc``, ``cc`` int32 arrays,
#: the rest integers); see :func:`make_int8_tile`.
ARGUMENTS = ("kg", "a", "a_off", "a_rs", "a_gs", "b", "b_off", "c", "c_off", "ldc", "first",
             "rc", "rc_off", "cc", "cc_off", "rows", "cols")
#: The taps tile's: ``segs`` runs of k described by the intp array ``seg`` instead of
#: ``kg`` groups at ``a_gs`` apart, and each row's place in A from the intp array
#: ``a_at`` instead of a row stride (see :func:`make_int8_tile`).  Word offsets are
#: intp: an image's widened rows may pass 2**31 words.
TAPS_ARGUMENTS = ("segs", "seg", "a", "a_at", "a_at_off") + ARGUMENTS[5:]
#: The codes tile's: the taps tile's without ``first`` and row corrections (its k is
#: whole and a convolution's weights have no zero point), C holding int8 or uint8
#: codes, and the requantization: per column a float32 multiplier and bias (the
#: output scale folded in), ``lim`` five float32 (zero point, lowest and highest code,
#: the upper and lower clip over the scale, within the codes' range less the zero
#: point), as ``kernels/requant.py`` :func:`fold` makes them and :func:`code` reads them.
CODES_ARGUMENTS = tuple(name for name in TAPS_ARGUMENTS
                        if name not in ("first", "rc", "rc_off")) + ("mult", "bias", "lim")
ARRAYS = {"a": types.int32, "b": types.int32, "c": types.int32, "rc": types.int32,
          "cc": types.int32, "seg": types.intp, "a_at": types.intp, "mult": types.float32,
          "bias": types.float32, "lim": types.float32}


def make_int8_tile(kind, bits, mr, nr, taps=False, codes=False):
    """The intrinsic of one int8 ``mr x nr`` tile of the ``kind`` (see the module docstring).

    ``tile(kg, a, a_off, a_rs, a_gs, b, b_off, c, c_off, ldc, first, rc, rc_off, cc,
    cc_off, rows, cols)`` sums ``kg`` groups of k: row i's word of group g of A at
    ``a[a_off + i*a_rs + g*a_gs]`` (a packed panel: ``a_rs = 1``, ``a_gs = mr``; A
    read in place: its row stride and 1), rows past ``rows`` reading the last one;
    B's packed panel from ``b[b_off]`` (``nr`` words per group).  It
    writes ``C[:rows, :cols]`` (from ``c[c_off]``, rows ``ldc`` apart): with
    ``first`` nonzero ``C = acc + rc[rc_off + i] + cc[cc_off + j]`` (C is not read),
    else ``C += acc``.  Nothing outside ``C[:rows, :cols]``, ``rc[rc_off:][:rows]``
    and ``cc[cc_off:][:cols]`` is read or written.

    With ``taps`` the tile is ``tile(segs, seg, a, a_at, a_at_off, b, ...)`` (the rest
    as above): k comes in ``segs`` runs, run s ``seg[2*s + 1]`` groups whose words for
    row i are consecutive from ``a[a_at[a_at_off + i] + seg[2*s]]``, B's groups following
    on in its panel: a convolution's kernel taps read from an image in place, each run
    a tap's channels, all of them summed in registers before C is touched, and the
    rows any output pixels (a tile may span the end of an image row).

    With ``codes`` (a taps tile whose k is whole, with no ``first`` and no row
    corrections) C holds int8 or uint8 codes, written from the registers: ``C =
    code(acc + cc[j])`` with ``tile(..., mult, bias, lim)`` as :data:`CODES_ARGUMENTS`
    describes, the same float32 operations as ``kernels/requant.py`` :func:`code`
    (the multiply-add fused where LLVM fuses the epilogue's), so the codes equal the
    epilogue's; the sums never go to memory.  The accumulators start from the
    column corrections.

    With ``kind == "amx"`` (``mr = nr = 32``) A's word of group g of row
    i is at ``a[a_off + i*a_rs + (g // 16)*a_gs + g % 16]``: ``a_gs`` is the distance
    of one step of :data:`KSTEP` groups, ``kg`` a multiple of it, and the tile
    configuration of :func:`make_tile_begin` must be loaded.  Its taps tile takes
    each run's groups in whole steps, rows 16h..16h+15's words from
    ``a[a_at[a_at_off + h] + i*a_at[a_at_off + 2] + seg[2s] + ...]`` (two A tiles, each
    16 rows a constant stride apart), and writes C's row i at ``c_off +
    a_at[a_at_off + 3 + i]``, or not at all where that is negative (``kernels/int8_taps.py``:
    rows of pixels the layer does not have); ``rows`` and ``ldc`` are unused.
    """
    lanes = bits // 32
    if nr % lanes or kind not in GROUP or (kind == "amx" and (mr, nr) != (32, 32)):
        raise ValueError(f"no int8 tile {mr}x{nr} of kind {kind!r} at {bits} bits")
    names = CODES_ARGUMENTS if codes else TAPS_ARGUMENTS if taps else ARGUMENTS
    byte_c = (types.int8, types.uint8) if codes else (types.int32,)

    def emit(context, builder, sig, args):
        _emit_tile(context, builder, sig, dict(zip(names, args)), kind, bits, (mr, nr))
        return context.get_dummy_value()

    def typing(typingctx, *args):
        if len(args) != len(names):
            raise TypeError(f"the int8 tile takes {len(names)} arguments "
                            f"({', '.join(names)}), got {len(args)}")
        given = dict(zip(names, args))
        for name, dtype in ARRAYS.items():
            want = byte_c if name == "c" else (dtype,)
            if name in given and not (isinstance(given[name], types.Array)
                                      and given[name].dtype in want):
                raise TypeError(f"int8 tile: {name} must be an array of "
                                f"{' or '.join(map(str, want))}, got {given[name]}")
        return types.void(*(given[n] if n in ARRAYS else types.intp for n in names)), emit

    # Numba binds a call's arguments by the typing function's signature: spell it out.
    param = inspect.Parameter
    typing.__signature__ = inspect.Signature(
        [param(n, param.POSITIONAL_OR_KEYWORD) for n in ("typingctx",) + names])
    tile = intrinsic(typing)
    tile.__name__ = (f"int8_tile_{kind}{bits}_{mr}x{nr}" + ("_taps" if taps else "")
                     + ("_codes" if codes else ""))
    return tile


def _emit_tile(context, builder, sig, arg, kind, bits, shape):
    """The k loop (over groups, or over the taps' runs of groups), then the update of C
    (see :func:`make_int8_tile`)."""
    mr, nr = shape
    lanes = bits // 32
    nv = nr // lanes
    vec = ir.VectorType(ir.IntType(32), lanes)
    intp = context.get_value_type(types.intp)
    types_of = dict(zip(arg, sig.args))
    if kind == "amx":
        return _emit_amx_tile(context, builder, (arg, types_of), vec)
    places = _row_places(builder, arg, mr)

    def const(value):
        return ir.Constant(intp, value)

    def ptr(name):
        return data_ptr(context, builder, types_of[name], arg[name], arg[name + "_off"])

    b_ptr, c_ptr, cc_ptr = ptr("b"), ptr("c"), ptr("cc")
    rc_ptr = ptr("rc") if "rc" in arg else None
    last = builder.sub(arg["rows"], const(1))
    valid = [builder.select(builder.icmp_signed("<", const(i), arg["rows"]), const(i), last)
             for i in range(mr)]
    if "kg" in arg:
        a_ptr = ptr("a")
        a_rows = [builder.gep(a_ptr, [builder.mul(v, arg["a_rs"])]) for v in valid]
    else:
        a_ptr = data_ptr(context, builder, types_of["a"], arg["a"], const(0))
        at_ptr = ptr("a_at")
        a_rows = [builder.gep(a_ptr, [builder.load(builder.gep(at_ptr, [v]))]) for v in valid]
    start = _start(builder, arg, cc_ptr, vec, nv)
    acc = [[cgutils.alloca_once_value(builder, start[v]) for v in range(nv)] for _ in range(mr)]

    def group(b_group, a_word):
        """One group of k: B's ``nr`` words of group ``b_group``, row i's word of A at
        ``a_rows[i] + a_word``."""
        b_row = builder.mul(b_group, const(nr))
        bv = [builder.load(vector_ptr(builder, b_ptr, builder.add(b_row, const(v * lanes)), vec),
                           align=4) for v in range(nv)]
        for i in range(mr):
            aw = splat(builder, builder.load(builder.gep(a_rows[i], [a_word])), vec)
            for v in range(nv):
                builder.store(dot_step(builder, kind, bits, builder.load(acc[i][v]), aw, bv[v]),
                              acc[i][v])

    if "kg" in arg:
        with cgutils.for_range(builder, arg["kg"]) as loop:
            group(loop.index, builder.mul(loop.index, arg["a_gs"]))
    else:
        seg_ptr = data_ptr(context, builder, types_of["seg"], arg["seg"], const(0))
        done = cgutils.alloca_once_value(builder, const(0))    # B's groups so far
        with cgutils.for_range(builder, arg["segs"]) as run:
            at = builder.mul(run.index, const(2))
            start = builder.load(builder.gep(seg_ptr, [at]))
            count = builder.load(builder.gep(seg_ptr, [builder.add(at, const(1))]))
            b0 = builder.load(done)
            with cgutils.for_range(builder, count) as loop:
                group(builder.add(b0, loop.index), builder.add(start, loop.index))
            builder.store(builder.add(b0, count), done)
    _finish(context, builder, (arg, types_of), (c_ptr, rc_ptr, cc_ptr), acc, places)


def _start(builder, arg, cc_ptr, vec, nv):
    """The accumulators' first values, per vector of columns: the column corrections
    (below ``cols``) for a codes tile, so that no addition follows the products;
    zero otherwise."""
    if "lim" not in arg:
        return [ir.Constant(vec, None)] * nv
    const = lambda value: ir.Constant(arg["cols"].type, value)   # noqa: E731
    masks = _column_masks(builder, arg["cols"], vec.count, nv, const)
    return [load_vector(builder, vector_ptr(builder, cc_ptr, const(v * vec.count), vec), 4,
                        masks[v]) for v in range(nv)]


def _row_places(builder, arg, mr):
    """Per row i of an ``mr``-row tile, ``(whether C has it, its first value's offset
    from C's)``: ``i < rows`` and ``i * ldc``."""
    intp = arg["rows"].type
    return [(builder.icmp_signed("<", ir.Constant(intp, i), arg["rows"]),
             builder.mul(ir.Constant(intp, i), arg["ldc"])) for i in range(mr)]


def _finish(context, builder, args, ptrs, acc, places):
    """C from the accumulators: the codes (a codes tile), else the sums."""
    arg, _ = args
    const = lambda value: ir.Constant(arg["cols"].type, value)   # noqa: E731
    if "lim" in arg:
        _store_codes(context, builder, args, ptrs, acc, const, places)
    else:
        _update_c(builder, arg, ptrs, acc, const, places)


#: AMX tile registers of the ``amx`` tile: C's 2 x 2 accumulators, then A's two
#: row blocks, then B's two column blocks; each 16 rows of 64 bytes.
AMX_C, AMX_A, AMX_B = (0, 1, 2, 3), (4, 5), (6, 7)


def amx_call(builder, name, *args):
    """Call the AMX intrinsic ``llvm.x86.<name>`` (tile numbers as i8 immediates,
    pointers as i8*, strides as i64)."""
    i8, i64 = ir.IntType(8), ir.IntType(64)
    params = {"tilezero": [i8], "tdpbusd": [i8, i8, i8],
              "tileloadd64": [i8, i8.as_pointer(), i64],
              "tilestored64": [i8, i8.as_pointer(), i64], "ldtilecfg": [i8.as_pointer()],
              "tilerelease": []}[name]
    fn = builder.module.declare_intrinsic(f"llvm.x86.{name}",
                                          fnty=ir.FunctionType(ir.VoidType(), params))
    return builder.call(fn, [builder.bitcast(a, t) if isinstance(t, ir.PointerType)
                             else ir.Constant(t, a) if isinstance(a, int) else a
                             for a, t in zip(args, params)])


def _emit_amx_tile(context, builder, args, vec):
    """The ``amx`` tile (see :func:`make_int8_tile`): per step of 16 groups, A's two
    16-row tiles and B's two 16-column tiles loaded, four ``tdpbusd``; then the
    accumulators stored to a 32 x 32 block on the stack, and C updated from it as
    the vector tiles update it from their registers.  The taps tile's steps come
    from its runs, its A tiles' rows from the image, its rows of C from ``a_at``."""
    arg, types_of = args
    intp = context.get_value_type(types.intp)

    def const(value):
        return ir.Constant(intp, value)

    def ptr(name, offset):
        return data_ptr(context, builder, types_of[name], arg[name], offset)

    if "lim" in arg:      # a codes tile: each row of C starts as the column corrections
        row = cgutils.alloca_once(builder, ir.ArrayType(ir.IntType(32), 32))
        row.align = 64
        first = builder.gep(row, [const(0), const(0)])
        for v, value in enumerate(_start(builder, arg, ptr("cc", arg["cc_off"]), vec, 2)):
            builder.store(value, vector_ptr(builder, first, const(16 * v), vec))
        for n, t in enumerate(AMX_C):       # stride 0: the row in all 16 of the tile's
            amx_call(builder, "tileloadd64", t, builder.gep(first, [const(16 * (n % 2))]),
                     const(0))
    else:
        for t in AMX_C:
            amx_call(builder, "tilezero", t)

    def step(a_rows, a_row_bytes, b_at):
        """One step of 16 groups: A's tiles from ``a_rows`` (two word offsets), B's from
        word ``b_at`` of its panel (32 words a group)."""
        for a_at, t in zip(a_rows, AMX_A):
            amx_call(builder, "tileloadd64", t, ptr("a", a_at), a_row_bytes)
        for h, t in enumerate(AMX_B):     # columns 16h..16h+15
            amx_call(builder, "tileloadd64", t, ptr("b", builder.add(b_at, const(16 * h))),
                     const(128))
        for i, ta in enumerate(AMX_A):
            for j, tb in enumerate(AMX_B):
                amx_call(builder, "tdpbusd", AMX_C[2 * i + j], ta, tb)

    if "kg" in arg:
        a_row_bytes = builder.mul(arg["a_rs"], const(4))
        with cgutils.for_range(builder, builder.sdiv(arg["kg"], const(16))) as loop:
            a_at = builder.add(arg["a_off"], builder.mul(loop.index, arg["a_gs"]))
            step([builder.add(a_at, builder.mul(arg["a_rs"], const(16 * h))) for h in (0, 1)],
                 a_row_bytes, builder.add(arg["b_off"], builder.mul(loop.index, const(16 * 32))))
        places = _row_places(builder, arg, 32)
    else:
        at_ptr = ptr("a_at", arg["a_at_off"])
        at = [builder.load(builder.gep(at_ptr, [const(i)])) for i in range(TILE_PLACES)]
        a_row_bytes = builder.mul(at[2], const(4))
        seg_ptr = ptr("seg", const(0))
        done = cgutils.alloca_once_value(builder, arg["b_off"])    # B's next group's word
        with cgutils.for_range(builder, arg["segs"]) as run:
            start = builder.load(builder.gep(seg_ptr, [builder.mul(run.index, const(2))]))
            count = builder.load(builder.gep(seg_ptr, [builder.add(builder.mul(
                run.index, const(2)), const(1))]))
            with cgutils.for_range(builder, builder.sdiv(count, const(16))) as loop:
                word = builder.add(start, builder.mul(loop.index, const(16)))
                b_at = builder.load(done)
                step([builder.add(at[h], word) for h in (0, 1)], a_row_bytes, b_at)
                builder.store(builder.add(b_at, const(16 * 32)), done)
        places = [(builder.icmp_signed(">=", at[3 + i], const(0)), at[3 + i]) for i in range(32)]
    block = cgutils.alloca_once(builder, ir.ArrayType(ir.IntType(32), 32 * 32))
    block.align = 64
    base = builder.gep(block, [const(0), const(0)])
    for n, t in enumerate(AMX_C):
        corner = builder.gep(base, [const(16 * 32 * (n // 2) + 16 * (n % 2))])
        amx_call(builder, "tilestored64", t, corner, const(128))
    acc = [[vector_ptr(builder, base, const(32 * i + 16 * v), vec) for v in range(2)]
           for i in range(32)]
    c_ptr, cc_ptr = (ptr(n, arg[n + "_off"]) for n in ("c", "cc"))
    rc_ptr = ptr("rc", arg["rc_off"]) if "rc" in arg else None
    _finish(context, builder, args, (c_ptr, rc_ptr, cc_ptr), acc, places)


def amx_configure(builder):
    """Load the AMX tile configuration: palette 1, all eight tiles 16 rows of 64 bytes."""
    config = [1] + [0] * 15 + [64, 0] * 8 + [0] * 16 + [16] * 8 + [0] * 8
    byte = ir.ArrayType(ir.IntType(8), 64)
    data = cgutils.alloca_once(builder, byte)
    builder.store(ir.Constant(byte, config), data)
    amx_call(builder, "ldtilecfg", data)


def make_tile_begin(kind):
    """``(begin, end)``: intrinsics of no arguments that a thread calls before and after
    running ``kind``'s tiles.  For ``amx`` ``begin`` loads the tile configuration
    (palette 1, all eight tiles 16 rows of 64 bytes) and ``end`` releases the tile
    state; for the vector kinds both do nothing."""
    def emit_begin(context, builder, sig, args):
        if kind == "amx":
            amx_configure(builder)
        return context.get_dummy_value()

    def emit_end(context, builder, sig, args):
        if kind == "amx":
            amx_call(builder, "tilerelease")
        return context.get_dummy_value()

    def begin(typingctx):
        return types.void(), emit_begin

    def end(typingctx):
        return types.void(), emit_end

    begin.__name__, end.__name__ = f"int8_begin_{kind}", f"int8_end_{kind}"
    return intrinsic(begin), intrinsic(end)


def dot_step(builder, kind, bits, acc, a, b):
    """``acc`` plus, per lane, the sum of the products of the lane's k group of ``a``
    and ``b`` (bytes, unsigned by signed, for :data:`BYTE_KINDS`; int16 pairs otherwise)."""
    vec = acc.type
    if kind == "vnni":
        fn = builder.module.declare_intrinsic(f"llvm.x86.avx512.vpdpbusd.{bits}",
                                              fnty=ir.FunctionType(vec, [vec, vec, vec]))
        return builder.call(fn, [acc, a, b])
    pairs = ir.VectorType(ir.IntType(16), 2 * vec.count)
    if kind == "maddubs":
        quads = ir.VectorType(ir.IntType(8), 4 * vec.count)
        ubs = builder.module.declare_intrinsic("llvm.x86.avx2.pmadd.ub.sw",
                                               fnty=ir.FunctionType(pairs, [quads, quads]))
        wd = builder.module.declare_intrinsic("llvm.x86.avx2.pmadd.wd",
                                              fnty=ir.FunctionType(vec, [pairs, pairs]))
        sums = builder.call(ubs, [builder.bitcast(a, quads), builder.bitcast(b, quads)])
        return builder.add(acc, builder.call(wd, [sums, ir.Constant(pairs, [1] * pairs.count)]))
    a16, b16 = builder.bitcast(a, pairs), builder.bitcast(b, pairs)
    if kind == "madd":
        name = "llvm.x86.avx512.pmaddw.d.512" if bits == 512 else "llvm.x86.avx2.pmadd.wd"
        fn = builder.module.declare_intrinsic(name, fnty=ir.FunctionType(vec, [pairs, pairs]))
        return builder.add(acc, builder.call(fn, [a16, b16]))
    wide = ir.VectorType(ir.IntType(32), 2 * vec.count)
    prod = builder.mul(builder.sext(a16, wide), builder.sext(b16, wide))
    i32 = ir.IntType(32)

    def lanes(first):
        mask = ir.Constant(ir.VectorType(i32, vec.count), list(range(first, 2 * vec.count, 2)))
        return builder.shuffle_vector(prod, prod, mask)

    return builder.add(acc, builder.add(lanes(0), lanes(1)))


def _update_c(builder, arg, ptrs, acc, const, places):
    """C's rows (``places``, as :func:`_row_places`), columns below ``cols`` = acc + row
    and column corrections (``first``) or += acc."""
    c_ptr, rc_ptr, cc_ptr = ptrs
    vec = acc[0][0].type.pointee
    lanes = vec.count
    nv = len(acc[0])
    masks = _column_masks(builder, arg["cols"], lanes, nv, const)
    first = builder.icmp_signed("!=", arg["first"], const(0))
    with builder.if_else(first) as (then_first, then_add):
        with then_first:
            col_corr = [load_vector(builder, vector_ptr(builder, cc_ptr, const(v * lanes), vec), 4,
                                    masks[v]) for v in range(nv)]
            _store_rows(builder, (acc, places), c_ptr, masks, const, lambda i, v, c: builder.add(
                c, builder.add(col_corr[v], splat(builder, builder.load(
                    builder.gep(rc_ptr, [const(i)])), vec))), read_c=False)
        with then_add:
            _store_rows(builder, (acc, places), c_ptr, masks, const, lambda i, v, c: c,
                        read_c=True)


def _store_codes(context, builder, args, ptrs, acc, const, places):
    """``C[:rows, :cols]`` = the codes of acc (which started from the column
    corrections): per vector, float32 ``sums * mult + bias`` clipped (the activation's
    clips narrowed to the codes' range), rounded half to even to int32, plus the zero
    point (the order of ``kernels/requant.py`` :func:`code`, its rounded float and
    whole zero point summed exactly either way), then each row's codes narrowed to
    bytes and stored as one run."""
    arg, types_of = args
    c_ptr = ptrs[0]
    vec = acc[0][0].type.pointee
    lanes, nv = vec.count, len(acc[0])
    f32 = ir.VectorType(ir.FloatType(), lanes)
    masks = _column_masks(builder, arg["cols"], lanes, nv, const)

    def columns(name, vtype):
        base = data_ptr(context, builder, types_of[name], arg[name], arg["cc_off"])
        return [load_vector(builder, vector_ptr(builder, base, const(v * lanes), vtype), 4,
                            masks[v]) for v in range(nv)]

    mult, bias = columns("mult", f32), columns("bias", f32)
    lim_ptr = data_ptr(context, builder, types_of["lim"], arg["lim"], const(0))
    zero, top, bottom = (splat(builder, builder.load(builder.gep(lim_ptr, [const(i)])), f32)
                         for i in (0, 3, 4))
    zero = builder.fptosi(zero, vec)      # a whole number: added after the conversion
    # fused where the target fuses: Numba's ``contract`` in the epilogue does the same
    fmuladd = builder.module.declare_intrinsic(f"llvm.fmuladd.v{lanes}f32",
                                               fnty=ir.FunctionType(f32, [f32] * 3))

    def clip(y, lo, hi):
        y = builder.select(builder.fcmp_ordered("<", y, lo), lo, y)
        return builder.select(builder.fcmp_ordered(">", y, hi), hi, y)

    byte = ir.IntType(8)
    row_mask, = _column_masks(builder, arg["cols"], nv * lanes, 1, const)
    for i, (has, at) in enumerate(places):
        with builder.if_then(has):
            parts = []
            for v in range(nv):
                y = builder.call(fmuladd, [builder.sitofp(builder.load(acc[i][v]), f32),
                                           mult[v], bias[v]])
                y = builder.add(_rounded(builder, clip(y, bottom, top), vec), zero)
                parts.append(builder.trunc(y, ir.VectorType(byte, lanes)))
            while len(parts) > 1:      # concatenated pairwise into one run of bytes
                n = parts[0].type.count
                parts = [builder.shuffle_vector(parts[k], parts[k + 1],
                                                ir.Constant(ir.VectorType(ir.IntType(32), 2 * n),
                                                            list(range(2 * n))))
                         for k in range(0, len(parts), 2)]
            ptr = builder.bitcast(builder.gep(builder.bitcast(c_ptr, byte.as_pointer()), [at]),
                                  parts[0].type.as_pointer())
            store_vector(builder, parts[0], ptr, 1, row_mask)


def _rounded(builder, y, vec):
    """The float32 lanes ``y`` rounded to int32 lanes (``vec``) by the current rounding
    mode, half to even by default, in one ``cvtps2dq``: ``rint`` then a conversion,
    as the epilogue's ``np.rint`` (``vroundps``, the same mode) then its cast."""
    i16, i32 = ir.IntType(16), ir.IntType(32)
    if vec.count == 4:        # the generic kind, plain IR for any target
        rint = builder.module.declare_intrinsic("llvm.rint.v4f32",
                                                fnty=ir.FunctionType(y.type, [y.type]))
        return builder.fptosi(builder.call(rint, [y]), vec)
    if vec.count == 16:
        fn = builder.module.declare_intrinsic(
            "llvm.x86.avx512.mask.cvtps2dq.512",
            fnty=ir.FunctionType(vec, [y.type, vec, i16, i32]))
        # all lanes, rounding by the current mode (_MM_FROUND_CUR_DIRECTION)
        return builder.call(fn, [y, ir.Constant(vec, None), ir.Constant(i16, -1),
                                 ir.Constant(i32, 4)])
    fn = builder.module.declare_intrinsic("llvm.x86.avx.cvt.ps2dq.256",
                                          fnty=ir.FunctionType(vec, [y.type]))
    return builder.call(fn, [y])


def _column_masks(builder, cols, lanes, count, const):
    """Per vector ``v`` of ``count`` (``lanes`` columns each), the mask of its columns
    below ``cols``."""
    intp = const(0).type
    lane = ir.Constant(ir.VectorType(intp, lanes), list(range(lanes)))
    limit = splat(builder, cols, lane.type)
    return [builder.icmp_signed("<", builder.add(lane, splat(builder, const(v * lanes), lane.type)),
                                limit) for v in range(count)]


def _store_rows(builder, tile, c_ptr, masks, const, extra, read_c):
    """Each of C's rows the tile has (``tile = (acc, places)``, as :func:`_row_places`):
    ``C = extra(i, v, acc)`` (+ C when ``read_c``)."""
    acc, places = tile
    vec = acc[0][0].type.pointee
    for i, (has, row) in enumerate(places):
        with builder.if_then(has):
            for v in range(len(acc[0])):
                ptr = vector_ptr(builder, c_ptr, builder.add(row, const(v * vec.count)), vec)
                r = extra(i, v, builder.load(acc[i][v]))
                if read_c:
                    r = builder.add(r, load_vector(builder, ptr, 4, masks[v]))
                store_vector(builder, r, ptr, 4, masks[v])


@intrinsic
def load_u64(typingctx, array, at):
    """The 8 bytes ``array[at:at + 8]`` of a 1-D byte array as one uint64 (little
    endian), read at any alignment."""
    def emit(context, builder, sig, args):
        ptr = data_ptr(context, builder, sig.args[0], args[0], args[1])
        return builder.load(builder.bitcast(ptr, ir.IntType(64).as_pointer()), align=1)
    return types.uint64(array, types.intp), emit


@intrinsic
def store_u64(typingctx, array, at, value):
    """``array[at:at + 8]`` = the 8 bytes of the uint64 ``value`` (little endian), at any
    alignment."""
    def emit(context, builder, sig, args):
        ptr = data_ptr(context, builder, sig.args[0], args[0], args[1])
        builder.store(args[2], builder.bitcast(ptr, ir.IntType(64).as_pointer()), align=1)
        return context.get_dummy_value()
    return types.void(array, types.intp, types.uint64), emit
