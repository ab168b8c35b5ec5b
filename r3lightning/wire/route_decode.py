"""Base64 route payloads decoded, and their rows checked, in one pass.

A validated route payload used to cost two passes: a SIMD base64 decode bound by memory (1.2 ms
for the 16 MiB of text of 32k x 48 x 8 uint8 ids) and then the route check, bound by compute
(0.5 ms). On x86 with AVX-512 VBMI (Ice Lake, Zen 4 and later) a compiled kernel does both at
once. Per 256 characters it looks each one up in a 128-entry table (``vpermi2b``; anything
outside the alphabet, ``=`` included, sets a flag), packs four 6-bit values into three bytes
with two multiply-adds, compacts the 192 bytes into three vectors (``vpermt2b``), stores them,
and hands the same registers to the vector row check
(:class:`~r3lightning.wire.route_kernels.VectorRowCheck`), whose arithmetic then runs under
the memory traffic: about 1.0 ms for decode and check together on one core.

The kernel is strict and never raises: on a flagged character the whole payload goes to
``pybase64.b64decode(validate=True)``, so errors (and what is accepted) are pybase64's. The
last 4 to 259 characters, where padding may sit, are always decoded by pybase64. A check that
fails is not an error here either: the payload is returned unverified and the wire decoder's
own check reports the row. Without VBMI (or with ``NUMBA_CPU_NAME`` / ``NUMBA_CPU_FEATURES``
set), pybase64 decodes and nothing is checked here.
"""

from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass

import numpy as np
import pybase64

from r3lightning.wire.route_kernels import (
    VECTOR_BYTES,
    VectorRowCheck,
    compiled_check,
    vector_covers_rows,
    vector_limit,
)

__all__ = ["DecodedPayload", "RowCheck", "decode_payload", "fused_decode_available"]

# Characters per kernel step and the bytes they decode to (three 64-byte vectors).
_STEP_CHARS, _STEP_BYTES = 4 * VECTOR_BYTES, 3 * VECTOR_BYTES
# Shorter payloads go to pybase64 (the kernel's compile, once per layout, would not pay).
_FUSED_MIN_CHARS = 1 << 16
# Steps per checked stretch: the kernel tests its flags between stretches (192 KiB of output).
_CHECK_CHUNK = 1024
_ALPHABET = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/"


@dataclass(frozen=True)
class RowCheck:
    """The route check the kernel runs: rows of ``top_k`` ids of ``dtype``, each below ``limit``
    (compared unsigned, see :func:`~r3lightning.wire.route_kernels.vector_limit`) and distinct
    within its row unless the row is all zero (dense-layer filler)."""

    dtype: np.dtype
    top_k: int
    limit: int

    @classmethod
    def of(cls, dtype: np.dtype, top_k: int | None, num_experts: int | None) -> RowCheck | None:
        """The check for this layout, or None where the vector kernel does not cover it."""
        dtype = np.dtype(dtype)
        if top_k is None or dtype.kind not in "iu" or not dtype.isnative:
            return None
        if not vector_covers_rows(top_k, dtype.itemsize):
            return None
        return cls(dtype, top_k, vector_limit(dtype, num_experts))

    def covers(self, routes: np.ndarray, num_experts: int | None) -> bool:
        """Whether passing this check implies ``routes`` passes the full route check (range
        under ``num_experts`` and distinct experts): same layout, a bound at least as tight."""
        return (
            routes.dtype == self.dtype
            and routes.ndim == 3
            and routes.shape[2] == self.top_k
            and self.limit <= vector_limit(routes.dtype, num_experts)
        )


class DecodedPayload:
    """A base64 payload already decoded (which also proved it valid base64); the wire decoders
    take it wherever they take base64 text and skip the decode.

    ``checked``: a :class:`RowCheck` that the bytes ``raw[rows_from:]`` passed during the decode
    (None: nothing was checked), and ``largest`` their largest id, read unsigned.
    """

    __slots__ = ("checked", "largest", "raw", "rows_from")

    def __init__(
        self,
        raw: bytearray | np.ndarray,
        checked: RowCheck | None = None,
        rows_from: int = 0,
        largest: int = 0,
    ):
        self.raw = raw  # the decoded bytes (a bytearray or a 1-D uint8 array)
        self.checked, self.rows_from, self.largest = checked, rows_from, largest


@functools.cache
def fused_decode_available() -> bool:
    """Whether this host runs the fused kernel: x86 with AVX-512 F, BW and VBMI, and numba
    compiling for the host CPU as it is."""
    from numba.core import config

    if config.CPU_NAME or config.CPU_FEATURES:
        return False
    try:
        import llvmlite.binding as llvm

        features = llvm.get_host_cpu_features()
    except (RuntimeError, ImportError):
        return False
    return all(features.get(name, False) for name in ("avx512f", "avx512bw", "avx512vbmi"))


