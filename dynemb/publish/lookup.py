"""ids -> rows of a published table, for inference code: straight from a serving store (Redis,
or an embedded store's files), with a bounded in-process cache.

    lookup = Lookup("redis://serving-redis:6379", "user", namespace="serving", cache_rows=1_000_000)
    rows = lookup(ids)          # (n, dim) float32; an id the table lacks gets the default row
    lookup.version              # the version the rows are of

The cache holds rows of one version: it is emptied when the store holds a newer one, which a
lookup asks the store about at most every `max_staleness_s` seconds (a lookup whose ids are all
cached and fresh enough costs no call).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from pathlib import Path

import numpy as np

from dynemb.ps_server.backends.serving_redis import ServingRedis
from dynemb.ps_server.schema import check_name
from dynemb.publish.quantize import as_float32


class Lookup:
    """ids -> float32 rows of one published table (see the module).

    Args:
        url: the serving store: redis://, rediss://, redis+cluster://, or embedded:///DIR.
        table: the published table.
        namespace: the Redis key namespace it was applied to.
        default: the row of an id the table lacks: None for zeros, a number for every value,
            or a (dim,) array.
        cache_rows: rows (and ids found missing) kept in an LRU cache; 0: none.
        max_staleness_s: how long cached rows are used without asking whether a newer version
            is there.

    Raises:
        TableNotFound: the table is not published there.
        InvalidArgument: the table's name is not valid (dynemb/common/names.py).
    """

    def __init__(
        self,
        url: str,
        table: str,
        namespace: str = "dynemb",
        default: float | np.ndarray | None = None,
        cache_rows: int = 1 << 20,
        max_staleness_s: float = 1.0,
    ) -> None:
        from dynemb.publish.apply import serving_store

        self.table = check_name(table)
        self.cache_rows = cache_rows
        self.max_staleness_s = max_staleness_s
        store = serving_store(url, namespace)
        self._reader: _RedisReader | _FilesReader = (
            _FilesReader(store, table) if isinstance(store, Path) else _RedisReader(store, table)
        )
        self.dim = self._reader.dim()
        self.default = np.zeros(self.dim, np.float32) if default is None else np.broadcast_to(
            np.asarray(default, np.float32), (self.dim,)
        )  # fmt: skip
        self._cache: OrderedDict[int, np.ndarray | None] = OrderedDict()
        self.version = 0
        self._checked = 0.0
        self.hits = self.misses = 0

    def __call__(self, ids) -> np.ndarray:
        """The rows of ids (n, dim) float32, in their order; the default row where the table lacks one."""
        ids = np.ascontiguousarray(ids, dtype=np.int64).ravel()
        now = time.monotonic()
        if now - self._checked > self.max_staleness_s:
            newest = self._reader.newest()
            if newest != self.version:
                self._cache.clear()
                self.version = newest
            self._checked = now
        out = np.empty((len(ids), self.dim), np.float32)
        todo = []
        for k, i in enumerate(ids.tolist()):
            row = self._cache.get(i, False)
            if row is False:
                todo.append(k)
                continue
            self._cache.move_to_end(i)
            out[k] = self.default if row is None else row
        self.hits += len(ids) - len(todo)
        self.misses += len(todo)
        if todo:
            at = np.array(todo)
            uniq, inverse = np.unique(ids[at], return_inverse=True)
            rows, found, version = self._reader.pull(uniq)
            if version != self.version:  # a newer version: what the cache gave is of the one before
                self._cache.clear()
                self.version = version
                if len(todo) < len(ids):
                    return self(ids)
            out[at] = np.where(found[:, None], rows, self.default)[inverse]
            if self.cache_rows:
                for i, row, f in zip(uniq.tolist(), rows, found):
                    self._cache[i] = row.copy() if f else None
                while len(self._cache) > self.cache_rows:
                    self._cache.popitem(last=False)
        return out


class _RedisReader:
    """A published table in Redis (serving_redis.py)."""

    def __init__(self, store: ServingRedis, table: str) -> None:
        self.store, self.table = store, table

    def dim(self) -> int:
        return self.store.head(self.table).dim

    def newest(self) -> int:
        return self.store.head(self.table).version

    def pull(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray, int]:
        rows, found, version = self.store.pull(self.table, ids)
        return as_float32(rows), found, version


class _FilesReader:
    """A published table in an embedded store's files, loaded read only, reloaded when newer."""

    def __init__(self, folder: Path, table: str) -> None:
        from dynemb.ps_server.backends.embedded import EmbeddedStore

        self.store = EmbeddedStore(str(folder))
        self.store.read_only = True
        self.table = table

    def dim(self) -> int:
        return self.store.schema(self.table).dim

    def newest(self) -> int:
        self.store.reload_if_newer()
        return self.store.published_version(self.table)

    def pull(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray, int]:
        self.store.reload_if_newer()  # on this thread alone: the rows and version are of one generation
        rows, found = self.store.pull(self.table, ids)
        return as_float32(rows), found, self.store.published_version(self.table)
