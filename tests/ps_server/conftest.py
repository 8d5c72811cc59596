"""Fixtures the PS's store tests share."""

from __future__ import annotations

import pytest

from dynemb.ps_server.backends.embedded import EmbeddedStore
from dynemb.ps_server.backends.redis_store import RedisStore


@pytest.fixture(params=["embedded", "redis", "redis-py", "redis-cluster"])
def every_store(request, redis_namespace):
    """Each store in turn: the embedded one, standalone Redis (compiled and redis-py row paths),
    Redis Cluster."""
    if request.param == "embedded":
        s = EmbeddedStore()
    elif request.param == "redis-cluster":
        cluster = request.getfixturevalue("redis_cluster")
        s = RedisStore.from_url(cluster.url, namespace=redis_namespace)
    else:
        url = request.getfixturevalue("redis_url")
        s = RedisStore.from_url(url, namespace=redis_namespace, native_rows=request.param == "redis")
    yield s
    s.close()
