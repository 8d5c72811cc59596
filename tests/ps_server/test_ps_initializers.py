"""Rows never pushed, pulled through real PS processes (embedded and Redis): initialised per the
table's Initializer, the same on every pull and on every PS, flagged missing, state = state_init."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from dynemb.ps_server.client import PSClient
from dynemb.ps_server.initializer import bf16_bits_to_float, initial_rows
from dynemb.ps_server.schema import Initializer
from dynemb.testing.local_ps import LocalPS

KINDS = {
    "zeros": Initializer("zeros", state_init=0.125),
    "constant": Initializer("constant", 0.3, state_init=-1.5),
    "uniform": Initializer("uniform", -0.5, 0.25, seed=11, state_init=0.1),
    "normal": Initializer("normal", 1.0, 0.5, seed=12, state_init=2.0),
}
DTYPES = ["fp32", "fp16", "bf16"]
DIM, STATE = 16, 2
N = 4000


@pytest.fixture(scope="module")
def two_ps(redis_url):
    """One PS on the embedded store and one on Redis (a namespace of this module's own)."""
    import uuid

    procs = [
        LocalPS("--not-serving-seconds", "0").start(),
        LocalPS(
            "--backend", redis_url, "--namespace", f"init{uuid.uuid4().hex[:8]}", "--not-serving-seconds", "0"
        ).start(),
    ]
    yield [p.address for p in procs]
    for p in procs:
        p.close()


def as_float(rows: np.ndarray, dtype: str) -> np.ndarray:
    return bf16_bits_to_float(rows).astype(np.float64) if dtype == "bf16" else rows.astype(np.float64)


def rounded(x: float, dtype: str) -> float:
    """x as the table's dtype stores it."""
    if dtype == "bf16":
        from dynemb.ps_server.initializer import float_to_bf16_bits

        return float(bf16_bits_to_float(float_to_bf16_bits(np.array([x], np.float32)))[0])
    return float(np.array([x], dtype={"fp32": np.float32, "fp16": np.float16}[dtype])[0])


def sample_ids() -> np.ndarray:
    rng = np.random.default_rng(1)
    ids = rng.choice(1 << 62, N, replace=False).astype(np.int64) - (1 << 61)
    ids[:4] = [0, -1, -(1 << 63), (1 << 63) - 1]
    return ids


@pytest.mark.parametrize("kind,dtype", list(itertools.product(KINDS, DTYPES)))
def test_missing_rows_are_initialised_the_same_everywhere(two_ps, kind, dtype):
    init = KINDS[kind]
    table = f"init_{kind}_{dtype}"
    ids = sample_ids()
    pulls = []
    for address in two_ps:
        with PSClient(address) as ps:
            info = ps.create_table(table, dim=DIM, state_width=STATE, dtype=dtype, initializer=init)
            got = ps.pull(table, ids)
            assert got.missing.all() and got.rows.shape == (N, DIM + STATE)
            assert got.rows.dtype == info.schema.np_dtype  # bf16 as its uint16 bits
            # pulling does not store anything, and a second pull (another order) is identical
            assert ps.describe_table(table).num_rows == 0
            perm = np.random.default_rng(2).permutation(N)
            again = ps.pull(table, ids[perm])
            assert np.array_equal(again.rows, got.rows[perm]) and again.missing.all()
            pulls.append(got.rows)
    # the embedded PS and the Redis PS are separate processes: the values depend on (seed, id, column) only
    assert np.array_equal(pulls[0], pulls[1])
    # ...and are what the client-side function gives (a trainer may fill rows itself)
    assert np.array_equal(pulls[0], initial_rows(info.schema, ids))

    values = as_float(pulls[0], dtype)
    emb, state = values[:, :DIM], values[:, DIM:]
    assert np.all(state == rounded(init.state_init, dtype))
    if kind == "zeros":
        assert np.all(emb == 0)
    elif kind == "constant":
        assert np.all(emb == rounded(init.a, dtype))
    else:
        # different ids get different rows, and the columns of one row differ
        assert len(np.unique(emb, axis=0)) == N
        assert np.all(np.ptp(emb, axis=1) > 0)
        if kind == "uniform":
            assert emb.min() >= rounded(init.a, dtype) and emb.max() <= rounded(init.b, dtype)
            assert abs(emb.mean() - (init.a + init.b) / 2) < 0.01
            assert abs(emb.std() - (init.b - init.a) / np.sqrt(12)) < 0.01
        else:
            assert abs(emb.mean() - init.a) < 0.02 and abs(emb.std() - init.b) < 0.02
            # a normal's tails: about 4.6% beyond 2 std
            beyond = np.mean(np.abs(emb - init.a) > 2 * init.b)
            assert 0.035 < beyond < 0.06


@pytest.mark.parametrize("kind", ["uniform", "normal"])
def test_the_seed_changes_the_values(two_ps, kind):
    ids = sample_ids()[:500]
    with PSClient(two_ps[0]) as ps:
        base = KINDS[kind]
        rows = []
        for seed in (base.seed, base.seed + 1):
            table = f"seed_{kind}_{seed}"
            ps.create_table(
                table,
                dim=DIM,
                state_width=STATE,
                initializer=Initializer(kind, base.a, base.b, seed=seed, state_init=base.state_init),
            )
            rows.append(ps.pull(table, ids).rows)
    differ = np.any(rows[0][:, :DIM] != rows[1][:, :DIM], axis=1)
    assert differ.all()
    assert np.array_equal(rows[0][:, DIM:], rows[1][:, DIM:])  # the state part is state_init either way


@pytest.mark.parametrize("dtype", DTYPES)
def test_pushed_and_missing_rows_side_by_side(two_ps, dtype):
    """Push half the ids: those come back exactly as pushed and not flagged; the other half stay
    initialised as before and flagged, in one pull over both PS processes as two shards."""
    init = KINDS["normal"]
    table = f"mixed_{dtype}"
    ids = sample_ids()
    rng = np.random.default_rng(3)
    with PSClient(two_ps) as ps:  # two shards: ids split between the embedded and the Redis PS
        info = ps.create_table(table, dim=DIM, state_width=STATE, dtype=dtype, initializer=init)
        before = ps.pull(table, ids)
        assert before.missing.all()
        pushed = rng.random(N) < 0.5
        if dtype == "bf16":
            rows = rng.integers(0, 1 << 16, (int(pushed.sum()), DIM + STATE), dtype=np.uint16)
        else:
            rows = rng.standard_normal((int(pushed.sum()), DIM + STATE)).astype(info.schema.np_dtype)
        assert ps.push(table, ids[pushed], rows) == len(rows)
        after = ps.pull(table, ids)
        assert np.array_equal(after.missing, ~pushed)
        assert np.array_equal(after.rows[pushed], rows)
        assert np.array_equal(after.rows[~pushed], before.rows[~pushed])
        assert ps.describe_table(table).num_rows == len(rows)
        # deleting a pushed id brings its initial row back
        gone = ids[pushed][:10]
        assert ps.delete(table, gone) == 10
        back = ps.pull(table, gone)
        assert back.missing.all() and np.array_equal(back.rows, before.rows[pushed][:10])
    # each PS of the pair holds rows (the ids were split between them)
    for address in two_ps:
        with PSClient(address) as one:
            assert 0 < one.describe_table(table).num_rows < len(rows)


@pytest.mark.parametrize(
    "dtype,init,bound",
    [
        ("fp32", Initializer("uniform", -1e308, 1e308), "3.40282e+38"),
        ("fp32", Initializer("constant", 1e39), "3.40282e+38"),
        ("fp16", Initializer("constant", 1e6), "65504"),
        ("fp32", Initializer("normal", 0.0, 1e308), "3.40282e+38"),
        ("fp16", Initializer("normal", 0.0, 8000.0), "65504"),  # mean + 8.6 std is past fp16's range
        ("bf16", Initializer("zeros", state_init=1e39), "3.38953e+38"),
    ],
    ids=["uniform-fp32", "constant-fp32", "constant-fp16", "normal-fp32", "normal-fp16", "state-bf16"],
)
def test_an_initializer_that_overflows_its_dtype_is_refused(two_ps, dtype, init, bound):
    """Such a table was created, and every pull of a new row returned inf."""
    from dynemb.ps_server.errors import InvalidArgument

    for address in two_ps:
        with PSClient(address) as ps:
            with pytest.raises(InvalidArgument) as info:
                ps.create_table(f"overflow_{dtype}_{init.kind}", dim=DIM, dtype=dtype, initializer=init)
            assert f"{dtype} range" in str(info.value) and bound in str(info.value)
            assert "INVALID_ARGUMENT" in str(info.value)
            assert not any(t.schema.name.startswith("overflow_") for t in ps.list_tables())
    # the widest that fit are taken, and pull finite values
    with PSClient(two_ps[0]) as ps:
        ps.create_table("fits_fp16", dim=DIM, dtype="fp16", initializer=Initializer("uniform", -65504.0, 65504.0))
        assert np.isfinite(ps.pull("fits_fp16", sample_ids()).rows).all()
