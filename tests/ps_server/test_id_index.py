"""dynemb/ps_server/backends/id_index.py (the compiled map of dynemb/ps_server/csrc/id_index.h) against a dict model."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dynemb.ps_server import native
from dynemb.ps_server.backends.id_index import SLOT_BYTES, IdIndex

INT64_MIN, INT64_MAX = -(1 << 63), (1 << 63) - 1
EDGE_IDS = [0, 1, -1, 255, 256, 1 << 56, INT64_MIN, INT64_MIN + 1, INT64_MAX]

# A small key range gives collisions, repeats and removals mid-chain; edge ids mixed in.
keys = st.one_of(st.integers(-200, 200), st.sampled_from(EDGE_IDS), st.integers(INT64_MIN, INT64_MAX))
batch = st.lists(keys, max_size=60)
ops = st.lists(
    st.one_of(
        st.tuples(st.just("insert"), batch),
        st.tuples(st.just("remove"), batch),
        st.tuples(st.just("lookup"), batch),
        st.tuples(st.just("lookup_or_insert"), batch),
        st.tuples(st.just("clear"), st.just([])),
    ),
    max_size=50,
)


def check_matches(index: IdIndex, model: dict) -> None:
    assert len(index) == len(model)
    k, v = index.items()
    assert len(k) == len(set(k.tolist())), "an id is stored twice"
    assert dict(zip(k.tolist(), v.tolist())) == model
    assert 2 * len(index) <= index.capacity  # at most half full, so probe chains stay short


@settings(max_examples=200, deadline=None)
@given(ops, st.sampled_from([1, 4, 16, 1024]), st.integers(0, 2**64 - 1))
def test_behaves_like_a_dict(sequence, capacity, seed):
    index, model, next_value = IdIndex(capacity=capacity, seed=seed), {}, 0
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
        elif op == "lookup_or_insert":  # the store's push: absent ids get new values, once each
            start, calls, spare = next_value, [], []

            def allocate(k: int) -> np.ndarray:
                calls.append(k)
                return np.arange(start, start + k, dtype=np.int64)

            absent = [k for k in ks if k not in model]
            given = dict(zip(range(len(absent)), range(start, start + len(absent))))
            first_value = {}
            for j, k in enumerate(absent):  # an absent id takes its first occurrence's value
                first_value.setdefault(k, given[j])
            got = index.lookup_or_insert(arr, allocate, spare.append).tolist()
            model.update(first_value)
            assert got == [model[k] for k in ks]  # every occurrence gets its id's value
            assert calls == ([len(absent)] if absent else [])  # once, with the count of absent ids
            unused = sorted(np.concatenate(spare).tolist()) if spare else []
            assert unused == sorted(set(given.values()) - set(first_value.values()))  # the repeats' values
            next_value += len(absent)
        else:
            index.clear()
            model.clear()
        check_matches(index, model)
    everything = np.array(sorted(model) + EDGE_IDS, dtype=np.int64)
    assert index.lookup(everything).tolist() == [model.get(k, -1) for k in everything.tolist()]


def fmix64(x: np.ndarray) -> np.ndarray:
    """The C side's hash (MurmurHash3's finaliser), in numpy's wrapping uint64 arithmetic."""
    x = x.astype(np.uint64)
    with np.errstate(over="ignore"):
        x ^= x >> np.uint64(33)
        x *= np.uint64(0xFF51AFD7ED558CCD)
        x ^= x >> np.uint64(33)
        x *= np.uint64(0xC4CEB9FE1A85EC53)
        x ^= x >> np.uint64(33)
    return x


def ids_with_home(cap: int, seed: int, home: int, count: int, start: int = 0) -> np.ndarray:
    """`count` ids whose first probe slot in a table of `cap` slots is `home`."""
    cand = np.arange(start, start + 200_000, dtype=np.int64)
    shift = np.uint64(64 - (cap.bit_length() - 1))
    slots = fmix64(cand.view(np.uint64) ^ np.uint64(seed)) >> shift
    found = cand[slots == np.uint64(home)][:count]
    assert len(found) == count
    return found


