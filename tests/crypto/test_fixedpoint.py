"""Fixed-point encoding into Z_2^64: round trip, overflow, NaN/inf, sums of terms."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from crypto.fixedpoint import (
    ENCODE_CHUNK_WORDS,
    FixedPointEncoder,
    FixedPointOverflow,
    SumDidNotCancel,
)


@settings(max_examples=60, deadline=None)
@given(
    frac_bits=st.integers(min_value=0, max_value=40),
    data=st.data(),
)
def test_round_trip_error_is_at_most_one_resolution_step(frac_bits: int, data) -> None:
    bound = 2.0 ** min(20, 62 - frac_bits)
    encoder = FixedPointEncoder(frac_bits=frac_bits, bound=bound)
    x = data.draw(
        hnp.arrays(
            np.float64,
            hnp.array_shapes(min_dims=0, max_dims=3, min_side=0, max_side=6),
            elements=st.floats(-bound, bound, allow_nan=False),
        )
    )
    decoded = encoder.decode(encoder.encode(x))
    assert decoded.shape == x.shape
    assert decoded.dtype == np.float64
    assert np.all(np.abs(decoded - x) <= 2.0**-frac_bits)


def test_encoding_is_twos_complement_of_the_rounded_scaled_value() -> None:
    encoder = FixedPointEncoder(frac_bits=20)
    encoded = encoder.encode(np.array([1.0, -1.0, 0.0, -(2.0**-21) * 3]))
    assert encoded.dtype == np.uint64
    assert encoded.tolist() == [2**20, 2**64 - 2**20, 0, 2**64 - 2]


def test_negative_numbers_round_trip() -> None:
    encoder = FixedPointEncoder(frac_bits=16, bound=1000.0)
    x = -np.linspace(0.0, 1000.0, 1001)
    np.testing.assert_allclose(encoder.decode(encoder.encode(x)), x, atol=2.0**-17, rtol=0)


def test_float32_input_and_shape_are_preserved() -> None:
    encoder = FixedPointEncoder()
    x = np.random.default_rng(0).standard_normal((3, 4, 5)).astype(np.float32)
    encoded = encoder.encode(x)
    assert encoded.shape == (3, 4, 5)
    np.testing.assert_allclose(encoder.decode(encoded), x, atol=2.0**-20, rtol=0)


def test_integer_input_is_encoded_exactly() -> None:
    encoder = FixedPointEncoder()
    x = np.arange(-5, 6, dtype=np.int64)
    np.testing.assert_array_equal(encoder.decode(encoder.encode(x)), x)


def test_non_real_dtypes_are_refused() -> None:
    with pytest.raises(TypeError, match="real numbers"):
        FixedPointEncoder().encode(np.array([1 + 2j]))


def test_values_beyond_the_bound_are_refused_naming_max_value_bound_and_fix() -> None:
    encoder = FixedPointEncoder(bound=10.0)
    with pytest.raises(FixedPointOverflow, match=r"max \|value\| 12\.5 .*bound 10.*clip") as err:
        encoder.encode(np.array([1.0, -12.5, 11.0]))
    assert "frac_bits" in str(err.value)


def test_overflow_message_names_the_global_max_across_chunks() -> None:
    encoder = FixedPointEncoder(bound=10.0)
    x = np.zeros(3 * ENCODE_CHUNK_WORDS)
    x[5] = 11.0
    x[-1] = -99.0
    with pytest.raises(FixedPointOverflow, match=r"max \|value\| 99"):
        encoder.encode(x)


def test_clip_mode_clips_to_the_bound() -> None:
    encoder = FixedPointEncoder(bound=10.0, on_overflow="clip")
    x = np.array([1e300, -12.5, 3.25, -1e300])
    np.testing.assert_array_equal(encoder.decode(encoder.encode(x)), [10.0, -10.0, 3.25, -10.0])


@pytest.mark.parametrize("on_overflow", ["raise", "clip"])
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_nan_and_inf_are_refused_in_every_mode(on_overflow: str, bad: float) -> None:
    encoder = FixedPointEncoder(on_overflow=on_overflow)
    with pytest.raises(FixedPointOverflow, match="NaN or inf"):
        encoder.encode(np.array([0.0, bad, 1.0], dtype=np.float32))
    with pytest.raises(FixedPointOverflow, match="NaN or inf"):
        encoder.encode(np.float64(bad))


def test_a_bound_that_does_not_fit_the_word_is_refused() -> None:
    with pytest.raises(ValueError, match=r"does not fit.*43 integer bits"):
        FixedPointEncoder(frac_bits=20, bound=2.0**43)
    FixedPointEncoder(frac_bits=20, bound=2.0**43 - 2.0**-10)


@pytest.mark.parametrize(
    "kwargs",
    [{"frac_bits": -1}, {"frac_bits": 63}, {"bound": 0.0}, {"bound": np.inf}, {"on_overflow": "x"}],
)
def test_invalid_configurations_are_refused(kwargs: dict) -> None:
    with pytest.raises(ValueError):
        FixedPointEncoder(**kwargs)


def test_max_terms_is_the_largest_sum_that_cannot_wrap() -> None:
    encoder = FixedPointEncoder(frac_bits=20, bound=2.0**20)
    assert encoder.max_terms() == (2**63 - 1) // 2**40
    encoder.check_terms(encoder.max_terms())
    with pytest.raises(FixedPointOverflow, match="can exceed the 64-bit ring"):
        encoder.check_terms(encoder.max_terms() + 1)


def test_sum_of_max_terms_extreme_values_decodes_without_wrapping() -> None:
    encoder = FixedPointEncoder(frac_bits=20, bound=2.0**40)
    terms = encoder.max_terms()
    one = encoder.encode(np.array([2.0**40, -(2.0**40)]))
    total = np.zeros(2, dtype=np.uint64)
    for _ in range(terms):
        np.add(total, one, out=total)
    np.testing.assert_array_equal(
        encoder.decode(total, terms=terms), [terms * 2.0**40, -terms * 2.0**40]
    )


def test_decode_with_terms_accepts_sums_within_terms_times_bound() -> None:
    encoder = FixedPointEncoder(bound=1.0)
    total = encoder.encode(np.array([1.0])) + encoder.encode(np.array([1.0]))
    np.testing.assert_array_equal(encoder.decode(total, terms=2), [2.0])
    with pytest.raises(SumDidNotCancel, match="outside terms \\* bound"):
        encoder.decode(total, terms=1)


def test_decode_refuses_values_out_of_range() -> None:
    encoder = FixedPointEncoder(bound=1.0)
    garbage = np.array([2**20, 2**63, 2**64 - 1], dtype=np.uint64)
    with pytest.raises(SumDidNotCancel, match="did not cancel"):
        encoder.decode(garbage, terms=3)
    with pytest.raises(SumDidNotCancel):
        encoder.decode(np.array([2**63], dtype=np.uint64), terms=3)


def test_decode_refuses_too_many_terms_and_non_uint64() -> None:
    encoder = FixedPointEncoder()
    with pytest.raises(FixedPointOverflow, match="exceed the 64-bit ring"):
        encoder.decode(np.zeros(1, dtype=np.uint64), terms=encoder.max_terms() + 1)
    with pytest.raises(ValueError, match="positive int"):
        encoder.decode(np.zeros(1, dtype=np.uint64), terms=0)
    with pytest.raises(TypeError, match="uint64"):
        encoder.decode(np.zeros(1, dtype=np.int64))


def test_encode_into_out_reuses_the_buffer() -> None:
    encoder = FixedPointEncoder()
    out = np.empty(6, dtype=np.uint64)
    result = encoder.encode(np.ones((2, 3)), out=out)
    assert result.shape == (2, 3)
    assert np.shares_memory(result, out)
    with pytest.raises(ValueError, match="C-contiguous uint64"):
        encoder.encode(np.ones(6), out=np.empty(5, dtype=np.uint64))


def test_encode_and_decode_emit_no_numpy_warnings() -> None:
    encoder = FixedPointEncoder(on_overflow="clip")
    with np.errstate(all="raise"):
        encoded = encoder.encode(np.array([1e308, -1e308, 0.5]))
        wrapped = encoded + encoded + encoded
        encoder.decode(wrapped, terms=3)
