"""Publishing for serving: versions of the tables that a serving fleet can follow (docs/publish.md).

    from dynemb.publish import PublishConfig, publish_table, apply_table, serving_store, Lookup

- publish_table(client, table, config): cut a table's next version from the PS (a delta of the
  rows changed and ids deleted since the last, or a full one) into config.root;
- publish_tables(dynamic, config, step): the same from a training job, collective: every rank
  pushes the rows it changed first;
- apply_table(serving_store(url), root, table): take a serving store (Redis, or an embedded
  store's files) to the newest version, readers switching at once;
- Lookup: ids -> rows from a serving store, for inference code, with a bounded cache;
- Version, chain, VersionWriter: the version folders themselves (version.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from dynemb.common.lazy import lazy_names

# name -> module; imported on first use, so that a training job that publishes loads no Redis
# client (the appliers' and readers' side) through this package
_PUBLIC = {
    "Applied": "dynemb.publish.apply",
    "apply_table": "dynemb.publish.apply",
    "serving_store": "dynemb.publish.apply",
    "publish_tables": "dynemb.publish.job",
    "Lookup": "dynemb.publish.lookup",
    "DEFAULT_FULL_EVERY": "dynemb.publish.publisher",
    "PublishConfig": "dynemb.publish.publisher",
    "publish_table": "dynemb.publish.publisher",
    "DTYPES": "dynemb.publish.quantize",
    "dequantize": "dynemb.publish.quantize",
    "quantize": "dynemb.publish.quantize",
    "Version": "dynemb.publish.version",
    "VersionError": "dynemb.publish.version",
    "VersionWriter": "dynemb.publish.version",
    "chain": "dynemb.publish.version",
    "numbers": "dynemb.publish.version",
}

__all__ = [  # _PUBLIC's names
    "DEFAULT_FULL_EVERY",
    "DTYPES",
    "Applied",
    "Lookup",
    "PublishConfig",
    "Version",
    "VersionError",
    "VersionWriter",
    "apply_table",
    "chain",
    "dequantize",
    "numbers",
    "publish_table",
    "publish_tables",
    "quantize",
    "serving_store",
]

if TYPE_CHECKING:
    from dynemb.publish.apply import Applied, apply_table, serving_store
    from dynemb.publish.job import publish_tables
    from dynemb.publish.lookup import Lookup
    from dynemb.publish.publisher import DEFAULT_FULL_EVERY, PublishConfig, publish_table
    from dynemb.publish.quantize import DTYPES, dequantize, quantize
    from dynemb.publish.version import Version, VersionError, VersionWriter, chain, numbers


__getattr__ = lazy_names("dynemb.publish", _PUBLIC, globals())