@pytest.mark.parametrize("home", [5, 63])  # 63: the chain wraps around the table's end
def test_colliding_ids_and_a_removal_mid_chain(home):
    seed = 12345
    index = IdIndex(capacity=32, seed=seed)
    cap = index.capacity
    assert cap == 64
    same = ids_with_home(cap, seed, home, 6)  # six ids that all want one slot: one probe chain
    index.insert(same, np.arange(6) * 10)
    assert index.capacity == cap and index.lookup(same).tolist() == [0, 10, 20, 30, 40, 50]
    # remove one in the middle of the chain: the ids after it move back and stay reachable
    assert index.remove(same[2:3]).tolist() == [20]
    assert index.lookup(same).tolist() == [0, 10, -1, 30, 40, 50]
    assert index.remove(same[2:3]).tolist() == []  # removing twice removes nothing
    assert len(index) == 5
    # a new id with the same home takes a free slot and is found; the old ones still are
    another = ids_with_home(cap, seed, home, 1, start=200_000)
    index.insert(another, np.array([99]))
    assert index.lookup(np.concatenate([same, another])).tolist() == [0, 10, -1, 30, 40, 50, 99]
    # an id removed and inserted again gets its new value
    index.insert(same[2:3], np.array([7]))
    assert index.lookup(same[2:3]).tolist() == [7]
    assert len(index) == 7
    assert sorted(index.remove(np.concatenate([same, another])).tolist()) == [0, 7, 10, 30, 40, 50, 99]
    assert len(index) == 0 and np.all(index.lookup(same) == -1)


def test_growth_keeps_every_entry():
    index = IdIndex(capacity=1)
    assert index.capacity == 16  # the smallest table
    rng = np.random.default_rng(0)
    ids = np.concatenate([np.array(EDGE_IDS, dtype=np.int64), rng.choice(1 << 62, 60000, replace=False)])
    values = rng.integers(0, 1 << 40, len(ids))
    caps = []
    for lo in range(0, len(ids), 7000):  # batches of mixed sizes, each growing the table
        index.insert(ids[lo : lo + 7000], values[lo : lo + 7000])
        caps.append(index.capacity)
        assert np.array_equal(index.lookup(ids[: lo + 7000]), values[: lo + 7000])
    assert caps == sorted(caps) and caps[-1] >= 2 * len(ids)
    assert caps[-1] & (caps[-1] - 1) == 0  # a power of two
    absent = rng.choice(1 << 62, 1000) | (1 << 62)  # the 1 << 62 bit is never set in ids above
    assert np.all(index.lookup(absent) == -1)


def test_churn_does_not_grow_without_bound():
    """Insert and delete the same number of ids over and over: a removal leaves no tombstone,
    so the table's size follows the live ids, not the ids ever seen."""
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
    assert index.nbytes() == index.capacity * SLOT_BYTES
    index.clear()
    assert len(index) == 0 and index.items()[0].size == 0 and index.capacity == 16  # memory given back
    assert np.all(index.lookup(np.arange(100)) == -1)
    index.insert(np.array([5]), np.array([6]))
    assert index.lookup(np.array([5, 6])).tolist() == [6, -1]


def test_ids_of_other_layouts_are_converted_and_others_refused():
    index = IdIndex()
    index.insert(np.array([1, 2, 3], dtype=np.int64), np.array([10, 20, 30]))
    strided = np.arange(8, dtype=np.int64)[::2]  # 0 2 4 6: not contiguous
    assert index.lookup(strided).tolist() == [-1, 20, -1, -1]
    assert index.lookup(np.array([3, 1], dtype=np.int32)).tolist() == [30, 10]
    assert index.lookup(np.array([3, 1], dtype=">i8")).tolist() == [30, 10]  # big-endian
    assert index.lookup([1, 3]).tolist() == [10, 30]
    assert index.lookup(np.array([])).tolist() == []  # numpy's empty array is float64
    with pytest.raises(TypeError, match="int64"):
        index.lookup(np.array([1.0, 2.0]))
    with pytest.raises(TypeError, match="int64"):
        index.remove(np.array(["1"]))
    with pytest.raises(ValueError, match="1-D"):
        index.lookup(np.array([[1, 2]], dtype=np.int64))
    with pytest.raises(ValueError, match=">= 0"):
        index.insert(np.array([9]), np.array([-5]))
    with pytest.raises(ValueError, match="2 values"):
        index.insert(np.array([9]), np.array([1, 2]))
    with pytest.raises(ValueError, match="returned 1 values"):
        index.lookup_or_insert(np.array([7, 8]), lambda k: np.arange(1))
    assert len(index) == 3 and index.lookup(np.array([7, 8, 9])).tolist() == [-1, -1, -1]  # nothing half-done


def test_repeated_absent_ids_get_one_value():
    index = IdIndex()
    index.insert(np.array([9]), np.array([7]))
    asked, spare = [], []
    got = index.lookup_or_insert(
        np.array([4, 9, 4, 5, 9, 5, 4]), lambda k: asked.append(k) or np.arange(100, 100 + k), spare.append
    )
    assert asked == [5]  # the five absent occurrences
    assert got.tolist() == [100, 7, 100, 102, 7, 102, 100]
    assert sorted(np.concatenate(spare).tolist()) == [101, 103, 104]  # given to repeats, unused
    assert len(index) == 3 and index.lookup(np.array([4, 5, 9])).tolist() == [100, 102, 7]


