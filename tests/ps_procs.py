"""PS subprocess fixtures: `dynemb ps serve` started through the CLI, as operators run it."""

from __future__ import annotations

import pytest
from helpers import wait_until

from dynemb.ps_server.client import PSClient
from dynemb.testing.local_ps import LocalPS


@pytest.fixture
def make_ps():
    """Factory: make_ps(*serve_flags, env=...) -> a started LocalPS; all stopped at the test's end."""
    made: list[LocalPS] = []

    def make(*args: str, env: dict | None = None, start: bool = True) -> LocalPS:
        # no NOT_SERVING pause on stop (a test that wants one passes --not-serving-seconds itself)
        ps = LocalPS("--log-level", "INFO", "--not-serving-seconds", "0", *args, env=env)
        made.append(ps)
        return ps.start() if start else ps

    yield make
    for ps in made:
        ps.close()


@pytest.fixture(scope="module")
def embedded_ps():
    """One embedded-store PS shared by a module's tests (each test uses its own table names)."""
    ps = LocalPS("--log-level", "INFO", "--not-serving-seconds", "0").start()
    yield ps
    ps.close()


@pytest.fixture
def embedded_client(embedded_ps):
    with PSClient(embedded_ps.address, timeout=30) as client:
        yield client


def wait_for_health(client: PSClient, want: str, timeout: float = 30.0) -> None:
    """Until every PS the client reaches answers health checks with `want` (SERVING, NOT_SERVING)."""
    wait_until(
        lambda: client.health(timeout=2) == [want] * len(client.addresses),
        timeout=timeout,
        what=f"PS health {want}",
        interval=0.1,
    )
