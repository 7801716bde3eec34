"""X25519 masking keys, pair-key agreement, mask keys and nonces, the AES-CTR keystream and CTR
done by hand on a reusable ECB context."""

from __future__ import annotations

import ast
import hashlib
import hmac
import os
import pathlib
import subprocess
import sys
import threading

import numpy as np
import pytest
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

from crypto.keys import MaskingKeyPair, pair_key
from crypto.prg import (
    KEYSTREAM_CHUNK_WORDS,
    MAX_FILL_WORDS,
    CounterStreams,
    Keystream,
    counter_blocks,
    keystream_uint64,
    mask_key,
    random_uint64,
    stream_nonce,
)

CRYPTO_DIR = pathlib.Path(__file__).resolve().parents[2] / "crypto"


def _pair(keys: dict[str, MaskingKeyPair], me: str, peer: str, session: bytes = b"s1") -> bytes:
    return pair_key(
        my_private=keys[me].private,
        peer_public=keys[peer].public,
        session=session,
        me=me,
        peer=peer,
    )


@pytest.fixture(scope="module")
def keys() -> dict[str, MaskingKeyPair]:
    return {name: MaskingKeyPair.generate() for name in ("alice", "bob", "carol")}


def test_generated_key_pair_is_x25519_from_cryptography() -> None:
    keypair = MaskingKeyPair.generate()
    assert len(keypair.private) == 32 and len(keypair.public) == 32
    derived = X25519PrivateKey.from_private_bytes(keypair.private).public_key()
    assert derived.public_bytes_raw() == keypair.public
    assert MaskingKeyPair.generate().private != keypair.private


def test_key_pair_json_round_trip() -> None:
    keypair = MaskingKeyPair.generate()
    as_json = keypair.to_json()
    assert as_json == {"private": keypair.private.hex(), "public": keypair.public.hex()}
    assert MaskingKeyPair.from_json(as_json) == keypair


def test_key_pair_refuses_mismatched_halves_bad_hex_and_missing_fields() -> None:
    one, other = MaskingKeyPair.generate(), MaskingKeyPair.generate()
    with pytest.raises(ValueError, match="does not match"):
        MaskingKeyPair.from_json({"private": one.private.hex(), "public": other.public.hex()})
    with pytest.raises(ValueError, match="non-hex"):
        MaskingKeyPair.from_json({"private": "zz", "public": one.public.hex()})
    with pytest.raises(ValueError, match="lacks the field"):
        MaskingKeyPair.from_json({"public": one.public.hex()})
    with pytest.raises(ValueError, match="32 raw bytes"):
        MaskingKeyPair(private=one.private[:31], public=one.public)


def test_key_pair_repr_hides_the_private_key() -> None:
    keypair = MaskingKeyPair.generate()
    assert keypair.private.hex() not in repr(keypair)
    assert str(keypair.private) not in repr(keypair)


def test_pair_key_is_symmetric(keys: dict[str, MaskingKeyPair]) -> None:
    forward = _pair(keys, "alice", "bob")
    assert len(forward) == 32
    assert forward == _pair(keys, "bob", "alice")


def test_pair_key_differs_by_session_and_by_pair(keys: dict[str, MaskingKeyPair]) -> None:
    derived = {
        _pair(keys, "alice", "bob", b"s1"),
        _pair(keys, "alice", "bob", b"s2"),
        _pair(keys, "alice", "carol", b"s1"),
        _pair(keys, "bob", "carol", b"s1"),
    }
    assert len(derived) == 4


def test_pair_key_binds_the_party_names(keys: dict[str, MaskingKeyPair]) -> None:
    same_secret_other_names = pair_key(
        my_private=keys["alice"].private,
        peer_public=keys["bob"].public,
        session=b"s1",
        me="alice",
        peer="mallory",
    )
    assert same_secret_other_names != _pair(keys, "alice", "bob")


def test_pair_key_refusals(keys: dict[str, MaskingKeyPair]) -> None:
    good = {
        "my_private": keys["alice"].private,
        "peer_public": keys["bob"].public,
        "session": b"s1",
        "me": "alice",
        "peer": "bob",
    }
    with pytest.raises(ValueError, match="with itself"):
        pair_key(**{**good, "peer": "alice"})
    with pytest.raises(ValueError, match="session"):
        pair_key(**{**good, "session": b""})
    with pytest.raises(ValueError, match="my_private must be 32"):
        pair_key(**{**good, "my_private": b"\x01" * 31})
    with pytest.raises(ValueError, match="peer_public must be 32"):
        pair_key(**{**good, "peer_public": b"\x01" * 33})
    with pytest.raises(ValueError, match="pinned for 'bob' is a low-order point"):
        pair_key(**{**good, "peer_public": bytes(32)})


