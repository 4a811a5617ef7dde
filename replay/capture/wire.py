"""Decoding the engines' ZMQ frames (CAPTURE.md sections 1 and 2).

Accepted shapes, and nothing else (anything else is a :class:`FrameError`,
which the recorder counts and skips):

* LoadStat: ``[topic, seq (8-byte big-endian unsigned), msgpack]`` where the
  payload is the array ``["LoadStat", running, waiting, num_tokens,
  max_total_num_tokens, attn_dp_rank | nil, <native tail of five>, ...]``;
  six elements (no tail) or eleven and more (extras ignored).  Between six and
  eleven is a partial tail: kept, the missing fields null.
* KV events: ``[topic, seq, msgpack EventBatch]``, the batch being the array
  ``[ts (float s), events, attn_dp_rank | nil]``; each event either a tagged
  array (``["BlockStored", block_hashes, parent_block_hash, token_ids,
  block_size, lora_id, medium]``, ``["BlockRemoved", block_hashes, medium]``,
  ``["AllBlocksCleared"]``; trailing optional fields may be absent) or a map
  with a ``"type"`` key and the same field names (optional keys omitted).
  ``BlockStored`` maps may carry ``cache_salt``, ``session_id`` and
  ``lora_name`` (sglang 0.5.23): kept.
* KV replay answers (the DEALER side of the replay ROUTER): ``[b"", topic,
  seq, payload]`` per buffered batch (three frames ``[b"", seq, payload]``
  from engines without the topic frame), then the end marker whose sequence
  frame is all ``0xFF`` (the topic frame is empty then, but so is every
  topic frame under the default empty topic: only the sequence tells).
* A live KV frame whose sequence is all ``0xFF`` (``-1`` signed) is a
  publisher reset (newer engines): :data:`RESET_SEQ`.
"""

from __future__ import annotations

import struct

import msgpack

LOAD_FIELDS = ("num_running_reqs", "num_waiting_reqs", "num_tokens", "max_total_num_tokens")
TAIL_FIELDS = ("num_waiting_uncached_tokens", "num_total_tokens", "max_running_requests",
               "total_prefill_uncached_tokens", "total_prefill_busy_us")

# One source of truth for the event kinds (kv_events.parquet column `type`)
BLOCK_STORED = "BlockStored"
BLOCK_REMOVED = "BlockRemoved"
ALL_BLOCKS_CLEARED = "AllBlocksCleared"
EVENT_TYPES = (BLOCK_STORED, BLOCK_REMOVED, ALL_BLOCKS_CLEARED)
MEDIA = ("GPU", "CPU_PINNED", "DISK", "EXTERNAL")

_SEQ = struct.Struct(">Q")
ALL_FF = b"\xff" * 8
RESET_SEQ = (1 << 64) - 1       # the all-0xFF sequence: replay end marker, or a live reset frame
U32_MAX = 0xFFFFFFFF
I64_MIN = -(1 << 63)
U64 = 1 << 64


class FrameError(ValueError):
    """A frame we cannot decode; the message says why in a few words."""


def pack_seq(seq: int) -> bytes:
    """8-byte big-endian unsigned (``-1`` packs as the all-0xFF marker)."""
    return _SEQ.pack(seq % (1 << 64))


def unpack_seq(frame: bytes) -> int:
    """The sequence as an unsigned integer (CAPTURE.md: read unsigned; the same
    bytes as signed below 2**63)."""
    if len(frame) != 8:
        raise FrameError(f"sequence frame of {len(frame)} bytes, expected 8")
    return _SEQ.unpack(frame)[0]


def stored_seq(seq: int) -> int:
    """A sequence number as the int64 Parquet column holds it (the same 8 bytes, signed)."""
    return seq - (1 << 64) if seq >= 1 << 63 else seq


