"""A PS that goes away and comes back, as a trainer's client sees it (dynemb.tables.open_store,
the trainer's own retry policy, rows through shared memory): while the PS is away a trainer's
metrics (TrainerMetrics, fed by the client's CallWatch) show a call blocked and retrying;
once a new PS answers on the same address the call is done within seconds, though gRPC's
reconnect backoff had grown for the whole outage and the old shared-memory segment means
nothing to the new PS."""

from __future__ import annotations

import time

import numpy as np
import pytest
from helpers import wait_until
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from dynemb.ps_server.errors import PSError
from dynemb.ps_server.schema import TableSchema
from dynemb.tables import TrainerMetrics, open_store

pytestmark = pytest.mark.torchrec  # TorchRec and fbgemm-gpu: needed by every test here

AWAY_SECONDS = 30  # gRPC's default reconnect backoff (1 s x 1.6^n, jittered) tries at ~26 s, then ~43 s
RESUME_SECONDS = 5  # the trainer's tries are at most 2 s apart, its channel's connects 1 s


@pytest.mark.slow
def test_a_client_blocked_on_a_ps_that_is_away_shows_it_and_resumes_within_seconds(make_ps, tmp_path):
    backend = f"embedded://{tmp_path}/tables"
    first = make_ps("--backend", backend)
    address = first.address
    store = open_store(address, timeout=600.0, attempt_timeout=30.0)
    metrics = TrainerMetrics(0)
    store.watch_calls(metrics.ps_calls)

    def scraped() -> dict[str, float]:
        """The rank's dynemb_trainer_ps_* samples, as Prometheus would read them."""
        text = generate_latest(metrics.registry).decode()
        return {
            s.name: s.value
            for f in text_string_to_metric_families(text)
            for s in f.samples
            if s.name.startswith("dynemb_trainer_ps_") and "table" not in s.labels
        }

    calm = {
        "dynemb_trainer_ps_retries_total": 0.0,
        "dynemb_trainer_ps_errors_total": 0.0,
        "dynemb_trainer_ps_blocked_seconds": 0.0,
    }
    try:
        store.create_table(TableSchema("t", dim=4))
        ids = np.arange(300, dtype=np.int64)
        rows = np.random.default_rng(1).random((300, 4), dtype=np.float32)
        store.push("t", ids, rows)
        assert np.array_equal(store.pull_many_async({"t": ids}).result()["t"][:, :4], rows)
        assert scraped() == calm
        assert first.stop() == 0

        pulled = store.pull_many_async({"t": ids})  # holds a segment the next PS will not know
        wait_until(
            lambda: scraped()["dynemb_trainer_ps_retries_total"] > 0, timeout=30, what="the pull retrying", interval=0.1
        )
        time.sleep(AWAY_SECONDS)
        assert not pulled.done()
        away = scraped()
        assert away["dynemb_trainer_ps_blocked_seconds"] >= AWAY_SECONDS  # blocked now, not only once it ends
        assert away["dynemb_trainer_ps_retries_total"] >= AWAY_SECONDS / 2 - 1  # tries at most 2 s apart
        assert away["dynemb_trainer_ps_errors_total"] == 0

        second = make_ps("--backend", backend, "--address", address)
        back = time.monotonic()
        got = pulled.result(timeout=120)
        resumed = time.monotonic() - back
        assert np.array_equal(got["t"][:, :4], rows)
        assert resumed < RESUME_SECONDS, f"the pull was done {resumed:.1f} s after the PS was back"
        after = scraped()
        assert after["dynemb_trainer_ps_errors_total"] == after["dynemb_trainer_ps_blocked_seconds"] == 0
        print(f"resumed {resumed:.2f} s after the PS was back, {after['dynemb_trainer_ps_retries_total']:.0f} retries")

        # a call whose retries run out counts as an error, once
        assert second.stop() == 0
        with pytest.raises(PSError):
            store.client.pull("t", ids, timeout=1.0)
        assert scraped()["dynemb_trainer_ps_errors_total"] == 1
    finally:
        store.close()
