"""Replay: what verification records for online distillation, in three modules:

- :mod:`learner.record`: ``ReplayRecord`` (one request's tokens and the target's sparse rows) and
  its byte codec;
- :mod:`learner.builder`: ``RecordBuilder``, a request's speculative steps -> its record;
- :mod:`learner.shards`: ``ShardConfig``, ``ReplayShard`` (one draft's records under a byte bound,
  on an append-only crash-safe log), ``ShardSet``.

This module re-exports their public names.
"""

from learner.builder import RecordBuilder
from learner.record import LEARNED_SOURCES, RECORD_OVERHEAD, ReplayRecord, decode_record, encode_record
from learner.shards import MAGIC, ReplayShard, ShardConfig, ShardSet, shard_path

__all__ = ["LEARNED_SOURCES", "MAGIC", "RECORD_OVERHEAD", "RecordBuilder", "ReplayRecord", "ReplayShard", "ShardConfig",
           "ShardSet", "decode_record", "encode_record", "shard_path"]
