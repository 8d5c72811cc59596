"""dynemb/tables/metrics.py's TableStats (per-table metrics kept in arrays, exposed when scraped)
against prometheus_client's own Counter and Histogram fed the same values."""

from __future__ import annotations

import numpy as np
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from dynemb.ps_server.metrics import LATENCY_BUCKETS
from dynemb.tables.metrics import TABLE_COUNTERS, TrainerMetrics


def samples(registry: CollectorRegistry, family: str) -> dict:
    """{(sample name, sorted labels): value} of one family, as a scrape parses it."""
    text = generate_latest(registry).decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for f in text_string_to_metric_families(text)
        if f.name == family
        for s in f.samples
        if not s.name.endswith("_created")
    }


def test_table_stats_match_prometheus_client_counters_and_histograms():
    rng = np.random.default_rng(3)
    metrics = TrainerMetrics(1)
    rows = metrics.tables.add_tables(["a", "b", "c"])
    assert rows.tolist() == [0, 1, 2]
    assert metrics.tables.add_tables(["c", "d"]).tolist() == [2, 3]  # known tables keep their row

    reference = CollectorRegistry()
    counters = {
        name: Counter(f"dynemb_trainer_{name}", "h", ["table", "rank", "train_job"], registry=reference)
        for name, _ in TABLE_COUNTERS
    }
    latency = Histogram(
        "dynemb_trainer_ps_request_seconds",
        "h",
        ["op", "table", "rank", "train_job"],
        buckets=LATENCY_BUCKETS,
        registry=reference,
    )
    tables = ["a", "b", "c", "d"]
    for _ in range(50):
        pick = rng.choice(4, size=int(rng.integers(1, 5)), replace=False)
        counts = rng.integers(0, 1000, size=(len(pick), len(TABLE_COUNTERS)))
        metrics.tables.count(pick, counts, rng.random(len(pick)))
        for t, row in zip(pick, counts):
            for (name, _), v in zip(TABLE_COUNTERS, row):
                counters[name].labels(tables[t], "1", "dynemb").inc(int(v))
        op = ["pull", "push"][int(rng.integers(2))]
        seconds = float(rng.choice([*LATENCY_BUCKETS, 1e-6, 0.003, 99.0]))  # on the bounds, between, past the last
        metrics.tables.observe(op, pick, seconds)
        for t in pick:
            latency.labels(op, tables[t], "1", "dynemb").observe(seconds)
    for name, _ in TABLE_COUNTERS:
        got = samples(metrics.registry, f"dynemb_trainer_{name}")
        assert got == samples(reference, f"dynemb_trainer_{name}") and got, name
    got = samples(metrics.registry, "dynemb_trainer_ps_request_seconds")
    want = samples(reference, "dynemb_trainer_ps_request_seconds")
    assert got.keys() == want.keys()
    for key, value in want.items():
        assert abs(got[key] - value) < 1e-9 * max(1.0, abs(value)), key


def test_table_stats_occupancy_is_the_latest_value():
    metrics = TrainerMetrics(0)
    rows = metrics.tables.add_tables(["t_0", "t_1"])
    metrics.tables.count(rows, np.zeros((2, len(TABLE_COUNTERS)), np.int64), np.array([0.25, 0.5]))
    metrics.tables.count(rows[:1], np.zeros((1, len(TABLE_COUNTERS)), np.int64), np.array([0.75]))
    got = samples(metrics.registry, "dynemb_trainer_table_occupancy_ratio")
    assert got == {
        ("dynemb_trainer_table_occupancy_ratio", (("rank", "0"), ("table", "t_0"), ("train_job", "dynemb"))): 0.75,
        ("dynemb_trainer_table_occupancy_ratio", (("rank", "0"), ("table", "t_1"), ("train_job", "dynemb"))): 0.5,
    }


def test_every_metric_carries_the_job_name_and_the_rank_metrics_start_at_zero():
    """Two jobs on one Prometheus stay apart by `train_job`; a rank's step counter is exposed
    (at 0) before its first step, so an alert sees a rank stuck before it."""
    metrics = TrainerMetrics(3, job="ctr-v2")
    metrics.tables.add_tables(["ctr_t_0"])
    text = generate_latest(metrics.registry).decode()
    families = [f for f in text_string_to_metric_families(text) if f.name.startswith("dynemb_trainer_")]
    names = {f.name for f in families}
    assert {
        "dynemb_trainer_steps",
        "dynemb_trainer_loss",
        "dynemb_trainer_lookups",
        "dynemb_trainer_ps_request_seconds",
    } <= names
    for f in families:
        for s in f.samples:
            if not s.name.endswith("_created"):
                assert s.labels["train_job"] == "ctr-v2" and s.labels["rank"] == "3", s
    assert samples(metrics.registry, "dynemb_trainer_steps") == {
        ("dynemb_trainer_steps_total", (("rank", "3"), ("train_job", "ctr-v2"))): 0.0
    }
    metrics.steps.inc()
    assert samples(metrics.registry, "dynemb_trainer_steps") == {
        ("dynemb_trainer_steps_total", (("rank", "3"), ("train_job", "ctr-v2"))): 1.0
    }


def test_job_name_flag_names_the_metrics_job():
    """--job-name sets the train_job label; without it, the PS table prefix names the job; a
    name that would read badly in a query is refused, naming the rule."""
    import argparse

    import pytest

    from dynemb.trainer.config import TrainConfig, add_arguments, from_args

    p = argparse.ArgumentParser()
    add_arguments(p)
    assert from_args(p.parse_args(["--job-name", "ctr-v2"])).metrics_job() == "ctr-v2"
    assert from_args(p.parse_args([])).metrics_job() == "dynemb"
    assert from_args(p.parse_args(["--ps-table-prefix", "ads_"])).metrics_job() == "ads"
    for bad in ("-x", "a b", "x" * 129, 'a"b'):
        with pytest.raises(ValueError, match="job_name .* 1 to 128 letters"):
            TrainConfig(job_name=bad)
