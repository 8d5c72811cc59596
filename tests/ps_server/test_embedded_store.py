"""The embedded store (and the disk store) against a dict: pushes with repeated ids (the last row wins), pulls into
a given array, deletes that free rows for reuse."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dynemb.ps_server.backends.disk import DiskStore
from dynemb.ps_server.backends.embedded import EmbeddedStore, SnapshotError
from dynemb.ps_server.schema import TableSchema

SCHEMA = TableSchema("t", 2, 1, "fp32")
ids_st = st.lists(st.integers(-20, 20), max_size=40)
ops = st.lists(st.tuples(st.sampled_from(["push", "pull", "pull_into", "delete"]), ids_st), max_size=30)


@pytest.fixture(scope="module", params=["embedded", "disk"])
def any_store(request, tmp_path_factory):
    """One store of each kind for the module (the disk one's WAL synced in the background: what
    it keeps through a crash is tests/ps_server/test_ps_drain.py's)."""
    folder = tmp_path_factory.mktemp("disk")
    store = EmbeddedStore() if request.param == "embedded" else DiskStore(f"disk://{folder}?cache_bytes=1MiB&sync=100")
    yield store
    store.close()


@settings(max_examples=150, deadline=None)
@given(ops)
def test_behaves_like_a_dict(any_store, sequence):
    store, model, stamp = any_store, {}, 0.0
    store.drop_table(SCHEMA.name)  # the last example's
    store.create_table(SCHEMA)
    for op, ks in sequence:
        ids = np.array(ks, dtype=np.int64)
        if op == "push":
            rows = (stamp + np.arange(len(ks) * SCHEMA.width, dtype=np.float32)).reshape(len(ks), SCHEMA.width)
            stamp += 1000
            assert store.push("t", ids, rows) == len(ks)
            for k, row in zip(ks, rows):
                model[k] = row  # later occurrences overwrite: the last row wins
        elif op in ("pull", "pull_into"):
            out = np.full((len(ks), SCHEMA.width), -7, np.float32) if op == "pull_into" else None
            rows, found = store.pull("t", ids, out=out)
            if out is not None:
                assert rows is out
            assert found.tolist() == [k in model for k in ks]
            for k, row, f in zip(ks, rows, found):
                if f:
                    assert np.array_equal(row, model[k])
        else:
            assert store.delete("t", ids) == len({k for k in ks if k in model})
            for k in ks:
                model.pop(k, None)
        assert store.num_rows("t") == len(model)


def test_pull_into_refuses_an_array_of_the_wrong_shape_or_dtype():
    store = EmbeddedStore()
    store.create_table(SCHEMA)
    ids = np.arange(3, dtype=np.int64)
    with pytest.raises(ValueError, match=r"shape \(3, 3\)"):
        store.pull("t", ids, out=np.empty((3, 2), np.float32))
    with pytest.raises(ValueError, match="float32"):
        store.pull("t", ids, out=np.empty((3, 3), np.float64))


# -- saving to a directory ---------------------------------------------------------------


def saved_store(directory, version: float) -> EmbeddedStore:
    """A store on directory whose tables a, b, c hold rows all equal to version, saved."""
    store = EmbeddedStore(str(directory))
    for name in "abc":
        store.create_table(TableSchema(name, 2, 0, "fp32"))
        store.push(name, np.arange(50), np.full((50, 2), version, np.float32))
    store.save()
    return store


def versions(store: EmbeddedStore) -> dict[str, set[float]]:
    return {s.name: set(store.pull(s.name, np.arange(50))[0].ravel().tolist()) for s in store.list_tables()}


def test_each_save_is_a_generation_and_the_previous_one_is_kept(tmp_path):
    saved_store(tmp_path, 1.0)
    second = saved_store(tmp_path, 2.0)
    second.drop_table("c")
    second.save()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["MANIFEST.json", "gen-00000002", "gen-00000003"]
    assert sorted(p.name for p in (tmp_path / "gen-00000003").iterdir()) == [
        "a.safetensors",
        "b.safetensors",
        "tables.json",
    ]
    assert versions(EmbeddedStore(str(tmp_path))) == {"a": {2.0}, "b": {2.0}}


def test_a_torn_file_loads_the_previous_generation_and_names_the_file(tmp_path, caplog):
    saved_store(tmp_path, 1.0)
    saved_store(tmp_path, 2.0)
    torn = tmp_path / "gen-00000002" / "b.safetensors"
    with open(torn, "r+b") as f:
        f.truncate(torn.stat().st_size - 40)
    with caplog.at_level("INFO", logger="dynemb.ps"):
        store = EmbeddedStore(str(tmp_path))
    assert versions(store) == {"a": {1.0}, "b": {1.0}, "c": {1.0}}  # every table from generation 1
    assert store.generation == 1
    assert str(torn) in caplog.text and "torn or truncated" in caplog.text
    assert "loaded generation 1 instead" in caplog.text
    store.save()  # the next save replaces the torn generation
    assert versions(EmbeddedStore(str(tmp_path))) == {"a": {1.0}, "b": {1.0}, "c": {1.0}}
    assert not (tmp_path / "gen-00000002").exists()


def test_a_corrupt_file_with_no_older_generation_is_refused_naming_it(tmp_path):
    saved_store(tmp_path, 1.0)
    bad = tmp_path / "gen-00000001" / "a.safetensors"
    data = bytearray(bad.read_bytes())
    data[-1] ^= 0xFF  # same size, other bytes
    bad.write_bytes(bytes(data))
    with pytest.raises(SnapshotError, match=rf"{bad}: sha256 is not the one tables.json lists.*Move the directory"):
        EmbeddedStore(str(tmp_path))


def test_a_directory_of_the_older_layout_loads_and_moves_to_generations(tmp_path):
    """The layout of one <table>.safetensors per table at the top, no manifest."""
    import json

    from safetensors.numpy import save_file

    for name, width in (("old", 3), ("older", 2)):
        schema = TableSchema(name, width, 0, "fp32")
        save_file(
            {"ids": np.arange(4, dtype=np.int64), "rows": np.full((4, width), 7, np.float32)},
            str(tmp_path / f"{name}.safetensors"),
            metadata={"schema": json.dumps(schema.to_dict())},
        )
    store = EmbeddedStore(str(tmp_path))
    assert [s.name for s in store.list_tables()] == ["old", "older"] and store.num_rows("old") == 4
    store.save()
    assert (tmp_path / "old.safetensors").exists()  # the fallback until a second save
    store.save()
    assert not (tmp_path / "old.safetensors").exists()
    again = EmbeddedStore(str(tmp_path))
    assert (again.pull("old", np.arange(4))[0] == 7).all() and again.num_rows("older") == 4
