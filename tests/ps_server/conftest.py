"""Fixtures the PS's store tests share."""

from __future__ import annotations

import pytest

from dynemb.ps_server.backends.disk import DiskStore
from dynemb.ps_server.backends.embedded import EmbeddedStore
from dynemb.ps_server.backends.redis_store import RedisStore


@pytest.fixture(params=["embedded", "disk", "redis", "redis-py", "redis-cluster"])
def every_store(request, redis_namespace, tmp_path):
    """Each store in turn: the embedded one, the disk one (RocksDB in tmp_path), standalone Redis
    (compiled and redis-py row paths), Redis Cluster."""
    if request.param == "embedded":
        s = EmbeddedStore()
    elif request.param == "disk":
        s = DiskStore(f"disk://{tmp_path}/disk?cache_bytes=8MiB")
    elif request.param == "redis-cluster":
        cluster = request.getfixturevalue("redis_cluster")
        s = RedisStore.from_url(cluster.url, namespace=redis_namespace)
    else:
        url = request.getfixturevalue("redis_url")
        s = RedisStore.from_url(url, namespace=redis_namespace, native_rows=request.param == "redis")
    yield s
    s.close()
