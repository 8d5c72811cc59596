"""A real small training run (in this process, its metrics scraped from --metrics-port): the
per-table counters add up as docs/metrics.md says, term by term, against figures worked out
from the run's own batches; the rank says it finished; and with --no-progress a loss line is
printed every --log-every steps."""

from __future__ import annotations

import contextlib
import io
import urllib.request

import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from dynemb.testing.local_redis import free_port
from dynemb.trainer.config import DataConfig, TableConfig, TrainConfig, table_name
from dynemb.trainer.data import SyntheticCriteo

pytestmark = pytest.mark.torchrec  # TorchRec and fbgemm-gpu: needed by every test here

STEPS, BATCH, EVAL_BATCHES, LOG_EVERY, TABLES = 24, 64, 2, 5, 2


@pytest.fixture(scope="module")
def run():
    """(cfg, the rank's metrics after the run {(name, table): value}, what it printed)."""
    from dynemb.trainer.train import train

    port = free_port()
    # a table as big as the ID universe evicts nothing, and admit_threshold 1 admits every new
    # ID at once: which IDs are resident at each batch then follows from the batches alone
    cfg = TrainConfig(
        data=DataConfig(num_sparse=TABLES, universe=500),
        table=TableConfig(dim=8, capacity_fraction=1.0, admit_threshold=1),
        batch_size=BATCH,
        steps=STEPS,
        eval_batches=EVAL_BATCHES,
        dense_arch=[8],
        over_arch=[8, 1],
        progress=False,
        log_every=LOG_EVERY,
        metrics_port=port,
        metrics_linger_seconds=0,
    )
    printed = io.StringIO()
    with contextlib.redirect_stderr(printed):
        result = train(cfg)
    assert len(result.losses) == STEPS
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    values = {
        (s.name, s.labels.get("table")): s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
        if s.name.startswith("dynemb_trainer_")
    }
    return cfg, values, printed.getvalue()


def expected_counts(cfg: TrainConfig, table: int) -> dict[str, int]:
    """What one table's counters must read after the run, from its batches: nothing is evicted,
    so an ID is resident from the batch that first sights it on."""
    data = SyntheticCriteo(cfg.data, cfg.batch_size)
    key = data.keys[table]
    seen: set[int] = set()
    lookups = hits = distinct_new = 0
    for k in range(cfg.steps):
        ids = data.batch(k).sparse_features[key].values().numpy()
        resident = np.isin(ids, np.fromiter(seen, dtype=np.int64, count=len(seen)))
        lookups += len(ids)
        hits += int(resident.sum())
        new = set(ids[~resident].tolist())
        distinct_new += len(new)
        seen |= new
    # evaluation: each held-out batch's IDs without a device row, each pulled once per batch
    looked_up = sum(
        len(set(data.batch(k, split=1).sparse_features[key].values().tolist()) - seen) for k in range(cfg.eval_batches)
    )
    return {
        "lookups": lookups,
        "hits": hits,
        "misses": lookups - hits,
        "admissions": distinct_new,
        "new": distinct_new,
        "looked_up": looked_up,
    }


@pytest.mark.parametrize("table", range(TABLES))
def test_the_counters_add_up_as_the_docs_say(run, table):
    cfg, values, _ = run
    name = f"dynemb_{table_name(table)}"  # the PS table's name, as the metrics label it

    def got(counter: str) -> int:
        return int(values[(f"dynemb_trainer_{counter}_total", name)])

    want = expected_counts(cfg, table)
    # lookups and hits count sightings: an ID twice in a batch is looked up twice
    assert got("lookups") == want["lookups"] == STEPS * BATCH
    assert got("hits") == want["hits"]
    assert got("lookups") == got("hits") + got("misses")
    # a batch's distinct non-resident IDs are admitted or rejected once each, however often the
    # batch sights them: misses exceed admissions + rejections by the repeats
    assert got("admissions") + got("rejections") == want["new"]
    assert got("misses") > got("admissions") + got("rejections"), "the batches repeat new IDs: misses must exceed"
    # every admission is one row pulled; a look-up without training (evaluation) pulls the rows
    # of the IDs without a device row too, and admits nothing
    assert got("rows_pulled") == got("admissions") + want["looked_up"]
    assert want["looked_up"] > 0, "the held-out batches must sight IDs that training did not"
    assert got("rows_pushed") == got("evictions") == 0


def test_a_rank_that_finished_says_so(run):
    _, values, _ = run
    assert values[("dynemb_trainer_finished", None)] == 1
    # no PS here: the watch of its calls stays at 0
    assert values[("dynemb_trainer_ps_retries_total", None)] == 0
    assert values[("dynemb_trainer_ps_blocked_seconds", None)] == 0


def test_no_progress_prints_a_loss_line_every_log_every_steps(run):
    _, _, printed = run
    lines = [line for line in printed.splitlines() if line.startswith("step ") and " loss " in line]
    # every LOG_EVERY steps, and the last step's
    steps = [*range(LOG_EVERY, STEPS + 1, LOG_EVERY), STEPS]
    assert [int(line.split(":")[0].split()[1]) for line in lines] == steps, printed[-2000:]
    assert all("samples/s" in line and "hit" in line for line in lines), lines
