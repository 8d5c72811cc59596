"""Stores behind the PS. `open_store(url)` picks one from a URL.

embedded:// (or empty)        in-process numpy store (the default); rows gone when the PS exits
embedded:///path/to/dir       the same, saved to dir on shutdown and loaded from it at start
disk:///path/to/dir[?cache_bytes=256MiB&sync=ack|<ms>&compression=none|lz4]
                              RocksDB in dir (disk.py): rows beyond RAM, every write in its WAL
redis://[user:pass@]host:port/db    standalone Redis
rediss://...                  the same over TLS
redis+cluster://host:port[,host:port...]  Redis Cluster (rediss+cluster:// for TLS)
redis+sentinel://[user:pass@]host:port[,host:port...]/<master name>[/db]  standalone Redis whose
                              master Sentinel names (rediss+sentinel:// for TLS)
"""

from __future__ import annotations

from dynemb.ps_server.backends.base import Store


def open_store(url: str = "", *, namespace: str = "dynemb", **options) -> Store:
    """The store for a backend URL (the schemes are in the module doc).

    Args:
        url: the backend URL; empty means embedded://.
        namespace: the Redis key namespace (Redis backends only).
        **options: passed to RedisStore.from_url (Redis backends only).

    Raises:
        InvalidArgument: the scheme is not one of those.
    """
    url = (url or "embedded://").strip()
    scheme = url.split("://", 1)[0].lower() if "://" in url else url.lower()
    if scheme in ("embedded", "memory"):
        from dynemb.ps_server.backends.embedded import EmbeddedStore

        path = url.split("://", 1)[1] if "://" in url else ""
        return EmbeddedStore(path or None)
    if scheme == "disk":
        from dynemb.ps_server.backends.disk import DiskStore

        return DiskStore(url)
    if scheme in ("redis", "rediss", "redis+cluster", "rediss+cluster", "redis+sentinel", "rediss+sentinel", "unix"):
        from dynemb.ps_server.backends.redis_store import RedisStore

        return RedisStore.from_url(url, namespace=namespace, **options)
    from dynemb.common.errors import shown
    from dynemb.ps_server.errors import InvalidArgument

    raise InvalidArgument(
        f"backend URL {shown(_without_password(url))}: scheme {shown(scheme)} is not one of embedded://, disk://, "
        f"redis://, rediss://, redis+cluster://, rediss+cluster://, redis+sentinel://, rediss+sentinel://"
    )


def _without_password(url: str) -> str:
    """The URL for a message: a password in it (scheme://user:password@host) becomes ***."""
    head, sep, rest = url.partition("://")
    userinfo, at, hosts = rest.rpartition("@")
    if not at or ":" not in userinfo:
        return url
    return f"{head}{sep}{userinfo.split(':', 1)[0]}:***@{hosts}"


__all__ = ["Store", "open_store"]
