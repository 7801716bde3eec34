"""CKKS secure sum: the key holder decrypts sums, everyone else only encrypts or adds.

Roles (DESIGN.md section 2, "ckks backend"):

- :class:`CkksKeyHolder` (the active party) creates the SEAL context and keys, keeps the
  secret key and exports only the public part (the encryption parameters, the scale, whether
  the chain has a special prime, and the public key; no secret key, no Galois keys, no
  relinearisation keys: sums need none). The public part is this module's own framing of
  SEAL's serialised parameters and public key (``_pack_public``), not a TenSEAL context:
  TenSEAL always makes relinearisation keys, so it refuses a chain without a special prime.
- :class:`CkksPublic` (passive parties and the aggregator) loads that public part. Parties
  :meth:`~CkksPublic.encrypt` their contributions; the aggregator :meth:`~CkksPublic.add`\\ s
  them. Neither can decrypt.
- :class:`PackedCiphertexts` is what travels: one serialized CKKS ciphertext per chunk of
  ``slots`` values (two per complex slot), each carried as one raw frame by the transport
  layer.

Integrity. A CKKS ciphertext has no integrity protection: it is a pair of polynomials, and
almost any change to its coefficients yields another valid ciphertext that decrypts to
different numbers. Loading refuses what *can* be detected (unparsable or truncated bytes, a
broken SEAL header, coefficients outside the modulus, another parameter set, the wrong
number of values, the wrong scale or level, a transparent ciphertext) with :class:`CkksError`.
It cannot detect a flipped bit inside the compressed coefficient data, nor a ciphertext made
under another key with the same parameters: both decrypt to garbage. The integrity and
authenticity of ciphertext content comes from the CurveZMQ channel (authenticated
encryption between each peer and the hub), not from CKKS.

Security of parameters. Parameter sets are checked against SEAL's table of the largest total
coefficient-modulus size that keeps 128-bit classical security for a ternary secret key
(HomomorphicEncryption.org standard, SEAL ``hestdparms.h``)::

    poly_modulus_degree   max total coeff_mod_bit_sizes
    1024                  27
    2048                  54
    4096                  109
    8192                  218
    16384                 438
    32768                 881

The public side re-checks the parameters of every context it receives, so a passive party
never encrypts under a context weaker than that. :func:`security_level` also reports whether a
parameter set meets the 192- and 256-bit rows of the same standard.

Parameters sized to the values. Sums need no multiplication, hence no rescaling level, and no
prime has to match the scale: the data primes (one, or a few when the values need more than 60
bits) only need a product that holds the scale plus the sum's integer bits. Sums never
key-switch either, so :func:`choose_params` adds no special prime: SEAL would encrypt under it
and divide it away, which costs about a third of an encryption of zero and only makes the fresh
noise smaller than :func:`error_bound`, which the scale is sized by anyway (see
:class:`_SealSetup` for how ciphertexts are made at the data level). Chains given by hand keep
SEAL's layout (last prime special) unless they say ``special_prime=False``; the security row is
checked on the whole chain either way. :func:`choose_params` picks the smallest degree and the
shortest chain whose data modulus has exactly the bits that the requested security, the
requested precision of the released sum (bits after the point, flooding included) and a
magnitude bound for a sum of K contributions need. A ciphertext then costs ``16 * data primes``
bytes per value before compression, and SEAL's zstd compression of the 64-bit coefficient words
brings that close to ``data bits / 4`` (e.g. 15 bytes per value for one 57-bit prime, 3.8x a
float32).

Packing and speed. Two real values share each complex CKKS slot, so a ciphertext of degree N
carries N values (TenSEAL's real-only vectors carry N/2 for the same bytes and time); every
chunk is full but an array's last. The module drives SEAL through TenSEAL's ``sealapi`` binding.
SEAL holds the GIL in encryption, decryption, encoding and adding (the binding never releases
it), so a thread pool cannot encrypt chunks in parallel; instead
:meth:`CkksPublic.prepare_zeros` precomputes encryptions of zero off the critical path (a
caller's worker thread, while the caller waits on the network), and :meth:`CkksPublic.encrypt`
then only encodes and adds each chunk into one (SEAL's encryption is exactly an encryption of
zero plus the plaintext, so the result is a fresh encryption). Each encryption of zero is used
once. In the coefficient encoding without a special prime the zeros are made by
:class:`_ZeroMaker` (SEAL's distributions and ring products, sampled in bulk: half the time of
SEAL's ``encrypt_zero``). A chunk travels as a 4-byte value count and the ciphertext's
coefficients copied out of SEAL's memory in as many bytes as each prime needs (the ``raw``
format: no file, no compression; within 1% of the size of SEAL's zstd serialisation at the
default Credit parameters and 7% smaller with one 56-bit prime, written in about a ninth and
read in under half of SEAL's CPU time, measured by ``bench/ckks_overhead.py``), or SEAL's own
serialisation (``seal``); see ``_CkksCodec``.

Decryptions that leave the key holder. CKKS is approximate: a decryption is the message plus
an error that depends on the secret key, and an adversary who sees exact decryptions of
ciphertexts it knows can recover the key (Li and Micciancio, IND-CPA^D, 2021). In a
federation the aggregator sees every ciphertext and the parties receive values derived from
decrypted sums (gradients), so :class:`DecryptionRelease` floods each decrypted value with
Gaussian noise of standard deviation ``2**flood_bits`` times :func:`error_bound` (a
high-probability bound on the decryption error of a sum of ``terms`` fresh ciphertexts), from a
cryptographic generator keyed by the operating system's CSPRNG, then rounds it to
``2**-precision_bits``. The per-value statistical distance to a flooded exact value is at most about
``2**-flood_bits`` (the bound is ~15x the error's standard deviation without a special prime,
so ~2**-14 in practice, and more with one): a mitigation
sized so that training is unaffected, not the ~2**-40 flooding of a formal IND-CPA^D proof,
which would swamp the values. :meth:`CkksKeyHolder.decrypt_sum` without a release returns the
raw decryption, which must not leave the key holder.

This module uses TenSEAL and NumPy only; it knows nothing of ML or of the transport.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import math
import os
import shutil
import struct
import tempfile
import threading
import weakref
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import tenseal.sealapi as sealapi  # SEAL itself: contexts, keys, complex slots, encrypt_zero

from crypto.prg import random_uint64

__all__ = [
    "MAX_COEFF_MODULUS_BITS",
    "MAX_COEFF_MODULUS_BITS_128",
    "MAX_PREPARED_ZEROS",
    "WIRE_ENV",
    "WIRE_RAW",
    "WIRE_SEAL",
    "CkksError",
    "CkksSizing",
    "DecryptionRelease",
    "ERROR_BOUND_TAIL",
    "error_bound",
    "CkksKeyHolder",
    "CkksParams",
    "CkksPublic",
    "DEFAULT_CKKS_PARAMS",
    "ENCODING_COEFFICIENTS",
    "ENCODING_SLOTS",
    "PackedCiphertexts",
    "choose_params",
    "context_fingerprint",
    "security_level",
]

#: SEAL's 128-bit classical security table: poly_modulus_degree -> max total modulus bits.
MAX_COEFF_MODULUS_BITS_128: dict[int, int] = {
    1024: 27,
    2048: 54,
    4096: 109,
    8192: 218,
    16384: 438,
    32768: 881,
}

#: The same standard's rows for 128-, 192- and 256-bit classical security (SEAL hestdparms.h).
MAX_COEFF_MODULUS_BITS: dict[int, dict[int, int]] = {
    128: MAX_COEFF_MODULUS_BITS_128,
    192: {1024: 19, 2048: 37, 4096: 75, 8192: 152, 16384: 305, 32768: 611},
    256: {1024: 14, 2048: 29, 4096: 58, 8192: 118, 16384: 237, 32768: 476},
}

#: How values sit in a ciphertext (:attr:`CkksParams.encoding`).
ENCODING_COEFFICIENTS = "coefficients"
ENCODING_SLOTS = "slots"

#: Wire formats of a ciphertext chunk (see ``_CkksCodec``): coefficients copied out of SEAL's
#: memory in as many bytes as each prime needs (default), or SEAL's own serialisation.
WIRE_RAW = "raw"
WIRE_SEAL = "seal"
#: Environment variable that picks the format a process writes (benchmarks compare the two).
WIRE_ENV = "SECUREVFL_CKKS_WIRE"

#: The most encryptions of zero one CkksPublic keeps ready (each is one ciphertext).
MAX_PREPARED_ZEROS = 4096

# SEAL refuses primes outside [2, 60] bits (SEAL_USER_MOD_BIT_COUNT_MAX/MIN).
_MAX_PRIME_BITS = 60
# Below 20 bits of scale the decrypted sum loses the precision the protocols rely on.
_MIN_SCALE_BITS = 20
# SEAL_CIPHERTEXT_SIZE_MAX: the most polynomials one SEAL ciphertext holds.
_MAX_CT_SIZE = 16
# Room for SEAL/protobuf headers on top of the raw ciphertext size.
_CHUNK_OVERHEAD_BYTES = 4096


class CkksError(ValueError):
    """A CKKS input was refused: malformed, tampered, truncated, or from another context."""


@dataclass(frozen=True)
class CkksParams:
    """CKKS encryption parameters; :meth:`validate` refuses anything below 128-bit security.

    ``coeff_mod_bit_sizes`` is the prime chain. With ``special_prime`` (the default, SEAL's
    usual layout) every prime but the last forms the data modulus that holds an encoded sum and
    the last is the special prime: SEAL encrypts under the whole chain and then divides the
    fresh noise by that prime. Without it every prime is a data prime and ciphertexts are made
    directly at the data level (see :class:`_SealSetup`): sums never key-switch, so the special
    prime only bought a smaller fresh noise, which :func:`error_bound` does not count on, at
    the cost of one more prime in every encryption. Either way sums need no rescaling, so no
    prime has to match the scale.
    """

    poly_modulus_degree: int = 8192
    coeff_mod_bit_sizes: tuple[int, ...] = (60, 40, 40, 60)
    scale_bits: int = 40
    special_prime: bool = True

    def validate(self) -> None:
        """Raise :class:`ValueError` naming the field if the parameters are unusable or weak.

        Refuses: a degree that is not a power of two in [1024, 32768]; ``special_prime`` not a
        bool; fewer than two primes with a special prime, or none without; a prime outside
        [log2(2 * degree) + 1, 60] bits; a total modulus (the whole chain) above SEAL's 128-bit
        limit for the degree (see :data:`MAX_COEFF_MODULUS_BITS_128`); a scale below 20 bits,
        or one that leaves the data modulus no room for a sum's integer part
        (:attr:`magnitude_bits` below 0).
        """
        n = self.poly_modulus_degree
        if isinstance(n, bool) or not isinstance(n, int):
            raise ValueError(f"poly_modulus_degree must be an int, got {type(n).__name__}.")
        if n not in MAX_COEFF_MODULUS_BITS_128:
            raise ValueError(
                f"poly_modulus_degree must be a power of two between 1024 and 32768, got {n}."
            )
        sizes = self.coeff_mod_bit_sizes
        if not isinstance(sizes, tuple) or not all(
            isinstance(b, int) and not isinstance(b, bool) for b in sizes
        ):
            raise ValueError(
                f"coeff_mod_bit_sizes must be a tuple of ints, got {sizes!r}; "
                "use a tuple such as (60, 40, 40, 60)."
            )
        if not isinstance(self.special_prime, bool):
            raise ValueError(f"special_prime must be a bool, got {self.special_prime!r}.")
        if self.special_prime and len(sizes) < 2:
            raise ValueError(
                "coeff_mod_bit_sizes needs at least two primes (one data prime and the special "
                f"prime), got {sizes!r}; or set special_prime=False to use every prime for data."
            )
        if not sizes:
            raise ValueError("coeff_mod_bit_sizes needs at least one prime, got ().")
        # A prime p = 1 mod 2n needs more bits than 2n itself.
        min_prime_bits = int(math.log2(2 * n)) + 1
        for i, bits in enumerate(sizes):
            if not min_prime_bits <= bits <= _MAX_PRIME_BITS:
                raise ValueError(
                    f"coeff_mod_bit_sizes[{i}] = {bits} is outside [{min_prime_bits}, "
                    f"{_MAX_PRIME_BITS}] bits, the range SEAL supports for "
                    f"poly_modulus_degree {n}."
                )
        total, limit = sum(sizes), MAX_COEFF_MODULUS_BITS_128[n]
        if total > limit:
            raise ValueError(
                f"coeff_mod_bit_sizes total {total} bits exceeds {limit}, the most SEAL allows "
                f"for 128-bit security at poly_modulus_degree {n}; use fewer or smaller primes "
                "or a larger poly_modulus_degree."
            )
        s = self.scale_bits
        if isinstance(s, bool) or not isinstance(s, int):
            raise ValueError(f"scale_bits must be an int, got {type(s).__name__}.")
        if s < _MIN_SCALE_BITS:
            raise ValueError(
                f"scale_bits = {s} is below {_MIN_SCALE_BITS}; the decrypted sum would be too "
                "imprecise."
            )
        data_primes = self.data_primes
        if self.data_bits - data_primes - s - 2 < 0:
            # sums need no rescaling, so only the data modulus as a whole must hold the scale
            raise ValueError(
                f"scale_bits = {s} leaves no room for the integer part of a sum: the data "
                f"primes {sizes[:data_primes]} hold {self.data_bits} bits, which must be at least "
                f"scale_bits + {data_primes + 2}; add bits to the data primes or lower scale_bits."
            )

    @property
    def slots(self) -> int:
        """Number of real values one ciphertext carries: one per coefficient, or two per
        complex CKKS slot (see :attr:`encoding`)."""
        return self.poly_modulus_degree

    @property
    def encoding(self) -> str:
        """How values sit in a ciphertext, decided by the parameters so that every role agrees:
        :data:`ENCODING_COEFFICIENTS` (one value per coefficient of the plaintext polynomial)
        where the data modulus is one prime, else :data:`ENCODING_SLOTS` (two values per
        complex slot, SEAL's CKKS encoder). Sums only add, so they need no slots: the
        coefficient form skips the encoder's FFTs at every encryption and decryption and its
        error is about sqrt(N/2) times smaller (see :func:`error_bound`). A chain of several
        data primes keeps the slots: reading a coefficient back would need a CRT of the
        primes, where SEAL's decoder does it."""
        return ENCODING_COEFFICIENTS if self.data_primes == 1 else ENCODING_SLOTS

    @property
    def data_primes(self) -> int:
        """How many primes form the data modulus: all of them, or all but the special one."""
        return len(self.coeff_mod_bit_sizes) - (1 if self.special_prime else 0)

    @property
    def data_bit_sizes(self) -> tuple[int, ...]:
        """Bit sizes of the data primes (the chain without its special prime, if any)."""
        return self.coeff_mod_bit_sizes[: self.data_primes]

    @property
    def data_bits(self) -> int:
        """Bits of the data modulus Q (every prime but the special one): what holds a sum."""
        return sum(self.data_bit_sizes)

    @property
    def magnitude_bits(self) -> int:
        """A sum whose values stay below ``2**magnitude_bits`` in magnitude decrypts correctly.

        Each b-bit prime is at least 2**(b-1), so Q >= 2**(data_bits - data primes); two
        values share a complex slot, whose modulus is at most sqrt(2) times the larger, and an
        encoded polynomial's coefficients reach ``2**scale_bits`` times the largest slot
        modulus, which must stay below Q/2: half a bit for the sqrt(2), half a bit left for
        the noise.
        """
        return self.data_bits - self.data_primes - self.scale_bits - 2

    @property
    def max_chunk_bytes(self) -> int:
        """Upper bound on a serialized chunk; larger frames are refused before parsing."""
        return 2 * self.poly_modulus_degree * self.data_primes * 8 + _CHUNK_OVERHEAD_BYTES


#: The design's default parameters: degree 8192, primes (60, 40, 40, 60), scale 2^40.
DEFAULT_CKKS_PARAMS = CkksParams()


def security_level(params: CkksParams) -> int:
    """The highest of 256, 192 and 128 bits whose row of the standard ``params`` meet; 0 if
    none (then :meth:`CkksParams.validate` refuses them)."""
    total = sum(params.coeff_mod_bit_sizes)
    for bits in (256, 192, 128):
        limit = MAX_COEFF_MODULUS_BITS[bits].get(params.poly_modulus_degree)
        if limit is not None and total <= limit:
            return bits
    return 0


@dataclass(frozen=True)
class CkksSizing:
    """What :func:`choose_params` chose, and what it guarantees for a sum of ``terms``.

    ``precision_bits``: the released value's error (flood noise of
    ``2**flood_bits * error_bound``, the dominant term) has standard deviation at most
    ``2**-precision_bits``; ``raw_precision_bits``: :func:`error_bound` itself is at most
    ``2**-raw_precision_bits``; ``magnitude_bits``: sums below ``2**magnitude_bits`` decrypt
    correctly; ``bytes_per_value``: ciphertext bytes per value before compression.
    """

    params: CkksParams
    security_bits: int
    terms: int
    flood_bits: int
    precision_bits: float
    raw_precision_bits: float
    magnitude_bits: int
    bytes_per_value: float

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready fields (the parameters flattened)."""
        return {
            "poly_modulus_degree": self.params.poly_modulus_degree,
            "coeff_mod_bit_sizes": list(self.params.coeff_mod_bit_sizes),
            "scale_bits": self.params.scale_bits,
            "special_prime": self.params.special_prime,
            "security_bits": self.security_bits,
            "terms": self.terms,
            "flood_bits": self.flood_bits,
            "precision_bits": self.precision_bits,
            "raw_precision_bits": self.raw_precision_bits,
            "magnitude_bits": self.magnitude_bits,
            "bytes_per_value": self.bytes_per_value,
        }


def describe_params(params: CkksParams, *, terms: int, flood_bits: int = 10) -> CkksSizing:
    """The guarantees of ``params`` for a sum of ``terms`` released with ``flood_bits``."""
    bound = error_bound(params, terms=terms)
    data_primes = params.data_primes
    return CkksSizing(
        params=params,
        security_bits=security_level(params),
        terms=terms,
        flood_bits=flood_bits,
        precision_bits=-math.log2(2.0**flood_bits * bound),
        raw_precision_bits=-math.log2(bound),
        magnitude_bits=params.magnitude_bits,
        bytes_per_value=2 * data_primes * 8 * params.poly_modulus_degree / params.slots,
    )


def choose_params(
    *,
    precision_bits: int,
    magnitude: float,
    terms: int,
    flood_bits: int = 10,
    security_bits: int = 128,
    min_degree: int = 1024,
) -> CkksSizing:
    """The smallest CKKS parameters for sums of ``terms`` contributions with ``|x| <=
    magnitude``, released to ``precision_bits`` bits after the point with ``flood_bits`` of
    flooding (see :class:`DecryptionRelease`), at ``security_bits`` (128, 192 or 256), of
    degree ``min_degree`` or more (a sum of many values costs about the same per value at any
    degree, but each ciphertext chunk has its own fixed costs).

    Smallest degree first, then the shortest chain, in the coefficient encoding (one data
    prime, its smaller noise) where one prime holds the sum, else the slot encoding: a scale
    just large enough for the precision (by :func:`error_bound`), the fewest data primes whose
    product just holds the scale plus the sum's integer bits (split evenly: no prime needs to
    match the scale, since sums never rescale), and no special prime (sums never key-switch;
    :func:`error_bound` is the noise of an encryption made directly at the data level).
    Promises parameters that :meth:`CkksParams.validate` accepts and that meet the security
    row. Refuses (ValueError)
    non-positive terms or magnitude, an unknown security level, and requirements no degree up
    to 32768 can meet, saying which.
    """
    if security_bits not in MAX_COEFF_MODULUS_BITS:
        raise ValueError(f"security_bits must be one of {sorted(MAX_COEFF_MODULUS_BITS)}")
    if isinstance(terms, bool) or not isinstance(terms, int) or terms < 1:
        raise ValueError(f"terms must be a positive int, got {terms!r}")
    if not (math.isfinite(magnitude) and magnitude > 0):
        raise ValueError(f"magnitude must be a positive finite float, got {magnitude!r}")
    if not 0 <= flood_bits <= 40 or not -20 <= precision_bits <= 60:
        raise ValueError("flood_bits must be in [0, 40] and precision_bits in [-20, 60]")
    sum_bits = max(0, math.ceil(math.log2(terms * magnitude)))
    limits = MAX_COEFF_MODULUS_BITS[security_bits]
    tried = []
    for degree in sorted(d for d in limits if d >= min_degree):
        # one data prime gives the coefficient encoding, more the slots (CkksParams.encoding):
        # the coefficients' smaller noise first, and the slots' where one prime cannot hold it
        for encoding in (ENCODING_COEFFICIENTS, ENCODING_SLOTS):
            # error_bound(params, terms) = _error_bound_units(degree, terms, encoding) / 2**scale
            noise_bits = math.log2(_error_bound_units(degree, terms, encoding))
            scale = max(_MIN_SCALE_BITS, math.ceil(precision_bits + flood_bits + noise_bits))
            primes = _data_primes(
                scale=scale, sum_bits=sum_bits, min_bits=int(math.log2(2 * degree)) + 1
            )
            if primes is None:
                tried.append(f"{degree}: scale {scale} leaves no room below {_MAX_PRIME_BITS} bits")
                break
            if (len(primes) == 1) != (encoding == ENCODING_COEFFICIENTS):
                continue  # several primes: the slots' noise sizes the scale
            if sum(primes) > limits[degree]:
                tried.append(f"{degree}: {sum(primes)} bits > {limits[degree]}")
                break
            params = CkksParams(
                poly_modulus_degree=degree,
                coeff_mod_bit_sizes=primes,
                scale_bits=scale,
                special_prime=False,
            )
            params.validate()
            return describe_params(params, terms=terms, flood_bits=flood_bits)
    raise ValueError(
        f"no CKKS parameters give {precision_bits} bits after the point (flood_bits "
        f"{flood_bits}) for sums of {terms} values up to {magnitude:g} at {security_bits}-bit "
        f"security: {'; '.join(tried)}; lower the precision or the magnitude"
    )


def _data_primes(*, scale: int, sum_bits: int, min_bits: int) -> tuple[int, ...] | None:
    """The fewest data primes, of near-equal sizes, whose product holds ``scale + sum_bits``
    bits with the margins of :attr:`CkksParams.magnitude_bits` (each b-bit prime counts as b - 1
    bits); None if the scale cannot fit below the largest prime. Sums never rescale, so the
    primes need not match the scale: the data modulus has exactly the bits it needs, and a
    ciphertext serialises to about that many bits per coefficient."""
    if scale >= _MAX_PRIME_BITS:
        return None
    for count in range(1, 8):
        total = scale + sum_bits + 2 + count  # Q >= 2**(total - count) > 2**(scale + sum_bits + 2)
        size, extra = divmod(total, count)
        sizes = tuple(max(size + (i < extra), min_bits) for i in range(count))
        if sizes[0] <= _MAX_PRIME_BITS:
            return sizes
    return None


@dataclass
class PackedCiphertexts:
    """A flattened array of ``length`` values as one serialized CKKS vector per chunk.

    Chunk ``i`` holds values ``[i * slots, min((i + 1) * slots, length))``. This class only
    carries bytes; :class:`CkksPublic` and :class:`CkksKeyHolder` check them on use.
    """

    chunks: list[bytes] = field(repr=False)
    length: int

    def __post_init__(self) -> None:
        if isinstance(self.length, bool) or not isinstance(self.length, int) or self.length < 0:
            raise CkksError(f"length must be a non-negative int, got {self.length!r}.")
        if not isinstance(self.chunks, list) or not all(isinstance(c, bytes) for c in self.chunks):
            raise CkksError("chunks must be a list of bytes objects (one per ciphertext).")

    def __repr__(self) -> str:
        size = sum(len(c) for c in self.chunks)
        return f"PackedCiphertexts(length={self.length}, chunks={len(self.chunks)}, bytes={size})"

    def to_frames(self) -> list[bytes]:
        """The chunks as raw frames for the transport, in order (one frame per chunk)."""
        return list(self.chunks)

    @classmethod
    def from_frames(
        cls, frames: Sequence[bytes | bytearray | memoryview], *, length: int
    ) -> PackedCiphertexts:
        """Rebuild from raw frames (bytes-like, e.g. zero-copy buffers) and the value count.

        Refuses with :class:`CkksError` a non-bytes frame, an empty frame, or a negative
        length. Chunk counts and contents are checked where the slot count is known
        (:meth:`CkksPublic.add`, :meth:`CkksKeyHolder.decrypt_sum`).
        """
        chunks: list[bytes] = []
        for i, frame in enumerate(frames):
            if not isinstance(frame, bytes | bytearray | memoryview):
                raise CkksError(
                    f"frame {i} is a {type(frame).__name__}, not bytes; CKKS chunks travel as "
                    "raw byte frames."
                )
            data = bytes(frame)
            if not data:
                raise CkksError(f"frame {i} is empty; a CKKS chunk cannot be empty.")
            chunks.append(data)
        return cls(chunks=chunks, length=length)


def context_fingerprint(context_bytes: bytes) -> str:
    """Hex SHA-256 of an exported public context, for parties to compare out of band.

    The hub forwards the public context; comparing fingerprints over an end-to-end
    authenticated path is what stops a hub from substituting a key it can decrypt with.
    """
    return hashlib.sha256(context_bytes).hexdigest()


def _num_chunks(length: int, slots: int) -> int:
    return -(-length // slots)


def _chunk_length(index: int, length: int, slots: int) -> int:
    return min(slots, length - index * slots)


# The exported public part: a magic, then tagged sections (4-byte tag, 4-byte little-endian
# length, bytes). This module writes META, PARM and PKEY only; the public side refuses SKEY
# (a secret key), any unknown tag, a duplicate, and a missing PARM, META or PKEY.
_PUBLIC_MAGIC = b"SVCKKSP1"
_TAG_META = b"META"  # scale_bits (u8), special_prime (u8)
_TAG_PARMS = b"PARM"  # SEAL's serialised EncryptionParameters
_TAG_PUBLIC_KEY = b"PKEY"  # SEAL's serialised PublicKey
_TAG_SECRET_KEY = b"SKEY"  # never written here: named so the public side can refuse it clearly
_SECTION = struct.Struct("<4sI")
_META = struct.Struct("<BB")


def _pack_public(sections: Sequence[tuple[bytes, bytes]]) -> bytes:
    """The public-part bytes of ``(tag, payload)`` sections, in order."""
    return _PUBLIC_MAGIC + b"".join(_SECTION.pack(tag, len(data)) + data for tag, data in sections)


def _unpack_public(data: bytes) -> dict[bytes, bytes]:
    """The sections of a public part; refuses (CkksError) a wrong magic, a truncated section
    and a duplicate tag."""
    if not data.startswith(_PUBLIC_MAGIC):
        raise CkksError(
            "the context bytes could not be parsed: they are not a securevfl CKKS public context "
            f"(no {_PUBLIC_MAGIC!r} magic); pass what CkksKeyHolder.public_context_bytes() "
            "returned, from a key holder of this version."
        )
    sections: dict[bytes, bytes] = {}
    offset = len(_PUBLIC_MAGIC)
    while offset < len(data):
        if offset + _SECTION.size > len(data):
            raise CkksError("the context bytes could not be parsed: a section header is truncated.")
        tag, size = _SECTION.unpack_from(data, offset)
        offset += _SECTION.size
        if offset + size > len(data):
            raise CkksError(
                f"the context bytes could not be parsed: section {tag!r} claims {size} bytes but "
                f"{len(data) - offset} remain (truncated)."
            )
        if tag in sections:
            raise CkksError(f"the context bytes could not be parsed: section {tag!r} repeats.")
        sections[tag] = data[offset : offset + size]
        offset += size
    return sections


@contextlib.contextmanager
def _seal_path() -> Iterator[str]:
    """A path for one SEAL save or load (the binding only takes paths): an anonymous memfd
    reached through /proc/self/fd where Linux offers it (no name in any directory, so even a
    key's bytes never land in a file others could list), else a private 0700 directory."""
    if hasattr(os, "memfd_create") and os.path.isdir("/proc/self/fd"):
        fd = os.memfd_create("securevfl-ckks", getattr(os, "MFD_CLOEXEC", 1))
        try:
            yield f"/proc/self/fd/{fd}"
        finally:
            os.close(fd)
    else:
        scratch = tempfile.mkdtemp(prefix="securevfl-ckks-")
        try:
            yield os.path.join(scratch, "seal")
        finally:
            shutil.rmtree(scratch, ignore_errors=True)


def _seal_save(save: Any) -> bytes:
    """The bytes a SEAL object's ``save(path)`` writes."""
    with _seal_path() as path:
        save(path)
        with open(path, "rb") as f:
            return f.read()


def _seal_load(load: Any, data: bytes) -> None:
    """Feed ``data`` to a SEAL object's ``load(path)``."""
    with _seal_path() as path:
        with open(path, "wb") as f:
            f.write(data)
        load(path)


def _encryption_parameters(params: CkksParams) -> Any:
    """SEAL's EncryptionParameters for ``params`` (SEAL picks the primes)."""
    parms = sealapi.EncryptionParameters(sealapi.SCHEME_TYPE.CKKS)
    parms.set_poly_modulus_degree(params.poly_modulus_degree)
    try:
        parms.set_coeff_modulus(
            sealapi.CoeffModulus.Create(
                params.poly_modulus_degree, list(params.coeff_mod_bit_sizes)
            )
        )
    except Exception as exc:  # e.g. SEAL finds no prime of a requested size
        raise CkksError(f"SEAL refused the parameters {params}: {exc}.") from exc
    return parms


def _params_from(parms: Any, meta: bytes) -> CkksParams:
    """The parameters a received public part describes; refuses a non-CKKS scheme and a
    malformed META section (CkksError). Not validated here."""
    try:
        scheme = parms.scheme().name
        degree = int(parms.poly_modulus_degree())
        sizes = tuple(int(m.bit_count()) for m in parms.coeff_modulus())
    except Exception as exc:  # the binding raises several types for unset fields
        raise CkksError(f"the context does not describe a usable CKKS setup ({exc}).") from exc
    if scheme != "CKKS":
        raise CkksError(f"the context uses the {scheme} scheme; a CKKS context is required.")
    if len(meta) != _META.size:
        raise CkksError(
            f"the context bytes could not be parsed: META has {len(meta)} bytes, not {_META.size}."
        )
    scale_bits, special = _META.unpack(meta)
    if special not in (0, 1):
        raise CkksError(f"the context bytes could not be parsed: special_prime flag {special}.")
    return CkksParams(
        poly_modulus_degree=degree,
        coeff_mod_bit_sizes=sizes,
        scale_bits=scale_bits,
        special_prime=bool(special),
    )


class _SealSetup:
    """The SEAL contexts of one (validated) parameter set, and where fresh ciphertexts live.

    ``enc`` is the context of the chain itself, checked by SEAL at 128-bit security: the public
    key lives at its key level (the whole chain). ``seal`` is the context in which ciphertexts
    are encoded, added, loaded and decrypted, and ``zero_level`` the parms_id of every fresh
    ciphertext:

    - with a special prime, ``seal`` is ``enc``: SEAL encrypts at the key level and divides
      down to the data level (``enc``'s first level);
    - without one, ciphertexts are made at ``enc``'s key level directly (no division, no extra
      prime in the encryption). SEAL refuses to add or decrypt ciphertexts at a context's key
      level, so ``seal`` is a second context whose chain is the data primes plus one spare
      prime: its first level has exactly the data primes, hence the same parms_id as ``enc``'s
      key level. The spare prime carries nothing: no public key, ciphertext or plaintext is
      ever made under it (only the key holder's decryption key has a component modulo it),
      which is why that context is built without SEAL's security check; the published public
      key is under ``enc``, which SEAL checks.
    """

    def __init__(self, parms: Any, params: CkksParams) -> None:
        self.params = params
        self.parms = parms
        self.enc = sealapi.SEALContext(parms, True, sealapi.SEC_LEVEL_TYPE.TC128)
        if not self.enc.parameters_set():
            raise CkksError(
                f"SEAL refused the parameters {params}: {self.enc.parameters_error_message()}."
            )
        if params.special_prime:
            self.seal = self.enc
            self.zero_level = self.enc.first_parms_id()
        else:
            self.seal = self._evaluation_context()
            self.zero_level = self.enc.key_parms_id()
        self.public_key: Any = None

    def _evaluation_context(self) -> Any:
        moduli = list(self.parms.coeff_modulus())
        degree = self.params.poly_modulus_degree
        used = {int(m.value()) for m in moduli}
        for bits in range(max(20, int(math.log2(2 * degree)) + 1), _MAX_PRIME_BITS + 1):
            try:
                spare = sealapi.CoeffModulus.Create(degree, [bits])[0]
            except Exception:  # no prime of this size for this degree
                continue
            if int(spare.value()) in used:
                continue
            parms = sealapi.EncryptionParameters(sealapi.SCHEME_TYPE.CKKS)
            parms.set_poly_modulus_degree(degree)
            parms.set_coeff_modulus([*moduli, spare])
            context = sealapi.SEALContext(parms, True, sealapi.SEC_LEVEL_TYPE.NONE)
            if context.parameters_set() and context.first_parms_id() == self.enc.key_parms_id():
                return context
        raise CkksError(f"no evaluation context for the data-only chain {self.params}.")

    def data_secret_key(self, secret_key: Any) -> Any:
        """``secret_key`` (at ``seal``'s key level: the data primes and the spare one) restricted
        to the data primes, as a key of ``enc``: the same secret, so a public key made from it
        encrypts to ``secret_key``. Built as SEAL's own uncompressed serialisation of the first
        ``degree * data primes`` coefficients (NTT form, one block per prime) and loaded by SEAL,
        which checks it; through an anonymous memfd, never a named file."""
        plaintext = self._data_secret_bytes(secret_key, self.enc.key_parms_id())
        key = sealapi.SecretKey()
        _seal_load(lambda path: key.load(self.enc, path), plaintext)
        return key

    def data_secret_plain(self, secret_key: Any) -> Any:
        """The same restriction of ``secret_key`` as a plaintext of ``seal`` at the data level
        (NTT form, scale 1): what :meth:`_CkksCodec.decrypt_coefficients` multiplies the
        summed second polynomials by. Loaded by SEAL, which checks it; through an anonymous
        memfd, never a named file; it stays with the key holder."""
        plain = sealapi.Plaintext()
        data = self._data_secret_bytes(secret_key, self.seal.first_parms_id())
        _seal_load(lambda path: plain.load(self.seal, path), data)
        return plain

    def _data_secret_bytes(self, secret_key: Any, parms_id: Any) -> bytes:
        """SEAL's uncompressed serialisation of a plaintext at ``parms_id`` (NTT form, scale
        1) holding the first ``degree * data primes`` coefficients of ``secret_key`` (one block
        per prime, data primes first)."""
        degree, primes = self.params.poly_modulus_degree, self.params.data_primes
        plain = secret_key.data()
        count = degree * primes
        words = np.fromiter((plain.data(i) for i in range(count)), dtype="<u8", count=count)
        version = _seal_save(self.parms.save)[2:5]  # header size, SEAL major and minor version

        def framed(members: bytes) -> bytes:  # SEALHeader: magic, sizes, no compression
            return b"\x5e\xa1" + version + b"\x00\x00\x00" + struct.pack("<Q", 16 + len(members))

        array = struct.pack("<Q", count) + words.tobytes()
        plaintext = (
            struct.pack("<4Q", *parms_id) + struct.pack("<Qd", count, 1.0) + framed(array) + array
        )
        return framed(plaintext) + plaintext

    def encryptor(self) -> Any:
        """An encryptor under the public key (set ``public_key`` first)."""
        return sealapi.Encryptor(self.enc, self.public_key)


class _CkksCodec:
    """Encoding, chunk framing, saving, loading and checking of ciphertexts for one context.

    A ciphertext of degree N carries N values, in one of two encodings
    (:attr:`CkksParams.encoding`). In the coefficient encoding (one data prime) value ``i`` is
    coefficient ``i`` of the plaintext polynomial, times the scale, and ciphertexts stay in
    coefficient form (SEAL's encryptions of zero are taken out of NTT form once, where they are
    made): a contribution is its encryption of zero with the rounded, scaled values added to
    the first polynomial modulo the prime, with no encoder at all; the key holder computes
    ``c0 + c1 * s`` with only the second polynomials in NTT form (:meth:`decrypt_coefficients`;
    a chunk in SEAL's format is brought into NTT form whole and decrypted by SEAL's
    Decryptor, :meth:`decrypt_values`).
    In the slot encoding two real values share one complex CKKS slot (value ``2j`` in the real
    part, ``2j + 1`` in the imaginary part), twice what TenSEAL's real-only vectors carry, for
    the same bytes and nearly the same encryption time; SEAL's encoder maps them to the
    polynomial and back. A chunk on
    the wire is a 4-byte little-endian value count (the sender's claim, checked against the
    other contributors and the key holder's shape) followed by the ciphertext in one of two
    formats, told apart by their first bytes:

    - ``raw`` (:data:`WIRE_RAW`, the default): the magic ``CKR1`` (slot encoding, NTT form)
      or ``CKC1`` (coefficient encoding and form), the ciphertext's 32-byte
      ``parms_id``, then its coefficients copied straight out of SEAL's memory, each prime's in
      just enough little-endian bytes for that prime (5 bytes for a 34-bit prime), the two
      polynomials one after the other. No file, no compression: a copy in each direction.
      Loading checks the length, the parms_id and that every coefficient is below its prime
      (what SEAL's own loader checks), and copies the coefficients into a ciphertext SEAL made.
      SEAL's Python binding offers no bytes API, so the coefficient buffer is reached through
      the layout of the binding's objects (:class:`_CoefficientAccess`), checked against
      SEAL's own accessors on a probe ciphertext before first use; a binding whose layout
      differs falls back to ``seal``.
    - ``seal`` (:data:`WIRE_SEAL`): SEAL's own serialisation (zstd-compressed by SEAL, which
      drops the unused high bits of each 64-bit coefficient word), parsed by SEAL. The binding
      saves and loads ciphertexts through file paths only, so this format goes through a
      private directory (mode 0700) on tmpfs (``/dev/shm`` where present), one ciphertext at a
      time, removed right after the save or load, never a key; the directory goes with the
      codec.

    Both formats are always accepted; ``wire`` picks what this codec writes. A chunk of the
    other encoding than the context's is refused (it would decrypt to other numbers).
    """

    def __init__(self, setup: _SealSetup, *, wire: str | None) -> None:
        self._setup = setup
        params = setup.params
        self._params = params
        self._scale = 2.0**params.scale_bits
        self.seal = setup.seal
        self._zero_level = setup.zero_level
        self._first_parms_id = self.seal.first_parms_id()
        if list(self._first_parms_id) != list(self._zero_level):
            raise CkksError("fresh ciphertexts would not be at the evaluation context's top level.")
        self._parms_id_bytes = struct.pack("<4Q", *self._first_parms_id)
        self.encoder = sealapi.CKKSEncoder(self.seal)
        self.evaluator = sealapi.Evaluator(self.seal)
        moduli = self.seal.first_context_data().parms().coeff_modulus()
        self._moduli = [int(m.value()) for m in moduli]
        self._prime_bytes = [(q.bit_length() + 7) // 8 for q in self._moduli]
        # a coefficient's low bytes, as one item of its 8-byte word (`dump_coefficients`)
        self._low_bytes = [
            np.dtype({"names": ["low"], "formats": [f"V{w}"], "offsets": [0], "itemsize": 8})
            for w in self._prime_bytes
        ]
        self._moduli_column = np.array(self._moduli, dtype=np.uint64).reshape(1, -1, 1)
        self._raw_body_bytes = (
            len(_RAW_MAGIC) + 32 + 2 * params.poly_modulus_degree * sum(self._prime_bytes)
        )
        self._scratch: str | None = None  # created on the first SEAL-format save or load
        self._finalizer: Any = None
        self._template: Any = None  # a valid ciphertext whose metadata raw loads copy
        self._template_coefficients: Any = None  # the same in coefficient form
        self._carrier_ct: Any = None  # NTT form, first polynomial zero (decrypt_values)
        self._access: _CoefficientAccess | None = None
        self._zeros_here: _ZeroMaker | None | bool = None  # False: SEAL's Encryptor makes them
        self.encoding = params.encoding
        self._raw_magic = _RAW_COEFF_MAGIC if self.encoding == ENCODING_COEFFICIENTS else _RAW_MAGIC
        self.wire = self._pick_wire(wire)
        if self.encoding == ENCODING_COEFFICIENTS and self._raw_access() is None:
            raise CkksError(
                "these parameters carry sums in the coefficient encoding (one data prime), "
                "which reads and writes the coefficients of SEAL's ciphertexts, and this SEAL "
                "binding's memory layout is not the one checked for; use a chain of two or more "
                "data primes ([secure] ckks.coeff_mod_bit_sizes) or TenSEAL 0.3.x."
            )

    def _pick_wire(self, wire: str | None) -> str:
        if wire is None:
            wire = os.environ.get(WIRE_ENV) or WIRE_RAW
        if wire not in (WIRE_RAW, WIRE_SEAL):
            raise CkksError(
                f"unknown CKKS wire format {wire!r} (from {WIRE_ENV} or the wire argument); "
                f"use {WIRE_RAW!r} or {WIRE_SEAL!r}."
            )
        if wire == WIRE_RAW and self._raw_access() is None:
            return WIRE_SEAL  # this binding's memory layout is not the one checked for
        return wire

    def _raw_access(self) -> _CoefficientAccess | None:
        """The checked accessor of coefficient buffers, or None where the check failed."""
        if self._access is None and self._template is None:
            self._template = self._fresh_zero(self._setup.encryptor())
            self._access = _CoefficientAccess.probe(
                self._template, degree=self._params.poly_modulus_degree, primes=len(self._moduli)
            )
        return self._access

    @property
    def params(self) -> CkksParams:
        """The parameters of this context."""
        return self._params

    @property
    def slots(self) -> int:
        """Values per ciphertext chunk (two per complex slot)."""
        return self._params.slots

    def _path(self) -> str:
        # one file per thread: the party's worker thread and its main thread never share one
        if self._scratch is None:
            base = (
                "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None
            )
            self._scratch = tempfile.mkdtemp(prefix="securevfl-ckks-", dir=base)
            self._finalizer = weakref.finalize(self, shutil.rmtree, self._scratch, True)
        return os.path.join(self._scratch, f"{threading.get_ident()}.ct")

    def encode(self, values: np.ndarray) -> Any:
        """A plaintext of up to ``slots`` real values, two per complex slot, at the scale."""
        z = np.zeros(self.slots // 2, dtype=np.complex128)
        z.real[: (values.size + 1) // 2] = values[0::2]
        z.imag[: values.size // 2] = values[1::2]
        plain = sealapi.Plaintext()
        self.encoder.encode(z.tolist(), self._scale, plain)
        return plain

    def decode(self, plain: Any, count: int) -> np.ndarray:
        """The first ``count`` real values of a decrypted plaintext."""
        z = np.asarray(self.encoder.decode_complex(plain), dtype=np.complex128)
        out = np.empty(2 * z.size, dtype=np.float64)
        out[0::2], out[1::2] = z.real, z.imag
        return out[:count]

    def zero(self, encryptor: Any) -> Any:
        """A fresh public-key encryption of zero at the data level and the context's scale
        (made there directly when the chain has no special prime: see :class:`_SealSetup`),
        in this encoding's form (coefficient form for the coefficient encoding). In the
        coefficient encoding without a special prime it is made by :class:`_ZeroMaker` (the
        same distribution as SEAL's, about half the time) as (2, 1, degree) coefficients,
        which :meth:`encrypt_values` and :meth:`dump` take as they take a ciphertext."""
        maker = self._zero_maker()
        if maker is not None:
            return maker.make(self._blank())
        ct = self._fresh_zero(encryptor)
        if self.encoding == ENCODING_COEFFICIENTS:
            self.evaluator.transform_from_ntt_inplace(ct)
        return ct

    def encrypt_values(self, values: np.ndarray, zero: Any) -> Any:
        """``zero`` (a fresh encryption of zero from :meth:`zero`, or its checked coefficients
        in the coefficient encoding; used up) made the encryption of up to ``slots`` float64
        ``values``, already checked finite and within the magnitude (see
        :meth:`CkksPublic.encrypt`); SEAL's encryption is exactly that, an encryption of zero
        plus the plaintext. Returns ``zero``, in its type (a coefficient array stays one: a
        raw chunk is written from it without SEAL)."""
        if self.encoding == ENCODING_SLOTS:
            if isinstance(zero, np.ndarray):
                zero = self.ciphertext_of(zero)
            self.evaluator.add_plain_inplace(zero, self.encode(values))
            return zero
        assert self._access is not None
        coeffs = zero if isinstance(zero, np.ndarray) else self._access.view(zero)
        q = np.uint64(self._moduli[0])
        scaled = np.rint(values * self._scale).astype(np.int64)  # |values * scale| < 2^62
        # the residues mod q: a negative value v is q + v, which uint64 arithmetic wraps to
        residues = scaled.view(np.uint64) + np.where(scaled < 0, q, np.uint64(0))
        head = coeffs[0, 0, : values.size]
        head += residues  # both below q < 2^60: no overflow
        np.minimum(head, head - q, out=head)  # head - q wraps above 2^63 where head < q
        return zero

    def decrypt_values(self, ct: Any, decryptor: Any, count: int) -> np.ndarray:
        """The first ``count`` values of a (summed) ciphertext of this codec, decrypted with
        ``decryptor`` (the key holder's), as float64. In the coefficient encoding ``ct`` is
        brought into NTT form (it is used up)."""
        plain = sealapi.Plaintext()
        if self.encoding == ENCODING_SLOTS:
            decryptor.decrypt(ct, plain)
            return self.decode(plain, count)
        assert self._access is not None
        self.evaluator.transform_to_ntt_inplace(ct)
        decryptor.decrypt(ct, plain)  # NTT form of the values times the scale, plus the error
        # the plaintext out of NTT form: as the first polynomial of a ciphertext (SEAL only
        # transforms ciphertexts), whose second one is nonzero (SEAL refuses transparent ones)
        out = sealapi.Ciphertext(self.seal)
        self.evaluator.add_plain(self._carrier(), plain, out)
        self.evaluator.transform_from_ntt_inplace(out)
        residues = self._access.view(out)[0, 0, :count].astype(np.int64)  # below q < 2^60
        q = self._moduli[0]
        centred = residues - np.where(residues > q // 2, np.int64(q), np.int64(0))
        return centred / self._scale

    def decrypt_coefficients(
        self, chunks: Sequence[np.ndarray], secret: Any, out: np.ndarray
    ) -> None:
        """Decrypt summed chunks given as their checked (2, 1, degree) coefficients (the
        coefficient encoding; :meth:`load_coefficients`) with ``secret``, the key holder's
        secret as a data-level NTT plaintext (:meth:`_SealSetup.data_secret_plain`), into
        ``out`` (float64, ``len(chunks) * degree`` values or fewer: the last chunk's first
        ones). The same numbers as :meth:`decrypt_values`, bit for bit: ``c0 + c1 * s`` modulo
        the prime, centred and divided by the scale; but only the second polynomials go into
        and out of NTT form, up to `_MAX_CT_SIZE` of them in one SEAL ciphertext (one
        transform each way instead of two per chunk), and ``c0`` is added in coefficient form."""
        assert self._access is not None and self.encoding == ENCODING_COEFFICIENTS
        n = self._params.poly_modulus_degree
        q = self._moduli[0]
        for first in range(0, len(chunks), _MAX_CT_SIZE):
            group = chunks[first : first + _MAX_CT_SIZE]
            # a ciphertext of len(group) polynomials (at least 2), coefficient form, scale 1
            ct = sealapi.Ciphertext(self.seal)
            ct.resize(self.seal, self._first_parms_id, max(len(group), 2))
            polys = self._access.view(ct)
            for i, coeffs in enumerate(group):
                polys[i] = coeffs[1]
            if len(group) == 1:
                polys[1] = polys[0]  # SEAL refuses a ciphertext whose second polynomial is 0
            self.evaluator.transform_to_ntt_inplace(ct)
            self.evaluator.multiply_plain_inplace(ct, secret)  # each polynomial times s
            self.evaluator.transform_from_ntt_inplace(ct)
            products = self._access.view(ct)[: len(group), 0, :]  # c1 * s, below q
            for i, coeffs in enumerate(group):
                np.add(products[i], coeffs[0, 0], out=products[i])  # both below q < 2^60
            np.minimum(products, products - np.uint64(q), out=products)
            signed = products.view(np.int64)
            np.subtract(signed, np.int64(q), out=signed, where=products > np.uint64(q // 2))
            start = first * n
            stop = min(start + len(group) * n, out.size)
            np.divide(signed.reshape(-1)[: stop - start], self._scale, out=out[start:stop])

    def _carrier(self) -> Any:
        """An NTT-form ciphertext of this context whose first polynomial is zero."""
        if self._carrier_ct is None:
            self._carrier_ct = self._ntt_blank()
            self._access.view(self._carrier_ct)[0] = 0
        return self._carrier_ct

    def _ntt_blank(self) -> Any:
        """A SEAL ciphertext with this context's metadata in NTT form (a copy of the
        template's), its coefficients to be written."""
        assert self._template is not None
        ct = sealapi.Ciphertext(self.seal)
        self.evaluator.negate(self._template, ct)
        return ct

    def _zero_maker(self) -> _ZeroMaker | None:
        """The maker of zeros of this context (:class:`_ZeroMaker`) where it applies: the
        coefficient encoding (one data prime), no special prime (the public key is at the
        data level), the coefficient layout checked; else None (SEAL's Encryptor)."""
        if self._zeros_here is None:
            self._zeros_here = False
            public_key = self._setup.public_key
            if (
                self.encoding == ENCODING_COEFFICIENTS
                and public_key is not None
                and not self._params.special_prime
                and self._raw_access() is not None
            ):
                try:
                    self._zeros_here = _ZeroMaker(self, public_key)
                except RuntimeError:  # the key is not at the data level's layout
                    self._zeros_here = False
        return self._zeros_here or None

    def _fresh_zero(self, encryptor: Any) -> Any:
        """A fresh encryption of zero as SEAL makes it (NTT form): under :meth:`zero` (which
        tests count) and the templates."""
        ct = sealapi.Ciphertext(self.seal)
        encryptor.encrypt_zero(self._zero_level, ct)
        ct.scale = self._scale
        return ct

    def dump(self, ct: Any, count: int) -> bytes:
        """The chunk bytes of a ciphertext (a SEAL one, or its checked (2, primes, degree)
        coefficients) carrying ``count`` values, in this codec's format."""
        if isinstance(ct, np.ndarray):
            if self.wire == WIRE_RAW:
                return self.dump_coefficients(ct, count)
            ct = self.ciphertext_of(ct)
        if self.wire == WIRE_RAW:
            return self._dump_raw(ct, count)
        path = self._path()
        try:
            ct.save(path)
            with open(path, "rb") as f:
                return _COUNT.pack(count) + f.read()
        finally:
            _unlink_quietly(path)

    def _dump_raw(self, ct: Any, count: int) -> bytes:
        assert self._access is not None
        # (2 polynomials, primes, degree) uint64, SEAL's memory
        return self.dump_coefficients(self._access.view(ct), count)

    def dump_coefficients(self, coeffs: np.ndarray, count: int) -> bytes:
        """The raw chunk of a ciphertext given as its (2, primes, degree) coefficients, in this
        codec's encoding (its form: checked on load)."""
        parts = [_COUNT.pack(count), self._raw_magic, self._parms_id_bytes]
        for i, low in enumerate(self._low_bytes):
            # each little-endian word's low bytes, copied as one item (a third of the time of
            # copying them byte by byte from a uint8 view)
            words = np.ascontiguousarray(coeffs[:, i, :], dtype="<u8")
            parts.append(words.view(low)["low"].tobytes())
        return b"".join(parts)

    def _load_raw(self, body: memoryview, *, what: str) -> Any:
        access = self._raw_access()
        if access is None:
            raise CkksError(
                f"{what} is in the raw format, which this SEAL binding cannot load (its memory "
                f"layout is not the one checked for); ask the sender to set {WIRE_ENV}=seal."
            )
        ct = self._blank()
        self._raw_coefficients(body, what=what, out=access.view(ct))  # into SEAL's memory
        return ct

    def _blank(self) -> Any:
        """A SEAL ciphertext with this context's metadata, in this encoding's form, its
        coefficients to be written."""
        if self.encoding == ENCODING_SLOTS:
            return self._ntt_blank()
        if self._template_coefficients is None:
            self._template_coefficients = self._ntt_blank()
            self.evaluator.transform_from_ntt_inplace(self._template_coefficients)
        ct = sealapi.Ciphertext(self.seal)
        self.evaluator.negate(self._template_coefficients, ct)
        return ct

    def ciphertext_of(self, coeffs: np.ndarray) -> Any:
        """A SEAL ciphertext holding (2, primes, degree) coefficients already checked."""
        access = self._raw_access()
        assert access is not None
        ct = self._blank()
        access.view(ct)[...] = coeffs
        return ct

    def _raw_coefficients(
        self, body: memoryview, *, what: str, out: np.ndarray | None = None
    ) -> np.ndarray:
        """The (2 polynomials, primes, degree) uint64 coefficients of a raw chunk's body,
        checked as SEAL's loader would: the length, the parms_id, every coefficient below its
        prime; written into `out` when given (a ciphertext's own buffer)."""
        if bytes(body[:4]) != self._raw_magic:
            raise CkksError(
                f"{what} is in the {_ENCODING_OF_MAGIC.get(bytes(body[:4]), 'unknown')} "
                f"encoding; this context's sums are in the {self.encoding} encoding, so it "
                "would decrypt to other numbers: every role must use the same parameters."
            )
        if body.nbytes != self._raw_body_bytes or bytes(body[4:36]) != self._parms_id_bytes:
            raise CkksError(
                f"{what} is not a valid CKKS ciphertext for this context (truncated, corrupted "
                f"or made with other parameters): a raw ciphertext of {body.nbytes} bytes or "
                "another parms_id."
            )
        n = self._params.poly_modulus_degree
        coeffs = np.empty((2, len(self._moduli), n), dtype=np.uint64) if out is None else out
        offset = len(_RAW_MAGIC) + 32
        padded = bytearray(body.nbytes + 8)  # 8-byte reads of the last coefficient stay inside
        padded[: body.nbytes] = body
        for i, (width, q) in enumerate(zip(self._prime_bytes, self._moduli, strict=True)):
            # each coefficient read as the 8 bytes where it starts, then cut to its width
            words = np.ndarray(
                (2, n), dtype="<u8", buffer=padded, offset=offset, strides=(n * width, width)
            )
            values = coeffs[:, i, :]
            np.bitwise_and(words, np.uint64((1 << (8 * width)) - 1), out=values)
            offset += 2 * n * width
            if int(values.max()) >= q:
                raise CkksError(
                    f"{what} is not a valid CKKS ciphertext for this context (truncated, "
                    "corrupted or made with other parameters): a coefficient is not below its "
                    "prime."
                )
        return coeffs

    def load_coefficients(
        self, data: bytes | bytearray | memoryview, *, expected_len: int | None, what: str
    ) -> tuple[np.ndarray, int] | None:
        """A raw chunk as its checked (2, primes, degree) coefficients and value count, with
        every check of :meth:`load` (a raw chunk has two polynomials, this context's parms_id,
        scale and level by construction; a transparent one, whose second polynomial is zero,
        is refused); None for a chunk in SEAL's format, or where this codec does not write raw
        chunks (then :meth:`load` is the way)."""
        if self.wire != WIRE_RAW:
            return None
        body, view = self._framed(data, what=what)
        if bytes(body[: len(_RAW_MAGIC)]) not in _ENCODING_OF_MAGIC:
            return None
        coeffs = self._raw_coefficients(body, what=what)
        if not coeffs[1].any():
            raise CkksError(f"{what} is transparent (not encrypted).")
        return coeffs, self._count(view, expected_len=expected_len, what=what)

    def add_coefficients(self, total: np.ndarray, other: np.ndarray) -> None:
        """``total += other`` modulo each prime, in place (both checked below their primes)."""
        total += other  # below 2^61 (SEAL's primes are at most 60 bits): no overflow
        # total - q wraps around to above 2^63 where total < q: the smaller is the residue
        np.minimum(total, total - self._moduli_column, out=total)

    def check_layout(self, packed: PackedCiphertexts, *, what: str) -> None:
        if not isinstance(packed, PackedCiphertexts):
            raise CkksError(f"{what} is a {type(packed).__name__}, not PackedCiphertexts.")
        expected = _num_chunks(packed.length, self.slots)
        if len(packed.chunks) != expected:
            raise CkksError(
                f"{what} has {len(packed.chunks)} chunks but {packed.length} values need "
                f"{expected} chunks of {self.slots} slots."
            )

    def load(
        self, data: bytes | bytearray | memoryview, *, expected_len: int | None, what: str
    ) -> tuple[Any, int]:
        """Parse one chunk and check everything that can be checked about it; returns the
        ciphertext and its value count. ``expected_len=None`` accepts any count from 1 to
        ``slots``."""
        body, view = self._framed(data, what=what)
        if bytes(body[: len(_RAW_MAGIC)]) in _ENCODING_OF_MAGIC:
            ct = self._load_raw(body, what=what)
        else:
            ct = self._load_seal(body, what=what)
        if bool(ct.is_ntt_form()) != (self.encoding == ENCODING_SLOTS):
            form = "NTT" if ct.is_ntt_form() else "coefficient"
            raise CkksError(
                f"{what} is in {form} form; this context's sums are in the {self.encoding} "
                "encoding, so it would decrypt to other numbers: every role must use the same "
                "parameters."
            )
        if ct.size() != 2:
            raise CkksError(
                f"{what} has {ct.size()} polynomials; a fresh or summed ciphertext has 2."
            )
        if ct.parms_id() != self._first_parms_id:
            raise CkksError(f"{what} is not at the context's top modulus level.")
        if ct.scale != self._scale:
            raise CkksError(f"{what} has scale {ct.scale}, not 2^{self._params.scale_bits}.")
        if ct.is_transparent():
            raise CkksError(f"{what} is transparent (not encrypted).")
        return ct, self._count(view, expected_len=expected_len, what=what)

    def _framed(
        self, data: bytes | bytearray | memoryview, *, what: str
    ) -> tuple[memoryview, memoryview]:
        """A chunk's ciphertext bytes and the whole chunk, once its size is checked."""
        if not isinstance(data, bytes | bytearray | memoryview):
            raise CkksError(f"{what} is a {type(data).__name__}, not bytes.")
        view = memoryview(data).cast("B")
        if not view.nbytes:
            raise CkksError(f"{what} is empty.")
        if view.nbytes > self._params.max_chunk_bytes:
            raise CkksError(
                f"{what} is {view.nbytes} bytes, more than the {self._params.max_chunk_bytes} a "
                "ciphertext of these parameters can take."
            )
        if view.nbytes <= _COUNT.size:
            raise CkksError(
                f"{what} is not a valid CKKS ciphertext for this context (truncated, corrupted "
                f"or made with other parameters): {view.nbytes} bytes."
            )
        return view[_COUNT.size :], view

    def _count(self, view: memoryview, *, expected_len: int | None, what: str) -> int:
        """A chunk's value count (its first 4 bytes), checked (after its ciphertext)."""
        (size,) = _COUNT.unpack_from(view)
        if expected_len is None:
            if not 1 <= size <= self.slots:
                raise CkksError(f"{what} carries {size} values; 1 to {self.slots} were expected.")
        elif size != expected_len:
            raise CkksError(f"{what} carries {size} values; {expected_len} were expected.")
        return size

    def _load_seal(self, body: memoryview, *, what: str) -> Any:
        path = self._path()
        with open(path, "wb") as f:
            f.write(body)
        ct = sealapi.Ciphertext(self.seal)
        try:
            ct.load(self.seal, path)  # SEAL checks the header, sizes and every coefficient < q
        except Exception as exc:  # SEAL raises ValueError, RuntimeError, IOError...
            raise CkksError(
                f"{what} is not a valid CKKS ciphertext for this context "
                f"(truncated, corrupted or made with other parameters): {exc}."
            ) from exc
        finally:
            _unlink_quietly(path)
        return ct

    def load_all(self, packed: PackedCiphertexts, *, what: str) -> list[Any]:
        self.check_layout(packed, what=what)
        return [
            self.load(
                chunk,
                expected_len=_chunk_length(i, packed.length, self.slots),
                what=f"{what} chunk {i}",
            )[0]
            for i, chunk in enumerate(packed.chunks)
        ]


_COUNT = struct.Struct("<I")
_RAW_MAGIC = b"CKR1"  # SEAL's own serialisation starts with 0x5E 0xA1, never with these
_RAW_COEFF_MAGIC = b"CKC1"
_ENCODING_OF_MAGIC = {_RAW_MAGIC: ENCODING_SLOTS, _RAW_COEFF_MAGIC: ENCODING_COEFFICIENTS}


class _CoefficientAccess:
    """A NumPy view of a SEAL ciphertext's coefficient buffer, found through the memory layout
    of the pybind11 object (the C++ pointer right after the Python object header) and of
    ``seal::Ciphertext`` (SEAL 4.x: parms_id, is_ntt_form, size, degree, prime count, scale,
    correction factor, then a DynArray whose data pointer follows its pool, capacity and size).

    :meth:`probe` checks every field of that layout against SEAL's own accessors on a real
    ciphertext, and a sample of the coefficients against ``dyn_array().at``, before the codec
    relies on it; :meth:`view` re-checks size, degree, prime count and buffer size on every
    call, so a view never covers memory that is not the ciphertext's coefficients.
    """

    _WORDS = 15  # the Ciphertext fields read, in 64-bit words

    def __init__(self, *, degree: int, primes: int) -> None:
        self._degree = degree
        self._primes = primes

    @staticmethod
    def _words(ct: Any) -> Any:
        base = ctypes.c_void_p.from_address(id(ct) + _PYBIND_VALUE_OFFSET).value
        if not base or base % 8:
            raise RuntimeError("no aligned C++ object pointer where pybind11 keeps it")
        return (ctypes.c_uint64 * _CoefficientAccess._WORDS).from_address(base)

    @classmethod
    def probe(cls, ct: Any, *, degree: int, primes: int) -> _CoefficientAccess | None:
        """The accessor if ``ct`` (a fresh encryption) shows the expected layout, else None."""
        try:
            if type(ct).__basicsize__ < _PYBIND_VALUE_OFFSET + 8:
                return None
            w = cls._words(ct)
            size = int(ct.size())
            expected = {
                **{i: v for i, v in enumerate(ct.parms_id())},
                5: size,
                6: degree,
                7: primes,
                8: struct.unpack("<Q", struct.pack("<d", ct.scale))[0],
                13: size * primes * degree,
            }
            if any(int(w[i]) != int(v) for i, v in expected.items()):
                return None
            if (int(w[4]) & 0xFF) != int(ct.is_ntt_form()) or int(w[12]) < int(w[13]):
                return None
            access = cls(degree=degree, primes=primes)
            flat = access.view(ct).reshape(-1)
            dyn = ct.dyn_array()
            n = flat.size
            sample = sorted({0, 1, degree - 1, degree, n // 2, n - 2, n - 1})
            if any(int(flat[i]) != int(dyn.at(i)) for i in sample):
                return None
            return access
        except Exception:  # any surprise in the layout means: do not use it
            return None

    def view(self, ct: Any) -> np.ndarray:
        """The coefficients of ``ct`` as a writable (size, primes, degree) uint64 view."""
        w = self._words(ct)
        size = int(w[5])
        if (
            size != ct.size()
            or w[6] != self._degree
            or w[7] != self._primes
            or w[13] != size * self._primes * self._degree
            or not w[14]
        ):
            raise RuntimeError("a SEAL ciphertext does not have the layout the codec checked")
        count = int(w[13])
        buffer = (ctypes.c_uint64 * count).from_address(int(w[14]))
        return np.ctypeslib.as_array(buffer).reshape(size, self._primes, self._degree)


class _ZeroMaker:
    """Public-key encryptions of zero for a one-prime context without a special prime, made
    here with SEAL's own transforms and products: ``(pk0 * u + e0, pk1 * u + e1) mod q``, with
    ``u`` uniform in {-1, 0, 1} and ``e0, e1`` SEAL's centered binomial errors (the ones in 21
    bits minus those in 21 others: standard deviation 3.24), every coefficient drawn from
    ``crypto.prg.random_uint64`` (AES-CTR keyed from the OS). That is SEAL's
    ``encrypt_zero_asymmetric`` at the key level (the same distributions, the same ring
    products, the decryptions' noise the same: tests compare them), which samples coefficient
    by coefficient through a virtual call each and transforms five polynomials; here the
    coefficients are drawn in bulk, ``u`` is transformed forward once (as both polynomials of a
    scratch ciphertext: SEAL transforms ciphertexts only, and refuses transparent ones),
    multiplied by the public key (``Evaluator.multiply`` of the two in NTT form, scale 1: its
    first and last polynomials are ``pk0 * u`` and ``pk1 * u``) and transformed back, in about
    half the time (0.37 against 0.68 ms at degree 4096, SEAL's zero brought out of NTT form). The
    zero is returned as (2, 1, degree) coefficients, the coefficient encoding's form."""

    def __init__(self, codec: _CkksCodec, public_key: Any) -> None:
        self._codec = codec
        self._q = codec._moduli[0]
        self._degree = codec.params.poly_modulus_degree
        pk = codec._ntt_blank()  # the key as a two-polynomial NTT-form ciphertext of scale 1
        codec._access.view(pk)[...] = codec._access.view(public_key.data())
        pk.scale = 1.0
        self._pk = pk

    def make(self, blank: Any) -> np.ndarray:
        """A fresh encryption of zero, (2, 1, degree) coefficients; ``blank`` is a scratch
        ciphertext of the context in coefficient form (used up)."""
        codec, n, q = self._codec, self._degree, self._q
        words = random_uint64(2 * n + _ternary_words(n))
        u = ternary_residues(words[2 * n :].view(np.uint8), n, q)
        view = codec._access.view(blank)  # (2, 1, degree)
        view[0, 0] = u
        view[1, 0] = u
        blank.scale = 1.0
        codec.evaluator.transform_to_ntt_inplace(blank)
        products = sealapi.Ciphertext(codec.seal)
        codec.evaluator.multiply(self._pk, blank, products)  # (pk0 u, (pk0 + pk1) u, pk1 u)
        made = codec._access.view(products)
        view[0], view[1] = made[0], made[2]
        codec.evaluator.transform_from_ntt_inplace(blank)
        out = np.array(view, dtype=np.uint64)
        add_cbd_errors(out[:, 0, :], words[: 2 * n].reshape(2, n), q)
        return out


def _ternary_words(n: int) -> int:
    """Words of random bytes drawn for ``n`` ternary coefficients: one byte each, a byte of
    255 rejected (1 in 256), and 1024 bytes to spare (more rejections than that at degree
    4096: below 2^-4000)."""
    return (n + 1024 + 7) // 8


def ternary_residues(random_bytes: np.ndarray, n: int, q: int) -> np.ndarray:
    """``n`` coefficients uniform in {-1, 0, 1} (``b mod 3 - 1`` of the uniform bytes below
    255: no bias), as residues mod ``q`` (``-1`` is ``q - 1``); more bytes are drawn in the
    (astronomically rare) case the given ones do not hold ``n`` below 255."""
    kept = random_bytes[random_bytes < 255]
    while kept.size < n:
        more = random_uint64(max(n // 8, 16)).view(np.uint8)
        kept = np.concatenate([kept, more[more < 255]])
    r = kept[:n] % np.uint8(3)  # 0, 1, 2 -> -1, 0, 1
    return np.where(r == 0, np.uint64(q - 1), r.astype(np.uint64) - np.uint64(1))


_CBD_BITS = np.uint64((1 << 21) - 1)


def add_cbd_errors(coefficients: np.ndarray, words: np.ndarray, q: int) -> None:
    """Add SEAL's error to residues mod ``q`` in place, from uniform 64-bit ``words`` (one a
    coefficient): the ones in 21 bits minus the ones in 21 others (a centered binomial in
    [-21, 21] of variance 21/2), reduced mod ``q`` (``q`` above 2^22)."""
    qq = np.uint64(q)
    plus = np.bitwise_count(words & _CBD_BITS)
    minus = np.bitwise_count((words >> np.uint64(21)) & _CBD_BITS)
    coefficients += plus  # below q + 21
    coefficients += qq - minus.astype(np.uint64)  # below 2q + 21, at least q - 21
    for _ in range(2):  # c - q wraps above 2^63 where c < q: the minimum is c mod q
        np.minimum(coefficients, coefficients - qq, out=coefficients)


# pybind11's instance: PyObject header (refcount, type), then the pointer to the C++ value
_PYBIND_VALUE_OFFSET = 16


def _unlink_quietly(path: str) -> None:
    # a scratch file lives only for one save or load: nothing is left behind, even on a kill
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


# SEAL's error distribution: by default (no SEAL_USE_GAUSSIAN_NOISE) a centered binomial of
# variance 21/2, standard deviation 3.24 (SEAL's nominal Gaussian has 3.2)
_SEAL_ERROR_STD = math.sqrt(21.0 / 2.0)


#: Per-value probability that a decryption error exceeds :func:`error_bound`.
ERROR_BOUND_TAIL = 2.0**-40


def _tail_multiple(tail: float) -> float:
    """The k with (1 + k) exp(-2k) = tail: the two-sided tail of a sum of two independent
    Laplace variables of total standard deviation 1 (see :func:`error_bound`)."""
    k = 1.0
    for _ in range(200):  # a contraction: the derivative is 1 / (2 (1 + k)) < 1
        k = 0.5 * math.log((1.0 + k) / tail)
    return k


_ERROR_BOUND_STDS = _tail_multiple(ERROR_BOUND_TAIL)  # about 15.3
# a (sub-)Gaussian's two-sided tail 2 exp(-k^2 / 2) = ERROR_BOUND_TAIL: about 7.5
_COEFFICIENT_BOUND_STDS = math.sqrt(2.0 * math.log(2.0 / ERROR_BOUND_TAIL))


def _error_bound_units(degree: int, terms: int, encoding: str) -> float:
    """:func:`error_bound` times the scale."""
    terms = max(int(terms), 1)
    if encoding == ENCODING_COEFFICIENTS:
        std = _SEAL_ERROR_STD * math.sqrt(terms * (4.0 * degree / 3.0 + 1.0))
        return _COEFFICIENT_BOUND_STDS * std
    std = degree * _SEAL_ERROR_STD * math.sqrt(2.0 / 3.0) * math.sqrt(terms)
    return _ERROR_BOUND_STDS * std


def error_bound(params: CkksParams, *, terms: int = 1) -> float:
    """A bound on the absolute decryption error of one value of a sum of `terms` fresh
    public-key encryptions made at the data level (no special prime), exceeded with probability
    at most :data:`ERROR_BOUND_TAIL` per value; a special prime only makes the error smaller.

    The error of the sum is ``e * U + s * E + E'`` with the public key's error ``e``, the
    secret ``s``, ``U`` the sum of the ``terms`` ternary encryption masks and ``E``, ``E'``
    sums of fresh Gaussian errors. In a slot (the polynomial evaluated at a root of unity) each
    product is a product of two independent complex Gaussians, so the real and the imaginary
    part (each carries one value) of each product are Laplace distributed; the two products
    have equal variance, ``N**2 * sigma**2 * terms / 3`` each per part (``E'`` adds 1/N of
    that), so a value's error has standard deviation ``N * sigma * sqrt(2 * terms / 3)``
    divided by the scale and the tail ``(1 + k) * exp(-2k)`` beyond k of them. The bound is
    ``k`` ~ 15.3 of them. Measured: the standard deviation is within 3% of that (a Gaussian
    tail bound of 6 would be exceeded about once in 10^6 values); see
    tests/crypto/test_ckks_noise.py.

    In the coefficient encoding (one data prime, :attr:`CkksParams.encoding`) a value is one
    coefficient of the same error polynomial: each of ``e * U`` and ``s * E`` is a sum of N
    products of a fixed key coefficient and a fresh small one (variance ``N sigma^2 2 terms /
    3`` each), ``E'`` adds ``terms sigma^2``, so the standard deviation is ``sigma * sqrt(terms
    * (4N/3 + 1))`` over the scale, about sqrt(N/2) times below the slots'. For a fixed key
    pair the sum is sub-Gaussian with about that variance, and the bound is the Gaussian tail's
    ``sqrt(2 ln(2 / tail))`` ~ 7.5 of them (measured in the same test file).
    """
    units = _error_bound_units(params.poly_modulus_degree, terms, params.encoding)
    return units / 2.0**params.scale_bits


def csprng_normal(shape: tuple[int, ...]) -> np.ndarray:
    """Standard normal float64 values from a cryptographic generator (``crypto.prg``'s
    ``random_uint64``: AES-128-CTR keyed by os.urandom): Marsaglia's polar method on 53-bit
    uniforms (a pair (x, y) in the unit disc gives two independent normals x f and y f,
    f = sqrt(-2 ln s / s), s = x^2 + y^2; pairs outside are drawn again), which needs no
    trigonometry (a third less CPU than Box-Muller for a batch's values)."""
    n = math.prod(shape)
    out = np.empty(n, dtype=np.float64)
    filled = 0
    while filled < n:
        pairs = (n - filled + 1) // 2
        pairs += pairs // 3 + 8  # pi/4 of the pairs land in the disc: one round nearly always
        u = (random_uint64(2 * pairs) >> np.uint64(11)).astype(np.float64)
        u *= 2.0**-52
        u -= 1.0  # uniform on [-1, 1)
        x, y = u[0::2], u[1::2]
        s = x * x + y * y
        inside = (s > 0.0) & (s < 1.0)
        x, y, s = x[inside], y[inside], s[inside]
        f = np.sqrt(-2.0 * np.log(s) / s)
        z = np.concatenate([x * f, y * f])
        take = min(z.size, n - filled)
        out[filled : filled + take] = z[:take]
        filled += take
    return out.reshape(shape)


@dataclass(frozen=True)
class DecryptionRelease:
    """How decrypted values are released by the key holder: flooded with Gaussian noise of
    standard deviation ``2**flood_bits * error_bound`` (CSPRNG-seeded), then rounded to
    ``2**-precision_bits``. See the module docstring for what this protects and what not."""

    precision_bits: int = 20
    flood_bits: int = 10

    def __post_init__(self) -> None:
        if not 8 <= self.precision_bits <= 40 or not 0 <= self.flood_bits <= 40:
            raise ValueError(
                f"precision_bits must be in [8, 40] and flood_bits in [0, 40], got "
                f"{self.precision_bits}, {self.flood_bits}"
            )

    def flood_std(self, params: CkksParams, *, terms: int) -> float:
        return 2.0**self.flood_bits * error_bound(params, terms=terms)

    def apply(
        self,
        values: np.ndarray,
        params: CkksParams,
        *,
        terms: int,
        normals: np.ndarray | None = None,
    ) -> np.ndarray:
        """``values`` flooded and rounded. ``normals``: standard normal values of
        ``csprng_normal`` made ahead for this release (each used for one release only), else
        drawn now."""
        std = self.flood_std(params, terms=terms)
        if normals is None or normals.size != values.size:
            normals = csprng_normal(values.shape)
        noisy = values + std * normals.reshape(values.shape)
        grid = 2.0**self.precision_bits
        return np.round(noisy * grid) / grid


class CkksKeyHolder:
    """The active party's side: owns the secret key and decrypts sums.

    Creates a fresh key pair on construction. Only :meth:`public_context_bytes` ever leaves
    this object; the secret key is never serialized by this class.
    """

    def __init__(self, *, params: CkksParams = DEFAULT_CKKS_PARAMS) -> None:
        """Create a CKKS context for ``params``; refuses invalid or sub-128-bit parameters.
        Reads chunks in either wire format (it writes none)."""
        if not isinstance(params, CkksParams):
            raise TypeError(f"params must be CkksParams, got {type(params).__name__}.")
        params.validate()
        parms = _encryption_parameters(params)
        setup = _SealSetup(parms, params)
        public_key = sealapi.PublicKey()
        if params.special_prime:
            keygen = sealapi.KeyGenerator(setup.enc)
            secret_key = keygen.secret_key()
        else:
            # the secret at seal's key level (it decrypts there), and the same secret at enc's
            # key level, where the public key is made (see _SealSetup)
            secret_key = sealapi.KeyGenerator(setup.seal).secret_key()
            keygen = sealapi.KeyGenerator(setup.enc, setup.data_secret_key(secret_key))
        keygen.create_public_key(public_key)
        setup.public_key = public_key
        self._codec = _CkksCodec(setup, wire=None)
        self._decryptor = sealapi.Decryptor(setup.seal, secret_key)
        # the coefficient encoding decrypts raw chunks with the secret as a plaintext
        # (_CkksCodec.decrypt_coefficients); it never leaves this object either
        self._secret_plain: Any = None
        if params.encoding == ENCODING_COEFFICIENTS:
            self._secret_plain = setup.data_secret_plain(secret_key)
        self._public_bytes = _pack_public(
            [
                (_TAG_META, _META.pack(params.scale_bits, int(params.special_prime))),
                (_TAG_PARMS, _seal_save(parms.save)),
                (_TAG_PUBLIC_KEY, _seal_save(public_key.save)),
            ]
        )
        self._check_key_pair()

    def _check_key_pair(self) -> None:
        # the exported public key must encrypt to the kept secret key: a test value round trip
        # values within what a sum may hold: the coefficient encoding wraps anything beyond
        probe = np.linspace(-0.5, 0.5, 8) * min(2.0**self.params.magnitude_bits, 8.0)
        ct = self._codec.encrypt_values(probe, self._codec.zero(self._codec._setup.encryptor()))
        if isinstance(ct, np.ndarray):  # coefficients (see `_CkksCodec.zero`)
            ct = self._codec.ciphertext_of(ct)
        decrypted = self._codec.decrypt_values(ct, self._decryptor, probe.size)
        error = float(np.max(np.abs(decrypted - probe)))
        if not error < 1e3 * error_bound(self.params):
            raise CkksError(f"the new key pair does not decrypt its own encryption ({error:g}).")

    @property
    def params(self) -> CkksParams:
        """The parameters of this key pair."""
        return self._codec.params

    @property
    def slots(self) -> int:
        """Values per ciphertext chunk."""
        return self._codec.slots

    @property
    def context_fingerprint(self) -> str:
        """SHA-256 of :meth:`public_context_bytes` (see :func:`context_fingerprint`)."""
        return context_fingerprint(self._public_bytes)

    def public_context_bytes(self) -> bytes:
        """The public context: parameters, scale and public key only.

        Promises: no secret key, no Galois keys, no relinearisation keys.
        """
        return self._public_bytes

    def decrypt_sum(
        self,
        packed: PackedCiphertexts,
        *,
        shape: tuple[int, ...],
        release: DecryptionRelease | None = None,
        terms: int = 1,
        normals: np.ndarray | None = None,
    ) -> np.ndarray:
        """Decrypt a (summed) packed ciphertext into a float64 array of ``shape``; with a
        `release`, flooded and rounded for a sum of `terms` ciphertexts (what may leave the key
        holder), with `normals` made ahead if given (see :meth:`DecryptionRelease.apply`).
        Without one, the raw decryption (CKKS noise of about 1e-8 at the defaults), which must
        stay with the key holder.

        Refuses with :class:`CkksError`: a shape whose size differs from ``packed.length``,
        a wrong chunk count, and any chunk that fails the checks of the module docstring.
        """
        shape = tuple(shape)
        if not all(isinstance(d, int | np.integer) and d >= 0 for d in shape):
            raise CkksError(f"shape must be a tuple of non-negative ints, got {shape!r}.")
        size = math.prod(shape)
        if size != packed.length:
            raise CkksError(
                f"shape {shape} has {size} values but the ciphertexts carry {packed.length}."
            )
        out = np.empty(size, dtype=np.float64)
        coefficients = self._raw_sum(packed)
        if coefficients is not None:
            self._codec.decrypt_coefficients(coefficients, self._secret_plain, out)
            if release is not None:
                out = release.apply(out, self.params, terms=terms, normals=normals)
            return out.reshape(shape)
        ciphertexts = self._codec.load_all(packed, what="sum")
        for i, ct in enumerate(ciphertexts):
            start = i * self.slots
            count = _chunk_length(i, size, self.slots)
            out[start : start + count] = self._codec.decrypt_values(ct, self._decryptor, count)
        if release is not None:
            out = release.apply(out, self.params, terms=terms, normals=normals)
        return out.reshape(shape)

    def _raw_sum(self, packed: PackedCiphertexts) -> list[np.ndarray] | None:
        """The checked coefficients of every chunk of a sum (:meth:`_CkksCodec.
        load_coefficients`: every check of a load) where the coefficient encoding can decrypt
        them without SEAL ciphertexts; None where a chunk is in SEAL's format (then the chunks
        are loaded as ciphertexts)."""
        codec = self._codec
        if self._secret_plain is None:
            return None
        codec.check_layout(packed, what="sum")
        chunks = []
        for i, chunk in enumerate(packed.chunks):
            loaded = codec.load_coefficients(
                chunk,
                expected_len=_chunk_length(i, packed.length, self.slots),
                what=f"sum chunk {i}",
            )
            if loaded is None:
                return None
            chunks.append(loaded[0])
        return chunks


class CkksPublic:
    """Parties' and aggregator's side: only the public context; can encrypt and add.

    Refuses, with :class:`CkksError`, a context that carries a secret key, lacks a public
    key, is not CKKS, is malformed or truncated (including a TenSEAL context, the format of
    earlier versions), or has parameters below 128-bit security. Cannot decrypt.
    """

    def __init__(self, *, context_bytes: bytes, wire: str | None = None) -> None:
        """Load the key holder's exported public context (see class docstring for refusals).

        ``wire``: the format this side writes, :data:`WIRE_RAW` or :data:`WIRE_SEAL`; None
        takes ``$SECUREVFL_CKKS_WIRE``, else raw (seal where this binding's layout cannot be
        read: see :attr:`wire_format`). Chunks in either format are always accepted.
        """
        if not isinstance(context_bytes, bytes | bytearray | memoryview):
            raise CkksError(
                f"context_bytes is a {type(context_bytes).__name__}, not bytes; pass what "
                "CkksKeyHolder.public_context_bytes() returned."
            )
        context_bytes = bytes(context_bytes)
        sections = _unpack_public(context_bytes)
        if _TAG_SECRET_KEY in sections:
            raise CkksError(
                "this context carries a secret key; the key holder must export only the "
                "public part (CkksKeyHolder.public_context_bytes())."
            )
        unknown = sorted(set(sections) - {_TAG_META, _TAG_PARMS, _TAG_PUBLIC_KEY})
        if unknown:
            raise CkksError(
                f"the context bytes could not be parsed: unknown sections {unknown}; a public "
                "context carries only parameters and a public key."
            )
        if _TAG_PARMS not in sections or _TAG_META not in sections:
            raise CkksError("the context bytes could not be parsed: no encryption parameters.")
        if _TAG_PUBLIC_KEY not in sections:
            raise CkksError("this context has no public key, so nothing can be encrypted.")
        parms = sealapi.EncryptionParameters(sealapi.SCHEME_TYPE.CKKS)
        try:
            _seal_load(parms.load, sections[_TAG_PARMS])
        except Exception as exc:  # SEAL raises several types for bad headers and sizes
            raise CkksError(f"the context bytes could not be parsed: {exc}.") from exc
        params = _params_from(parms, sections[_TAG_META])
        try:
            params.validate()
        except ValueError as exc:
            raise CkksError(f"the received context is refused: {exc}") from exc
        setup = _SealSetup(parms, params)
        public_key = sealapi.PublicKey()
        try:
            _seal_load(lambda path: public_key.load(setup.enc, path), sections[_TAG_PUBLIC_KEY])
        except Exception as exc:  # SEAL checks the key's parms_id and every coefficient
            raise CkksError(
                f"the context's public key could not be parsed for its parameters: {exc}."
            ) from exc
        setup.public_key = public_key
        self._codec = _CkksCodec(setup, wire=wire)
        self._encryptor = setup.encryptor()
        self._fingerprint = context_fingerprint(context_bytes)
        # encryptions of zero (any chunk can use any of them), each to be used once
        self._zeros: list[Any] = []
        self._zero_source: Any = None  # a crypto.ckks_zeros.ZeroSource, read after _zeros

    @property
    def params(self) -> CkksParams:
        """The parameters read from the received context."""
        return self._codec.params

    @property
    def slots(self) -> int:
        """Values per ciphertext chunk."""
        return self._codec.slots

    @property
    def context_fingerprint(self) -> str:
        """SHA-256 of the context bytes this object was built from."""
        return self._fingerprint

    @property
    def wire_format(self) -> str:
        """The chunk format :meth:`encrypt` and :meth:`add` write (``raw`` or ``seal``)."""
        return self._codec.wire

    def packed_from_frames(
        self, frames: Sequence[bytes | bytearray | memoryview]
    ) -> PackedCiphertexts:
        """Rebuild a contribution whose value count the receiver (the aggregator) does not know.

        The length is read from the frames: ``slots`` per chunk, except the last chunk, which
        is loaded and checked to learn its value count. That length is only the sender's
        claim: :meth:`add` then checks every contributor against it, and the key holder checks
        the sum against the true shape at decryption. Refuses what
        :meth:`PackedCiphertexts.from_frames` refuses, and a last chunk that fails to load.
        """
        packed = PackedCiphertexts.from_frames(frames, length=0)
        if not packed.chunks:
            return packed
        last = len(packed.chunks) - 1
        _, count = self._codec.load(packed.chunks[last], expected_len=None, what=f"chunk {last}")
        packed.length = last * self.slots + count
        return packed

    def attach_zero_source(self, source: Any) -> None:
        """Let :meth:`encrypt` take encryptions of zero from ``source`` (an object whose
        ``take()`` returns a fresh one or None, e.g. :class:`crypto.ckks_zeros.ZeroSource`)
        when none prepared in process is ready; None detaches it."""
        self._zero_source = source

    def _take_zero(self) -> Any | None:
        """A fresh encryption of zero, removed from where it was kept (so never handed out
        twice), or None when none is ready."""
        if self._zeros:
            return self._zeros.pop()
        if self._zero_source is not None:
            return self._zero_source.take()
        return None

    def keep_source_zeros(self, count: int) -> int:
        """Move up to `count` encryptions of zero that the attached source has ready into the
        prepared ones (each read from the source once, so still used once); returns how many.
        Never waits: a source with none ready gives none."""
        kept = 0
        while self._zero_source is not None and kept < count:
            if len(self._zeros) >= MAX_PREPARED_ZEROS:
                break
            ct = self._zero_source.take()
            if ct is None:
                break
            self._zeros.append(ct)
            kept += 1
        return kept

    @property
    def prepared_zeros(self) -> int:
        """How many encryptions of zero are ready for :meth:`encrypt`."""
        return len(self._zeros)

    @property
    def ready_zeros(self) -> int:
        """How many prepared encryptions of zero are waiting to be used."""
        return len(self._zeros)

    def prepare_zeros(self, length: int) -> None:
        """Precompute the encryptions of zero that an :meth:`encrypt` of ``length`` values will
        use (one per chunk), so that call only encodes, adds and serialises.

        Call it off the critical path: SEAL holds the GIL, so from a thread it overlaps with
        waiting (on the network), not with other computation. Refuses a negative length and
        more than :data:`MAX_PREPARED_ZEROS` ready ciphertexts (CkksError).
        """
        if isinstance(length, bool) or not isinstance(length, int | np.integer) or length < 0:
            raise CkksError(f"length must be a non-negative int, got {length!r}.")
        count = _num_chunks(int(length), self.slots)
        if len(self._zeros) + count > MAX_PREPARED_ZEROS:
            raise CkksError(
                f"{len(self._zeros)} encryptions of zero are ready and {count} more would pass "
                f"the limit of {MAX_PREPARED_ZEROS}; encrypt first."
            )
        for _ in range(count):
            self._zeros.append(self._codec.zero(self._encryptor))

    def encrypt(self, x: Any, *, max_abs: float | None = None) -> PackedCiphertexts:
        """Encrypt an array: flattened (C order) into chunks of ``slots`` values each, two
        values per complex slot.

        A chunk uses a prepared encryption of zero when one is ready (see
        :meth:`prepare_zeros`, then :meth:`attach_zero_source`), else encrypts afresh: the
        same distribution either way (SEAL's encryption is an encryption of zero plus the
        plaintext). Refuses with
        :class:`CkksError` non-numeric or non-finite input and values beyond
        ``2**params.magnitude_bits`` (too large for a sum to decrypt). An empty array gives
        zero chunks. ``max_abs``: ``max |x|`` of exactly this input where the caller has it
        already (NaN where it holds a NaN), which saves a pass over the values.
        """
        try:
            flat = np.asarray(x, dtype=np.float64).reshape(-1)
        except (TypeError, ValueError) as exc:
            raise CkksError(f"cannot encrypt this input as float64 values: {exc}.") from exc
        if max_abs is None:
            max_abs = float(np.max(np.abs(flat))) if flat.size else 0.0
        if not math.isfinite(max_abs):  # NaN and infinities carry into the maximum
            raise CkksError("cannot encrypt NaN or infinite values; check the contribution.")
        limit = 2.0**self.params.magnitude_bits
        if max_abs >= limit:
            raise CkksError(
                f"values are too large: max |x| {max_abs:g} reaches "
                f"2^{self.params.magnitude_bits}, beyond which a sum no longer decrypts with "
                f"these parameters; choose parameters for a larger magnitude (choose_params)."
            )
        chunks: list[bytes] = []
        for start in range(0, flat.size, self.slots):
            values = flat[start : start + self.slots]
            try:
                ct = self._take_zero()  # used once: a reused zero would leak differences
                if ct is None:
                    ct = self._codec.zero(self._encryptor)
                ct = self._codec.encrypt_values(values, ct)
            except (ValueError, RuntimeError) as exc:  # "encoded values are too large"
                raise CkksError(f"cannot encrypt values starting at index {start}: {exc}.") from exc
            chunks.append(self._codec.dump(ct, values.size))
        return PackedCiphertexts(chunks=chunks, length=int(flat.size))

    def load_contribution(self, frames: Sequence[bytes | bytearray | memoryview]) -> list[Any]:
        """Parse and check every chunk of one contributor's frames (for an aggregator that
        validates each contribution as it arrives, so a malformed one is rejected alone).
        Returns loaded chunks for :meth:`add_loaded`; refuses like :meth:`add`. Each chunk is
        parsed once: every chunk but the last must be full, the last carries 1 to ``slots``
        values (the length is the sender's claim, checked against the others' by
        :meth:`add_loaded` and against the true shape by the key holder)."""
        packed = PackedCiphertexts.from_frames(frames, length=0)
        last = len(packed.chunks) - 1
        return [
            self._load_any(c, expected_len=None if i == last else self.slots, what=f"chunk {i}")
            for i, c in enumerate(packed.chunks)
        ]

    def _load_any(self, data: bytes, *, expected_len: int | None, what: str) -> tuple[Any, int]:
        """A chunk as its coefficients (a raw chunk, which the sum never hands to SEAL: adding
        is a modular addition of coefficients) or as a SEAL ciphertext (SEAL's format)."""
        loaded = self._codec.load_coefficients(data, expected_len=expected_len, what=what)
        if loaded is not None:
            return loaded
        return self._codec.load(data, expected_len=expected_len, what=what)

    def _summed(self, chunks: list[list[tuple[Any, int]]]) -> list[bytes]:
        """The chunk-wise sums of contributions loaded by :meth:`_load_any`, serialised.
        Coefficients are added modulo each prime (what SEAL's add does on ciphertexts at one
        level and scale, all checked on load); a chunk in SEAL's format among them makes the
        sum of that chunk SEAL's."""
        out = []
        for parts in zip(*chunks, strict=True):
            count = parts[0][1]
            items = [item for item, _ in parts]
            if all(isinstance(item, np.ndarray) for item in items):
                total = items[0]
                for other in items[1:]:
                    self._codec.add_coefficients(total, other)
                out.append(self._codec.dump_coefficients(total, count))
                continue
            cts = [
                self._codec.ciphertext_of(item) if isinstance(item, np.ndarray) else item
                for item in items
            ]
            for ct in cts[1:]:
                self._codec.evaluator.add_inplace(cts[0], ct)
            out.append(self._codec.dump(cts[0], count))
        return out

    def add_loaded(self, contributions: Sequence[list[Any]]) -> PackedCiphertexts:
        """Sum contributions already loaded by :meth:`load_contribution` (consumes them)."""
        if not contributions:
            raise CkksError("add needs at least one contribution, got none.")
        sizes = [[count for _, count in c] for c in contributions]
        if any(s != sizes[0] for s in sizes):
            raise CkksError(
                "contributions to one sum must have the same chunk layout; "
                f"got value counts {sizes}."
            )
        return PackedCiphertexts(
            chunks=self._summed(list(contributions)), length=int(sum(sizes[0]))
        )

    def add(self, contributions: Sequence[PackedCiphertexts]) -> PackedCiphertexts:
        """Homomorphic sum of the contributions, chunk by chunk.

        Adds in place on the first contribution's ciphertext and serializes once per chunk.
        Refuses with :class:`CkksError`: no contributions, different lengths, wrong chunk
        counts, and any chunk that fails the checks of the module docstring (naming the
        contributor and chunk). The minimum group size is the caller's rule, not checked here.
        """
        contributions = list(contributions)
        if not contributions:
            raise CkksError("add needs at least one contribution, got none.")
        length = contributions[0].length if isinstance(contributions[0], PackedCiphertexts) else 0
        for k, packed in enumerate(contributions):
            self._codec.check_layout(packed, what=f"contribution {k}")
            if packed.length != length:
                raise CkksError(
                    f"contribution {k} carries {packed.length} values but contribution 0 "
                    f"carries {length}; all contributions to one sum must have the same length."
                )
        loaded = [
            [
                self._load_any(
                    chunk,
                    expected_len=_chunk_length(i, length, self.slots),
                    what=f"contribution {k} chunk {i}",
                )
                for i, chunk in enumerate(packed.chunks)
            ]
            for k, packed in enumerate(contributions)
        ]
        return PackedCiphertexts(chunks=self._summed(loaded), length=length)
