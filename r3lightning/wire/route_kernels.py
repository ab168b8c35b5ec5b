"""Compiled route checks (numba), one kernel per row layout, for :mod:`.route_check`.

Each kernel checks decoded routes ``[rows, num_layers, top_k]`` in one pass without the GIL and
reports the first block of ``KERNEL_BLOCK`` flat ``[top_k]`` rows holding a repeat (numpy then
finds the exact row) and whether an id is out of range. All-zero rows (the filler of a dense
layer) are exempt from the distinct-experts test. Each kernel is compiled lazily, once per
layout and process (0.3-0.9 s):

- the vector kernel for power-of-two ``top_k`` of 1, 2 or 4-byte ids in rows of 8 to 64 bytes
  (uint8 top-8, int16 top-8, int32 top-8, ...): portable LLVM vector code over 64-byte vectors
  (0.47 ms for 32k x 48 x 8 uint8 ids);
- a SWAR kernel for shorter rows (uint8 top-2 and top-4, 16-bit top-2), and for every range-only
  check: a row is one to eight machine words whose lanes are its ids; xoring a word with its
  own rotations by whole lanes puts every pair of ids side by side, and a zero lane in the xor,
  found with the classic ``(y - 0x01..) & ~y & 0x80..`` test, is a repeat (the range alone
  0.2 ms for 32k x 48 x 8 uint8 ids);
- a pairwise kernel for any other ``top_k`` up to 16 (DeepSeek-V2's 6, Qwen3-Next's 10) and
  8-byte ids: each pair of a row's ids compared directly, unrolled (0.5 ms for top-6 uint8
  ids, 4 ms for top-10).

Strided or big-endian arrays, and ``top_k`` above 16, are left to numpy.
"""

from __future__ import annotations

import functools

import numpy as np

__all__ = [
    "KERNEL_BLOCK",
    "VECTOR_BYTES",
    "VectorRowCheck",
    "compiled_check",
    "vector_covers",
    "vector_covers_rows",
    "vector_limit",
    "word_layout",
]

# Rows per block of the compiled kernels: they report the first block with a repeat, which numpy
# then searches for the exact row (only on the error path).
KERNEL_BLOCK = 1 << 10

# Largest top_k the pairwise kernel unrolls (top_k*(top_k-1)/2 comparisons per row).
_PAIRWISE_MAX_TOP_K = 16


def compiled_check(
    routes: np.ndarray, num_experts: int | None, *, range_check: bool, unique: bool
) -> tuple[int, bool] | None:
    """``(first flat row of the first block with a repeat or -1, whether an id is out of range)``
    from a compiled kernel, or None when none covers ``routes`` (numpy then checks it): the
    vector kernel for the distinct-experts check of rows of 8 to 64 bytes, the SWAR kernel for
    shorter rows and every range-only check, the pairwise one for other ``top_k`` up to 16. A
    block is ``KERNEL_BLOCK`` flat rows; ``range_check=False`` never flags a range."""
    if routes.dtype.kind not in "iu" or not routes.dtype.isnative or not routes.flags.c_contiguous:
        return None  # numba takes native byte order only; the kernels read rows in C order
    if unique and vector_covers(routes):
        return _run_vector(routes, num_experts if range_check else None, range_check=range_check)
    if (layout := word_layout(routes)) is not None:
        return _run_swar(routes, layout, num_experts, range_check=range_check, unique=unique)
    top_k = routes.shape[2]
    if top_k > _PAIRWISE_MAX_TOP_K:
        return None
    info = np.iinfo(routes.dtype)
    limit = num_experts if range_check and num_experts is not None and num_experts <= info.max else None
    signed = range_check and routes.dtype.kind == "i"
    kernel = _pairwise_kernel(top_k, limit is not None, signed, unique)
    first_block, bad = kernel(routes.reshape(-1), routes.dtype.type(limit or 0))
    return int(first_block), bool(bad)


