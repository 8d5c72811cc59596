"""Write deploy/grafana/dashboards/dynemb.json, the dynemb Grafana dashboard.

    python deploy/grafana/build_dashboard.py      # after changing a panel; tests check the two agree

Plain dicts rather than a dashboard library: the dashboard is a few rows of time series over
PromQL, and Grafana's JSON model is the thing operators read and diff.
"""

from __future__ import annotations

import json
from pathlib import Path

OUT = Path(__file__).resolve().parent / "dashboards" / "dynemb.json"

# Template variables narrow every trainer panel to some jobs, tables and ranks, PS panels to some
# PS. Trainer and PS name a table alike (the PS table's name), so $table narrows PS rows too.
T = 'train_job=~"$train_job", table=~"$table", rank=~"$rank"'
R = 'train_job=~"$train_job", rank=~"$rank"'
P = 'job="dynemb-ps", instance=~"$ps"'
RATE = "$__rate_interval"

# (row title, [(panel title, unit, [(expr, legend)]), ...])
ROWS = [
    (
        "Dynamic tables",
        [
            (
                "Hit rate by table",
                "percentunit",
                [
                    (
                        f"sum by (train_job, table) (rate(dynemb_trainer_hits_total{{{T}}}[{RATE}])) / "
                        f"sum by (train_job, table) (rate(dynemb_trainer_lookups_total{{{T}}}[{RATE}]))",
                        "{{train_job}} {{table}}",
                    )
                ],
            ),
            (
                "Hit rate by rank",
                "percentunit",
                [
                    (
                        f"sum by (train_job, rank) (rate(dynemb_trainer_hits_total{{{T}}}[{RATE}])) / "
                        f"sum by (train_job, rank) (rate(dynemb_trainer_lookups_total{{{T}}}[{RATE}]))",
                        "{{train_job}} rank {{rank}}",
                    )
                ],
            ),
            (
                "Evictions /s",
                "ops",
                [
                    (
                        f"sum by (train_job, table, rank) (rate(dynemb_trainer_evictions_total{{{T}}}[{RATE}]))",
                        "{{train_job}} {{table}} rank {{rank}}",
                    )
                ],
            ),
            (
                "Admissions and rejections /s",
                "ops",
                [
                    (
                        f"sum by (train_job, table) (rate(dynemb_trainer_admissions_total{{{T}}}[{RATE}]))",
                        "admitted {{train_job}} {{table}}",
                    ),
                    (
                        f"sum by (train_job, table) (rate(dynemb_trainer_rejections_total{{{T}}}[{RATE}]))",
                        "below threshold {{train_job}} {{table}}",
                    ),
                ],
            ),
            (
                "Table occupancy",
                "percentunit",
                [(f"dynemb_trainer_table_occupancy_ratio{{{T}}}", "{{train_job}} {{table}} rank {{rank}}")],
            ),
            (
                "Eviction share of lookups (5m)",
                "percentunit",
                [
                    (
                        "train_job_table:dynemb_trainer_eviction_ratio:rate5m"
                        '{train_job=~"$train_job", table=~"$table"}',
                        "{{train_job}} {{table}}",
                    )
                ],
            ),
        ],
    ),
    (
        "Trainer and the PS",
        [
            (
                "Rows pulled and pushed /s",
                "ops",
                [
                    (
                        f"sum by (train_job, table) (rate(dynemb_trainer_rows_pulled_total{{{T}}}[{RATE}]))",
                        "pull {{train_job}} {{table}}",
                    ),
                    (
                        f"sum by (train_job, table) (rate(dynemb_trainer_rows_pushed_total{{{T}}}[{RATE}]))",
                        "push {{train_job}} {{table}}",
                    ),
                ],
            ),
            (
                "PS call latency seen by trainers (p50, p99)",
                "s",
                [
                    (
                        "histogram_quantile(0.5, sum by (train_job, op, le) "
                        f"(rate(dynemb_trainer_ps_request_seconds_bucket{{{T}}}[{RATE}])))",
                        "{{train_job}} {{op}} p50",
                    ),
                    (
                        "histogram_quantile(0.99, sum by (train_job, op, le) "
                        f"(rate(dynemb_trainer_ps_request_seconds_bucket{{{T}}}[{RATE}])))",
                        "{{train_job}} {{op}} p99",
                    ),
                ],
            ),
            (
                # a rank blocked on a PS that is away shows here while it waits (DynembTrainerBlockedOnPS)
                "PS calls retried and failed /s, by rank",
                "ops",
                [
                    (
                        f"sum by (train_job, rank) (rate(dynemb_trainer_ps_retries_total{{{R}}}[{RATE}]))",
                        "retried {{train_job}} rank {{rank}}",
                    ),
                    (
                        f"sum by (train_job, rank) (rate(dynemb_trainer_ps_errors_total{{{R}}}[{RATE}]))",
                        "failed {{train_job}} rank {{rank}}",
                    ),
                ],
            ),
            (
                "Oldest PS call waiting, by rank",
                "s",
                [
                    (
                        f"max by (train_job, rank) (dynemb_trainer_ps_blocked_seconds{{{R}}})",
                        "{{train_job}} rank {{rank}}",
                    )
                ],
            ),
        ],
    ),
    (
        "Training",
        [
            (
                "Samples /s",
                "ops",
                [
                    (
                        f"sum by (train_job, rank) (rate(dynemb_trainer_samples_total{{{R}}}[{RATE}]))",
                        "{{train_job}} rank {{rank}}",
                    ),
                    (
                        f"sum by (train_job) (rate(dynemb_trainer_samples_total{{{R}}}[{RATE}]))",
                        "{{train_job}} all ranks",
                    ),
                ],
            ),
            ("Loss", "none", [(f"dynemb_trainer_loss{{{R}}}", "{{train_job}} rank {{rank}}")]),
            (
                "Steps /s",
                "ops",
                [
                    (
                        f"sum by (train_job, rank) (rate(dynemb_trainer_steps_total{{{R}}}[{RATE}]))",
                        "{{train_job}} rank {{rank}}",
                    )
                ],
            ),
        ],
    ),
    (
        "Parameter servers",
        [
            (
                "PS requests /s by method",
                "reqps",
                [(f"sum by (method) (rate(dynemb_ps_requests_total{{{P}}}[{RATE}]))", "{{method}}")],
            ),
            (
                "PS rows /s by table",
                "ops",
                [
                    (
                        f'sum by (method, table) (rate(dynemb_ps_rows_total{{{P}, table=~"$table"}}[{RATE}]))',
                        "{{method}} {{table}}",
                    )
                ],
            ),
            (
                "PS latency p99 by method",
                "s",
                [
                    (
                        "histogram_quantile(0.99, sum by (method, le) "
                        f"(rate(dynemb_ps_request_seconds_bucket{{{P}}}[{RATE}])))",
                        "{{method}}",
                    )
                ],
            ),
            (
                "PS store latency p99 by operation",
                "s",
                [
                    (
                        "histogram_quantile(0.99, sum by (op, le) "
                        f"(rate(dynemb_ps_backend_seconds_bucket{{{P}}}[{RATE}])))",
                        "{{op}}",
                    )
                ],
            ),
            (
                "PS errors /s",
                "reqps",
                [(f"sum by (method, code) (rate(dynemb_ps_errors_total{{{P}}}[{RATE}]))", "{{method}} {{code}}")],
            ),
            (
                "PS up, serving, store reachable, in flight",
                "short",
                [
                    (f"up{{{P}}}", "up {{instance}}"),
                    (f"dynemb_ps_serving{{{P}}}", "serving {{instance}}"),
                    (f"dynemb_ps_backend_up{{{P}}}", "store reachable {{instance}}"),
                    (f"dynemb_ps_inflight_requests{{{P}}}", "in flight {{instance}}"),
                ],
            ),
            ("PS memory (RSS)", "bytes", [(f"process_resident_memory_bytes{{{P}}}", "{{instance}}")]),
            (
                # --redis-durable: short = writes failed for lack of replicas (retried), unreplicated =
                # written to a master with none online (docs/ps.md, "Failover")
                "PS durable writes /s by outcome",
                "ops",
                [
                    (
                        f"sum by (instance, outcome) (rate(dynemb_ps_replica_waits_total{{{P}}}[{RATE}]))",
                        "{{outcome}} {{instance}}",
                    )
                ],
            ),
        ],
    ),
    (
        # docs/ps.md, "Rows that expire"; a table's state as each PS over its store reports it
        "Rows that expire",
        [
            (
                "Rows expired /s by table",
                "ops",
                [
                    (
                        f'sum by (table) (rate(dynemb_ps_rows_expired_total{{{P}, table=~"$table"}}[{RATE}]))',
                        "{{table}}",
                    )
                ],
            ),
            (
                "Oldest row age, time since the last sweep",
                "s",
                [
                    (f'dynemb_ps_oldest_row_age_seconds{{{P}, table=~"$table"}}', "oldest row {{table}} {{instance}}"),
                    (
                        f'time() - dynemb_ps_last_sweep_timestamp_seconds{{{P}, table=~"$table"}}',
                        "since sweep {{table}} {{instance}}",
                    ),
                ],
            ),
            (
                "Rows over the row cap",
                "short",
                [(f'dynemb_ps_rows_over_cap{{{P}, table=~"$table"}}', "{{table}} {{instance}}")],
            ),
            (
                "Rows over the declared size",
                "short",
                [(f'dynemb_ps_rows_over_declared{{{P}, table=~"$table"}}', "{{table}} {{instance}}")],
            ),
        ],
    ),
    (
        # the disk backend (docs/ps.md, "The disk backend"): RocksDB under each disk PS
        "Disk store",
        [
            (
                "Disk cache hit rate by cache",
                "percentunit",
                [
                    (
                        "sum by (instance, cache) "
                        f'(rate(dynemb_ps_disk_cache_lookups_total{{{P}, result="hit"}}[{RATE}])) / '
                        f"sum by (instance, cache) (rate(dynemb_ps_disk_cache_lookups_total{{{P}}}[{RATE}]))",
                        "{{cache}} {{instance}}",
                    )
                ],
            ),
            ("Bytes on disk", "bytes", [(f"dynemb_ps_disk_bytes{{{P}}}", "{{instance}}")]),
            (
                "Compaction: bytes /s and pending",
                "bytes",
                [
                    (
                        f"sum by (instance, direction) (rate(dynemb_ps_disk_compaction_bytes_total{{{P}}}[{RATE}]))",
                        "{{direction}} /s {{instance}}",
                    ),
                    (f"dynemb_ps_disk_pending_compaction_bytes{{{P}}}", "pending {{instance}}"),
                ],
            ),
            (
                # seconds a second that writes waited: a disk that cannot keep up with the pushes
                "Write stalls (s /s)",
                "percentunit",
                [(f"rate(dynemb_ps_disk_write_stall_seconds_total{{{P}}}[{RATE}])", "{{instance}}")],
            ),
        ],
    ),
    (
        "Redis",
        [
            (
                "Redis memory used / maxmemory",
                "percentunit",
                [('redis_memory_used_bytes{job="redis"} / (redis_memory_max_bytes{job="redis"} > 0)', "{{instance}}")],
            ),
            ("Redis memory used", "bytes", [('redis_memory_used_bytes{job="redis"}', "{{instance}}")]),
            (
                # a master's replicas (a failover leaves the promoted one with none until the old is back)
                "Redis replicas connected, by master",
                "short",
                [
                    (
                        'redis_connected_slaves{job="redis"} and on (instance) redis_instance_info{role="master"}',
                        "{{instance}}",
                    )
                ],
            ),
        ],
    ),
]


