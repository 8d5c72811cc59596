"""A store a job cannot use costs it no wait of dynemb's own: DynamicEmbeddings and `dynemb train`
refuse a malformed PS address at once, and a PS that is down (a real closed port) fails the start
once the timeout the user set has passed (it waited 30 s whatever ps_timeout_seconds said)."""

from __future__ import annotations

import logging
import socket
import time

import pytest
from helpers import dynemb
from tables_models import CONFIGS, build

from dynemb import tables as dt
from dynemb.ps_server.errors import InvalidArgument, Unavailable

pytestmark = pytest.mark.torchrec  # TorchRec and fbgemm-gpu: the model in front of the store


@pytest.fixture
def closed_port():
    """A port of this host that refuses connections: bound, not listening (so no one else takes it meanwhile)."""
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        yield held.getsockname()[1]


def test_a_malformed_store_is_refused_at_once(one_process_group):
    model, _ = build(60)
    started = time.monotonic()
    with pytest.raises(InvalidArgument, match=r"PS address 'localhost:35411x' is not host:port .* expected host:port"):
        dt.DynamicEmbeddings(model, CONFIGS, store="localhost:35411x")
    assert time.monotonic() - started < 1.0


def test_a_ps_that_is_down_fails_the_start_after_ps_timeout_seconds(one_process_group, closed_port, caplog):
    model, _ = build(60)
    address = f"127.0.0.1:{closed_port}"
    started = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="dynemb.ps.client"):
        with pytest.raises(Unavailable, match=rf"PS not ready after 2 s: {address}: UNAVAILABLE"):
            dt.DynamicEmbeddings(model, CONFIGS, store=address, ps_timeout_seconds=2)
    took = time.monotonic() - started
    assert 2.0 <= took < 5.0, took
    assert f"waiting up to 2 s for the PS to be ready: {address}" in caplog.text  # said while it waits


def test_the_training_job_refuses_a_malformed_ps_before_it_sets_up():
    done = dynemb("train", "--steps", "1", "--ps", "localhost:35411x", timeout=60)
    assert done.returncode == 2, done.stderr[-2000:]
    assert done.stderr.strip().splitlines()[-1] == (
        "dynemb train: error: PS address 'localhost:35411x' is not host:port (port '35411x' is not a number from "
        "1 to 65535); expected host:port, comma-separated for shards, 'a:port|b:port' for replicas of one shard, "
        "or unix:/path"
    )
