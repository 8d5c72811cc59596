"""The PS client: `PSClient`, whose methods are the protocol's verbs, over layers of one concern each.

- ps_client.py: PSClient, the verbs (create_table, pull, push, pull_many, import_rows, export, stats...).
- transport.py: channels, TLS and the token; a call with its retries and deadline; one request to several PSes.
- retry.py: RetryPolicy, which failures are tried again and when; CallWatch, what the calls are doing.
- sharding.py: which PS owns which id; batches cut into messages.
- ordering.py: a table's row operations take effect in call order.
- shared_memory.py: rows through memory shared with a PS on this host (the mechanism is ../shm.py).
- rows.py: pull, push and delete of one or several tables, on the layers above.
- streaming.py: import and export streams.
- schema_cache.py, results.py: the tables' schemas as last seen; PullResult and TableInfo.
"""

from dynemb.ps_server.client.ps_client import PSClient
from dynemb.ps_server.client.results import PullResult, TableInfo
from dynemb.ps_server.client.retry import RETRYABLE, CallWatch, RetryPolicy

__all__ = ["CallWatch", "PSClient", "PullResult", "RETRYABLE", "RetryPolicy", "TableInfo"]
