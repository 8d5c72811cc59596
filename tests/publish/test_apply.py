"""Published versions applied to serving stores (dynemb/publish/apply.py): Redis (standalone and
Cluster) and the embedded store's files. What readers see is the PS's rows at the cut, never a
mix of two versions; a gap or a corrupt file writes nothing; an applier cut short is finished by
the next."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from dynemb.ps_server.backends.embedded import EmbeddedStore
from dynemb.ps_server.backends.serving_redis import ServingRedis
from dynemb.publish import apply as apply_mod
from dynemb.publish.apply import apply_table, serving_store
from dynemb.publish.version import VersionError, VersionWriter, folder_name

DIM = 4


def write_version(root, number, kind, rows: dict[int, float], deleted=(), dtype="fp32", parent=None, base=None):
    """A version whose row for id i is DIM copies of rows[i]."""
    ids = np.array(sorted(rows), dtype=np.int64)
    values = np.repeat(np.array([rows[i] for i in ids.tolist()], np.float32)[:, None], DIM, axis=1)
    parent = number - 1 if parent is None and kind == "delta" else parent
    base = number if kind == "full" else (base or 1)
    with VersionWriter(root, "user", number, kind, parent, base, dtype, DIM, number, rows_per_file=7) as w:
        w.write_rows(ids, values)
        w.write_deleted(np.asarray(deleted, dtype=np.int64))


def read(target: str, namespace: str, ids) -> dict[int, float]:
    """What a reader of the serving store finds: id -> the row's first value."""
    ids = np.asarray(ids, dtype=np.int64)
    store = serving_store(target, namespace)
    if isinstance(store, ServingRedis):
        rows, found, _ = store.pull("user", ids)
    else:
        es = EmbeddedStore(str(store))
        rows, found = es.pull("user", ids)
    return {i: float(r[0]) for i, r, f in zip(ids.tolist(), rows, found) if f}


def test_a_chain_applied_is_what_was_published(target, redis_namespace, tmp_path):
    root = tmp_path / "published"
    write_version(root, 1, "full", {i: float(i) for i in range(100)})
    store = serving_store(target, redis_namespace)
    assert apply_table(store, root, "user").versions == [1]
    assert read(target, redis_namespace, range(200)) == {i: float(i) for i in range(100)}
    write_version(root, 2, "delta", {5: -5.0, 150: 150.0}, deleted=[7, 8, 999])
    write_version(root, 3, "delta", {7: 77.0, 150: 1.5}, deleted=[5])
    got = apply_table(serving_store(target, redis_namespace), root, "user")
    assert got.versions == [2, 3] and got.holds == 3
    want = {i: float(i) for i in range(100) if i not in (5, 8)} | {7: 77.0, 150: 1.5}
    assert read(target, redis_namespace, range(200)) == want
    # again: a no-op
    assert apply_table(serving_store(target, redis_namespace), root, "user") == ([], 3)
    # a new full version replaces everything
    write_version(root, 4, "full", {1000: 1.0, 1001: 2.0})
    assert apply_table(serving_store(target, redis_namespace), root, "user").versions == [4]
    assert read(target, redis_namespace, [*range(200), 1000, 1001]) == {1000: 1.0, 1001: 2.0}
    if "redis" in target:  # the old full's keys are gone
        s = serving_store(target, redis_namespace)
        assert s.raw_head("user").tag == "v4"
        with s.store._redis():
            assert s.store.client.exists(b"dn:%s:serving:user:v1:{user.0}" % redis_namespace.encode()) == 0


def test_a_gap_or_a_corrupt_file_writes_nothing(target, redis_namespace, tmp_path):
    root = tmp_path / "published"
    write_version(root, 1, "full", {1: 1.0, 2: 2.0})
    apply_table(serving_store(target, redis_namespace), root, "user")
    write_version(root, 2, "delta", {1: 10.0})
    write_version(root, 3, "delta", {2: 20.0})
    rows_file = root / "user" / folder_name(3) / "rows-00000.safetensors"
    data = bytearray(rows_file.read_bytes())
    data[-1] ^= 1
    rows_file.write_bytes(bytes(data))
    with pytest.raises(VersionError, match="corrupt"):
        apply_table(serving_store(target, redis_namespace), root, "user")
    assert read(target, redis_namespace, [1, 2]) == {1: 1.0, 2: 2.0}  # not even version 2
    for p in (root / "user" / folder_name(3)).iterdir():
        p.unlink()
    (root / "user" / folder_name(3)).rmdir()
    write_version(root, 4, "delta", {2: 40.0}, parent=3)  # version 3 missing: a gap
    with pytest.raises(VersionError, match="no chain"):
        apply_table(serving_store(target, redis_namespace), root, "user")
    assert read(target, redis_namespace, [1, 2]) == {1: 1.0, 2: 2.0}