def decode_payload(
    text: bytes | bytearray | memoryview | str, rows: RowCheck | None = None, rows_from: int = 0
) -> DecodedPayload:
    """Strictly decode base64 ``text``; with ``rows``, also check the decoded bytes from
    ``rows_from`` on as rows of that layout, in the same pass where the fused kernel runs.

    Returns a :class:`DecodedPayload` whose ``checked`` is ``rows`` only when those bytes passed.
    Raises what ``pybase64.b64decode(validate=True)`` raises (``binascii.Error``, ``ValueError``)
    for invalid base64. Cost: one pass over ``text``; the first call per row layout and process
    compiles its kernel (about 0.5 s).
    """
    view = None if isinstance(text, str) else memoryview(text)
    if view is None or not _fused_takes(view):
        return DecodedPayload(pybase64.b64decode_as_bytearray(text, validate=True))
    src = np.frombuffer(view, np.uint8)  # [chars], whatever the buffer's item size
    size = src.size
    padding = int(src[-1] == ord("=")) + int(src[-2] == ord("="))
    nbytes, steps = size // 4 * 3 - padding, (size - 4) // _STEP_CHARS
    row_bytes = rows.top_k * rows.dtype.itemsize if rows is not None else 1
    if rows is not None and (rows_from % row_bytes or (nbytes - rows_from) % row_bytes or rows_from > nbytes):
        rows = None  # rows that do not tile the payload: the wire decoder reports them
    out = _aligned(nbytes)
    if rows is None:
        bad, failed, largest = _kernel(8, 0)(src, out, np.uint64(steps), np.uint64(steps), np.uint64(0))
    else:
        # steps holding bytes before rows_from are decoded without the check
        head = min(steps, -(-rows_from // _STEP_BYTES))
        bad, failed, largest = _kernel(8 * rows.dtype.itemsize, row_bytes)(
            src, out, np.uint64(head), np.uint64(steps), np.uint64(rows.limit)
        )
    if bad:
        return DecodedPayload(pybase64.b64decode_as_bytearray(text, validate=True))  # raises pybase64's error
    # padding sits in the tail's last group only, so its decoded size is what nbytes counted
    out[steps * _STEP_BYTES :] = np.frombuffer(
        pybase64.b64decode(src[steps * _STEP_CHARS :], validate=True), np.uint8
    )
    if rows is None or failed:
        return DecodedPayload(out)
    largest = int(largest)
    # the rows the kernel did not check: before its first checked step, and from its last on
    for lo, hi in ((rows_from, head * _STEP_BYTES), (max(rows_from, steps * _STEP_BYTES), nbytes)):
        if hi > lo:
            part = out[lo:hi].view(rows.dtype).reshape(-1, 1, rows.top_k)
            first_block, out_of_range = compiled_check(part, rows.limit, range_check=True, unique=True)
            if first_block >= 0 or out_of_range:
                return DecodedPayload(out)
            largest = max(largest, int(part.view(f"u{rows.dtype.itemsize}").max()))
    return DecodedPayload(out, rows, rows_from, largest)


def _fused_takes(view: memoryview) -> bool:
    """Whether the kernel decodes this text: contiguous, 64 KiB or more, whole groups of four."""
    return (
        view.c_contiguous
        and view.nbytes >= _FUSED_MIN_CHARS
        and not view.nbytes % 4
        and fused_decode_available()
    )


def _aligned(nbytes: int) -> np.ndarray:
    """An uninitialised ``[nbytes]`` uint8 array starting on a 64-byte boundary (the kernel's
    streaming stores need whole aligned vectors), in a bytearray allocated as pybase64 allocates
    its output. Not ``np.empty``: numpy advises arrays of 4 MiB and more onto huge pages, whose
    first touch can stall for memory compaction under the common THP ``defrag=madvise`` setting
    (40-150 ms a call for a 48 MiB payload, seen on the benchmark machine)."""
    buffer = np.frombuffer(_new_bytearray(None, nbytes + VECTOR_BYTES), np.uint8)
    start = -buffer.ctypes.data % VECTOR_BYTES
    return buffer[start : start + nbytes]


# PyByteArray_FromStringAndSize(NULL, n): a bytearray of n bytes, not zero-filled
_new_bytearray = ctypes.pythonapi.PyByteArray_FromStringAndSize
_new_bytearray.restype = ctypes.py_object
_new_bytearray.argtypes = (ctypes.c_char_p, ctypes.c_ssize_t)


@functools.cache
def _kernel(lane_bits: int, row_bytes: int):
    """``kernel(src, dst, head, steps, limit) -> (bad character seen, rows failed, largest id)``:
    decodes ``steps`` steps of 256 characters of ``src`` into ``dst``, checking the rows of steps
    ``head`` on (``row_bytes`` 0: none) until one repeats an id or an id reaches ``limit``
    (a wrong layout guess then costs little more than the decode); ``dst`` must start on a
    64-byte boundary. Compiled once per layout and process."""
    import numba
    from llvmlite import ir
    from numba import types
    from numba.core import cgutils
    from numba.extending import intrinsic

    chars, ints16, ints32 = (ir.VectorType(ir.IntType(b), VECTOR_BYTES * 8 // b) for b in (8, 16, 32))
    table = [0x80] * 128  # 7-bit character -> its 6-bit value, 0x80 outside the alphabet
    for value, char in enumerate(_ALPHABET):
        table[char] = value
    # byte k of the step's 192 is byte 2 - k % 3 of the 32-bit group k // 3 (the packed 24 bits,
    # little-endian); output vector o draws on two adjacent packed vectors
    compaction = [
        [4 * (k // 3 % 16) + 2 - k % 3 + 64 * (k // 48 - o * 64 // 48) for k in range(64 * o, 64 * o + 64)]
        for o in range(3)
    ]
    check = VectorRowCheck(lane_bits, row_bytes) if row_bytes else None

    def x86(builder, name, result, *args):
        function = ir.FunctionType(result, [a.type for a in args])
        return builder.call(cgutils.get_or_insert_function(builder.module, function, name), list(args))

    def decode_step(builder, src, dst, step, flags):
        """Decode step ``step`` into ``dst``; returns its three output vectors."""
        packed, seen = [], builder.load(flags)
        for j in range(4):
            at = builder.add(builder.mul(step, ir.Constant(step.type, 4)), ir.Constant(step.type, j))
            text = builder.load(builder.gep(src, [at]), align=1)
            low, high = ir.Constant(chars, table[:64]), ir.Constant(chars, table[64:])
            values = x86(builder, "llvm.x86.avx512.vpermi2var.qi.512", chars, low, text, high)
            seen = builder.or_(seen, builder.or_(text, values))  # a top bit: not base64
            pairs = x86(
                builder, "llvm.x86.avx512.pmaddubs.w.512", ints16, values, ir.Constant(chars, [64, 1] * 32)
            )
            groups = x86(
                builder, "llvm.x86.avx512.pmaddw.d.512", ints32, pairs, ir.Constant(ints16, [4096, 1] * 16)
            )
            packed.append(builder.bitcast(groups, chars))
        builder.store(seen, flags)
        outputs = []
        for o in range(3):
            first = o * 64 // 48
            mask = ir.Constant(ir.VectorType(ir.IntType(32), 64), compaction[o])
            out = builder.shuffle_vector(packed[first], packed[first + 1], mask)
            at = builder.add(builder.mul(step, ir.Constant(step.type, 3)), ir.Constant(step.type, o))
            store = builder.store(out, builder.gep(dst, [at]), align=VECTOR_BYTES)
            # around the cache: the output is not read again soon, and a 12 MiB write through the
            # cache first reads every line it writes (a quarter of the kernel's memory traffic)
            store.set_metadata("nontemporal", builder.module.add_metadata([ir.Constant(ir.IntType(32), 1)]))
            outputs.append(out)
        return outputs

    def steps_intrinsic(rows: bool):
        @intrinsic
        def steps_flags(typingctx, src, dst, first, count):
            """Decode steps [first, first + count), checking their rows when ``rows``."""
            signature = types.UniTuple(types.uint64, 3)(src, dst, first, count)

            def codegen(context, builder, sig, args):
                source, target, first, count = args
                src = context.make_array(sig.args[0])(context, builder, source).data
                dst = context.make_array(sig.args[1])(context, builder, target).data
                src, dst = builder.bitcast(src, chars.as_pointer()), builder.bitcast(dst, chars.as_pointer())
                flags = cgutils.alloca_once_value(builder, ir.Constant(chars, [0] * 64))
                state = check.begin(builder) if rows else None
                with cgutils.for_range(builder, count) as loop:
                    outputs = decode_step(builder, src, dst, builder.add(first, loop.index), flags)
                    for out in outputs if rows else ():
                        check.add(builder, state, out)
                top_bits = builder.and_(builder.load(flags), ir.Constant(chars, [0x80] * 64))
                bad = builder.icmp_unsigned("!=", top_bits, ir.Constant(chars, [0] * 64))
                bad = builder.zext(builder.bitcast(bad, ir.IntType(64)), ir.IntType(64))
                zero = ir.Constant(ir.IntType(64), 0)
                repeats, top = check.flags(builder, state) if rows else (zero, zero)
                builder.fence("seq_cst")  # streaming stores are weakly ordered: publish them
                return context.make_tuple(builder, sig.return_type, [bad, repeats, top])

            return signature, codegen

        return steps_flags

    decode_steps, checked_steps = steps_intrinsic(False), steps_intrinsic(check is not None)

    u64 = np.uint64

    chunk = u64(_CHECK_CHUNK)

    @numba.njit(nogil=True, cache=False)
    def kernel(src, dst, head, steps, limit):  # src: [chars] uint8; dst: [bytes] uint8
        bad, _, _ = decode_steps(src, dst, u64(0), head)
        top = u64(0)
        start = head
        while start < steps:
            count = min(chunk, steps - start)
            more, repeats, high = checked_steps(src, dst, start, count)
            bad |= more
            top = max(top, high)
            start += count
            if repeats != u64(0) or top >= limit:  # failed: decode the rest unchecked
                more, _, _ = decode_steps(src, dst, start, steps - start)
                return bad | more, u64(1), top
        return bad, u64(0), top

    return kernel
