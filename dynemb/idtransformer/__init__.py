"""ID transformer: unbounded int64 IDs → slots of a bounded table, batch by batch.

Read top to bottom (no module imports one that imports it back; tests/test_layering.py):
- results.py: what a transform gives (TransformResult, one table; ManyResult, many tables).
- sharded.py: ShardedIDTransformer and transform_tables, each rank owning the IDs that hash to it;
  stream.py: TransformStream, the same with one exchange per batch; route.py lays the exchange
  out; find.py: the same exchange, read-only (evaluation).
- many.py: all of a rank's tables in one call (transform_many, release_many).
- transformer.py: IDTransformer, one table on one device (transform, find, release, state).
- backend.py: the backends and where each runs:
  - "kernel" (CPU, the exact oracle): kernel.py builds csrc/slot_map.cpp (the map, lookup,
    admission, eviction) and csrc/route.cpp (the exchange's routing); slot_map.py its map;
  - "torch" (any device, the kernel's results in torch ops): slot_map.py's sorted map;
  - "triton" (CUDA): bucket_tables.py, the tables of a batch in one bucket_map.py map (set-
    associative, one launch and one host copy a call).
- policy.py: eviction scores (LRU / LFU / hybrid, TTL); admission.py: the count-min sketch.
- hashing.py: XXH64 in torch ops (an ID's owner rank); ids.py: what counts as an ID;
  device_select.py: compaction into fixed shapes. The hashes the kernels use are
  dynemb/common/csrc/hash.h.
"""
