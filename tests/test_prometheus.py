"""A real Prometheus (Debian's 2.42, from .bin/) with deploy/prometheus's own config and rules,
but second-long intervals and this test's targets, scrapes a running PS (`dynemb ps serve`
over Redis, with the auth token and TLS the Kubernetes manifests use), both ranks of a torchrun
trainer (`-m dynemb.trainer --metrics-port`) that trains through that PS, and redis_exporter beside
the Redis (run with deploy/k8s's redis.conf). PromQL through Prometheus' HTTP API then returns
the trainer's hit and eviction counters per table and rank, the PS's rows per table, its
sweeps and its tables' declared sizes, the recorded series, the Redis memory limit, and data
for the dashboard's panels."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from pathlib import Path

import pytest
import yaml
from deploy_files import DEPLOY, dashboard_exprs, redis_conf_lines, tool

from dynemb.testing.local_ps import LocalPS, _die_with_parent
from dynemb.testing.local_redis import RedisProcess, free_port, make_tls_files
from dynemb.testing.process import end_process

pytestmark = [pytest.mark.slow, pytest.mark.dist, pytest.mark.torchrec]

# enough steps that Prometheus (1 s scrapes) sees the counters move: rate() needs two samples
# that differ, and 40 steps ran in well under a second
STEPS, BATCH, TABLES, RANKS = 600, 64, 3, 2
TOKEN = "prometheus-test-token"
JOB = "promtest"  # the trainer's --job-name: its metrics' train_job label
TABLE_NAMES = [f"dynemb_t_{t}" for t in range(TABLES)]  # the PS's table names, on both sides


def free_port_pair() -> int:
    """p with p and p + 1 free: rank with local rank l serves on metrics_port + l."""
    while True:
        p = free_port()
        try:
            with socket.socket() as s:
                s.bind(("127.0.0.1", p + 1))
            return p
        except OSError:
            continue


class Prometheus:
    def __init__(self, workdir: Path, targets: dict[str, list[str]]) -> None:
        """deploy/prometheus copied to workdir, with 1 s intervals and these targets per job."""
        shutil.copytree(DEPLOY / "prometheus", workdir / "prometheus")
        config_path = workdir / "prometheus" / "prometheus.yml"
        config = yaml.safe_load(config_path.read_text())
        config["global"].update(scrape_interval="1s", evaluation_interval="1s")
        config_path.write_text(yaml.safe_dump(config))
        for job in config["scrape_configs"]:
            for sd in job["file_sd_configs"]:
                for name in sd["files"]:
                    (config_path.parent / name).write_text(yaml.safe_dump([{"targets": targets[job["job_name"]]}]))
        self.port = free_port()
        self.log = open(workdir / "prometheus.log", "wb")
        self.proc = subprocess.Popen(
            [
                tool("prometheus"),
                f"--config.file={config_path}",
                f"--storage.tsdb.path={workdir / 'tsdb'}",
                f"--web.listen-address=127.0.0.1:{self.port}",
            ],
            stdout=self.log,
            stderr=subprocess.STDOUT,
            preexec_fn=_die_with_parent,
        )
        deadline = time.monotonic() + 30
        while True:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{self.port}/-/ready", timeout=2)
                return
            except OSError:
                assert self.proc.poll() is None and time.monotonic() < deadline, self.log_text()
                time.sleep(0.1)

    def log_text(self) -> str:
        return Path(self.log.name).read_text(errors="replace")[-4000:]

    def query(self, promql: str) -> list[dict]:
        url = f"http://127.0.0.1:{self.port}/api/v1/query?" + urllib.parse.urlencode({"query": promql})
        reply = json.loads(urllib.request.urlopen(url, timeout=10).read())
        assert reply["status"] == "success", (promql, reply)
        return reply["data"]["result"]

    def values(self, promql: str, *labels: str) -> dict[tuple, float]:
        return {tuple(r["metric"].get(k) for k in labels): float(r["value"][1]) for r in self.query(promql)}

    def targets(self) -> list[dict]:
        url = f"http://127.0.0.1:{self.port}/api/v1/targets"
        return json.loads(urllib.request.urlopen(url, timeout=10).read())["data"]["activeTargets"]

    def close(self) -> None:
        end_process(self.proc, timeout=20)
        self.log.close()


@pytest.fixture(scope="module")
def stack(tmp_path_factory, redis_binaries):
    """Redis (deploy/k8s's redis.conf) + redis_exporter + a TLS, token-checking PS over it +
    Prometheus, then a 2-rank torchrun trainer through the PS. Yields while the trainer's
    /metrics linger after its last step."""
    work = tmp_path_factory.mktemp("prometheus")
    conf = [
        line
        for line in redis_conf_lines((DEPLOY / "k8s" / "redis" / "redis.conf").read_text())
        if line.split()[0] not in ("port", "bind", "dir")
    ]
    redis = RedisProcess(conf).start()
    procs: list = []
    try:
        exporter_port = free_port()
        exporter_log = open(work / "redis_exporter.log", "wb")
        procs.append(
            subprocess.Popen(
                [
                    tool("redis_exporter"),
                    f"--redis.addr=redis://{redis.address}",
                    f"--web.listen-address=127.0.0.1:{exporter_port}",
                ],
                stdout=exporter_log,
                stderr=subprocess.STDOUT,
                preexec_fn=_die_with_parent,
            )
        )
        tls = make_tls_files(str(work))
        ps = LocalPS(
            "--backend",
            redis.url,
            "--namespace",
            "promtest",
            "--tls-cert",
            tls["cert"],
            "--tls-key",
            tls["key"],
            "--not-serving-seconds",
            "0",
            "--sweep-every",  # passes over tables with a row cap alone are this often
            "1",
            env={"DYNEMB_PS_AUTH_TOKEN": TOKEN},
        ).start()
        procs.append(ps)
        metrics_port = free_port_pair()
        prom = Prometheus(
            work,
            {
                "dynemb-ps": [f"127.0.0.1:{ps.metrics_port}"],
                "dynemb-trainer": [f"127.0.0.1:{metrics_port + r}" for r in range(RANKS)],
                "redis": [f"127.0.0.1:{exporter_port}"],
            },
        )
        procs.append(prom)
        trainer_log = open(work / "trainer.log", "wb")
        trainer = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--standalone",
                f"--nproc_per_node={RANKS}",
                "-m",
                "dynemb.trainer",
                "--ps",
                f"localhost:{ps.port}",
                "--ps-tls-ca",
                tls["ca"],
                "--num-sparse",
                str(TABLES),
                *(
                    "--universe 2000 --capacity-fraction 0.25 --dim 8 --dense-arch 8 --over-arch 8,1 --batch-size"
                ).split(),
                str(BATCH),
                "--steps",
                str(STEPS),
                # a row cap far above the rows trained: the PS sweeps the tables, deleting nothing
                *"--ps-max-rows 1000000 --eval-batches 1 --no-progress --job-name".split(),
                JOB,
                "--metrics-port",
                str(metrics_port),
                "--metrics-linger-seconds",
                "12",
            ],
            stdout=trainer_log,
            stderr=subprocess.STDOUT,
            preexec_fn=_die_with_parent,
            env={**os.environ, "OMP_NUM_THREADS": "1", "DYNEMB_PS_AUTH_TOKEN": TOKEN},
        )
        procs.append(trainer)

        def trainer_output() -> str:
            return (work / "trainer.log").read_text(errors="replace")[-6000:]

        # wait until Prometheus has scraped both ranks' last steps, then until the evaluation
        # batch and the final flush have been counted too (nothing moves for 3 s; the ranks'
        # /metrics linger 12 s after the job)
        deadline = time.monotonic() + 150
        moving = "sum(dynemb_trainer_lookups_total) + sum(dynemb_ps_rows_total)"
        last, still_since = None, time.monotonic()
        mid_training = False  # the rate rules need a sample taken while the counters moved
        while True:
            done = prom.values("dynemb_trainer_steps_total", "rank")
            mid_training |= any(0 < v < STEPS for v in done.values())
            now = prom.values(moving)
            if now != last:
                last, still_since = now, time.monotonic()
            if done == {(str(r),): STEPS for r in range(RANKS)} and time.monotonic() - still_since > 3:
                assert mid_training, "training ended before Prometheus scraped it once: raise STEPS"
                break
            assert trainer.poll() is None, f"trainer exited ({trainer.returncode}):\n{trainer_output()}"
            assert time.monotonic() < deadline, f"Prometheus saw {done}\n{trainer_output()}\n{prom.log_text()}"
            time.sleep(0.5)
        yield prom, ps
        assert trainer.wait(60) == 0, trainer_output()
    finally:
        for p in reversed(procs):
            if isinstance(p, subprocess.Popen):
                if p.poll() is None:
                    p.terminate()
                    p.wait(30)
            else:
                p.close()
        redis.close()


def test_every_target_is_up(stack):
    prom, _ = stack
    health = {(t["labels"]["job"], t["labels"]["instance"]): t["health"] for t in prom.targets()}
    assert sorted({job for job, _ in health}) == ["dynemb-ps", "dynemb-trainer", "redis"]
    assert sum(job == "dynemb-trainer" for job, _ in health) == RANKS
    assert set(health.values()) == {"up"}, health


def test_ranks_say_they_finished_and_export_their_ps_calls(stack):
    """Each rank, lingering after its job, says it finished (what DynembTrainerDown and
    DynembTrainerStalled read) and exports its PS client's retries, failures and blocked time."""
    prom, _ = stack
    ranks = {(str(r), JOB) for r in range(RANKS)}
    deadline = time.monotonic() + 8  # the ranks linger 12 s; the fixture waited 3 of them
    while (finished := prom.values("dynemb_trainer_finished", "rank", "train_job")) != dict.fromkeys(ranks, 1.0):
        assert time.monotonic() < deadline, finished
        time.sleep(0.2)
    for name in ("dynemb_trainer_ps_retries_total", "dynemb_trainer_ps_errors_total"):
        got = prom.values(name, "rank", "train_job")
        assert set(got) == ranks and all(v >= 0 for v in got.values()), (name, got)
    assert prom.values("dynemb_trainer_ps_errors_total", "rank", "train_job") == dict.fromkeys(ranks, 0.0)
    assert prom.values("dynemb_trainer_ps_blocked_seconds", "rank", "train_job") == dict.fromkeys(ranks, 0.0)
    alerts = 'ALERTS{alertname=~"DynembTrainerDown|DynembTrainerStalled|DynembTrainerBlockedOnPS"}'
    assert prom.query(alerts) == []


def test_trainer_hit_and_eviction_counters_per_table_and_rank(stack):
    prom, _ = stack
    keys = {(table, str(r), JOB) for table in TABLE_NAMES for r in range(RANKS)}
    for name in ("dynemb_trainer_hits_total", "dynemb_trainer_evictions_total", "dynemb_trainer_admissions_total"):
        got = prom.values(f'{name}{{job="dynemb-trainer"}}', "table", "rank", "train_job")
        assert set(got) == keys, (name, got)
        assert all(v > 0 for v in got.values()), (name, got)
    assert prom.values("dynemb_trainer_steps_total", "rank", "train_job") == {
        (str(r), JOB): STEPS for r in range(RANKS)
    }
    # every ID of every rank's batches is looked up once, by the rank that owns it
    lookups = prom.values('sum by (table) (dynemb_trainer_lookups_total{job="dynemb-trainer"})', "table")
    assert lookups == {(table,): RANKS * BATCH * STEPS for table in TABLE_NAMES}  # evaluation counts none
    hits = prom.values("sum by (table) (dynemb_trainer_hits_total)", "table")
    misses = prom.values("sum by (table) (dynemb_trainer_misses_total)", "table")
    assert {k: hits[k] + misses[k] for k in hits} == lookups
    latency = prom.values('dynemb_trainer_ps_request_seconds_count{op="pull"}', "table", "rank", "train_job")
    assert set(latency) == keys and all(v > 0 for v in latency.values())


def test_ps_counts_the_rows_the_trainers_moved_per_table(stack):
    prom, _ = stack
    ps_pulled = prom.values('dynemb_ps_rows_total{job="dynemb-ps", method="Pull"}', "table")
    trainer_pulled = prom.values("sum by (table) (dynemb_trainer_rows_pulled_total)", "table")
    assert set(ps_pulled) == {(table,) for table in TABLE_NAMES}
    assert ps_pulled == trainer_pulled  # one table name on both sides
    pushed = prom.values('dynemb_ps_rows_total{job="dynemb-ps", method="Push"}', "table")
    evicted = prom.values("sum by (table) (dynemb_trainer_evictions_total)", "table")
    for table in TABLE_NAMES:  # evictions, then the final flush of every resident row
        assert pushed[(table,)] > evicted[(table,)] > 0
    assert prom.values('up{job="dynemb-ps"}', "job") == {("dynemb-ps",): 1.0}
    assert prom.values("dynemb_ps_serving", "job") == {("dynemb-ps",): 1.0}


def test_ps_reports_its_sweeps_and_the_tables_declared_sizes(stack):
    """The trainer's tables declare their ID universe and carry a row cap far above it: the PS
    sweeps them (deleting nothing) and counts them against their declarations, and no alert on
    rows that expire fires."""
    prom, _ = stack
    tables = {(table,) for table in TABLE_NAMES}
    assert prom.values('dynemb_ps_table_declared_rows{job="dynemb-ps"}', "table") == dict.fromkeys(tables, 2000.0)
    assert prom.values('dynemb_ps_rows_over_declared{job="dynemb-ps"}', "table") == dict.fromkeys(tables, 0.0)
    assert prom.values('dynemb_ps_rows_over_cap{job="dynemb-ps"}', "table") == dict.fromkeys(tables, 0.0)
    assert prom.values('dynemb_ps_rows_expired_total{job="dynemb-ps"}', "table") == dict.fromkeys(tables, 0.0)
    ages = prom.values('dynemb_ps_oldest_row_age_seconds{job="dynemb-ps"}', "table")
    assert set(ages) == tables and all(0 <= v < 600 for v in ages.values()), ages
    since = prom.values('time() - dynemb_ps_last_sweep_timestamp_seconds{job="dynemb-ps"}', "table")
    assert set(since) == tables and all(v < 60 for v in since.values()), since
    alerts = 'ALERTS{alertname=~"DynembTableOverDeclared|DynembTableOverCap|DynembSweepsStopped"}'
    assert prom.query(alerts) == []


def test_recording_rules_evaluate_on_real_data(stack):
    prom, _ = stack
    hit = prom.values("train_job_table:dynemb_trainer_hit_ratio:rate5m", "train_job", "table")
    assert set(hit) == {(JOB, table) for table in TABLE_NAMES} and all(0 < v < 1 for v in hit.values()), hit
    per_rank = prom.values("train_job_table_rank:dynemb_trainer_hit_ratio:rate5m", "train_job", "table", "rank")
    assert len(per_rank) == TABLES * RANKS and {k[0] for k in per_rank} == {JOB}
    evictions = prom.values("train_job_table:dynemb_trainer_evictions:rate5m", "train_job", "table")
    assert len(evictions) == TABLES and all(v > 0 for v in evictions.values())
    p99 = prom.values("method:dynemb_ps_request_seconds:p99_5m", "method")
    assert 0 < p99[("PullMany",)] < 30 and 0 < p99[("PushMany",)] < 30  # a trainer step: one call each
    trainer_p99 = prom.values("train_job_op_table:dynemb_trainer_ps_request_seconds:p99_5m", "op", "table")
    assert {op for op, _ in trainer_p99} == {"pull", "push"}


def test_redis_exporter_reports_the_deployed_maxmemory(stack):
    """The Redis alert's metrics are real: redis_exporter's names, with deploy/k8s's maxmemory."""
    prom, _ = stack
    conf = dict(line.split(None, 1) for line in redis_conf_lines((DEPLOY / "k8s/redis/redis.conf").read_text()))
    amount = conf["maxmemory"].lower()
    units = {"gb": 1 << 30, "mb": 1 << 20, "kb": 1 << 10}
    maxmemory = int(amount[:-2]) * units[amount[-2:]] if amount[-2:] in units else int(amount)
    assert prom.values('redis_memory_max_bytes{job="redis"}', "job") == {("redis",): float(maxmemory)}
    assert prom.values('redis_up{job="redis"}', "job") == {("redis",): 1.0}
    used = prom.values('redis_memory_used_bytes{job="redis"} / (redis_memory_max_bytes{job="redis"} > 0)', "job")
    assert 0 < used[("redis",)] < 0.9  # the alert's expression, not firing
    # the failover alerts' inputs (a lone master: no replica, never promoted)
    assert prom.values('redis_connected_slaves{job="redis"}', "job") == {("redis",): 0.0}
    assert prom.values('redis_instance_info{job="redis"}', "role") == {("master",): 1.0}


def test_every_dashboard_query_runs_and_shows_data(stack):
    """Each panel's PromQL, its variables set to 'All', parses and (but for PS errors, of which
    there were none, and the disk store's, which this stack's Redis PS has not) returns series."""
    prom, _ = stack
    empty = []
    for title, expr in dashboard_exprs():
        promql = expr.replace("$__rate_interval", "1m")
        for variable in ("$train_job", "$table", "$rank", "$ps"):
            promql = promql.replace(variable, ".*")
        if not prom.query(promql) and "dynemb_ps_disk_" not in promql:
            empty.append(title)
    assert set(empty) <= {"PS errors /s"}, empty
