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

from replay.capture.sha256 import chain_hashes_nb
from replay.errors import ReplayError

SALT_PREFIX = b"sglang-cache-salt-v1\0"
# pages of up to this many tokens are hashed by the compiled chain (replay.capture.sha256): there
# Python's cost per hash dominates; longer pages go to hashlib, whose SHA instructions win
COMPILED_MAX_PAGE = 128


def salt_prior(cache_salt: str | bytes | None) -> bytes:
    """The first block's prior digest: empty without a salt, else SHA256(prefix + salt)."""
    if not cache_salt:
        return b""
    salt = cache_salt.encode() if isinstance(cache_salt, str) else bytes(cache_salt)
    return hashlib.sha256(SALT_PREFIX + salt).digest()


def _chain(raw: bytes, start: int, stop: int, step: int, prior: bytes, out: list) -> None:
    """Append the hashes of ``raw[start:stop]`` (uint32 LE tokens) in chunks of ``step`` bytes."""
    sha = hashlib.sha256
    frombytes = int.from_bytes
    full_end = start + (stop - start) // step * step
    for a in range(start, full_end, step):
        prior = sha(prior + raw[a:a + step]).digest()
        out.append(frombytes(prior[:8], "big", signed=True))
    if full_end < stop:  # the partial last block
        prior = sha(prior + raw[full_end:stop]).digest()
        out.append(frombytes(prior[:8], "big", signed=True))


def _token_bytes(toks: np.ndarray) -> bytes:
    if toks.size and (toks.min() < 0 or toks.max() > 0xFFFFFFFF):
        raise ReplayError("token ids must fit an unsigned 32-bit integer")
    return toks.astype("<u4").tobytes()


def block_hashes(token_ids: Sequence[int] | np.ndarray, page_size: int,
                 cache_salt: str | bytes | None = None) -> list[int]:
    """The request's block hashes, one per (possibly partial) chunk of ``page_size`` tokens."""
    if page_size < 1:
        raise ReplayError(f"page_size must be >= 1, got {page_size}")
    raw = _token_bytes(np.asarray(token_ids, dtype=np.int64))
    out: list[int] = []
    _chain(raw, 0, len(raw), 4 * page_size, salt_prior(cache_salt), out)
    return out


def block_hashes_csr(tokens: np.ndarray, tok_off: np.ndarray, page_size: int,
                     salts: Sequence[str | None] | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Block hashes of many requests at once: request ``i``'s tokens are
    ``tokens[tok_off[i]:tok_off[i+1]]``; returns CSR ``(offsets, hashes)``."""
    if page_size < 1:
        raise ReplayError(f"page_size must be >= 1, got {page_size}")
    raw = _token_bytes(np.asarray(tokens, dtype=np.int64))
    lens = np.diff(tok_off)
    if page_size <= COMPILED_MAX_PAGE:
        prior_of = np.full(len(lens), -1, dtype=np.int64)
        priors = np.zeros((0, 32), dtype=np.uint8)
        if salts is not None:
            distinct: dict = {}
            for i, salt in enumerate(salts):
                if salt:
                    prior_of[i] = distinct.setdefault(salt, len(distinct))
            if distinct:
                priors = np.frombuffer(b"".join(salt_prior(x) for x in distinct), np.uint8).reshape(-1, 32)
        return chain_hashes_nb(np.frombuffer(raw, np.uint8), np.asarray(tok_off, dtype=np.int64), int(page_size),
                               prior_of, priors)
    off = np.zeros(len(lens) + 1, dtype=np.int64)
    np.cumsum(-(-lens // page_size), out=off[1:])
    out: list[int] = []
    step = 4 * page_size
    b = (np.asarray(tok_off, dtype=np.int64) * 4).tolist()
    for i in range(len(lens)):
        prior = salt_prior(salts[i]) if salts is not None and salts[i] else b""
        _chain(raw, b[i], b[i + 1], step, prior, out)
    return off, np.array(out, dtype=np.int64)
