"""Apply a table's published versions to a serving store: a Redis namespace (serving_redis.py's
layout, read by a read-only PS and dynemb.publish.Lookup) or the embedded store's files (read
by a read-only PS over `embedded:///DIR`).

`apply_table` takes the store from the version it holds to the newest there is. Everything is
checked before anything is written, on every store: every file of the chain against its manifest
(version.chain: sha256, tensors, dtype, shapes, counts), each delta's width and dtype against the
version before it or the store's, and that the version the store holds is the folder's of that
number (its manifest's digest, kept by the store) and not newer than the folder's newest. So a
gap, a corrupt or lying file, or another publisher's folder writes nothing; a store that holds
the newest already is left as it is. Readers switch from
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
from dynemb.publish.version import Version, VersionError, chain, folder_name, numbers, table_folder

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


def _check_holds(root, table: str, have: int, digest: str) -> None:
    """VersionError unless the version `have` the store holds (its manifest's digest: "" if
    applied by an older dynemb, not checked) is the published folder's version of that number:
    a folder made again, or another publisher's, must not be taken for the one applied."""
    published = numbers(root, table)
    if not have or not published:
        return  # nothing held; or nothing published, which chain() says
    folder = table_folder(root, table)
    if have > published[-1]:
        raise VersionError(
            f"{folder}: the store holds version {have} of table {table!r}, newer than the newest published "
            f"there ({published[-1]}): the folder was made again or is another publisher's; apply it to another "
            "serving store"
        )
    if digest and have in published and Version.read(folder / folder_name(have)).digest != digest:
        raise VersionError(
            f"{folder / folder_name(have)}: not the version {have} the store holds (its manifest differs from the "
            "one applied): the folder was made again or is another publisher's; apply it to another serving store"
        )


def _check_widths(
    versions: list[Version], dim: int, dtype: str, held: str, stored: Callable[[str], str] = lambda d: d
) -> None:
    """VersionError unless each delta's rows are stored as those of the version before it are
    (its width, and its dtype as the store keeps it: stored()), the first delta's as the store's
    (dim, dtype; dim 0: it holds none), which `held` names."""
    for v in versions:
        if v.kind == "delta" and (v.dim, stored(v.dtype)) != (dim, dtype):
            raise VersionError(
                f"{v.folder}: a delta of dim {v.dim}, {v.dtype} onto {held} of dim {dim}, {dtype}; nothing was applied"
            )
        dim, dtype, held = v.dim, stored(v.dtype), f"version {v.number}"


# -- Redis ---------------------------------------------------------------------------------


def _apply_redis(store: ServingRedis, root, table: str, progress, shown) -> Applied:
    head = store.raw_head(table)
    versions = []
    if head.pending:  # a delta cut short: finished first
        pending = Version.read(table_folder(root, table) / folder_name(head.pending))
        pending.check_files()
        versions.append(pending)
    else:
        _check_holds(root, table, head.version, head.digest)
    versions += chain(root, table, have=(head.pending or head.version) or None)
    _check_widths(versions, head.dim if head.version else 0, head.dtype, f"the store's version {head.version}")
    for v in versions:  # every file and width checked: now written
        if v.number == head.pending:
            log.info("table %s: finishing version %d, cut short", table, v.number)
        if v.kind == "full":
            _apply_full(store, table, head, v, progress, shown)
        else:
            _apply_delta(store, table, head, v, progress, shown)
        head = store.raw_head(table)
    return Applied([v.number for v in versions], head.version)


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
        pending=0, visible=0, writing_tag="", writing_buckets=0, rows=rows, time=repr(v.time), digest=v.digest,
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
        store.set_head(table, True, version=v.number, visible=1, time=repr(v.time), digest=v.digest)
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
        have, digest, held = store.published_version(table), store.published_digest(table), store.schema(table)
    except TableNotFound:
        have, digest, held = 0, "", None
    _check_holds(root, table, have, digest)
    versions = chain(root, table, have=have or None)
    dim, dtype = (held.dim, held.dtype) if held is not None and have else (0, "")
    _check_widths(versions, dim, dtype, f"the store's version {have}", stored=_read_dtype)
    for v in versions:  # every file and width checked: now written
        schema = TableSchema(table, v.dim, 0, _read_dtype(v.dtype))
        if v.kind == "full":
            store.drop_table(table)
            store.create_table(schema)
        for ids, q in v.row_chunks():
            rows = q.values if v.dtype != "int8" else dequantize(q, v.dtype)
            store.push(table, ids, np.ascontiguousarray(rows))
            _note(progress, len(ids))
        gone = v.deleted_ids()
        if len(gone):
            store.delete(table, gone)
        store.set_published(table, v.number, v.time, v.digest)  # saved with the table
    if versions:
        store.save()  # the switch: a new generation, by a rename
        _note(shown, versions[-1].number)
    return Applied([v.number for v in versions], store.published_version(table) if store.schemas([table]) else 0)


def _read_dtype(dtype: str) -> str:
    """The dtype the embedded store keeps a version's rows in (int8 rows dequantized: fp32)."""
    return "fp32" if dtype == "int8" else dtype