def _unpack(payload: bytes):
    try:
        return msgpack.unpackb(payload, raw=False, strict_map_key=False)
    except Exception as err:  # noqa: BLE001 - msgpack raises several kinds for garbage
        raise FrameError(f"not msgpack ({type(err).__name__})") from None


def _count(v, what: str) -> int:
    if isinstance(v, bool) or not isinstance(v, int):
        raise FrameError(f"{what} is {type(v).__name__}, expected an integer")
    if v < 0:
        raise FrameError(f"{what} is negative ({v})")
    return v


def split(frames: list[bytes]) -> tuple[bytes, int, bytes]:
    """``(topic, seq, payload)`` of a three-frame message."""
    if len(frames) != 3:
        raise FrameError(f"{len(frames)} frames, expected 3 (topic, sequence, payload)")
    return frames[0], unpack_seq(frames[1]), frames[2]


def split_replay(frames: list[bytes]) -> tuple[int, bytes] | None:
    """``(seq, payload)`` of one replay answer, None for the end marker.

    Four frames ``[b"", topic, seq, payload]`` (sglang 0.5.23) or three
    ``[b"", seq, payload]``; the end marker is recognised by its all-0xFF
    sequence frame alone."""
    if len(frames) not in (3, 4) or frames[0] != b"":
        raise FrameError(f"replay answer of {len(frames)} frames, expected [b'', topic, seq, payload]")
    seq_frame, payload = frames[-2], frames[-1]
    if seq_frame == ALL_FF:
        return None
    return unpack_seq(seq_frame), payload


def decode_loadstat(payload: bytes) -> dict:
    """One LoadStat sample as ``{field: int | None}`` plus ``attn_dp_rank``."""
    msg = _unpack(payload)
    if isinstance(msg, dict):
        # REPLAY CHOICE: a map with the same field names is accepted too (the
        # spec names only the array; a map costs nothing to read and refusing
        # it would lose a week of samples over a serializer option).
        if msg.get("type", "LoadStat") != "LoadStat":
            raise FrameError(f"payload type {msg.get('type')!r}, expected LoadStat")
        arr = [None] + [msg.get(k) for k in LOAD_FIELDS] + [msg.get("attn_dp_rank")] + \
              [msg.get(k) for k in TAIL_FIELDS]
        while len(arr) > 6 and arr[-1] is None:
            arr.pop()
    elif isinstance(msg, (list, tuple)):
        if not msg or msg[0] != "LoadStat":
            raise FrameError("payload is not a LoadStat array")
        arr = list(msg)
    else:
        raise FrameError(f"payload is {type(msg).__name__}, expected a LoadStat array")
    if len(arr) < 6:
        raise FrameError(f"LoadStat of {len(arr)} elements, expected at least 6")
    out: dict = {}
    for k, v in zip(LOAD_FIELDS, arr[1:5], strict=True):
        out[k] = _count(v, k)
    rank = arr[5]
    out["attn_dp_rank"] = None if rank is None else _count(rank, "attn_dp_rank")
    for j, k in enumerate(TAIL_FIELDS):
        v = arr[6 + j] if 6 + j < len(arr) else None
        out[k] = None if v is None else _count(v, k)
    return out


def _hash(v, what: str) -> int:
    if isinstance(v, bool) or not isinstance(v, int):
        raise FrameError(f"{what} is {type(v).__name__}, expected an integer")
    if v >= 1 << 63:
        if v >= U64:
            raise FrameError(f"{what} does not fit 64 bits")
        # REPLAY CHOICE: an unsigned 64-bit hash is the same 8 bytes read as signed
        v -= U64
    if v < I64_MIN:
        raise FrameError(f"{what} does not fit 64 bits")
    return v


def _hashes(v) -> list[int]:
    if not isinstance(v, (list, tuple)):
        raise FrameError(f"block_hashes is {type(v).__name__}, expected a list")
    return [_hash(h, "block hash") for h in v]


def _medium(v) -> str | None:
    if v is None:
        return None
    if v not in MEDIA:
        raise FrameError(f"medium {v!r} is not one of {', '.join(MEDIA)}")
    return v


