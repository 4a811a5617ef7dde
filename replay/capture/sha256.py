"""SHA-256 (FIPS 180-4) compiled, for chains of short block hashes.

The block hash of CAPTURE.md section 3 is one SHA-256 per page over the
previous page's digest and the page's tokens: for pages of a few dozen tokens
that is about 100 bytes a call, and Python's per-call cost (building the
bytes, the hash object, the digest, the int) is several times the hashing.
:func:`chain_hashes_nb` walks every request's chain in one compiled loop.
``hashlib`` is the reference (tests/test_capture_blockhash.py holds the two
equal); for long pages, where OpenSSL's SHA instructions win, the caller keeps
``hashlib``.
"""

from __future__ import annotations

import numpy as np

from replay.kernels._jit import njit

_K = np.array([
    0x428a2f98, 0x71374491, 0xb5c0fbcf, 0xe9b5dba5, 0x3956c25b, 0x59f111f1, 0x923f82a4, 0xab1c5ed5,
    0xd807aa98, 0x12835b01, 0x243185be, 0x550c7dc3, 0x72be5d74, 0x80deb1fe, 0x9bdc06a7, 0xc19bf174,
    0xe49b69c1, 0xefbe4786, 0x0fc19dc6, 0x240ca1cc, 0x2de92c6f, 0x4a7484aa, 0x5cb0a9dc, 0x76f988da,
    0x983e5152, 0xa831c66d, 0xb00327c8, 0xbf597fc7, 0xc6e00bf3, 0xd5a79147, 0x06ca6351, 0x14292967,
    0x27b70a85, 0x2e1b2138, 0x4d2c6dfc, 0x53380d13, 0x650a7354, 0x766a0abb, 0x81c2c92e, 0x92722c85,
    0xa2bfe8a1, 0xa81a664b, 0xc24b8b70, 0xc76c51a3, 0xd192e819, 0xd6990624, 0xf40e3585, 0x106aa070,
    0x19a4c116, 0x1e376c08, 0x2748774c, 0x34b0bcb5, 0x391c0cb3, 0x4ed8aa4a, 0x5b9cca4f, 0x682e6ff3,
    0x748f82ee, 0x78a5636f, 0x84c87814, 0x8cc70208, 0x90befffa, 0xa4506ceb, 0xbef9a3f7, 0xc67178f2,
], dtype=np.uint32)
_H0 = np.array([0x6a09e667, 0xbb67ae85, 0x3c6ef372, 0xa54ff53a, 0x510e527f, 0x9b05688c, 0x1f83d9ab, 0x5be0cd19],
               dtype=np.uint32)
M32 = 0xFFFFFFFF


@njit(inline=True)
def _rotr(x, n):
    return ((x >> n) | (x << (32 - n))) & M32


@njit(allocates=False)
def _compress(h, block, w, k):
    """One 64-byte ``block`` (uint8) into the state ``h`` (8 int64 holding uint32); ``w`` is
    scratch of 64 int64."""
    for t in range(16):
        w[t] = ((np.int64(block[4 * t]) << 24) | (np.int64(block[4 * t + 1]) << 16)
                | (np.int64(block[4 * t + 2]) << 8) | np.int64(block[4 * t + 3]))
    for t in range(16, 64):
        x, y = w[t - 15], w[t - 2]
        s0 = _rotr(x, 7) ^ _rotr(x, 18) ^ (x >> 3)
        s1 = _rotr(y, 17) ^ _rotr(y, 19) ^ (y >> 10)
        w[t] = (w[t - 16] + s0 + w[t - 7] + s1) & M32
    a, b, c, d, e, f, g, hh = h[0], h[1], h[2], h[3], h[4], h[5], h[6], h[7]
    for t in range(64):
        s1 = _rotr(e, 6) ^ _rotr(e, 11) ^ _rotr(e, 25)
        ch = (e & f) ^ ((~e & M32) & g)
        t1 = (hh + s1 + ch + k[t] + w[t]) & M32
        s0 = _rotr(a, 2) ^ _rotr(a, 13) ^ _rotr(a, 22)
        maj = (a & b) ^ (a & c) ^ (b & c)
        t2 = (s0 + maj) & M32
        hh, g, f, e, d, c, b, a = g, f, e, (d + t1) & M32, c, b, a, (t1 + t2) & M32
    h[0] = (h[0] + a) & M32
    h[1] = (h[1] + b) & M32
    h[2] = (h[2] + c) & M32
    h[3] = (h[3] + d) & M32
    h[4] = (h[4] + e) & M32
    h[5] = (h[5] + f) & M32
    h[6] = (h[6] + g) & M32
    h[7] = (h[7] + hh) & M32


