"""Apply a table's published versions to a serving store: a Redis namespace (serving_redis.py's
layout, read by a read-only PS and dynemb.publish.Lookup) or the embedded store's files (read
by a read-only PS over `embedded:///DIR`).

`apply_table` takes the store from the version it holds to the newest there is (version.chain:
every file of the chain is checked before anything is written, so a gap or a corrupt file
writes nothing); a store that holds the newest already is left as it is. Readers switch from
v-1 to v at once, never seeing a mix (Redis: serving_redis.py's three steps; files: a new
generation of the embedded store, switched to by a rename). An applier killed midway leaves the
store at v-1 to readers; the next apply finishes v.
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import numpy as np

from dynemb.ps_server.backends.serving_redis import GROWTH, ROWS_PER_BUCKET, ServingHead, ServingRedis, encode_rows
from dynemb.publish.quantize import Quantized, dequantize
from dynemb.publish.version import Version, VersionError, chain, folder_name, table_folder

log = logging.getLogger("dynemb.publish")
# Tests only: an apply to Redis stops for good at this point of a delta ("step1": its pending
# fields written, not shown; "step2": shown, not compacted), so that a kill -9 lands there.
STALL_ENV = "DYNEMB_TEST_APPLY_STALL"


class Applied(NamedTuple):
    """What an apply did: the versions applied, in order ([]: the store had the newest), and
    the version the store holds after."""

    versions: list[int]
    holds: int


def serving_store(url: str, namespace: str = "dynemb") -> ServingRedis | Path:
    """The serving store a URL names: a ServingRedis for a Redis URL, the folder for embedded:///DIR."""
    if url.startswith(("embedded://", "memory://")):
        path = url.split("://", 1)[1]
        if not path:
            raise VersionError(f"{url}: give the embedded store's folder, embedded:///path/to/dir")
        return Path(path)
    from dynemb.ps_server.backends import open_store

    return ServingRedis(open_store(url, namespace=namespace), namespace)


def apply_table(
    store: ServingRedis | Path,
    root: str | os.PathLike,
    table: str,
    progress: Callable[[int], None] | None = None,
    shown: Callable[[int], None] | None = None,
) -> Applied:
    """Take the store's copy of the table to the newest version under root (see the module).

    Args:
        store: serving_store()'s answer.
        root: the published tables' folder.
        table: the table.
        progress: called with the rows written, as they are.
        shown: called with each version's number once readers read it (before a delta's
            rows are moved out of their pending fields, on Redis).

    Raises:
        VersionError: no chain from what the store holds to the newest (a gap, no full version
            to start from), or a file of it missing or corrupt: nothing was written then.
    """
    if isinstance(store, Path):
        return _apply_files(store, root, table, progress, shown)
    return _apply_redis(store, root, table, progress, shown)


def _note(progress: Callable[[int], None] | None, n: int) -> None:
    if progress is not None:
        progress(n)


# -- Redis ---------------------------------------------------------------------------------


def _apply_redis(store: ServingRedis, root, table: str, progress, shown) -> Applied:
    head = store.raw_head(table)
    done = []
    if head.pending:  # a delta cut short: finish it first
        v = Version.read(table_folder(root, table) / folder_name(head.pending))
        v.check_files()
        log.info("table %s: finishing version %d, cut short", table, v.number)
        _apply_delta(store, table, head, v, progress, shown)
        done.append(v.number)
        head = store.raw_head(table)
    for v in chain(root, table, have=head.version or None):
        if v.kind == "full":
            _apply_full(store, table, head, v, progress, shown)
        else:
            if v.dim != head.dim or v.dtype != head.dtype:
                raise VersionError(
                    f"{v.folder}: a delta of dim {v.dim}, {v.dtype} onto a store holding dim {head.dim}, {head.dtype}"
                )
            _apply_delta(store, table, head, v, progress, shown)
        done.append(v.number)
        head = store.raw_head(table)
    return Applied(done, head.version)


def _stored(q: Quantized, dtype: str) -> list[bytes]:
    return encode_rows(q.values, q.scales if dtype == "int8" else None)


