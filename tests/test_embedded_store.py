"""The embedded store against a dict: pushes with repeated ids (the last row wins), pulls into
a given array, deletes that free rows for reuse."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dynemb.ps_server.backends.embedded import EmbeddedStore
from dynemb.ps_server.schema import TableSchema

SCHEMA = TableSchema("t", 2, 1, "fp32")
ids_st = st.lists(st.integers(-20, 20), max_size=40)
ops = st.lists(st.tuples(st.sampled_from(["push", "pull", "pull_into", "delete"]), ids_st), max_size=30)


@settings(max_examples=150, deadline=None)
@given(ops)
def test_behaves_like_a_dict(sequence):
    store, model, stamp = EmbeddedStore(), {}, 0.0
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
