"""Publishing for serving: versions of the tables that a serving fleet can follow (docs/publish.md).

    from dynemb.publish import PublishConfig, publish_table, apply_table, serving_store, Lookup

- publish_table(client, table, config): cut a table's next version from the PS (a delta of the
  rows changed and ids deleted since the last, or a full one) into config.root;
- publish_tables(dynamic, config, step): the same from a training job, collective: every rank
  pushes the rows it changed first;
- apply_table(serving_store(url), root, table): take a serving store (Redis, or an embedded
  store's files) to the newest version, readers switching at once;
- Lookup: ids -> rows from a serving store in Redis, for inference code, with a bounded cache;
- Version, chain, VersionWriter: the version folders themselves (version.py).
"""

from dynemb.publish.apply import Applied, apply_table, serving_store
from dynemb.publish.job import publish_tables
from dynemb.publish.lookup import Lookup
from dynemb.publish.publisher import DEFAULT_FULL_EVERY, PublishConfig, publish_table
from dynemb.publish.quantize import DTYPES, dequantize, quantize
from dynemb.publish.version import Version, VersionError, VersionWriter, chain, numbers

__all__ = [
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