def test_mask_key_is_truncated_hmac_of_the_pair_key_and_nonces_separate_domains() -> None:
    key = bytes(range(32))
    assert mask_key(key) == hmac.digest(key, b"securevfl/mask-key/v2", "sha256")[:16]
    assert mask_key(key) != mask_key(bytes(32))
    with pytest.raises(ValueError, match="32 bytes"):
        mask_key(key[:16])
    expected = hashlib.sha256(b"securevfl/mask-nonce/v2d1").digest()[:12]
    assert stream_nonce(b"d1") == expected
    assert stream_nonce(b"d1") != stream_nonce(b"d2")
    with pytest.raises(ValueError, match="non-empty"):
        stream_nonce(b"")


@pytest.mark.parametrize("first", [0, 1, 5, MAX_FILL_WORDS // 2 - 3, MAX_FILL_WORDS, 2**32 - 7])
@pytest.mark.parametrize("count", [1, 2, 7])
def test_counter_blocks_under_ecb_are_the_ctr_keystream(first: int, count: int) -> None:
    # CTR done by hand (one reusable ECB context) gives OpenSSL's CTR bits for that nonce
    key, nonce = hashlib.sha256(b"k").digest()[:16], hashlib.sha256(b"n").digest()[:12]
    blocks = counter_blocks(nonce, first, count, np.empty(16 * count + 5, dtype=np.uint8))
    assert blocks.size == 16 * count
    assert blocks[:12].tobytes() == nonce and blocks[12:16].tobytes() == first.to_bytes(4, "big")
    streams = CounterStreams()
    out = np.zeros(16 * count + 15, dtype=np.uint8)
    assert streams.encryptor(key)(blocks, out) == 16 * count
    expected = keystream_uint64(key, 2 * count, nonce=nonce, start_word=2 * first)
    assert out[: 16 * count].tobytes() == expected.tobytes()
    assert not out[16 * count :].any()  # the slack is never written
    with pytest.raises(ValueError, match="2\\*\\*32 blocks"):
        counter_blocks(nonce, 2**32 - 1, 2, np.empty(32, dtype=np.uint8))


@pytest.mark.parametrize(
    "first", [0, 3, 2**16 - 8192, 2**16 - 100, 3 * 2**16 + 5, 2**24 - 50, 2**32 - 8192]
)
def test_counter_blocks_are_the_same_bytes_on_every_path(first: int) -> None:
    # the template path (an 8-byte aligned buffer; pieces split where the counter's upper 16
    # bits change) and the big-endian writes (an unaligned buffer) agree, at any offset
    nonce, count = hashlib.sha256(b"n2").digest()[:12], 8192
    aligned = counter_blocks(nonce, first, count, np.empty(16 * count, dtype=np.uint8))
    unaligned = counter_blocks(nonce, first, count, np.empty(16 * count + 1, dtype=np.uint8)[1:])
    expected = b"".join(nonce + (first + i).to_bytes(4, "big") for i in range(count))
    assert aligned.tobytes() == expected and unaligned.tobytes() == expected


def test_counter_streams_keep_one_context_per_key_and_thread() -> None:
    streams = CounterStreams()
    key = bytes(range(16))
    assert streams.encryptor(key) is streams.encryptor(key)
    assert streams.encryptor(key) is not streams.encryptor(bytes(16))
    other: list = []
    thread = threading.Thread(target=lambda: other.append(streams.encryptor(key)))
    thread.start(), thread.join()
    assert other[0] is not streams.encryptor(key)
    with pytest.raises(ValueError, match="16 bytes"):
        streams.encryptor(b"short")
    streams.clear()
    assert streams.encryptor(key) is not other[0]


def test_a_keystream_with_a_nonce_starts_at_counter_block_nonce_zero() -> None:
    key, nonce = bytes(range(16)), bytes(range(12))
    reference = Cipher(algorithms.AES(key), modes.CTR(nonce + bytes(4))).encryptor()
    assert keystream_uint64(key, 9, nonce=nonce).tobytes() == reference.update(bytes(72))
    with pytest.raises(ValueError, match="12 bytes"):
        keystream_uint64(key, 9, nonce=bytes(16))
    with pytest.raises(ValueError, match="2\\*\\*32 blocks"):
        Keystream(key, start_word=2**33)


@pytest.mark.parametrize("n", [0, 1, 3, KEYSTREAM_CHUNK_WORDS, 2 * KEYSTREAM_CHUNK_WORDS + 7])
def test_keystream_is_aes128_ctr_from_counter_block_zero(n: int) -> None:
    key = hashlib.sha256(b"k").digest()[:16]
    reference = Cipher(algorithms.AES(key), modes.CTR(bytes(16))).encryptor().update(bytes(8 * n))
    words = keystream_uint64(key, n)
    assert words.dtype == np.uint64 and words.shape == (n,)
    assert words.tobytes() == reference


def test_keystream_writes_into_out_without_reallocating() -> None:
    key = bytes(16)
    out = np.zeros(1000, dtype=np.uint64)
    result = keystream_uint64(key, 1000, out=out)
    assert result is out
    assert np.array_equal(out, keystream_uint64(key, 1000))
    with pytest.raises(ValueError, match="expected n=999"):
        keystream_uint64(key, 999, out=out)
    with pytest.raises(ValueError, match="uint64"):
        keystream_uint64(key, 1000, out=np.zeros(1000, dtype=np.int64))


def test_keystream_fill_continues_the_stream() -> None:
    key = bytes(range(16))
    stream = Keystream(key)
    pieces = [np.empty(size, dtype=np.uint64) for size in (5, KEYSTREAM_CHUNK_WORDS, 11)]
    for piece in pieces:
        stream.fill(piece)
    expected = keystream_uint64(key, sum(piece.size for piece in pieces))
    assert np.array_equal(np.concatenate(pieces), expected)


def test_keystream_is_deterministic_per_key_and_refuses_bad_keys() -> None:
    assert np.array_equal(keystream_uint64(b"a" * 16, 64), keystream_uint64(b"a" * 16, 64))
    assert not np.array_equal(keystream_uint64(b"a" * 16, 64), keystream_uint64(b"b" * 16, 64))
    with pytest.raises(ValueError, match="16 bytes"):
        keystream_uint64(b"a" * 32, 4)
    with pytest.raises(ValueError, match="non-negative"):
        keystream_uint64(b"a" * 16, -1)


def test_crypto_never_uses_non_cryptographic_randomness() -> None:
    for source_file in CRYPTO_DIR.glob("*.py"):
        tree = ast.parse(source_file.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and node.attr == "random":
                pytest.fail(f"{source_file.name} uses .random (line {node.lineno})")
            if isinstance(node, ast.Import | ast.ImportFrom):
                module = getattr(node, "module", None) or ""
                names = [alias.name for alias in node.names]
                assert "random" not in [module, *names], f"{source_file.name} imports random"
                assert "numpy.random" not in [module, *names], source_file.name


def test_importing_crypto_pulls_in_no_ml_transport_or_engine_modules() -> None:
    probe = (
        "import sys, crypto, crypto.masking; "
        "bad = [m for m in ('torch', 'zmq', 'transport', 'securevfl', 'crypto.ckks') "
        "if m in sys.modules]; print(bad)"
    )
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


def test_random_words_are_fresh_uniform_and_refuse_a_negative_count() -> None:
    a, b = random_uint64(4096), random_uint64(4096)
    assert a.dtype == np.uint64 and a.shape == (4096,)
    assert not np.array_equal(a, b)
    # each bit is set about half the time (4096 * 64 bits: 6 standard deviations is 0.0023)
    bits = np.unpackbits(np.concatenate([a, b]).view(np.uint8))
    assert abs(bits.mean() - 0.5) < 0.0025
    assert random_uint64(0).size == 0
    with pytest.raises(ValueError, match="non-negative"):
        random_uint64(-1)


def test_random_words_are_not_repeated_by_a_forked_child() -> None:
    random_uint64(8)  # the parent's generator is keyed before the fork
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: its next words, to the parent, then out at once
        try:
            os.write(write, random_uint64(64).tobytes())
        finally:
            os._exit(0)
    os.close(write)
    child = b""
    while len(child) < 512:
        chunk = os.read(read, 512 - len(child))
        if not chunk:
            break
        child += chunk
    os.close(read)
    os.waitpid(pid, 0)
    parent = random_uint64(64).tobytes()
    assert len(child) == 512 and child != parent


def test_random_words_from_several_threads_are_all_distinct() -> None:
    import threading

    out: list[np.ndarray] = []

    def draw() -> None:
        out.append(random_uint64(1 << 15))

    threads = [threading.Thread(target=draw) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    words = np.concatenate(out)
    assert np.unique(words).size == words.size
