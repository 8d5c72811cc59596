"""TLS to Redis (rediss://, rediss+cluster://): the files a URL names are checked when the
store is built, and a certificate Redis presents that we do not trust gets a hint of the fix.

    rediss://host:6380/0?ssl_ca_certs=/etc/dynemb/redis-ca.pem
    rediss://host:6380/0?ssl_ca_certs=ca.pem&ssl_certfile=me.pem&ssl_keyfile=me.key   # Redis asks for client certs
"""

from __future__ import annotations

import os

from dynemb.ps_server.errors import InvalidArgument

# redis-py option -> what the file is; each is a path it opens only at the first connection
TLS_FILES = {"ssl_ca_certs": "CA certificate", "ssl_certfile": "client certificate", "ssl_keyfile": "client key"}


def check_tls_files(options: dict) -> None:
    """A named file that cannot be read is a setting to fix, not an outage to retry: say so
    now, naming the option and the file (redis-py would say only 'No such file or directory')."""
    for option, what in TLS_FILES.items():
        path = options.get(option)
        if path and not os.access(path, os.R_OK):
            reason = "no such file" if not os.path.exists(path) else "not readable"
            raise InvalidArgument(f"Redis TLS {what} {option}={path!r}: {reason}")


def untrusted_hint(text: str) -> str:
    """What to do about a Redis certificate we could not verify ('' if that is not the error)."""
    if "CERTIFICATE_VERIFY_FAILED" not in text:
        return ""
    return (
        " (Redis' certificate is not signed by a CA this PS trusts: give that CA in the backend URL, "
        "rediss://host:port/0?ssl_ca_certs=/path/ca.pem)"
    )
