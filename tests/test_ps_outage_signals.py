"""A PS that goes away and comes back, as a trainer's client sees it (dynemb.tables.open_store,
the trainer's own retry policy, rows through shared memory): while the PS is away the client's
CallWatch (what a trainer exports as dynemb_trainer_ps_*) shows a call blocked and retrying;
once a new PS answers on the same address the call is done within seconds, though gRPC's
reconnect backoff had grown for the whole outage and the old shared-memory segment means
nothing to the new PS."""

from __future__ import annotations

import time

import numpy as np
import pytest
from helpers import wait_until

from dynemb.ps_server.client import CallWatch
from dynemb.ps_server.schema import TableSchema
from dynemb.tables import open_store

AWAY_SECONDS = 50  # gRPC's default reconnect backoff (1 s x 1.6^n, jittered) is 17-27 s by then
RESUME_SECONDS = 5  # the trainer's tries are at most 2 s apart, its channel's connects 1 s


@pytest.mark.slow
def test_a_client_blocked_on_a_ps_that_is_away_shows_it_and_resumes_within_seconds(make_ps, tmp_path):
    backend = f"embedded://{tmp_path}/tables"
    first = make_ps("--backend", backend)
    address = first.address
    store = open_store(address, timeout=600.0, attempt_timeout=30.0)
    watch = CallWatch()
    store.watch_calls(watch)
    try:
        store.create_table(TableSchema("t", dim=4))
        ids = np.arange(300, dtype=np.int64)
        rows = np.random.default_rng(1).random((300, 4), dtype=np.float32)
        store.push("t", ids, rows)
        assert np.array_equal(store.pull_many_async({"t": ids}).result()["t"][:, :4], rows)
        assert watch.retries == watch.failures == 0 and watch.blocked_seconds() == 0
        assert first.stop() == 0

        pulled = store.pull_many_async({"t": ids})  # holds a segment the next PS will not know
        wait_until(lambda: watch.retries > 0, timeout=30, what="the pull retrying", interval=0.1)
        time.sleep(AWAY_SECONDS)
        assert not pulled.done()
        assert watch.blocked_seconds() >= AWAY_SECONDS  # blocked now, not only once it ends
        retried = watch.retries
        assert retried >= AWAY_SECONDS / 2 - 1  # tries at most 2 s apart

        make_ps("--backend", backend, "--address", address)
        back = time.monotonic()
        got = pulled.result(timeout=120)
        resumed = time.monotonic() - back
        assert np.array_equal(got["t"][:, :4], rows)
        assert resumed < RESUME_SECONDS, f"the pull was done {resumed:.1f} s after the PS was back"
        assert watch.failures == 0 and watch.blocked_seconds() == 0
    finally:
        store.close()
