"""The block hash against SHA-256 computed here, step by step, as CAPTURE.md s.3 words it."""

from __future__ import annotations

import hashlib
import struct

import pytest
from capture_fixture import spec_hashes  # the hash written from CAPTURE.md's prose
from hypothesis import given, settings
from hypothesis import strategies as st

from replay.capture.blockhash import block_hashes, block_hashes_csr
from replay.errors import ReplayError


def test_known_values_partial_block_and_salt():
    toks = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]                 # 3 blocks of 4: the last partial (2 tokens)
    got = block_hashes(toks, 4)
    assert len(got) == 3
    assert got == spec_hashes(toks, 4)
    d0 = hashlib.sha256(b"".join(struct.pack("<I", t) for t in (1, 2, 3, 4))).digest()
    assert got[0] == int.from_bytes(d0[:8], "big", signed=True)
    d2 = hashlib.sha256(hashlib.sha256(d0 + b"".join(struct.pack("<I", t) for t in (5, 6, 7, 8))).digest()
                        + struct.pack("<I", 9) + struct.pack("<I", 10)).digest()
    assert got[2] == int.from_bytes(d2[:8], "big", signed=True)
    salted = block_hashes(toks, 4, cache_salt="tenant-a")
    assert salted == spec_hashes(toks, 4, "tenant-a")
    assert salted[0] != got[0] and all(a != b for a, b in zip(salted, got, strict=True))
    assert block_hashes(toks, 4, cache_salt="") == got          # empty salt = no salt
    assert any(h < 0 for h in block_hashes(list(range(4000)), 16))   # signed: negative values occur


def test_prefix_property_and_edges():
    a = block_hashes(list(range(100)), 16)
    b = block_hashes(list(range(96)) + [7, 7, 7, 7, 9], 16)
    assert a[:6] == b[:6] and a[6] != b[6]
    assert block_hashes([], 16) == []
    assert block_hashes([0xFFFFFFFF], 1) == spec_hashes([0xFFFFFFFF], 1)
    with pytest.raises(ReplayError):
        block_hashes([1 << 32], 4)
    with pytest.raises(ReplayError):
        block_hashes([1], 0)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 2**32 - 1), max_size=70), st.integers(1, 17),
       st.one_of(st.none(), st.text(min_size=1, max_size=5)))
def test_matches_spec_prose(tokens, B, salt):
    assert block_hashes(tokens, B, cache_salt=salt) == spec_hashes(tokens, B, salt)


@settings(max_examples=30, deadline=None)
@given(st.lists(st.tuples(st.lists(st.integers(0, 2**32 - 1), max_size=30),
                          st.one_of(st.none(), st.sampled_from(["a", "tenant-b"]))), max_size=8),
       st.integers(1, 9))
def test_many_at_once_equal_one_by_one(reqs, B):
    import numpy as np

    flat = np.array([t for toks, _ in reqs for t in toks], dtype=np.int64)
    tok_off = np.cumsum([0] + [len(toks) for toks, _ in reqs])
    off, hv = block_hashes_csr(flat, tok_off, B, [s for _, s in reqs])
    for i, (toks, salt) in enumerate(reqs):
        assert hv[off[i]:off[i + 1]].tolist() == spec_hashes(toks, B, salt)


@pytest.mark.parametrize("n", [0, 1, 31, 55, 56, 63, 64, 65, 96, 119, 120, 127, 128, 1000])
def test_compiled_sha256_equals_hashlib(n):
    import numpy as np

    from replay.capture.sha256 import sha256_nb

    msg = np.random.default_rng(n).integers(0, 256, n).astype(np.uint8)
    assert bytes(sha256_nb(msg)) == hashlib.sha256(msg.tobytes()).digest()
    if n:
        flipped = msg.copy()
        flipped[n // 2] ^= 1
        assert bytes(sha256_nb(flipped)) != hashlib.sha256(msg.tobytes()).digest()


@pytest.mark.parametrize("page", [16, 64, 128, 129, 512])
def test_many_at_once_on_both_sides_of_the_compiled_page_limit(page):
    import numpy as np

    rng = np.random.default_rng(page)
    lens = rng.integers(0, 3 * page + 7, 40)
    tok_off = np.r_[0, np.cumsum(lens)]
    flat = rng.integers(0, 2**32, int(tok_off[-1])).astype(np.int64)
    salts = [None if i % 3 else f"s{i % 2}" for i in range(40)]
    off, hv = block_hashes_csr(flat, tok_off, page, salts)
    for i in range(40):
        toks = flat[tok_off[i]:tok_off[i + 1]].tolist()
        assert hv[off[i]:off[i + 1]].tolist() == spec_hashes(toks, page, salts[i])