@functools.cache
def _pairwise_kernel(top_k: int, has_limit: bool, signed: bool, unique: bool):
    """The kernel for any ``top_k``: every pair of a row's ids compared directly (LLVM unrolls
    the pairs and vectorises across rows: about 0.55 ms for 32k x 48 x 6 uint8 ids, 4.4 ms for
    top-10, against 8 and 13 ms in numpy). Ids are flagged when negative (``signed``) or at least
    ``limit`` (``has_limit``); numba specialises it per dtype on first call."""
    import numba

    u64 = np.uint64
    width, block = u64(top_k), u64(KERNEL_BLOCK)

    @numba.njit(nogil=True, cache=False)
    def kernel(flat, limit):  # flat: [rows * top_k] ids; unsigned indices, as in the SWAR kernel
        n = u64(flat.shape[0]) // width
        bad = False
        start = u64(0)
        while start < n:
            stop = min(start + block, n)
            repeats = False
            for r in range(start, stop):
                base = r * width
                nonzero = False
                hits = False
                for i in range(top_k):
                    x = flat[base + u64(i)]
                    nonzero |= x != 0
                    if signed:
                        bad |= x < 0
                    if has_limit:
                        bad |= x >= limit
                    if unique:
                        for j in range(i + 1, top_k):
                            hits |= x == flat[base + u64(j)]
                repeats |= hits & nonzero  # all-zero rows (dense-layer filler) are exempt
            if repeats:
                return np.int64(start), bad
            start = stop
        return np.int64(-1), bad

    return kernel


def word_layout(routes: np.ndarray) -> tuple[int, int, int] | None:
    """``(word_bytes, lanes per word, words per row)`` when the kernel covers ``routes``: a
    C-contiguous array of native-order 1, 2 or 4-byte ids whose ``top_k`` is a power of two with rows of at
    most 64 bytes. Rows up to 8 bytes are one word; longer rows are 2, 4 or 8 uint64 words."""
    k, size = routes.shape[2], routes.dtype.itemsize
    if routes.dtype.kind not in "iu" or not routes.dtype.isnative or size not in (1, 2, 4) or k & (k - 1):
        return None
    if not routes.flags.c_contiguous or k * size > 64:
        return None
    row_bytes = k * size
    word = min(row_bytes, 8)
    return word, word // size, row_bytes // word


# Range tests the kernel is compiled with (see _range_test)
_NO_RANGE, _RANGE_LOW, _RANGE_HIGH = 0, 1, 2


def _range_test(routes: np.ndarray, num_experts: int | None) -> tuple[int, int]:
    """``(test, add)``: how the kernel flags the lanes holding an id outside ``[0, num_experts)``,
    with ``t = (x & ~H) + add`` per word (H: each lane's top bit, ``add`` repeated per lane).

    ``_RANGE_LOW``, for ``E = num_experts`` no larger than half the lane range: ``add =
    2**(b-1) - E`` and the flag is ``(t | x) & H``: the low bits plus ``add`` reach the top bit
    exactly when they are ``>= E``, and a set top bit (a negative id, or one >= half the range)
    is bad anyway. ``_RANGE_HIGH``, for a larger E (unsigned ids only): ``add = 2**b - E`` and
    the flag is ``t & x & H``: only lanes with the top bit set can be bad, and they are when
    their low bits reach ``E - 2**(b-1)``. Neither sum carries into the next lane."""
    bits = 8 * routes.dtype.itemsize
    half = 1 << (bits - 1)
    limit = num_experts if num_experts is not None else 1 << bits
    if routes.dtype.kind == "i":
        limit = min(limit, half)  # a negative id has the top bit set
    if limit >= 1 << bits:
        return _NO_RANGE, 0  # every unsigned id is in range
    if limit <= half:
        return _RANGE_LOW, half - limit
    return _RANGE_HIGH, (1 << bits) - limit


def _run_swar(
    routes: np.ndarray,
    layout: tuple[int, int, int],
    num_experts: int | None,
    *,
    range_check: bool = True,
    unique: bool = True,
) -> tuple[int, bool]:
    """``(first flat row of the first block with a repeat or -1, whether an id is out of range)``;
    ``unique=False`` checks the range only (the first value is then -1)."""
    word, lanes, words = layout
    test, add = _range_test(routes, num_experts) if range_check else (_NO_RANGE, 0)
    lane_bits = 8 * word // lanes
    spread = sum(1 << (i * lane_bits) for i in range(lanes))  # 1 in every lane
    add = np.uint64(add * spread)
    view = routes.reshape(-1).view(f"=u{word}")  # [rows * words]
    first_block, bad = _swar_kernel(8 * word, lanes, words, test, unique)(view, add)
    return int(first_block), bool(bad)


