"""The schemas of the tables a client uses, as it last created or described them: rows are sized and checked by
them without asking a PS on each call. A table re-created with another schema meanwhile shows as rows of the wrong
size; the cache then forgets it or describes it again."""

from __future__ import annotations

import threading
from collections.abc import Callable

from dynemb.ps_server.schema import TableSchema


class SchemaCache:
    """Table name -> TableSchema, filled on first use.

    Args:
        describe: asks the PSes for a table's schema (DescribeTable).
    """

    def __init__(self, describe: Callable[[str], TableSchema]) -> None:
        self._describe = describe
        self._schemas: dict[str, TableSchema] = {}
        self._lock = threading.Lock()

    def get(self, table: str, refresh: bool = False) -> TableSchema:
        """The table's schema, described by the PSes when not known yet or when refresh is set.

        Raises:
            PSError: the PSes could not describe it (TableNotFound: there is no such table).
        """
        with self._lock:
            have = self._schemas.get(table)
        if have is None or refresh:
            have = self._describe(table)
            self.remember(have)
        return have

    def remember(self, schema: TableSchema) -> None:
        """Keep a schema, replacing the one known for its table."""
        with self._lock:
            self._schemas[schema.name] = schema

    def forget(self, table: str) -> None:
        """Drop the table's schema, if known."""
        with self._lock:
            self._schemas.pop(table, None)