@njit(allocates=False)
def _digest(msg, n, out, h, w, blk, k, h0):
    """SHA-256 of ``msg[:n]`` (uint8) into ``out`` (32 uint8)."""
    for i in range(8):
        h[i] = h0[i]
    full = n // 64
    for j in range(full):
        _compress(h, msg[64 * j:64 * j + 64], w, k)
    r = n - 64 * full
    for i in range(r):
        blk[i] = msg[64 * full + i]
    blk[r] = 0x80
    for i in range(r + 1, 128):
        blk[i] = 0
    end = 64 if r < 56 else 128
    bits = np.int64(n) * 8
    for i in range(8):
        blk[end - 1 - i] = (bits >> (8 * i)) & 0xFF
    _compress(h, blk[0:64], w, k)
    if end == 128:
        _compress(h, blk[64:128], w, k)
    for i in range(8):
        out[4 * i] = (h[i] >> 24) & 0xFF
        out[4 * i + 1] = (h[i] >> 16) & 0xFF
        out[4 * i + 2] = (h[i] >> 8) & 0xFF
        out[4 * i + 3] = h[i] & 0xFF


@njit
def sha256_nb(msg):
    """SHA-256 of the uint8 array ``msg`` (32 uint8)."""
    out = np.empty(32, np.uint8)
    _digest(msg, msg.shape[0], out, np.empty(8, np.int64), np.empty(64, np.int64), np.empty(128, np.uint8),
            _K, _H0)
    return out


@njit
def chain_hashes_nb(raw, tok_off, page, prior_of, priors):
    """Every request's block hashes: request ``i``'s tokens are the uint32 little-endian bytes
    ``raw[4 * tok_off[i]:4 * tok_off[i + 1]]``, cut in pages of ``page`` tokens (the last may be
    partial); a page's digest is SHA-256 over the previous page's digest (the first page's:
    ``priors[prior_of[i]]`` when ``prior_of[i] >= 0``, else nothing) and its bytes; its hash the
    digest's first 8 bytes, big-endian, signed.  Returns ``(offsets, hashes)``."""
    n = tok_off.shape[0] - 1
    off = np.zeros(n + 1, np.int64)
    for i in range(n):
        off[i + 1] = off[i] + (tok_off[i + 1] - tok_off[i] + page - 1) // page
    out = np.empty(off[n], np.int64)
    msg = np.empty(32 + 4 * page, np.uint8)
    dig = np.empty(32, np.uint8)
    h = np.empty(8, np.int64)
    w = np.empty(64, np.int64)
    blk = np.empty(128, np.uint8)
    k = _K
    h0 = _H0
    for i in range(n):
        a = 4 * tok_off[i]
        end = 4 * tok_off[i + 1]
        have = 0
        if prior_of[i] >= 0:
            for j in range(32):
                dig[j] = priors[prior_of[i], j]
            have = 32
        q = off[i]
        while a < end:
            b = min(a + 4 * page, end)
            for j in range(have):
                msg[j] = dig[j]
            m = have
            for j in range(a, b):
                msg[m] = raw[j]
                m += 1
            _digest(msg, m, dig, h, w, blk, k, h0)
            v = np.int64(0)
            for j in range(8):
                v = (v << 8) | np.int64(dig[j])
            out[q] = v
            q += 1
            have = 32
            a = b
    return off, out