def _apply_full(store: ServingRedis, table: str, head: ServingHead, v: Version, progress, shown) -> None:
    tag = f"v{v.number}"
    buckets = max(1, math.ceil(v.rows * GROWTH / ROWS_PER_BUCKET))
    if head.writing_tag and head.writing_tag not in (tag, head.tag):  # a full cut short: its keys are garbage
        store.unlink_tag(table, head.writing_tag, head.writing_buckets)
    if head.writing_tag == tag and head.writing_buckets != buckets:
        store.unlink_tag(table, tag, head.writing_buckets)
    store.set_head(table, False, writing_tag=tag, writing_buckets=buckets)
    rows = 0
    for ids, q in v.row_chunks():
        rows += store.write(table, tag, buckets, ids, _stored(q, v.dtype), pending=False)
        _note(progress, len(ids))
    store.set_head(
        table, True, version=v.number, base=v.number, tag=tag, buckets=buckets, dim=v.dim, dtype=v.dtype,
        pending=0, visible=0, writing_tag="", writing_buckets=0, rows=rows, time=repr(v.time),
    )  # fmt: skip
    _note(shown, v.number)
    if head.tag and head.tag != tag:  # readers of the old tag read again (gen moved on)
        store.unlink_tag(table, head.tag, head.buckets)
    log.info("table %s: full version %d applied (%d rows)", table, v.number, v.rows)


def _apply_delta(store: ServingRedis, table: str, head: ServingHead, v: Version, progress, shown) -> None:
    tag, buckets = head.tag, head.buckets
    gone = v.deleted_ids()
    none = [None] * len(gone)
    if not head.visible:  # steps 1 and 2 (again, if cut short before 2: the same fields)
        store.set_head(table, False, pending=v.number)
        for ids, q in v.row_chunks():
            store.write(table, tag, buckets, ids, _stored(q, v.dtype), pending=True)
            _note(progress, len(ids))
        store.write(table, tag, buckets, gone, none, pending=True)
        _stall("step1")
        store.set_head(table, True, version=v.number, visible=1, time=repr(v.time))
        _note(shown, v.number)
        _stall("step2")
        head = store.raw_head(table)
    if head.counted != v.number:  # the rows it leaves, counted before step 3 writes any
        rows = head.rows + store.count(table, tag, buckets, gone, none)
        for ids, _ in v.row_chunks():
            rows += store.count(table, tag, buckets, ids, [b""] * len(ids))
        store.set_head(table, False, counted=v.number, counted_rows=rows)
        head = store.raw_head(table)
    for ids, q in v.row_chunks():  # step 3
        store.compact(table, tag, buckets, ids, list(_stored(q, v.dtype)))
    store.compact(table, tag, buckets, gone, none)
    store.set_head(table, True, pending=0, visible=0, rows=head.counted_rows)
    log.info("table %s: version %d applied (%d rows, %d deleted)", table, v.number, v.rows, v.deleted)


def _stall(point: str) -> None:
    if os.environ.get(STALL_ENV) == point:
        log.warning("apply stalled at %s (%s, tests only)", point, STALL_ENV)
        while True:
            time.sleep(60)


# -- the embedded store's files ----------------------------------------------------------------


def _apply_files(folder: Path, root, table: str, progress, shown) -> Applied:
    """Load the embedded store's files, apply the chain, save a new generation (the switch)."""
    from dynemb.ps_server.backends.embedded import EmbeddedStore
    from dynemb.ps_server.errors import TableNotFound
    from dynemb.ps_server.schema import TableSchema

    store = EmbeddedStore(str(folder))
    try:
        have = store.published_version(table) or None
    except TableNotFound:
        have = None
    versions = chain(root, table, have=have)
    for v in versions:
        read_dtype = "fp32" if v.dtype == "int8" else v.dtype
        schema = TableSchema(table, v.dim, 0, read_dtype)
        if v.kind == "full":
            store.drop_table(table)
            store.create_table(schema)
        elif store.schema(table) != schema:
            raise VersionError(f"{v.folder}: a delta of dim {v.dim}, {v.dtype} onto table {store.schema(table)}")
        for ids, q in v.row_chunks():
            rows = q.values if v.dtype != "int8" else dequantize(q, v.dtype)
            store.push(table, ids, np.ascontiguousarray(rows))
            _note(progress, len(ids))
        gone = v.deleted_ids()
        if len(gone):
            store.delete(table, gone)
        store.set_published(table, v.number, v.time)  # saved with the table
    if versions:
        store.save()  # the switch: a new generation, by a rename
        _note(shown, versions[-1].number)
    return Applied([v.number for v in versions], store.published_version(table) if store.schemas([table]) else 0)
