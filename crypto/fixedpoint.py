"""Fixed-point encoding of floats into the ring Z_2^64 (NumPy uint64).

A float ``x`` with ``|x| <= bound`` is encoded as ``round(x * 2**frac_bits)``, stored as an int64
and reinterpreted as uint64 (two's complement), so that uint64 addition, which NumPy wraps
modulo 2^64, is signed fixed-point addition. Values beyond ``bound`` are refused or clipped,
never silently wrapped.

Fast path. When ``|round(bound * 2**frac_bits)| <= 2**51`` (every practical configuration),
rounding is one float addition: ``y = x + 1.5 * 2**(52 - frac_bits)`` lands in a binade whose
spacing is exactly ``2**-frac_bits``, so IEEE round-to-nearest-even makes the bit pattern of
``y`` equal to ``round(x * 2**frac_bits)`` plus a constant (:attr:`FixedPointEncoder.shift`).
That is bit-for-bit ``rint(x * 2**frac_bits)``, written straight into the uint64 output.
"""

from __future__ import annotations

import math

import numpy as np

__all__ = [
    "FixedPointEncoder",
    "FixedPointOverflow",
    "SumDidNotCancel",
    "ENCODE_CHUNK_WORDS",
    "NARROW_DETECTION_BITS",
]

# Work in chunks that stay in L2 cache: the input chunk plus the output chunk.
ENCODE_CHUNK_WORDS = 1 << 15

_RING_SIGNED_MAX = (1 << 63) - 1
_RING32_SIGNED_MAX = (1 << 31) - 1
#: A sum goes in the 32-bit ring only if a sum whose masks did not cancel (uniform in Z_2^32)
#: would pass :meth:`FixedPointEncoder.decode`'s range check with probability at most
#: 2**-NARROW_DETECTION_BITS (every element must pass), as in the 64-bit ring for any sum of
#: two or more values.
NARROW_DETECTION_BITS = 128
# x + 1.5 * 2**(52 - f) stays in one binade (spacing 2**-f) while |x * 2**f| <= 2**51.
_MAGIC_LIMIT = 1 << 51
_ON_OVERFLOW_MODES = ("raise", "clip")
_REAL_KINDS = frozenset("fiu")  # NumPy's floating and integer dtypes (not bool, not complex)


class FixedPointOverflow(ValueError):
    """A value cannot be encoded: it is NaN/inf, or beyond the bound (in ``"raise"`` mode)."""


class SumDidNotCancel(ValueError):
    """A decoded sum lies outside ``terms * bound``: its masks did not cancel.

    This is what a sum looks like when a contributor is missing or an extra one was added:
    the uncancelled pairwise masks make the result a uniformly random ring element.
    """