@functools.cache
def _swar_kernel(word_bits: int, lanes: int, words: int, range_test: int, unique: bool):
    """The kernel for rows of ``words`` words of ``word_bits`` bits, ``lanes`` ids per word, one
    of the range tests of :func:`_range_test`, and the distinct-experts test if ``unique`` (rows
    of one word only: longer rows go to the vector kernel).

    Everything that depends on the layout is a closure constant, so numba specialises the
    rotations and LLVM unrolls the lane loops and vectorises across rows. Numba is imported
    here: a process that never validates routes never loads it."""
    import numba

    if unique and words != 1:
        raise ValueError(f"the SWAR distinct-experts test takes one-word rows, got {words} words")
    u64 = np.uint64
    lane_bits = word_bits // lanes
    full = u64((1 << word_bits) - 1)
    low = u64(sum(1 << (i * lane_bits) for i in range(lanes)))  # 1 in every lane
    high = u64(int(low) << (lane_bits - 1))  # top bit of every lane
    not_high = u64(int(full) & ~int(high))
    zero = u64(0)
    # the row's word against itself: rotations by 1 .. lanes/2 lanes pair every two of its ids
    inner = tuple(u64(r * lane_bits) for r in range(1, lanes // 2 + 1))
    inner_back = tuple(u64(word_bits - int(s)) for s in inner)
    if not unique:  # no pairs to compare: the loop below compiles away
        inner, inner_back = (u64(0),), (u64(0),)
    n_inner = len(inner) if unique else 0
    block, width = u64(KERNEL_BLOCK), u64(words)

    @numba.njit(nogil=True, cache=False)
    def kernel(view, add):  # view: [rows * words] unsigned words
        # unsigned indices: numba then emits no negative-index wraparound, which would turn the
        # loads into gathers and stop LLVM from vectorising across rows
        n = u64(view.shape[0]) // width
        bad = zero  # only the lanes' top bits count (masked once, at the end)
        start = zero
        while start < n:
            stop = min(start + block, n)
            repeats = zero
            for r in range(start, stop):
                base = r * width
                nonzero = zero
                hits = zero  # a lane whose top bit ends up set held a zero xor: a repeat
                for i in range(words):
                    x = u64(view[base + u64(i)])
                    nonzero |= x
                    if range_test == 1:
                        bad |= ((x & not_high) + add) | x
                    elif range_test == 2:
                        bad |= ((x & not_high) + add) & x
                    for j in range(n_inner):
                        y = x ^ (((x << inner[j]) | (x >> inner_back[j])) & full)
                        hits |= (y - low) & ~y
                if nonzero != zero:  # all-zero rows (dense-layer filler) are exempt
                    repeats |= hits
            if repeats & high != zero:
                return np.int64(start), bad & high != zero
            start = stop
        return np.int64(-1), bad & high != zero

    return kernel


# --------------------------------------------------------------------------- the vector kernel

VECTOR_BYTES = 64  # one AVX-512 register; LLVM splits it into two or four on narrower machines


def vector_covers(routes: np.ndarray) -> bool:
    """Whether the vector kernel checks ``routes`` (C-contiguous, native order assumed): a
    power-of-two ``top_k`` above 1 of 1, 2 or 4-byte ids, rows of 8 to 64 bytes (uint8 top-8,
    the layout vLLM and SkyRL send for up to 256 experts; int16 top-8; SGLang's int32 top-8)."""
    return vector_covers_rows(routes.shape[2], routes.dtype.itemsize)


def vector_covers_rows(top_k: int, itemsize: int) -> bool:
    """:func:`vector_covers` for rows of ``top_k`` ids of ``itemsize`` bytes."""
    return (
        itemsize in (1, 2, 4)
        and top_k > 1
        and not top_k & (top_k - 1)
        and 8 <= top_k * itemsize <= VECTOR_BYTES
    )


def vector_limit(dtype: np.dtype, num_experts: int | None) -> int:
    """The bound the vector kernel holds ids of ``dtype`` under, compared unsigned: ``num_experts``
    where given, at most half the range for signed ids (a negative id has its top bit set), and
    the whole range (a bound no id reaches) otherwise."""
    bits = 8 * dtype.itemsize
    limit = 1 << bits
    if num_experts is not None:
        limit = min(limit, num_experts)
    if dtype.kind == "i":
        limit = min(limit, 1 << (bits - 1))
    return limit


def _run_vector(routes: np.ndarray, num_experts: int | None, *, range_check: bool) -> tuple[int, bool]:
    """The vector kernel: ``(first flat row of the first block with a repeat or -1, whether an
    id is out of range)``."""
    bits = 8 * routes.dtype.itemsize
    limit = vector_limit(routes.dtype, num_experts) if range_check else 1 << bits
    data = routes.reshape(-1).view(np.uint8)  # [rows * row bytes]
    kernel = _vector_kernel(bits, routes.shape[2] * routes.dtype.itemsize)
    first_block, bad = kernel(data, np.uint64(limit))
    return int(first_block), bool(bad)


class VectorRowCheck:
    """LLVM IR for the vector row check, shared by :func:`_vector_kernel` and the fused decode
    (:mod:`.route_decode`): feed it 64-byte vectors of whole rows with :meth:`add`, then read
    the flags with :meth:`flags`. One object per layout; :meth:`begin` gives each loop its own
    running state.

    Per vector: each rotation of a row by 1 .. top_k/2 lanes is xored with the row, and the
    lane-wise unsigned minimum of those xors is zero exactly where two ids of the row are equal;
    all-zero rows (dense-layer filler) are lifted out with an all-ones mask. The running minimum
    and maximum stay in two vector registers. LLVM maps this to rotates or shuffles, xor, min and
    max (vprolq, vpminub on AVX-512): about 14 operations per vector of uint8 top-8 rows.
    """

    def __init__(self, lane_bits: int, row_bytes: int):
        from llvmlite import ir

        self.lane_bits, self.lanes = lane_bits, 8 * VECTOR_BYTES // lane_bits
        top_k = 8 * row_bytes // lane_bits
        self.vector = ir.VectorType(ir.IntType(lane_bits), self.lanes)
        self.words = ir.VectorType(ir.IntType(64), VECTOR_BYTES // 8)
        index = ir.VectorType(ir.IntType(32), self.lanes)
        self.rotations = [  # by 1 .. top_k/2 lanes within each row: together they pair every two ids
            ir.Constant(index, [top_k * (i // top_k) + (i % top_k + step) % top_k for i in range(self.lanes)])
            for step in range(1, top_k // 2 + 1)
        ]
        # a row is all zero when all its 64-bit words are: AND each word with its partners, pairwise
        self.partners = [
            ir.Constant(
                ir.VectorType(ir.IntType(32), self.words.count), [i ^ s for i in range(self.words.count)]
            )
            for s in (1, 2, 4)
            if s < row_bytes // 8
        ]

    def begin(self, builder) -> tuple:
        """A loop's running ``(minimum, maximum)``, allocated before it (stack slots that LLVM
        keeps in registers)."""
        from llvmlite import ir
        from numba.core import cgutils

        full = (1 << self.lane_bits) - 1
        return (
            cgutils.alloca_once_value(builder, ir.Constant(self.vector, [full] * self.lanes)),
            cgutils.alloca_once_value(builder, ir.Constant(self.vector, [0] * self.lanes)),
        )

    def add(self, builder, state: tuple, ids) -> None:
        """Check one vector ``ids`` (64 bytes of whole rows, any vector type of that size)."""
        from llvmlite import ir

        ids = builder.bitcast(ids, self.vector)
        undefined = ir.Constant(self.vector, ir.Undefined)
        xors = None
        for rotation in self.rotations:
            xor = builder.xor(ids, builder.shuffle_vector(ids, undefined, rotation))
            xors = xor if xors is None else _unsigned_min(builder, xors, xor)
        words = self.words
        zero = builder.icmp_unsigned("==", builder.bitcast(ids, words), ir.Constant(words, [0] * words.count))
        for partner in self.partners:
            zero = builder.and_(
                zero, builder.shuffle_vector(zero, ir.Constant(zero.type, ir.Undefined), partner)
            )
        xors = builder.or_(xors, builder.bitcast(builder.sext(zero, words), self.vector))
        smallest, largest = state
        builder.store(_unsigned_min(builder, builder.load(smallest), xors), smallest)
        high = builder.load(largest)
        builder.store(builder.select(builder.icmp_unsigned(">", high, ids), high, ids), largest)

    def flags(self, builder, state: tuple):
        """``(i64 nonzero if a row repeats an id, i64 largest id)`` over the vectors added."""
        from llvmlite import ir
        from numba.core import cgutils

        smallest, largest = state
        repeated = builder.icmp_unsigned(
            "==", builder.load(smallest), ir.Constant(self.vector, [0] * self.lanes)
        )
        repeats = builder.zext(builder.bitcast(repeated, ir.IntType(self.lanes)), ir.IntType(64))
        reduce_max = cgutils.get_or_insert_function(
            builder.module,
            ir.FunctionType(ir.IntType(self.lane_bits), [self.vector]),
            f"llvm.vector.reduce.umax.v{self.lanes}i{self.lane_bits}",
        )
        top = builder.zext(builder.call(reduce_max, [builder.load(largest)]), ir.IntType(64))
        return repeats, top


def _unsigned_min(builder, a, b):
    return builder.select(builder.icmp_unsigned("<", a, b), a, b)


@functools.cache
def _vector_kernel(lane_bits: int, row_bytes: int):
    """The distinct-experts and range check of ``row_bytes``-byte rows of ``lane_bits``-bit ids
    (:class:`VectorRowCheck`, as a numba intrinsic) over 64-byte vectors of rows. A block's
    minimum and maximum are tested once per block: 0.47 ms for 32k x 48 x 8 uint8 ids on one
    core against 0.65 ms for the SWAR kernel, whose zero-lane test costs two more operations
    per rotation."""
    import numba
    from numba import types
    from numba.core import cgutils
    from numba.extending import intrinsic

    check = VectorRowCheck(lane_bits, row_bytes)

    @intrinsic
    def block_flags(typingctx, data, first, count):
        """``(nonzero if a row of vectors [first, first + count) repeats an id, largest id)``."""
        signature = types.UniTuple(types.uint64, 2)(data, first, count)

        def codegen(context, builder, sig, args):
            array, first, count = args
            base = context.make_array(sig.args[0])(context, builder, array).data
            base = builder.bitcast(base, check.vector.as_pointer())
            state = check.begin(builder)
            with cgutils.for_range(builder, count) as loop:
                check.add(
                    builder, state, builder.load(builder.gep(base, [builder.add(first, loop.index)]), align=1)
                )
            return context.make_tuple(builder, sig.return_type, list(check.flags(builder, state)))

        return signature, codegen

    u64 = np.uint64
    rows_per_vector = VECTOR_BYTES // row_bytes
    width, per_vector = u64(VECTOR_BYTES), u64(rows_per_vector)
    block, kernel_block = u64(KERNEL_BLOCK // rows_per_vector), u64(KERNEL_BLOCK)  # block: vectors

    @numba.njit(nogil=True, cache=False)
    def kernel(data, limit):  # data: [rows * row_bytes] bytes
        n = u64(data.shape[0]) // width
        top = u64(0)
        start = u64(0)
        while start < n:
            count = min(block, n - start)
            repeats, high = block_flags(data, start, count)
            top = max(top, high)
            if repeats != u64(0):
                return np.int64(start * per_vector), top >= limit
            start += count
        tail = u64(data.shape[0]) - n * width
        if tail != u64(0):  # the last rows, padded with all-zero rows (exempt and in range)
            padded = np.zeros(VECTOR_BYTES, np.uint8)
            padded[:tail] = data[n * width :]
            repeats, high = block_flags(padded, u64(0), u64(1))
            top = max(top, high)
            if repeats != u64(0):
                return np.int64(n * per_vector // kernel_block * kernel_block), top >= limit
        return np.int64(-1), top >= limit

    return kernel