def _wide(toks) -> bool:
    if not toks:
        return False
    try:
        return bool(max(toks) > U32_MAX or min(toks) < 0)
    except TypeError:      # bigram pairs (lists) or something that is not a number
        return True


_STORED_KEYS = ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium")


def decode_event(ev) -> dict:
    """One event as a row: type, block_hashes, parent_block_hash, n_tokens, block_size, lora_id, medium."""
    if isinstance(ev, dict):
        kind = ev.get("type")
        fields = ev
    elif isinstance(ev, (list, tuple)) and ev:
        kind = ev[0]
        if kind == BLOCK_STORED:
            fields = dict(zip(_STORED_KEYS, ev[1:], strict=False))
        elif kind == BLOCK_REMOVED:
            fields = dict(zip(("block_hashes", "medium"), ev[1:], strict=False))
        else:
            fields = {}
    else:
        raise FrameError(f"event is {type(ev).__name__}, expected a tagged array or a map")
    row = {"type": kind, "block_hashes": None, "parent_block_hash": None, "n_tokens": None,
           "block_size": None, "lora_id": None, "medium": None, "cache_salt": None, "session_id": None,
           "lora_name": None, "wide_tokens": None}
    if kind == BLOCK_STORED:
        row["block_hashes"] = _hashes(fields.get("block_hashes"))
        parent = fields.get("parent_block_hash")
        row["parent_block_hash"] = None if parent is None else _hash(parent, "parent_block_hash")
        toks = fields.get("token_ids")
        if toks is not None and not isinstance(toks, (list, tuple)):
            raise FrameError("token_ids is not a list")
        row["n_tokens"] = None if toks is None else len(toks)
        # token ids the engine hashes in another form than u32 little-endian: ids above
        # 2**32 - 1 (its per-page wide form) or bigram pairs (EAGLE workers); flagged, for
        # the importer to refuse to call its matches exact
        row["wide_tokens"] = _wide(toks)
        for k in ("cache_salt", "session_id", "lora_name"):
            v = fields.get(k)
            if v is not None and not isinstance(v, str):
                raise FrameError(f"{k} is {type(v).__name__}, expected a string")
            row[k] = v or None
        bs = fields.get("block_size")
        row["block_size"] = None if bs is None else _count(bs, "block_size")
        lora = fields.get("lora_id")
        row["lora_id"] = None if lora is None else _count(lora, "lora_id")
        row["medium"] = _medium(fields.get("medium"))
    elif kind == BLOCK_REMOVED:
        row["block_hashes"] = _hashes(fields.get("block_hashes"))
        row["medium"] = _medium(fields.get("medium"))
    elif kind != ALL_BLOCKS_CLEARED:
        raise FrameError(f"unknown event type {kind!r}")
    return row


def decode_batch(payload: bytes) -> tuple[float | None, int | None, list[dict]]:
    """An EventBatch as ``(ts seconds, attn_dp_rank, [event rows])``."""
    msg = _unpack(payload)
    if isinstance(msg, dict):
        ts, events = msg.get("ts"), msg.get("events")
        rank = msg.get("attn_dp_rank", msg.get("data_parallel_rank"))
    elif isinstance(msg, (list, tuple)) and len(msg) >= 2:
        ts, events = msg[0], msg[1]
        rank = msg[2] if len(msg) > 2 else None
    else:
        raise FrameError("payload is not an EventBatch [ts, events, attn_dp_rank]")
    if ts is not None and (isinstance(ts, bool) or not isinstance(ts, (int, float))):
        raise FrameError(f"batch ts is {type(ts).__name__}, expected a number")
    if not isinstance(events, (list, tuple)):
        raise FrameError("batch events is not a list")
    if rank is not None:
        rank = _count(rank, "attn_dp_rank")
    return (None if ts is None else float(ts)), rank, [decode_event(e) for e in events]
