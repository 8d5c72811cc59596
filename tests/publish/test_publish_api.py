"""dynemb.publish's names: the ones its docstring and docs/publish.md use, each importable, none
of them loading a Redis client until an applier's or reader's name is used."""

from __future__ import annotations

import subprocess
import sys

import dynemb.publish as publish


def test_every_public_name_resolves():
    assert set(publish.__all__) == set(publish._PUBLIC)
    for name in publish.__all__:
        assert getattr(publish, name) is not None


def test_publishing_from_a_job_loads_no_redis_client():
    code = (
        "import sys; from dynemb.publish import PublishConfig, publish_tables; "
        "print(sorted(m for m in sys.modules if m == 'redis' or m.startswith('redis.')))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"
