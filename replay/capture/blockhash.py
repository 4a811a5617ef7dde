"""The block hash the SGLang router and engines agree on (CAPTURE.md section 3).

A prompt's token ids are cut into chunks of ``page_size`` tokens (the last may
be partial).  Chunk ``i``'s digest is SHA-256 over the previous chunk's full
32-byte digest (nothing for the first chunk, or the cache-salt prior) followed
by every token as an unsigned 32-bit little-endian integer; the published hash
is the digest's first 8 bytes read as a big-endian signed int64.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import numpy as np

from ..errors import ReplayError

SALT_PREFIX = b"sglang-cache-salt-v1\0"


def salt_prior(cache_salt: str | bytes | None) -> bytes:
    """The first block's prior digest: empty without a salt, else SHA256(prefix + salt)."""
    if not cache_salt:
        return b""
    salt = cache_salt.encode() if isinstance(cache_salt, str) else bytes(cache_salt)
    return hashlib.sha256(SALT_PREFIX + salt).digest()


def block_hashes(token_ids: Sequence[int] | np.ndarray, page_size: int,
                 cache_salt: str | bytes | None = None) -> list[int]:
    """The request's block hashes, one per (possibly partial) chunk of ``page_size`` tokens."""
    if page_size < 1:
        raise ReplayError(f"page_size must be >= 1, got {page_size}")
    toks = np.asarray(token_ids, dtype=np.int64)
    if toks.size and (toks.min() < 0 or toks.max() > 0xFFFFFFFF):
        raise ReplayError("token ids must fit an unsigned 32-bit integer")
    raw = toks.astype("<u4").tobytes()
    step = 4 * page_size
    prior = salt_prior(cache_salt)
    out: list[int] = []
    sha = hashlib.sha256
    frombytes = int.from_bytes
    for start in range(0, len(raw), step):
        prior = sha(prior + raw[start:start + step]).digest()
        out.append(frombytes(prior[:8], "big", signed=True))
    return out
