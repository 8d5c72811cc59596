"""ID transformer: unbounded int64 IDs → slots of a bounded table, batch by batch.

transformer.py (IDTransformer, one table on one device), sharded.py (ShardedIDTransformer,
each rank owning the IDs that hash to it; route.py lays out its exchange), policy.py (LRU / LFU / hybrid / TTL scoring),
admission.py (count-min sketch), slot_map.py + csrc/slot_map.cpp (the map and the CPU kernel).
"""
