"""ID transformer: unbounded int64 IDs → slots of a bounded table, batch by batch.

- transformer.py: IDTransformer, one table on one device (transform, release, state).
- many.py: all of a rank's tables in one call (transform_many, release_many).
- sharded.py: ShardedIDTransformer and transform_tables, each rank owning the IDs that hash to it;
  stream.py: TransformStream, the same with one exchange per batch; route.py lays the exchange out.
- policy.py: eviction scores (LRU / LFU / hybrid, TTL); admission.py: the count-min sketch.
- backend.py: the backends ("kernel", "triton", "torch") and where each runs.
- slot_map.py: the id → slot maps (the kernel's, and a sorted one in torch ops); triton_map.py:
  the triton backend's hash table; device_transform.py: its batched pass with one host copy,
  device_select.py: its compaction into fixed shapes; triton_select.py: its victims (the k
  lowest scores by radix select).
- kernel.py builds and loads the CPU kernel: csrc/slot_map.cpp (the map, lookup, admission,
  eviction), csrc/route.cpp (the exchange's routing); the hashes both use are dynemb/common/csrc/hash.h.
- hashing.py: XXH64 in torch ops (an ID's owner rank); ids.py: what counts as an ID.
"""
