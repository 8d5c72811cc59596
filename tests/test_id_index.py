"""ps_server/backends/id_index.py: the vectorised int64 -> int64 map against a dict model."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from ps_server.backends import id_index
from ps_server.backends.id_index import IdIndex
from ps_server.hashing import xxh64_ids

INT64_MIN, INT64_MAX = -(1 << 63), (1 << 63) - 1
EDGE_IDS = [0, 1, -1, 255, 256, 1 << 56, INT64_MIN, INT64_MIN + 1, INT64_MAX]

# A small key range gives collisions, repeats and tombstones; edge ids mixed in.
keys = st.one_of(st.integers(-200, 200), st.sampled_from(EDGE_IDS), st.integers(INT64_MIN, INT64_MAX))
ops = st.lists(
    st.one_of(
        st.tuples(st.just("insert"), st.lists(keys, max_size=60)),
        st.tuples(st.just("remove"), st.lists(keys, max_size=60)),
        st.tuples(st.just("lookup"), st.lists(keys, max_size=60)),
        st.tuples(st.just("lookup_or_insert"), st.lists(keys, max_size=60)),
        st.tuples(st.just("clear"), st.just([])),
    ),
    max_size=50,
)


def check_matches(index: IdIndex, model: dict) -> None:
    assert len(index) == len(model)
    k, v = index.items()
    assert len(k) == len(set(k.tolist())), "an id is stored twice"
    assert dict(zip(k.tolist(), v.tolist())) == model
    # at most half the slots are not empty (live or tombstone), so every probe chain ends
    assert 2 * int((index.state != id_index.EMPTY).sum()) <= index.capacity


@settings(max_examples=150, deadline=None)
@given(ops, st.sampled_from([1, 4, 16, 1024]))
def test_behaves_like_a_dict(sequence, capacity):
    index, model, next_value = IdIndex(capacity=capacity), {}, 0
    for op, ks in sequence:
        arr = np.array(ks, dtype=np.int64)
        if op == "insert":
            # the store's contract: insert only ids that are absent, each once
            new = np.unique(arr)
            new = new[index.lookup(new) < 0]
            values = np.arange(next_value, next_value + len(new), dtype=np.int64)
            next_value += len(new)
            index.insert(new, values)
            model.update(zip(new.tolist(), values.tolist()))
        elif op == "remove":  # repeats in one call are removed once
            removed = index.remove(arr)
            want = [model.pop(k) for k in dict.fromkeys(ks) if k in model]
            assert sorted(removed.tolist()) == sorted(want)
        elif op == "lookup":
            assert index.lookup(arr).tolist() == [model.get(k, -1) for k in ks]
        elif op == "lookup_or_insert":  # the store's push: distinct ids, absent ones get new values
            distinct = np.array(list(dict.fromkeys(ks)), dtype=np.int64)
            start = next_value

            def allocate(k: int) -> np.ndarray:
                return np.arange(start, start + k, dtype=np.int64)

            want = []
            for k in distinct.tolist():
                if k not in model:
                    model[k] = next_value
                    next_value += 1
                want.append(model[k])
            assert index.lookup_or_insert(distinct, allocate).tolist() == want
        else:
            index.clear()
            model.clear()
        check_matches(index, model)
    everything = np.array(sorted(model) + EDGE_IDS, dtype=np.int64)
    assert index.lookup(everything).tolist() == [model.get(k, -1) for k in everything.tolist()]


def ids_with_home(cap: int, home: int, count: int, start: int = 0) -> np.ndarray:
    """`count` ids whose first probe slot in a table of `cap` slots is `home`."""
    cand = np.arange(start, start + 200_000, dtype=np.int64)
    slots = xxh64_ids(cand, id_index._HASH_SEED) & np.uint64(cap - 1)
    found = cand[slots == np.uint64(home)][:count]
    assert len(found) == count
    return found


def test_colliding_ids_in_one_batch_and_a_tombstone_in_the_chain():
    index = IdIndex(capacity=64)
    cap = index.capacity
    same = ids_with_home(cap, 5, 6)  # six ids that all want slot 5: they share one probe chain
    index.insert(same, np.arange(6) * 10)
    assert index.capacity == cap and index.lookup(same).tolist() == [0, 10, 20, 30, 40, 50]
    # remove one in the middle of the chain: the ids after it stay reachable through its tombstone
    assert index.remove(same[2:3]).tolist() == [20]
    assert index.lookup(same).tolist() == [0, 10, -1, 30, 40, 50]
    assert index.remove(same[2:3]).tolist() == []  # removing twice removes nothing
    assert len(index) == 5
    # a new id with the same home reuses a free slot and is found; the old ones still are
    another = ids_with_home(cap, 5, 1, start=200_000)
    index.insert(another, np.array([99]))
    assert index.lookup(np.concatenate([same, another])).tolist() == [0, 10, -1, 30, 40, 50, 99]
    # an id removed and inserted again gets its new value
    index.insert(same[2:3], np.array([7]))
    assert index.lookup(same[2:3]).tolist() == [7]
    assert len(index) == 7


def test_growth_keeps_every_entry():
    index = IdIndex(capacity=1)
    assert index.capacity == 16  # the smallest table
    rng = np.random.default_rng(0)
    ids = np.concatenate([np.array(EDGE_IDS, dtype=np.int64), rng.choice(1 << 62, 60000, replace=False)])
    values = rng.integers(0, 1 << 40, len(ids))
    caps = []
    for lo in range(0, len(ids), 7000):  # batches of mixed sizes, each growing the table
        index.insert(ids[lo:lo + 7000], values[lo:lo + 7000])
        caps.append(index.capacity)
        assert np.array_equal(index.lookup(ids[: lo + 7000]), values[: lo + 7000])
    assert caps == sorted(caps) and caps[-1] >= 2 * len(ids)
    assert caps[-1] & (caps[-1] - 1) == 0  # a power of two
    absent = rng.choice(1 << 62, 1000) | (1 << 62)  # the 1 << 62 bit is never set in ids above
    assert np.all(index.lookup(absent) == -1)


def test_churn_does_not_grow_without_bound():
    """Insert and delete the same number of ids over and over: tombstones are dropped when
    the table is rebuilt, so its size follows the live ids, not the ids ever seen."""
    index = IdIndex(capacity=16)
    live: dict[int, int] = {}
    for step in range(60):
        ids = np.arange(step * 1000, step * 1000 + 1000, dtype=np.int64)
        index.insert(ids, ids * 2)
        live.update(zip(ids.tolist(), (ids * 2).tolist()))
        check_matches(index, live)
        if step >= 2:  # keep the two newest batches
            old = np.arange((step - 2) * 1000, (step - 1) * 1000, dtype=np.int64)
            assert sorted(index.remove(old).tolist()) == (old * 2).tolist()
            for k in old.tolist():
                del live[k]
    assert len(index) == len(live) == 2000
    assert index.capacity <= 8192, index.capacity  # 60000 ids were seen; 2000 live
    check_matches(index, live)
    gone = np.arange(0, 58000, dtype=np.int64)
    assert np.all(index.lookup(gone) == -1)


def test_clear_and_nbytes():
    index = IdIndex(capacity=4096)
    index.insert(np.arange(100, dtype=np.int64), np.arange(100))
    assert index.nbytes() == index.capacity * 17  # key, value and state per slot
    index.clear()
    assert len(index) == 0 and index.items()[0].size == 0
    assert np.all(index.lookup(np.arange(100)) == -1)
    index.insert(np.array([5]), np.array([6]))
    assert index.lookup(np.array([5, 6])).tolist() == [6, -1]