@pytest.mark.parametrize("cut_after", ["step1", "step2"])
def test_an_applier_cut_short_leaves_the_last_version_and_the_next_finishes(
    redis_url, redis_namespace, tmp_path, monkeypatch, cut_after
):
    root = tmp_path / "published"
    write_version(root, 1, "full", {i: 1.0 for i in range(50)})
    write_version(root, 2, "delta", {i: 2.0 for i in range(0, 50, 2)}, deleted=[1, 3])
    apply_table(serving_store(redis_url, redis_namespace), root, "user")  # both
    write_version(root, 3, "delta", {i: 3.0 for i in range(50)}, deleted=[0])
    real = ServingRedis.set_head

    def killed(self, table, bump, **fields):  # as if killed -9 before (step 1) or after (2) the switch
        if fields.get("visible") == 1 and cut_after == "step1":
            raise KeyboardInterrupt("killed")
        real(self, table, bump, **fields)
        if fields.get("visible") == 1 and cut_after == "step2":
            raise KeyboardInterrupt("killed")

    monkeypatch.setattr(ServingRedis, "set_head", killed)
    with pytest.raises(KeyboardInterrupt):
        apply_table(serving_store(redis_url, redis_namespace), root, "user")
    monkeypatch.setattr(ServingRedis, "set_head", real)
    seen = read(redis_url, redis_namespace, range(50))
    if cut_after == "step1":  # readers still at version 2
        assert seen == {i: (2.0 if i % 2 == 0 else 1.0) for i in range(50) if i not in (1, 3)}
    else:  # at version 3 already (its pending fields read)
        assert seen == {i: 3.0 for i in range(1, 50)}
    head = serving_store(redis_url, redis_namespace).raw_head("user")
    assert head.pending == 3
    assert apply_table(serving_store(redis_url, redis_namespace), root, "user").holds == 3
    head = serving_store(redis_url, redis_namespace).raw_head("user")
    assert (head.version, head.pending, head.visible) == (3, 0, 0)
    assert read(redis_url, redis_namespace, range(50)) == {i: 3.0 for i in range(1, 50)}


def test_readers_never_see_two_versions_at_once(redis_url, redis_namespace, tmp_path):
    """Every version sets every row to its number: a read of all rows must find one number."""
    root = tmp_path / "published"
    ids = list(range(1000))
    write_version(root, 1, "full", {i: 1.0 for i in ids})
    apply_table(serving_store(redis_url, redis_namespace), root, "user")
    stop = threading.Event()
    seen: list[set] = []

    def reader():
        store = serving_store(redis_url, redis_namespace)
        while not stop.is_set():
            rows, found, version = store.pull("user", np.array(ids))
            assert found.all()
            values = set(rows[:, 0].tolist())
            seen.append(values)
            assert values == {float(version)}

    threads = [threading.Thread(target=reader) for _ in range(2)]
    for t in threads:
        t.start()
    for n in range(2, 6):
        write_version(root, n, "delta", {i: float(n) for i in ids})
        apply_table(serving_store(redis_url, redis_namespace), root, "user")
    stop.set()
    for t in threads:
        t.join()
    assert len(seen) > 4 and all(len(v) == 1 for v in seen)
    assert len({next(iter(v)) for v in seen}) > 1  # the readers did read across versions


def test_int8_versions_are_read_dequantized(redis_url, redis_namespace, tmp_path):
    root = tmp_path / "published"
    write_version(root, 1, "full", {1: 1.0, 2: -0.5, 3: 0.0}, dtype="int8")
    store = serving_store(redis_url, redis_namespace)
    apply_table(store, root, "user")
    rows, found, _ = store.pull("user", np.array([1, 2, 3, 4]))
    assert found.tolist() == [True, True, True, False] and rows.dtype == np.float32
    np.testing.assert_allclose(rows[:3, 0], [1.0, -0.5, 0.0], atol=1 / 127)
    assert apply_mod.Applied([], 1) == ([], 1)


@pytest.mark.parametrize("kind", ["redis", "files"])
def test_a_lookup_serves_rows_a_default_and_follows_new_versions(redis_url, redis_namespace, tmp_path, kind):
    from dynemb.publish import Lookup

    root = tmp_path / "published"
    target = redis_url if kind == "redis" else f"embedded://{tmp_path / 'serving'}"
    write_version(root, 1, "full", {i: float(i) for i in range(10)})
    apply_table(serving_store(target, redis_namespace), root, "user")
    lookup = Lookup(target, "user", namespace=redis_namespace, default=-1.0, cache_rows=4, max_staleness_s=0.0)
    got = lookup(np.array([3, 99, 3, 5]))
    assert got.shape == (4, DIM) and got[:, 0].tolist() == [3.0, -1.0, 3.0, 5.0] and lookup.version == 1
    assert lookup.misses == 4 and len(lookup._cache) == 3  # 3, 99 (missing), 5
    lookup(np.array([3, 5]))
    assert lookup.hits == 2
    lookup(np.arange(10))
    assert len(lookup._cache) == 4  # bounded
    write_version(root, 2, "delta", {3: 33.0}, deleted=[5])
    apply_table(serving_store(target, redis_namespace), root, "user")
    assert lookup(np.array([3, 5, 4]))[:, 0].tolist() == [33.0, -1.0, 4.0] and lookup.version == 2
    stale = Lookup(target, "user", namespace=redis_namespace, max_staleness_s=3600)
    assert stale(np.array([3]))[0, 0] == 33.0
    write_version(root, 3, "delta", {3: 333.0})
    apply_table(serving_store(target, redis_namespace), root, "user")
    assert stale(np.array([3]))[0, 0] == 33.0  # cached, and not asked again within the hour
    assert stale(np.array([4, 3]))[:, 0].tolist() == [4.0, 333.0]  # a miss finds version 3: all read again