def test_the_c_module_checks_every_buffer_itself():
    """The module behind the wrapper never trusts its caller: wrong sizes, dtypes, layouts,
    positions or handles are Python exceptions, never a read or write outside a buffer."""
    from dynemb.ps_server import native

    c = native.id_index()
    h = c.new(16, 1)
    ids = np.arange(10, dtype=np.int64)
    assert c.insert(h, ids, None, ids * 2, None) == 0
    with pytest.raises(ValueError, match="too small"):
        c.lookup(h, ids, np.empty(9, dtype=np.int64), None)
    with pytest.raises(ValueError, match="too small"):
        c.lookup(h, ids, np.empty(10, dtype=np.int64), np.empty(3, dtype=np.int64))
    with pytest.raises(ValueError, match="too small"):
        c.remove(h, ids, np.empty(2, dtype=np.int64))
    with pytest.raises(TypeError, match="int64"):
        c.lookup(h, ids.astype(np.int32), np.empty(10, dtype=np.int64), None)
    with pytest.raises(TypeError, match="int64"):
        c.lookup(h, ids.astype(np.float64), np.empty(10, dtype=np.int64), None)
    with pytest.raises(ValueError, match="contiguous"):  # numpy refuses to export it
        c.lookup(h, np.arange(20, dtype=np.int64)[::2], np.empty(10, dtype=np.int64), None)
    read_only = np.zeros(10, dtype=np.int64)
    read_only.setflags(write=False)
    with pytest.raises(ValueError, match="read-only"):
        c.lookup(h, ids, read_only, None)
    with pytest.raises(IndexError, match="outside"):
        c.insert(h, ids, np.array([10], dtype=np.int64), np.array([1], dtype=np.int64), None)
    with pytest.raises(IndexError, match="outside"):
        c.insert(h, ids, np.array([-1], dtype=np.int64), np.array([1], dtype=np.int64), None)
    with pytest.raises(ValueError, match="one value"):
        c.insert(h, ids, None, np.array([1], dtype=np.int64), None)
    with pytest.raises(ValueError, match="too small"):
        c.insert(h, ids, np.array([1], dtype=np.int64), np.array([1], dtype=np.int64), np.empty(1, dtype=np.int64))
    with pytest.raises(ValueError, match="PyCapsule"):
        c.size(object())  # not an index
    keys, values = np.empty(3, dtype=np.int64), np.empty(10, dtype=np.int64)
    assert c.items(h, keys, values) == 3  # only as many as the smaller buffer holds
    assert c.size(h) == 10


def test_pull_rows_copies_the_rows_asked_for():
    """The store's pull copies rows with pull_rows: equal to numpy's indexing on a big table's
    scattered rows (the copy prefetches rows further down)."""
    rng = np.random.default_rng(7)
    table = rng.random((1000, 17), dtype=np.float32)
    index = IdIndex()
    stored = rng.choice(1 << 40, 1000, replace=False).astype(np.int64)
    index.insert(stored, rng.permutation(1000).astype(np.int64))
    ids = stored[rng.integers(0, 1000, 5000)]
    out = np.empty((5000, 17), dtype=np.float32)
    assert len(index.pull_rows(ids, table, out)) == 0
    assert np.array_equal(out, table[index.lookup(ids)])


def test_scatter_writes_the_rows_given_and_refuses_what_is_outside():
    from dynemb.ps_server import native

    scatter = native.id_index().scatter
    rng = np.random.default_rng(8)
    table = np.zeros((1000, 17), dtype=np.float32)
    rows = rng.random((300, 17), dtype=np.float32)
    where = rng.choice(1000, 300, replace=False)
    take = rng.integers(0, 300, 300)
    expect = table.copy()
    expect[where] = rows[take]
    scatter(table, 68, where, rows, take)
    assert np.array_equal(table, expect)
    for w, t in (([1000], [0]), ([-1], [0]), ([0], [300]), ([0], [-1])):
        with pytest.raises(IndexError, match="out of range"):
            scatter(table, 68, np.array(w), rows, np.array(t))
    assert np.array_equal(table, expect)  # a refused call wrote nothing
    with pytest.raises(ValueError, match="differ in length"):
        scatter(table, 68, where, rows, take[:5])
    with pytest.raises(BufferError):
        scatter(bytes(68 * 10), 68, where[:1] % 10, rows, take[:1])


