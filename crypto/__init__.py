"""Cryptographic building blocks of securevfl: fixed point, keystreams, key agreement, masking.

NumPy and ``cryptography`` only; this package never imports torch, ZeroMQ, ``transport`` or
``securevfl``. The CKKS backend lives in ``crypto.ckks`` and is imported from there.
"""

from crypto.fixedpoint import FixedPointEncoder, FixedPointOverflow, SumDidNotCancel
from crypto.keys import MaskingKeyPair, pair_key
from crypto.masking import (
    MaskCallDomain,
    MaskDomain,
    MaskedSumAggregator,
    MaskedSumParty,
    MissingContributorError,
    decode_sum,
)
from crypto.prg import Keystream, keystream_uint64, mask_key, stream_nonce

__all__ = [
    "FixedPointEncoder",
    "FixedPointOverflow",
    "Keystream",
    "MaskCallDomain",
    "MaskDomain",
    "MaskedSumAggregator",
    "MaskedSumParty",
    "MaskingKeyPair",
    "MissingContributorError",
    "SumDidNotCancel",
    "decode_sum",
    "keystream_uint64",
    "mask_key",
    "pair_key",
    "stream_nonce",
]
