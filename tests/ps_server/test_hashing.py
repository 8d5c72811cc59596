"""dynemb/ps_server/hashing.py: the vectorised XXH64 against the xxhash package, and the shard and
bucket functions built on it."""

from __future__ import annotations

import numpy as np
import pytest
import xxhash

from dynemb.ps_server.hashing import ROW_HASH_SEED, bucket_of, shard_of, xxh64_ids

INT64_MIN, INT64_MAX = -(1 << 63), (1 << 63) - 1
EDGE_IDS = np.array(
    [
        0,
        1,
        -1,
        2,
        -2,
        255,
        256,
        -256,
        1 << 32,
        (1 << 32) - 1,
        1 << 56,
        -(1 << 56),
        INT64_MIN,
        INT64_MIN + 1,
        INT64_MAX,
        INT64_MAX - 1,
    ],
    dtype=np.int64,
)
SEEDS = [0, 1, 42, ROW_HASH_SEED, 0x5EED_1D, (1 << 63) - 1, 1 << 63, (1 << 64) - 1]


def reference(ids, seed: int = 0) -> list[int]:
    return [xxhash.xxh64_intdigest(int(i).to_bytes(8, "little", signed=True), seed) for i in ids]


def random_ids(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(INT64_MIN, INT64_MAX, n, dtype=np.int64, endpoint=True)


@pytest.mark.parametrize("seed", SEEDS + [int(s) for s in np.random.default_rng(7).integers(0, 1 << 63, 3)])
def test_xxh64_matches_the_xxhash_package(seed):
    ids = np.concatenate([EDGE_IDS, random_ids(3000, seed & 0xFFFF)])
    got = xxh64_ids(ids, seed)
    assert got.dtype == np.uint64 and got.shape == ids.shape
    assert got.tolist() == reference(ids, seed)


def test_xxh64_input_forms():
    ids = random_ids(1001, 3)
    want = reference(ids)
    assert xxh64_ids(ids[::-1]).tolist() == want[::-1]  # a strided view
    assert xxh64_ids(ids.tolist()).tolist() == want  # a plain list
    small = np.array([5, -5, 70000], dtype=np.int32)  # other integer widths hash as their int64 value
    assert xxh64_ids(small).tolist() == reference(small)
    assert xxh64_ids(np.zeros(0, dtype=np.int64)).shape == (0,)
    # one id hashes the same whatever else is in the batch
    assert xxh64_ids(ids[5:6]).tolist() == [want[5]]


@pytest.mark.parametrize("n", [2, 3, 5, 8])
def test_shard_of_is_xxh64_modulo_n_and_stable(n):
    ids = np.concatenate([EDGE_IDS, random_ids(20000, n)])
    owner = shard_of(ids, n)
    assert owner.dtype == np.int64 and owner.min() >= 0 and owner.max() < n
    assert owner.tolist() == [h % n for h in reference(ids)]
    # stable: the same id has the same owner whatever batch it comes in, in any order
    perm = np.random.default_rng(n).permutation(len(ids))
    assert np.array_equal(shard_of(ids[perm], n), owner[perm])
    assert np.array_equal(shard_of(ids[:100].copy(), n), owner[:100])


def test_one_shard_owns_everything():
    assert not shard_of(random_ids(500, 1), 1).any()


@pytest.mark.parametrize("n", [2, 3, 7, 16])
@pytest.mark.parametrize("kind", ["random", "sequential", "strided"])
def test_shards_are_balanced(n, kind):
    count = 64000
    ids = {
        "random": random_ids(count, 11),
        "sequential": np.arange(count, dtype=np.int64),  # real ids are often dense counters
        "strided": np.arange(count, dtype=np.int64) * 1024,  # or share their low bits
    }[kind]
    counts = np.bincount(shard_of(ids, n), minlength=n)
    expected = count / n
    # a fair hash stays within a few standard deviations (sqrt(expected) ~ 60..180) of even
    assert np.all(np.abs(counts - expected) < 6 * np.sqrt(expected) + 1), counts


def test_buckets_rise_with_the_row_hash_and_cover_the_range():
    ids = random_ids(20000, 2)
    for num_buckets in (1, 7, 4096):
        b = bucket_of(ids, num_buckets)
        assert b.min() >= 0 and b.max() < num_buckets
        order = np.argsort(xxh64_ids(ids, ROW_HASH_SEED))
        assert np.all(np.diff(b[order]) >= 0)  # monotonic in the row hash
        # 20000 ids leave almost no bucket empty (about 0.8% of 4096 expected to be)
        assert len(np.unique(b)) >= min(num_buckets, 0.97 * num_buckets)
    counts = np.bincount(bucket_of(ids, 16), minlength=16)
    assert counts.min() > 0.8 * len(ids) / 16
    # the bucket is the top 32 bits of the row hash, scaled to the range
    h = xxhash.xxh64_intdigest(int(ids[9]).to_bytes(8, "little", signed=True), ROW_HASH_SEED)
    assert bucket_of(ids[9:10], 4096)[0] == ((h >> 32) * 4096) >> 32