class FixedPointEncoder:
    """Owns the float <-> Z_2^64 mapping: scale ``2**frac_bits``, magnitude bound ``bound``.

    Promises: ``decode(encode(x))`` differs from ``x`` by at most ``2**-(frac_bits + 1)`` per
    element, and up to :meth:`max_terms` encoded values can be summed in the ring without
    wrapping. Refuses: NaN and inf (always), ``|x| > bound`` (unless ``on_overflow="clip"``,
    which clips to ``[-bound, bound]``), and configurations whose bound does not fit in the
    ``63 - frac_bits`` integer bits of a signed 64-bit word.
    """

    def __init__(
        self, *, frac_bits: int = 20, bound: float = 2.0**20, on_overflow: str = "raise"
    ) -> None:
        if isinstance(frac_bits, bool) or not isinstance(frac_bits, int):
            raise TypeError(f"frac_bits must be an int, got {type(frac_bits).__name__}")
        if not 0 <= frac_bits <= 62:
            raise ValueError(f"frac_bits must be in [0, 62], got {frac_bits}")
        bound = float(bound)
        if not (math.isfinite(bound) and bound > 0):
            raise ValueError(f"bound must be a positive finite float, got {bound!r}")
        if on_overflow not in _ON_OVERFLOW_MODES:
            raise ValueError(f"on_overflow must be 'raise' or 'clip', got {on_overflow!r}")
        integer_bits = 63 - frac_bits
        if bound >= 2.0**integer_bits:
            raise ValueError(
                f"bound {bound:g} does not fit the fixed-point format: with frac_bits={frac_bits} "
                f"a signed 64-bit word keeps {integer_bits} integer bits, so |x| must stay below "
                f"2**{integer_bits} = {2.0**integer_bits:g}; lower the bound or frac_bits"
            )
        self.frac_bits = frac_bits
        self.bound = bound
        self.on_overflow = on_overflow
        self._scale = float(2.0**frac_bits)
        self._inv_scale = float(2.0**-frac_bits)
        # Largest |encoded integer| of one value; rounding never exceeds the ceiling.
        self._bound_int = max(1, math.ceil(bound * self._scale))
        self._magic: float | None = None
        self.shift = np.uint64(0)
        if self._bound_int <= _MAGIC_LIMIT:
            self._magic = 1.5 * 2.0 ** (52 - frac_bits)
            self.shift = np.array([self._magic], dtype=np.float64).view(np.uint64)[0]

    def __repr__(self) -> str:
        return (
            f"FixedPointEncoder(frac_bits={self.frac_bits}, bound={self.bound!r}, "
            f"on_overflow={self.on_overflow!r})"
        )

    @property
    def resolution(self) -> float:
        """The spacing of representable values, ``2**-frac_bits``."""
        return self._inv_scale

    def max_terms(self) -> int:
        """How many values with ``|x| <= bound`` can be summed in the ring without wrapping."""
        return _RING_SIGNED_MAX // self._bound_int

    def ring_dtype(self, *, terms: int, size: int) -> np.dtype:
        """The ring a masked sum of ``terms`` contributions of ``size`` values each travels
        in: ``uint32`` (Z_2^32, half the bytes) where such a sum cannot wrap 32 bits
        (``terms * bound * 2**frac_bits < 2**31``) and a sum whose masks did not cancel would
        still be caught by :meth:`decode` except with probability below
        ``2**-NARROW_DETECTION_BITS``; else ``uint64``. Every role computes it from the same
        encoder, group and size, so a sender, the aggregator and the key holder agree on it.

        A contribution in Z_2^32 is the Z_2^64 one (encoding, masks, binding) reduced mod 2^32
        (:meth:`narrow`): reduction commutes with addition, so the masks still cancel, and the
        low 32 bits of a uniform mask are uniform, so it still hides the value."""
        limit = terms * self._bound_int
        if terms < 1 or size < 1 or limit > _RING32_SIGNED_MAX:
            return np.dtype(np.uint64)
        passing = (2 * limit + 1) / 2.0**32  # of one uniform element, by the range check
        if size * -math.log2(passing) < NARROW_DETECTION_BITS:
            return np.dtype(np.uint64)
        return np.dtype(np.uint32)

    @staticmethod
    def narrow(ring64: np.ndarray) -> np.ndarray:
        """Z_2^64 elements reduced mod 2^32: a new uint32 array (see :meth:`ring_dtype`)."""
        return np.asarray(ring64, dtype=np.uint64).astype(np.uint32)

    def encode(self, x: np.ndarray, *, out: np.ndarray | None = None) -> np.ndarray:
        """Encode a real array as uint64 ring elements of the same shape.

        ``out`` (optional) is a C-contiguous uint64 array of ``x.size`` elements to write into;
        it is returned reshaped to ``x.shape``. Accepts floating and integer dtypes; refuses
        others (TypeError). Raises :class:`FixedPointOverflow` for NaN/inf (in every mode) and
        for ``|x| > bound`` in ``"raise"`` mode, naming the largest magnitude and the bound.
        """
        x = self.check_dtype(x)
        flat_in = x.reshape(-1)
        if out is None:
            out = np.empty(flat_in.size, dtype=np.uint64)
        elif out.dtype != np.uint64 or out.size != flat_in.size or not out.flags.c_contiguous:
            raise ValueError(
                f"out must be a C-contiguous uint64 array of {flat_in.size} elements, got "
                f"dtype {out.dtype}, size {out.size}"
            )
        flat_out = out.reshape(-1)
        for start in range(0, flat_in.size, ENCODE_CHUNK_WORDS):
            stop = min(start + ENCODE_CHUNK_WORDS, flat_in.size)
            if not self.encode_shifted(flat_in[start:stop], flat_out[start:stop]):
                raise self.refusal(flat_in)
        if self.shift:
            np.subtract(flat_out, self.shift, out=flat_out)
        return out.reshape(x.shape)

    @staticmethod
    def check_dtype(x: np.ndarray) -> np.ndarray:
        """``x`` as an array if its dtype is real (floating or integer); TypeError otherwise."""
        x = np.asarray(x)
        if x.dtype.kind not in _REAL_KINDS:
            raise TypeError(f"can only encode real numbers, got dtype {x.dtype}")
        return x

    def encode_shifted(self, chunk: np.ndarray, out: np.ndarray) -> bool:
        """Write ``encode(chunk) + shift`` (mod 2^64) into ``out``; the building block of fused
        masking, which folds the subtraction of :attr:`shift` into its masks.

        ``chunk`` is a 1-d real array (dtype already checked), ``out`` a C-contiguous 1-d uint64
        array of the same size; no other memory is written. Returns False when the chunk must
        be refused (NaN/inf, or beyond the bound in ``"raise"`` mode); ``out`` is then garbage
        and the caller must discard it.
        """
        if chunk.size == 0:
            return True
        # Compared as Python floats: NumPy would round the bound to a float16/32 input's dtype.
        lo, hi = float(chunk.min()), float(chunk.max())
        # The comparisons are False for NaN, so NaN falls into this branch too.
        clip = not (lo >= -self.bound and hi <= self.bound)
        if clip and (self.on_overflow == "raise" or not (math.isfinite(lo) and math.isfinite(hi))):
            return False
        if self._magic is None:
            return self._encode_generic(chunk, out, clip=clip)
        # The output doubles as float64 scratch: y = x + magic, whose bits are the encoding.
        as_float = out.view(np.float64)
        if clip:
            np.clip(chunk, -self.bound, self.bound, out=as_float, dtype=np.float64)
            np.add(as_float, self._magic, out=as_float)
        else:
            np.add(chunk, self._magic, out=as_float, dtype=np.float64)
        return True

    def _encode_generic(self, chunk: np.ndarray, out: np.ndarray, *, clip: bool) -> bool:
        """``rint(x * 2**frac_bits)`` through a float64 scratch, for bounds beyond 2**51 ulps."""
        scratch = np.empty(chunk.size, dtype=np.float64)
        if clip:
            np.clip(chunk, -self.bound, self.bound, out=scratch, dtype=np.float64)
            np.multiply(scratch, self._scale, out=scratch)
        else:
            np.multiply(chunk, self._scale, out=scratch, dtype=np.float64)
        np.rint(scratch, out=scratch)
        np.copyto(out.view(np.int64), scratch, casting="unsafe")
        return True

    def refusal(self, x: np.ndarray) -> FixedPointOverflow:
        """Describe why ``x`` (the whole input) cannot be encoded; only on the error path."""
        as_float = np.asarray(x).astype(np.float64)
        non_finite = int(np.count_nonzero(~np.isfinite(as_float)))
        if non_finite:
            return FixedPointOverflow(
                f"cannot encode NaN or inf: the input holds {non_finite} non-finite value(s) "
                f"out of {as_float.size}; fix the computation that produced them (clipping "
                "cannot)"
            )
        max_abs = float(np.max(np.abs(as_float)))
        return FixedPointOverflow(
            f"max |value| {max_abs:g} exceeds the fixed-point bound {self.bound:g}; raise the "
            "clip bound (lower frac_bits if the bound then no longer fits), or clip the inputs "
            "(on_overflow='clip')"
        )

    def check_terms(self, terms: int, *, ring_bits: int = 64) -> None:
        """Refuse a number of summands whose worst-case sum would wrap the ring (Z_2^64, or
        Z_2^32 with ``ring_bits=32``)."""
        if isinstance(terms, bool) or not isinstance(terms, int) or terms < 1:
            raise ValueError(f"terms must be a positive int, got {terms!r}")
        most = self.max_terms() if ring_bits == 64 else _RING32_SIGNED_MAX // self._bound_int
        if terms > most:
            raise FixedPointOverflow(
                f"a sum of {terms} values each bounded by {self.bound:g} can exceed the "
                f"{ring_bits}-bit ring (at most {most} terms fit with "
                f"frac_bits={self.frac_bits}); lower the bound or frac_bits"
            )

    def decode(self, v: np.ndarray, *, terms: int = 1) -> np.ndarray:
        """Decode ring elements (a sum of ``terms`` encoded values) to float64: uint64 (Z_2^64)
        or uint32 (Z_2^32, :meth:`ring_dtype`).

        Raises :class:`SumDidNotCancel` if any element lies outside ``terms * bound`` (plus the
        rounding slack of each term): such a value cannot be a sum of ``terms`` encodings, so
        pairwise masks did not cancel. Refuses input of another dtype (TypeError) and a
        ``terms`` whose worst-case sum would wrap the ring (:class:`FixedPointOverflow`).
        """
        v = np.asarray(v)
        if v.dtype == np.uint32:
            self.check_terms(terms, ring_bits=32)
            signed = v.view(np.int32)
        elif v.dtype == np.uint64:
            self.check_terms(terms)
            signed = v.view(np.int64)
        else:
            raise TypeError(f"decode expects uint64 or uint32 ring elements, got dtype {v.dtype}")
        limit = terms * self._bound_int
        if signed.size:
            lo, hi = int(signed.min()), int(signed.max())
            if lo < -limit or hi > limit:
                worst = max(abs(lo), abs(hi)) * self._inv_scale
                raise SumDidNotCancel(
                    f"decoded value of magnitude {worst:g} is outside terms * bound = "
                    f"{terms} * {self.bound:g}: the masks did not cancel (a contributor is "
                    "missing or an extra one was added), or terms is wrong"
                )
        result = signed.astype(np.float64)
        np.multiply(result, self._inv_scale, out=result)
        return result
