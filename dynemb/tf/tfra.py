"""TensorFlow Recommenders-Addons (TFRA) dynamic-embedding tables in a checkpoint.

A TFRA `dynamic_embedding.Variable` named V keeps its rows in N hash tables named
'V_mht_1ofN' ... 'V_mht_NofN' (slashes in V become underscores); each table saves two
tensors, its keys (the ids, (n,)) and its values ((n, dim)):

    TF1 Saver (graph mode):   <scope>/V_mht_1of2-keys, <scope>/V_mht_1of2-values, ...
    TF2 (tf.train.Checkpoint):<object path>/tables_of_V/0/.ATTRIBUTES/table-keys, .../table-values

An optimizer's slot of V is itself a TFRA variable named 'V/<optimizer>/<slot>', so its
tables are 'V_<optimizer>_<slot>_mht_...' (Adam: V_Adam_m, V_Adam_v; Adagrad:
V_Adagrad_accumulator). A slot's rows are matched to V's by key: the shards of a slot need
not list keys in V's order, and a key the slot lacks reads as missing.
"""

from __future__ import annotations

import re

import numpy as np

from dynemb.tf.bundle import Bundle, TensorInfo
from dynemb.tf.errors import TFMigrationError
from dynemb.tf.source import Rows, Table, bundle_rows, concat_rows

TF1 = re.compile(r"^(?:.*/)?(?P<table>[^/]+)_mht_(?P<i>\d+)of(?P<n>\d+)-(?P<part>keys|values)$")
TF2 = re.compile(r"^(?:.*/)?tables_of_(?P<table>[^/]+)/(?P<i>\d+)/\.ATTRIBUTES/table-(?P<part>keys|values)$")
SLOT = re.compile(r"^_[A-Za-z0-9]+_(?P<slot>m|v|accumulator|momentum)$")


def is_tfra(name: str) -> bool:
    """Whether a tensor name is part of a TFRA dynamic table (its keys, values or a shard)."""
    return bool(TF1.match(name) or TF2.match(name))


def _groups(infos: dict[str, TensorInfo]) -> dict[str, dict[int, dict[str, str]]]:
    """{table: {shard: {"keys": tensor, "values": tensor}}} with shards numbered from 0."""
    groups: dict[str, dict[int, dict[str, str]]] = {}
    counts: dict[str, int] = {}
    for name in infos:
        m = TF1.match(name)
        if m:
            shard, n = int(m["i"]) - 1, int(m["n"])
            if counts.setdefault(m["table"], n) != n:
                raise TFMigrationError(
                    f"TFRA table {m['table']!r}: its shards disagree on their count "
                    f"({counts[m['table']]} and {n}, at {name!r})"
                )
        else:
            m = TF2.match(name)
            if not m:
                continue
            shard = int(m["i"])
        groups.setdefault(m["table"], {}).setdefault(shard, {})[m["part"]] = name
    for table, shards in groups.items():
        want = counts.get(table, len(shards))
        for k in range(want):
            parts = shards.get(k, {})
            for part in ("keys", "values"):
                if part not in parts:
                    raise TFMigrationError(
                        f"TFRA table {table!r}: shard {k + 1} of {want} has no {part} tensor "
                        f"(found: {sorted(n for s in shards.values() for n in s.values())})"
                    )
    return groups


def _table_rows(bundle: Bundle, table: str, shards: dict[int, dict[str, str]]) -> tuple[Rows, Rows]:
    keys = concat_rows([bundle_rows(bundle, shards[k]["keys"]) for k in sorted(shards)], f"{table} keys")
    values = concat_rows([bundle_rows(bundle, shards[k]["values"]) for k in sorted(shards)], f"{table} values")
    for k in sorted(shards):
        kinfo, vinfo = bundle.info(shards[k]["keys"]), bundle.info(shards[k]["values"])
        if len(kinfo.shape) != 1 or len(vinfo.shape) != 2 or kinfo.shape[0] != vinfo.shape[0]:
            raise TFMigrationError(
                f"TFRA table {table!r}: shard {k + 1} has keys {list(kinfo.shape)} and values "
                f"{list(vinfo.shape)}; expected (n,) and (n, dim)"
            )
    count = f"{len(shards)} shard{'s' if len(shards) > 1 else ''}"
    keys.label, values.label = f"{table} keys", f"{table} ({count})"
    return keys, values


def _aligned(primary_keys: Rows, keys: Rows, values: Rows) -> Rows:
    """The slot's values in the primary table's key order (loaded whole: slots are matched by
    key, and TFRA stores them in hash order)."""
    state: dict[str, np.ndarray] = {}

    def load() -> None:
        if state:
            return
        want = primary_keys.read(0, primary_keys.num_rows)
        have = keys.read(0, keys.num_rows)
        order = np.argsort(have, kind="stable")
        pos = np.searchsorted(have[order], want)
        pos = np.minimum(pos, max(len(have) - 1, 0))
        found = (have[order][pos] == want) if len(have) else np.zeros(len(want), bool)
        state["rows"] = order[pos] if len(have) else np.zeros(len(want), np.int64)
        state["found"] = found
        state["values"] = values.read(0, values.num_rows)

    def read(lo: int, hi: int) -> np.ndarray:
        load()
        vals = state["values"]
        if not len(vals):  # an empty slot table: every row missing
            return np.zeros((len(state["found"][lo:hi]), *values.shape[1:]), vals.dtype)
        return vals[state["rows"][lo:hi]]

    def missing(lo: int, hi: int) -> np.ndarray:
        load()
        return ~state["found"][lo:hi]

    def verify() -> None:
        keys.verify()
        values.verify()

    return Rows(
        f"{values.label[:-1]}, matched by key)",
        values.dtype,
        (primary_keys.num_rows, *values.shape[1:]),
        read,
        verify,
        missing,
        parts=keys.parts + values.parts,
    )


def find(bundle: Bundle, infos: dict[str, TensorInfo]) -> dict[str, Table]:
    """The TFRA dynamic tables of a bundle, with their optimizer slots, by table name.

    Args:
        bundle: the checkpoint's tensor bundle.
        infos: its tensors by name.
    """
    groups = _groups(infos)
    tables: dict[str, Table] = {}
    parts = {name: _table_rows(bundle, name, shards) for name, shards in groups.items()}
    slot_of: dict[str, tuple[str, str]] = {}
    for name in groups:
        for other in groups:
            m = SLOT.match(other[len(name) :]) if other.startswith(name + "_") else None
            if m:
                slot_of[other] = (name, m["slot"])
    for name, shards in groups.items():
        if name in slot_of:
            continue
        keys, values = parts[name]
        slots = {slot: _aligned(keys, *parts[s]) for s, (owner, slot) in slot_of.items() if owner == name}
        count = f"{len(shards)} shard{'s' if len(shards) > 1 else ''}"
        tables[name] = Table(name, values, keys=keys, slots=slots, kind=f"TFRA table ({count})", embedding=True)
    return tables
