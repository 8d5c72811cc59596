"""What the publish tests share: the serving stores a version is applied to."""

from __future__ import annotations

import pytest


@pytest.fixture(params=["redis", "redis-cluster", "files"])
def target(request, redis_namespace, tmp_path):
    """A serving store's address: standalone Redis, Redis Cluster, or an embedded store's folder."""
    if request.param == "files":
        return f"embedded://{tmp_path / 'serving'}"
    if request.param == "redis-cluster":
        return request.getfixturevalue("redis_cluster").url
    return request.getfixturevalue("redis_url")
