"""The torch XXH64 matches the xxhash package and the PS client's numpy version."""

import numpy as np
import torch
import xxhash

from dynemb.idtransformer.hashing import owner_of, unsigned_mod, xxh64
from dynemb.ps_server.hashing import shard_of, xxh64_ids


def test_xxh64_matches_xxhash_and_numpy():
    gen = torch.Generator().manual_seed(0)
    ids = torch.cat(
        [
            torch.tensor([0, 1, -1, 256, -(1 << 63), (1 << 63) - 1], dtype=torch.int64),
            torch.randint(-(1 << 63), (1 << 63) - 1, (3000,), generator=gen, dtype=torch.int64),
        ]
    )
    for seed in (0, 7, 0x6479_6E65_6D62):
        got = xxh64(ids, seed).numpy().view(np.uint64)
        want = [xxhash.xxh64_intdigest(int(i).to_bytes(8, "little", signed=True), seed) for i in ids.tolist()]
        assert got.tolist() == want
        assert np.array_equal(got, xxh64_ids(ids.numpy(), seed))


def test_owner_is_the_ps_shard_function():
    ids = torch.randint(-(1 << 62), 1 << 62, (20000,), dtype=torch.int64)
    for n in (1, 2, 3, 4, 7):
        owner = owner_of(ids, n)
        assert owner.min() >= 0 and owner.max() < n
        assert np.array_equal(owner.numpy(), shard_of(ids.numpy(), n))


def test_unsigned_mod_of_negative_patterns():
    h = torch.tensor([-1, -(1 << 63), 5, -7], dtype=torch.int64)
    as_unsigned = [(v + (1 << 64)) % 10 if v < 0 else v % 10 for v in h.tolist()]
    assert unsigned_mod(h, 10).tolist() == as_unsigned