def variable(name: str, label: str, query: str) -> dict:
    return {
        "name": name,
        "label": label,
        "type": "query",
        "datasource": {"type": "prometheus", "uid": "${datasource}"},
        "query": {"query": query, "refId": name},
        "definition": query,
        "refresh": 2,
        "sort": 3,
        "multi": True,
        "includeAll": True,
        "allValue": ".*",
        "current": {"text": "All", "value": "$__all"},
    }


def build() -> dict:
    panels, panel_id, y = [], 1, 0
    for title, row in ROWS:
        panels.append(
            {
                "id": panel_id,
                "type": "row",
                "title": title,
                "collapsed": False,
                "gridPos": {"h": 1, "w": 24, "x": 0, "y": y},
                "panels": [],
            }
        )
        panel_id, y = panel_id + 1, y + 1
        for i, (name, unit, targets) in enumerate(row):
            panels.append(
                {
                    "id": panel_id,
                    "type": "timeseries",
                    "title": name,
                    "datasource": {"type": "prometheus", "uid": "${datasource}"},
                    "gridPos": {"h": 8, "w": 8, "x": 8 * (i % 3), "y": y + 8 * (i // 3)},
                    "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
                    "options": {"legend": {"displayMode": "list", "placement": "bottom"}, "tooltip": {"mode": "multi"}},
                    "targets": [
                        {"refId": chr(ord("A") + k), "expr": expr, "legendFormat": legend}
                        for k, (expr, legend) in enumerate(targets)
                    ],
                }
            )
            panel_id += 1
        y += 8 * ((len(row) + 2) // 3)
    return {
        "uid": "dynemb",
        "title": "dynemb",
        "tags": ["dynemb"],
        "timezone": "browser",
        "editable": True,
        "schemaVersion": 39,
        "version": 1,
        "refresh": "30s",
        "time": {"from": "now-3h", "to": "now"},
        "templating": {
            "list": [
                {
                    "name": "datasource",
                    "label": "Prometheus",
                    "type": "datasource",
                    "query": "prometheus",
                    "current": {},
                    "hide": 0,
                },
                variable("train_job", "job", "label_values(dynemb_trainer_steps_total, train_job)"),
                variable(
                    "table", "table", 'label_values(dynemb_trainer_lookups_total{train_job=~"$train_job"}, table)'
                ),
                variable("rank", "rank", 'label_values(dynemb_trainer_steps_total{train_job=~"$train_job"}, rank)'),
                # every scraped PS, an idle one (no request yet: no dynemb_ps_requests_total) or a down one too
                variable("ps", "PS", 'label_values(up{job="dynemb-ps"}, instance)'),
            ]
        },
        "annotations": {"list": []},
        "panels": panels,
    }


def render() -> str:
    return json.dumps(build(), indent=2) + "\n"


def main(argv: list[str] | None = None) -> int:
    """Write the dashboard (or check it is current, with --check); exit status."""
    import argparse

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=OUT, help=f"where to write it [default {OUT}]")
    p.add_argument("--check", action="store_true", help="write nothing: exit 1 if --out differs from the panels here")
    args = p.parse_args(argv)
    text = render()
    if args.check:
        current = args.out.exists() and args.out.read_text() == text
        print(f"{args.out}: {'current' if current else 'out of date: run python deploy/grafana/build_dashboard.py'}")
        return 0 if current else 1
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