@settings(max_examples=60, deadline=None)
@given(
    stored=st.lists(st.integers(-(1 << 63), (1 << 63) - 1), unique=True, max_size=60),
    asked=st.lists(st.integers(-5, 5), max_size=80),
    width=st.integers(1, 9),
)
def test_pull_rows_is_a_lookup_then_a_gather(stored, asked, width):
    """pull_rows (one C call) = lookup, gather of the present, positions of the absent."""
    index = IdIndex()
    table = np.arange((len(stored) + 3) * width, dtype=np.float32).reshape(-1, width)
    index.insert(np.array(stored, dtype=np.int64), np.arange(len(stored), dtype=np.int64) + 3)
    # ask for stored ids (by position) and for ones never stored
    ids = np.array([stored[a % len(stored)] if stored and a >= 0 else (1 << 62) + a for a in asked], dtype=np.int64)
    out = np.full((len(ids), width), -1.0, np.float32)
    missing = index.pull_rows(ids, table, out)
    where = index.lookup(ids)
    assert missing.tolist() == np.flatnonzero(where < 0).tolist()
    present = where >= 0
    assert np.array_equal(out[present], table[where[present]])
    assert (out[~present] == -1.0).all()  # rows of absent ids untouched


def test_pull_rows_refuses_what_is_outside():
    index = IdIndex()
    index.insert(np.array([7], dtype=np.int64), np.array([5], dtype=np.int64))  # row 5 of a 2-row table
    c = native.id_index()
    table, out, missing = np.zeros((2, 4), np.float32), np.zeros((1, 4), np.float32), np.zeros(1, np.int64)
    with pytest.raises(IndexError, match="outside the 2 rows"):
        index.pull_rows(np.array([7]), table, out)
    with pytest.raises(ValueError, match="too small"):
        c.pull_rows(index._h, table, 16, np.array([7, 7]), out, missing)
    with pytest.raises(ValueError, match="missing"):
        c.pull_rows(index._h, table, 16, np.array([7, 7]), np.zeros((2, 4), np.float32), missing)
    with pytest.raises(ValueError, match="row_bytes"):
        c.pull_rows(index._h, table, 0, np.array([7]), out, missing)
    index.insert(np.array([8], dtype=np.int64), np.array([1], dtype=np.int64))
    with pytest.raises(BufferError):  # a read-only out
        c.pull_rows(index._h, table, 16, np.array([8]), bytes(16), missing)


@settings(max_examples=60, deadline=None)
@given(batches=st.lists(st.lists(st.integers(-6, 6), max_size=30), max_size=6), width=st.integers(1, 5))
def test_push_rows_is_an_upsert_then_a_scatter(batches, width):
    """push_rows (one C call): new ids take the next free rows in order of first sighting, every
    id's row is written, a repeated id's last row stays; against a dict."""
    index, table, used, model = IdIndex(capacity=1), np.zeros((0, width), np.float32), 0, {}
    for b, batch in enumerate(batches):
        ids = np.array(batch, dtype=np.int64)
        rows = (np.arange(len(ids) * width, dtype=np.float32) + 1000 * b).reshape(-1, width)
        grown = np.zeros((used + len(ids), width), np.float32)
        grown[:used] = table[:used]
        table = grown
        new = index.push_rows(ids, table, rows, used)
        first_seen = [k for i, k in enumerate(batch) if k not in model and k not in batch[:i]]
        assert new == len(first_seen)
        assert index.lookup(np.array(first_seen, dtype=np.int64)).tolist() == list(range(used, used + new))
        used += new
        for k, row in zip(batch, rows):
            model[k] = row
        assert len(index) == len(model)
        for k, row in model.items():
            assert np.array_equal(table[index.lookup(np.array([k]))[0]], row)


def test_push_rows_refuses_what_does_not_fit():
    index = IdIndex()
    c = native.id_index()
    table, rows = np.zeros((3, 2), np.float32), np.ones((2, 2), np.float32)
    with pytest.raises(ValueError, match="not room for 2 from row 2"):
        index.push_rows(np.array([1, 2]), table, rows, 2)
    with pytest.raises(ValueError, match="2 contiguous rows"):
        index.push_rows(np.array([1, 2]), table, rows[:1], 0)
    with pytest.raises(ValueError, match="2 contiguous rows"):
        index.push_rows(np.array([1, 2]), table, rows.astype(np.float64), 0)
    with pytest.raises(ValueError, match="fewer rows"):
        c.push_rows(index._h, table, 8, np.array([1, 2]), rows[:1], 0)
    with pytest.raises(ValueError, match="next_value"):
        c.push_rows(index._h, table, 8, np.array([1]), rows, -1)
    with pytest.raises(BufferError):  # a read-only table
        c.push_rows(index._h, bytes(24), 8, np.array([1]), rows, 0)
    assert len(index) == 0  # nothing was inserted by a refused call
    assert index.push_rows(np.array([5, 5]), table, np.array([[1, 2], [3, 4]], np.float32), 1) == 1
    assert table[1].tolist() == [3.0, 4.0] and index.lookup(np.array([5])).tolist() == [1]
