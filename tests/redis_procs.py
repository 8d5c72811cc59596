"""The Redis process helpers live in the package (dynemb/testing/local_redis.py) so benchmarks share them."""

from dynemb.testing.local_redis import (  # noqa: F401
    REPO,
    SETUP_HINT,
    RedisClusterProcesses,
    RedisProcess,
    find_binary,
    free_port,
    make_tls_files,
)
