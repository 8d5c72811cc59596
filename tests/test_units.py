"""Pure functions and data structures under the PS: hashing, generated code, the id index, init."""

from __future__ import annotations

import filecmp

import numpy as np
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from protos import generate
from ps_server.backends.id_index import IdIndex
from ps_server.hashing import bucket_of, shard_of, xxh64_ids
from ps_server.initializer import bf16_bits_to_float, float_to_bf16_bits, initial_rows
from ps_server.schema import Initializer, TableSchema

EDGE_IDS = np.array([0, 1, -1, 255, 256, 1 << 56, -(1 << 63), (1 << 63) - 1], dtype=np.int64)


def test_xxh64_matches_the_xxhash_package():
    rng = np.random.default_rng(0)
    ids = np.concatenate([EDGE_IDS, rng.integers(-(1 << 63), (1 << 63) - 1, 2000, dtype=np.int64)])
    for seed in (0, 1, 0x6479_6E65_6D62, (1 << 64) - 1):
        want = [xxhash.xxh64_intdigest(int(i).to_bytes(8, "little", signed=True), seed) for i in ids]
        assert xxh64_ids(ids, seed).tolist() == want


def test_shards_are_stable_and_balanced():
    ids = np.random.default_rng(1).integers(0, 1 << 40, 60000)
    owner = shard_of(ids, 3)
    assert np.array_equal(owner, shard_of(ids.copy(), 3))
    counts = np.bincount(owner, minlength=3)
    assert counts.min() > 0.95 * len(ids) / 3
    # the shard is the xxh64 of the id modulo the number of addresses
    assert owner[5] == xxhash.xxh64_intdigest(int(ids[5]).to_bytes(8, "little", signed=True)) % 3


def test_buckets_rise_with_the_row_hash():
    ids = np.random.default_rng(2).integers(-(1 << 62), 1 << 62, 5000)
    from ps_server.hashing import ROW_HASH_SEED

    order = np.argsort(xxh64_ids(ids, ROW_HASH_SEED))
    b = bucket_of(ids[order], 4096)
    assert np.all(np.diff(b) >= 0) and b.min() >= 0 and b.max() < 4096


def test_checked_in_generated_code_matches_the_proto(tmp_path):
    paths = generate.generate(tmp_path)
    for path in paths:
        checked_in = generate.ROOT / "protos" / path.name
        assert filecmp.cmp(path, checked_in, shallow=False), (
            f"{checked_in} differs from what protos/ps.proto generates: run `python -m protos.generate`"
        )


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from("iril"), st.lists(st.integers(-300, 300), max_size=40)), max_size=40))
def test_id_index_behaves_like_a_dict(ops):
    index, model, next_value = IdIndex(capacity=4), {}, 0
    for op, keys in ops:
        ids = np.unique(np.array(keys, dtype=np.int64))
        if op == "i":
            new = ids[index.lookup(ids) < 0]
            values = np.arange(next_value, next_value + len(new), dtype=np.int64)
            next_value += len(new)
            index.insert(new, values)
            model.update(zip(new.tolist(), values.tolist()))
        elif op == "r":
            removed = index.remove(np.array(keys, dtype=np.int64))
            assert sorted(removed.tolist()) == sorted(model.pop(k) for k in ids.tolist() if k in model)
        else:
            assert index.lookup(ids).tolist() == [model.get(k, -1) for k in ids.tolist()]
        assert len(index) == len(model)
        keys_now, values_now = index.items()
        assert dict(zip(keys_now.tolist(), values_now.tolist())) == model


def test_id_index_edge_ids_and_growth():
    index = IdIndex(capacity=16)
    ids = np.concatenate([EDGE_IDS, np.arange(10_000, 60_000, dtype=np.int64)])
    index.insert(ids, np.arange(len(ids)))
    assert index.capacity >= 2 * len(ids)
    assert np.array_equal(index.lookup(ids), np.arange(len(ids)))
    assert np.all(index.lookup(np.array([2, 3, -2])) == -1)


def test_initial_rows_are_a_function_of_seed_and_id():
    ids = np.array([3, 1, 2, 3], dtype=np.int64)
    for kind, a, b in (("uniform", -0.5, 0.5), ("normal", 1.0, 0.1)):
        s = TableSchema("t", 16, 2, "fp32", Initializer(kind, a, b, seed=9, state_init=0.25))
        rows = initial_rows(s, ids)
        assert np.array_equal(rows[0], rows[3]) and not np.array_equal(rows[0], rows[1])
        assert np.array_equal(rows, initial_rows(s, ids))
        assert np.all(rows[:, 16:] == 0.25)
        other = initial_rows(TableSchema("t", 16, 2, "fp32", Initializer(kind, a, b, seed=10)), ids)
        assert not np.array_equal(rows[:, :16], other[:, :16])
    big = initial_rows(TableSchema("t", 64, 0, "fp32", Initializer("uniform", -0.5, 0.5)), np.arange(5000))
    assert -0.5 <= big.min() and big.max() < 0.5 and abs(big.mean()) < 0.01
    normal = initial_rows(TableSchema("t", 64, 0, "fp32", Initializer("normal", 1.0, 0.1)), np.arange(5000))
    assert abs(normal.mean() - 1.0) < 0.01 and abs(normal.std() - 0.1) < 0.01


def test_bf16_round_trip_and_rounding():
    x = np.array([0.0, 1.0, -2.5, 3.140625, 1e-3, 65504.0], dtype=np.float32)
    bits = float_to_bf16_bits(x)
    back = bf16_bits_to_float(bits)
    assert np.all(np.abs(back - x) <= np.abs(x) * 2**-8)
    assert float_to_bf16_bits(np.array([1.0], np.float32))[0] == 0x3F80
