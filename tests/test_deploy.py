"""deploy/: the Prometheus config and rules pass promtool (and their unit tests), the Grafana
dashboard and every Kubernetes manifest parse and validate, and all of them name the metrics,
flags, variables, ports, probes and images that the code and CLI really have. A real
Prometheus scraping a PS and trainer ranks: test_prometheus.py."""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import subprocess
import sys
from functools import lru_cache

import pytest
import yaml
from deploy_files import (
    DEPLOY,
    OVERLAYS,
    PROMQL_NAME,
    RECORDED_NAME,
    cli_env_names,
    container,
    dashboard,
    dashboard_exprs,
    exported_samples,
    find,
    metric_labels,
    named,
    ports,
    ps_workload,
    redis_conf_lines,
    rendered,
    rule_groups,
    tool,
)

from dynemb import __version__
from dynemb.ps_server.client import PSClient
from dynemb.testing.local_ps import REPO, LocalPS


def promtool(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([tool("promtool"), *args], capture_output=True, text=True, timeout=60, cwd=REPO)


# -- Prometheus --------------------------------------------------------------------------


@pytest.mark.parametrize("config", ["prometheus.yml", "prometheus-k8s.yml"])
def test_promtool_checks_the_scrape_configs(config):
    run = promtool("check", "config", f"deploy/prometheus/{config}")
    assert run.returncode == 0, run.stdout + run.stderr
    assert "SUCCESS: 2 rule files found" in run.stdout + run.stderr, run.stdout + run.stderr


def test_promtool_checks_the_rules_and_runs_their_unit_tests():
    rules = sorted(str(p.relative_to(REPO)) for p in (DEPLOY / "prometheus" / "rules").glob("*.yml"))
    run = promtool("check", "rules", *rules)
    assert run.returncode == 0, run.stdout + run.stderr
    tests = sorted(str(p.relative_to(REPO)) for p in (DEPLOY / "prometheus" / "tests").glob("*.yml"))
    run = promtool("test", "rules", *tests)
    assert run.returncode == 0 and "SUCCESS" in run.stdout, run.stdout + run.stderr


def test_the_alerts_the_issue_asks_for_exist():
    alerts = {r["alert"] for g in rule_groups() for r in g["rules"] if "alert" in r}
    assert {
        "DynembHitRateFalling",
        "DynembEvictionStorm",
        "DynembPSErrors",
        "DynembPSDown",
        "DynembRedisMemoryNearLimit",
        "DynembPSAbsent",
        "DynembRedisAbsent",
        "DynembTrainerDown",
        "DynembTrainerStalled",
    } <= alerts


def test_every_alert_has_a_unit_test_that_fires_it():
    alerts = {r["alert"] for g in rule_groups() for r in g["rules"] if "alert" in r}
    fired = set()
    for path in (DEPLOY / "prometheus" / "tests").glob("*.yml"):
        for case in yaml.safe_load(path.read_text())["tests"]:
            fired |= {t["alertname"] for t in case.get("alert_rule_test", []) if t["exp_alerts"]}
    assert alerts <= fired, f"alerts no test in deploy/prometheus/tests fires: {sorted(alerts - fired)}"


def test_ps_error_alert_counts_the_server_side_codes_the_ps_starts_at_zero():
    """DynembPSErrors' ratio selects exactly the server-side codes of dynemb/ps_server/metrics.py,
    and a real PS's /metrics has each of them, for every method, at 0 before any request (so
    rate() and increase() see the first burst of errors)."""
    from prometheus_client.parser import text_string_to_metric_families

    from dynemb.ps_server.metrics import METHODS, SERVER_ERROR_CODES

    rules = {r.get("record") or r["alert"]: r["expr"] for g in rule_groups() for r in g["rules"]}
    ratio = rules["instance_method:dynemb_ps_server_error_ratio:rate1m"]
    selected = re.search(r'dynemb_ps_errors_total\{code=~"([^"]+)"\}', ratio).group(1)
    assert set(selected.split("|")) == set(SERVER_ERROR_CODES)
    assert re.search(r"sum by \(job, instance, method\)", ratio)
    assert "instance_method:dynemb_ps_server_error_ratio:rate1m" in rules["DynembPSErrors"]
    assert {"NOT_FOUND", "INVALID_ARGUMENT", "ALREADY_EXISTS", "UNAUTHENTICATED"}.isdisjoint(SERVER_ERROR_CODES)
    assert {"Pull", "Push", "PullMany", "PushMany", "DescribeTable"} <= set(METHODS)

    ps = LocalPS("--backend", "embedded://", "--not-serving-seconds", "0").start()
    try:
        samples = {
            (s.labels["method"], s.labels["code"]): s.value
            for f in text_string_to_metric_families(ps.metrics_text())
            if f.name == "dynemb_ps_errors"
            for s in f.samples
            if s.name == "dynemb_ps_errors_total"
        }
    finally:
        ps.close()
    assert samples == {(m, c): 0.0 for m in METHODS for c in SERVER_ERROR_CODES}


def _scrape_jobs(config: str) -> set[str]:
    return {j["job_name"] for j in yaml.safe_load((DEPLOY / "prometheus" / config).read_text())["scrape_configs"]}


def test_rules_and_dashboard_name_metrics_the_code_exports():
    """Every dynemb_* name in a rule or a dashboard query is a sample the PS's or a trainer's
    registry really exposes; every recorded series used is recorded; every job exists in both
    scrape configs."""
    samples = exported_samples()
    recorded = {r["record"] for g in rule_groups() for r in g["rules"] if "record" in r}
    exprs = [("rule " + (r.get("record") or r.get("alert")), r["expr"]) for g in rule_groups() for r in g["rules"]]
    exprs += [("panel " + title, e) for title, e in dashboard_exprs()]
    exprs += [
        ("variable " + v["name"], v["query"]["query"])
        for v in dashboard()["templating"]["list"]
        if v["type"] == "query"
    ]
    # checked live in test_prometheus
    redis_names = {
        "redis_up",
        "redis_memory_used_bytes",
        "redis_memory_max_bytes",
        "redis_connected_slaves",
        "redis_instance_info",
    }
    jobs = _scrape_jobs("prometheus.yml")
    assert jobs == _scrape_jobs("prometheus-k8s.yml") == {"dynemb-ps", "dynemb-trainer", "redis"}
    used = set()
    for where, expr in exprs:
        text = re.sub(r'"[^"]*"', '""', expr)  # label values are not names
        for name in PROMQL_NAME.findall(RECORDED_NAME.sub("", text)):
            if name.startswith("dynemb_"):
                assert name in samples, f"{where}: {name} is not exported (exported: {sorted(samples)})"
                used.add(name)
            elif name.startswith("redis_"):
                assert name in redis_names, f"{where}: {name}"
        for name in RECORDED_NAME.findall(text):
            assert name in recorded, f"{where}: recorded series {name} is not recorded"
        for job in re.findall(r'job="([^"]+)"', expr):
            assert job in jobs, f"{where}: job {job} is not scraped"
    for needed in (
        "dynemb_trainer_hits_total",
        "dynemb_trainer_evictions_total",
        "dynemb_trainer_admissions_total",
        "dynemb_trainer_rows_pulled_total",
        "dynemb_trainer_ps_request_seconds_bucket",
        "dynemb_trainer_table_occupancy_ratio",
        "dynemb_trainer_samples_total",
        "dynemb_trainer_loss",
        "dynemb_ps_request_seconds_bucket",
        "dynemb_ps_errors_total",
    ):
        assert needed in used, f"{needed} is in no rule or panel"


def test_metric_names_follow_prometheus_conventions():
    for name, kind in exported_samples().items():
        assert name.startswith(("dynemb_ps_", "dynemb_trainer_")), name
        assert re.fullmatch(r"[a-z][a-z0-9_]*", name), name
        if kind == "histogram":
            assert re.search(r"_seconds_(bucket|sum|count)$", name), f"{name}: times are histograms in seconds"
        if kind == "gauge":
            assert not name.endswith("_total"), name
    labels = metric_labels()
    for name, names in labels.items():
        if name.startswith("dynemb_trainer_"):  # jobs sharing a Prometheus stay apart by train_job
            assert names[-2:] == ["rank", "train_job"], f"{name}: labels {names}"
    for name in (
        "dynemb_trainer_hits_total",
        "dynemb_trainer_evictions_total",
        "dynemb_trainer_ps_request_seconds",
        "dynemb_ps_rows_total",
    ):
        assert "table" in labels[name], name
    assert labels["dynemb_trainer_ps_request_seconds"] == ["op", "table", "rank", "train_job"]


def test_docs_metrics_table_matches_the_code():
    """docs/metrics.md lists every exported metric, with its type and labels, and no other."""
    text = (REPO / "docs" / "metrics.md").read_text()
    rows = re.findall(r"^\| `(dynemb_[a-z0-9_]+)` \| (\w+) \|\s*([a-z_, ]*?)\s*\|", text, re.M)
    documented = {name: (kind, [s.strip() for s in labels.split(",") if s.strip()]) for name, kind, labels in rows}
    types = {name: kind for name, kind in exported_samples().items()}
    labels = metric_labels()
    assert set(documented) == set(labels), set(documented) ^ set(labels)
    for name, (kind, names) in documented.items():
        sample = name + ("_count" if kind == "histogram" else "")
        assert types[sample] == kind, name
        assert names == labels[name], f"{name}: documented labels {names}, exported {labels[name]}"
    assert "docs/metrics.md" in (REPO / "README.md").read_text()


# -- Grafana -----------------------------------------------------------------------------


def test_the_dashboard_builder_has_help_writes_and_checks(tmp_path):
    def builder(*args: str) -> subprocess.CompletedProcess:
        script = DEPLOY / "grafana" / "build_dashboard.py"
        return subprocess.run([sys.executable, str(script), *args], capture_output=True, text=True, timeout=60)

    shown = builder("--help")
    assert shown.returncode == 0 and "--check" in shown.stdout and "--out" in shown.stdout
    out = tmp_path / "dash.json"
    stale = builder("--check", "--out", str(out))
    assert stale.returncode == 1 and "out of date" in stale.stdout
    written = builder("--out", str(out))
    assert written.returncode == 0
    assert out.read_text() == (DEPLOY / "grafana" / "dashboards" / "dynemb.json").read_text()
    current = builder("--check", "--out", str(out))
    assert current.returncode == 0 and "current" in current.stdout


def test_grafana_dashboard_is_what_its_builder_writes_and_well_formed():
    sys.path.insert(0, str(DEPLOY / "grafana"))
    try:
        import build_dashboard
    finally:
        sys.path.pop(0)
    path = DEPLOY / "grafana" / "dashboards" / "dynemb.json"
    assert path.read_text() == build_dashboard.render(), "run python deploy/grafana/build_dashboard.py"
    d = json.loads(path.read_text())
    variables = {v["name"]: v for v in d["templating"]["list"]}
    assert {"datasource", "train_job", "table", "rank", "ps"} <= set(variables)
    # every PS Prometheus scrapes, idle or down too (a PS that has served no request has no
    # dynemb_ps_requests_total series)
    assert variables["ps"]["query"]["query"] == 'label_values(up{job="dynemb-ps"}, instance)'
    panels = [p for p in d["panels"] if p["type"] != "row"]
    assert len({p["id"] for p in d["panels"]}) == len(d["panels"])
    titles = " ".join(p["title"].lower() for p in panels)
    for word in ("hit rate", "evictions", "admissions", "pulled and pushed", "latency", "occupancy", "samples", "loss"):
        assert word in titles, word
    for p in panels:
        assert p["targets"] and p["datasource"]["uid"] == "${datasource}", p["title"]
        if "dynemb_trainer_" in json.dumps(p["targets"]):
            for t in p["targets"]:  # one job's panels apart from another's, per job
                assert 'train_job=~"$train_job"' in t["expr"], p["title"]
                assert "sum (" not in t["expr"] and all(
                    "train_job" in by for by in re.findall(r"by \(([^)]*)\)", t["expr"])
                )
                if "rank" not in p["title"].lower():
                    assert 'rank=~"$rank"' in t["expr"] or ":rate5m" in t["expr"], p["title"]


def test_grafana_provisioning_points_at_the_dashboard_and_prometheus():
    prov = yaml.safe_load((DEPLOY / "grafana/provisioning/dashboards/dynemb.yml").read_text())
    assert prov["apiVersion"] == 1 and prov["providers"][0]["type"] == "file"
    assert prov["providers"][0]["options"]["path"]
    ds = yaml.safe_load((DEPLOY / "grafana/provisioning/datasources/dynemb-prometheus.yml").read_text())
    assert ds["datasources"][0]["type"] == "prometheus"


# -- Kubernetes --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def k8s_dir(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("k8s"))


def test_every_yaml_under_deploy_parses():
    for path in sorted(DEPLOY.rglob("*.y*ml")):
        docs = [d for d in yaml.safe_load_all(path.read_text())]
        assert docs and all(d is not None for d in docs), path


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_k8s_overlays_render_and_validate_against_kubernetes_schemas(overlay, k8s_dir):
    import kubernetes_validate

    docs = rendered(overlay, k8s_dir)
    kinds = {d["kind"] for d in docs}
    assert {"Namespace", "Service", "StatefulSet", "Job", "ConfigMap", "Secret"} <= kinds
    ps_workload(docs)  # the PS: a Deployment over Redis, a StatefulSet of disk PSes
    for doc in docs:
        assert doc["metadata"].get("namespace", "dynemb") == "dynemb" or doc["kind"] == "Namespace"
        for version in ("1.29.0", "1.33.0"):
            try:
                kubernetes_validate.validate(doc, version, strict=True)
            except kubernetes_validate.ValidationError as e:
                pytest.fail(f"{overlay}: {doc['kind']}/{doc['metadata']['name']} (Kubernetes {version}): {e.message}")


def _ps_args(docs: list[dict], monkeypatch) -> tuple[argparse.Namespace, dict]:
    """The PS container's command line and environment, parsed by the real `dynemb` CLI."""
    from dynemb.cli import build_parser

    ps = container(ps_workload(docs), "ps")
    env = dict(named(docs, "ConfigMap", "dynemb-ps")["data"])
    for e in ps["env"]:
        env[e["name"]] = e.get("value", "<from a secret>")
    env = {k: re.sub(r"\$\((\w+)\)", lambda m: env.get(m.group(1), ""), v) for k, v in env.items()}
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    assert ps["image"] == f"dynemb:{__version__}"
    return build_parser().parse_args(ps["args"]), env


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_k8s_ps_agrees_with_its_cli(overlay, k8s_dir, monkeypatch):
    docs = rendered(overlay, k8s_dir)
    deployment = ps_workload(docs)
    ps = container(deployment, "ps")
    args, env = _ps_args(docs, monkeypatch)
    assert args.ps_command == "serve"
    accepted = cli_env_names("ps", "serve")
    unknown = {k for k in env if k.startswith("DYNEMB_")} - accepted
    assert not unknown, f"the PS reads no {unknown}"
    host, port = args.address.rsplit(":", 1)
    assert host == "0.0.0.0" and args.metrics_address == "0.0.0.0", "a pod must listen on all interfaces"
    assert ports(ps) == {"grpc": int(port), "metrics": args.metrics_port}
    pods = find(docs, "Service", "dynemb-ps-pods")
    assert pods["spec"]["clusterIP"] == "None" and pods["spec"]["ports"][0]["name"] == "metrics"
    if deployment["kind"] == "StatefulSet":  # disk PSes, each with other rows: no Service spreads calls over them
        assert deployment["spec"]["serviceName"] == "dynemb-ps-pods"
        assert not [d for d in docs if d["kind"] == "Service" and d["metadata"]["name"] == "dynemb-ps"]
    else:
        service = find(docs, "Service", "dynemb-ps")
        assert [(p["port"], p["targetPort"]) for p in service["spec"]["ports"]] == [(int(port), "grpc")]
    spec = deployment["spec"]["template"]["spec"]
    assert spec["terminationGracePeriodSeconds"] > args.drain_seconds + args.not_serving_seconds
    assert env["DYNEMB_PS_AUTH_TOKEN"] == "<from a secret>"
    secret = ps["env"][0]["valueFrom"]["secretKeyRef"]
    assert named(docs, "Secret", "dynemb-ps-auth")["metadata"]["name"] == secret["name"]
    # liveness asks about the health service that says only "the process runs" (SERVING while
    # Redis is away: a Redis outage must not restart every PS); startup and readiness about ""
    from dynemb.ps_server.server import LIVENESS_SERVICE

    for probe, service in (("startupProbe", ""), ("readinessProbe", ""), ("livenessProbe", LIVENESS_SERVICE)):
        if overlay.endswith("tls"):  # exec: `dynemb ps health` over TLS, parsed by the real CLI
            from dynemb.cli import build_parser

            command = ps[probe]["exec"]["command"]
            assert command[0] == "dynemb"
            health = build_parser().parse_args(command[1:])
            assert health.ps_command == "health" and health.ps == f"localhost:{port}"
            assert health.service == service, probe
            mounts = {m["name"]: m["mountPath"] for m in ps["volumeMounts"]}
            assert health.tls_ca.startswith(mounts["tls"] + "/")
            assert args.tls_cert.startswith(mounts["tls"] + "/") and args.tls_key.startswith(mounts["tls"] + "/")
        else:  # Kubernetes' own gRPC probe on the gRPC port
            want = {"port": int(port), **({"service": service} if service else {})}
            assert ps[probe]["grpc"] == want, probe
    backend = args.backend
    if overlay == "cluster":
        from dynemb.ps_server.backends.redis_store import _split_cluster_url

        nodes, options = _split_cluster_url(backend)
        sts = find(docs, "StatefulSet", "dynemb-redis-cluster")
        names = {f"dynemb-redis-cluster-{i}.dynemb-redis-cluster" for i in range(sts["spec"]["replicas"])}
        assert nodes and all(h in names and p == 6379 for h, p in nodes)
        assert options.get("password") == "<from a secret>"
    elif overlay == "disk":
        from dynemb.ps_server.backends.disk_config import parse_disk_url

        config = parse_disk_url(backend)
        mounts = {m["name"]: m["mountPath"] for m in ps["volumeMounts"]}
        (claim,) = deployment["spec"]["volumeClaimTemplates"]
        assert config.path.startswith(mounts[claim["metadata"]["name"]] + "/") and config.sync == "ack"
        assert claim["spec"]["accessModes"] == ["ReadWriteOnce"], "one pod on a volume: RocksDB's directory is one PS's"
        assert "storageClassName" not in claim["spec"], "the cluster's default class, as the comment says"
        assert _bytes(ps["resources"]["limits"]["memory"]) > config.cache_bytes
        assert not [d for d in docs if "redis" in d["metadata"]["name"]], "no Redis in the disk overlay"
    else:
        assert re.fullmatch(r"redis://:<from a secret>@dynemb-redis:6379/0", backend)
        find(docs, "StatefulSet", "dynemb-redis")


@pytest.mark.slow
def test_ps_liveness_stays_serving_while_redis_is_away_and_while_draining(redis_process):
    """What the probes ask a real `dynemb ps serve` over a Redis that is stopped: readiness ("")
    NOT_SERVING, liveness SERVING (the kubelet restarts no PS for a Redis outage); both again
    through `dynemb ps health`, the TLS overlay's probe command. While it drains after SIGTERM
    the PS is unready but alive."""
    import signal

    from helpers import wait_until

    from dynemb.ps_server.server import LIVENESS_SERVICE

    redis = redis_process()
    ps = LocalPS("--backend", redis.url, "--not-serving-seconds", "30", "--backend-check-seconds", "0.2").start()

    def health(service: str) -> list[str]:
        with PSClient(ps.address, timeout=5) as client:
            return client.health(timeout=2, service=service)

    def probe(service: str) -> int:
        command = [tool("dynemb"), "ps", "health", "--ps", ps.address, "--timeout", "2", "--service", service]
        return subprocess.run(command, capture_output=True, text=True, timeout=60).returncode

    try:
        wait_until(lambda: health("") == ["SERVING"], timeout=30, what="PS SERVING")
        assert health(LIVENESS_SERVICE) == ["SERVING"]
        redis.stop()
        wait_until(lambda: health("") == ["NOT_SERVING"], timeout=30, what="PS NOT_SERVING without Redis")
        assert health(LIVENESS_SERVICE) == ["SERVING"]
        assert probe("") == 1 and probe(LIVENESS_SERVICE) == 0
        redis.start()
        wait_until(lambda: health("") == ["SERVING"], timeout=30, what="PS SERVING once Redis is back")
        ps.proc.send_signal(signal.SIGTERM)  # drains: NOT_SERVING for --not-serving-seconds
        wait_until(lambda: health("") == ["NOT_SERVING"], timeout=30, what="PS NOT_SERVING while draining")
        assert health(LIVENESS_SERVICE) == ["SERVING"]
    finally:
        ps.stop(signal.SIGKILL)  # not 30 s of draining
        ps.close()


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_k8s_prometheus_discovers_pods_that_are_not_ready(overlay, k8s_dir):
    """Every Service that prometheus-k8s.yml finds targets through (SRV _port._tcp.service) lists
    its pods ready or not: a crashed PS or a Redis that is down stays a target whose `up` is 0,
    so its alert keeps firing instead of resolving when the pod drops out of discovery."""
    docs = rendered(overlay, k8s_dir)
    config = yaml.safe_load((DEPLOY / "prometheus" / "prometheus-k8s.yml").read_text())
    services = {d["metadata"]["name"]: d for d in docs if d["kind"] == "Service"}
    checked = set()
    for job in config["scrape_configs"]:
        for sd in job["dns_sd_configs"]:
            for name in sd["names"]:
                port, _, service, namespace = re.fullmatch(
                    r"_([a-z0-9-]+)\._(tcp)\.([a-z0-9-]+)\.([a-z0-9-]+)\.svc\.cluster\.local", name
                ).groups()
                if service not in services:  # the other overlay's Redis
                    continue
                assert namespace == "dynemb"
                spec = services[service]["spec"]
                assert spec["clusterIP"] == "None", f"{service}: SRV records per pod need a headless Service"
                assert spec.get("publishNotReadyAddresses") is True, f"{service} hides pods that are not ready"
                assert port in {p["name"] for p in spec["ports"]}, f"{service} has no port {port}"
                checked.add(job["job_name"])
    assert checked == {"dynemb-ps", "dynemb-trainer"} | ({"redis"} if overlay != "disk" else set())


@lru_cache(maxsize=1)
def _torchrun_help() -> str:
    return subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--help"], capture_output=True, text=True, timeout=120
    ).stdout


@pytest.mark.slow
@pytest.mark.parametrize("overlay", OVERLAYS)
def test_k8s_trainer_job_agrees_with_torchrun_and_dynemb_train(overlay, k8s_dir, tmp_path, monkeypatch):
    from dynemb.cli import build_parser
    from dynemb.trainer.config import from_args

    docs = rendered(overlay, k8s_dir)
    job = find(docs, "Job", "dynemb-trainer")
    spec = job["spec"]
    assert spec["completionMode"] == "Indexed" and spec["completions"] == spec["parallelism"]
    pod = spec["template"]["spec"]
    trainer = container(job, "trainer")
    assert trainer["image"] == f"dynemb:{__version__}" and trainer["command"] == ["torchrun"]
    args = trainer["args"]
    split = args.index("-m")
    assert args[split + 1] == "dynemb.trainer"
    launcher = dict(a.lstrip("-").split("=", 1) for a in args[:split])
    help_text = _torchrun_help()
    for flag in launcher:
        assert f"--{flag}" in help_text, f"torchrun has no --{flag}"
    assert int(launcher["nnodes"]) == spec["completions"]
    assert launcher["node-rank"] == "$(JOB_COMPLETION_INDEX)"
    assert any(e["name"] == "JOB_COMPLETION_INDEX" for e in trainer["env"])
    service = find(docs, "Service", pod["subdomain"])
    assert service["spec"]["clusterIP"] == "None"
    assert launcher["master-addr"] == f"{job['metadata']['name']}-0.{pod['subdomain']}"
    assert ports(trainer)["rendezvous"] == int(launcher["master-port"])

    # the trainer's settings: the ConfigMap's train.yaml with the Job's flags over it, parsed as dynemb train does
    config_map = named(docs, "ConfigMap", "dynemb-train")
    mounts = {m["name"]: m["mountPath"] for m in trainer["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["volumes"]}
    trainer_args = args[split + 2 :]
    files = {}
    for name, mount in mounts.items():
        source = volumes[name].get("configMap")
        if source:
            data = next(d for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["name"] == source["name"])["data"]
            for key, text in data.items():
                local = tmp_path / name / key
                local.parent.mkdir(exist_ok=True)
                local.write_text(text)
                files[f"{mount}/{key}"] = str(local)
    assert config_map["metadata"]["name"] == volumes["config"]["configMap"]["name"]
    local_args = [re.sub(r"=(/[^ ]+)$", lambda m: "=" + files.get(m.group(1), m.group(1)), a) for a in trainer_args]
    for a in local_args:
        if a.startswith(("--config=", "--ps-tls-ca=")):
            assert os.path.exists(a.split("=", 1)[1]), f"{a}: no such file in the pod's mounts"
    cfg = from_args(build_parser().parse_args(["train", *local_args]))
    nproc = int(launcher["nproc-per-node"])
    assert cfg.metrics_port and cfg.metrics_address == "0.0.0.0" and cfg.metrics_linger_seconds > 0
    wanted = {f"metrics-{i}": cfg.metrics_port + i for i in range(nproc)}
    assert {k: v for k, v in ports(trainer).items() if k.startswith("metrics")} == wanted
    assert {p["name"]: p["port"] for p in service["spec"]["ports"] if p["name"].startswith("metrics")} == wanted
    k8s_prom = (DEPLOY / "prometheus" / "prometheus-k8s.yml").read_text()
    for i in range(nproc):
        assert f"_metrics-{i}._tcp.{service['metadata']['name']}.dynemb.svc" in k8s_prom
    if overlay == "disk":  # one address a disk PS pod: test_k8s_trainers_list_every_disk_ps_pod
        assert cfg.ps == _trainer_ps_flag(docs)
    else:
        host, port = cfg.ps.split(":")
        ps_service = find(docs, "Service", host)
        assert ps_service["spec"]["ports"][0]["port"] == int(port)
    token = next(e for e in trainer["env"] if e["name"] == "DYNEMB_PS_AUTH_TOKEN")
    ps_token = next(e for e in container(ps_workload(docs), "ps")["env"] if e["name"] == "DYNEMB_PS_AUTH_TOKEN")
    assert token["valueFrom"] == ps_token["valueFrom"]
    # the trainer opens the PS through dynemb.tables.open_store
    assert "DYNEMB_PS_AUTH_TOKEN" in (REPO / "dynemb" / "tables" / "row_store.py").read_text()
    assert bool(cfg.ps_tls_ca) == overlay.endswith("tls")


def _trainer_ps_flag(docs: list[dict]) -> str:
    """The trainer Job's --ps, as `dynemb train` parses it."""
    from dynemb.cli import build_parser

    args = container(find(docs, "Job", "dynemb-trainer"), "trainer")["args"]
    return getattr(build_parser().parse_args(["train", *args[args.index("-m") + 2 :]]), "training.ps")


def test_k8s_trainers_list_every_disk_ps_pod(k8s_dir):
    """The trainers' --ps names each pod of the disk PSes' StatefulSet once, in order, by the
    stable name its headless Service gives it: the client shards ids over these addresses."""
    from dynemb.ps_server.addresses import ps_addresses

    docs = rendered("disk", k8s_dir)
    sts = find(docs, "StatefulSet", "dynemb-ps")
    service = find(docs, "Service", sts["spec"]["serviceName"])
    assert service["spec"]["clusterIP"] == "None" and service["spec"]["publishNotReadyAddresses"] is True
    port = ports(container(sts, "ps"))["grpc"]
    pods = [f"dynemb-ps-{i}.{service['metadata']['name']}:{port}" for i in range(sts["spec"]["replicas"])]
    assert ps_addresses(_trainer_ps_flag(docs)) == pods and len(pods) == 3
    assert service["spec"]["selector"].items() <= sts["spec"]["template"]["metadata"]["labels"].items()


@pytest.mark.parametrize("overlay", ["standalone", "cluster"])
def test_k8s_redis_is_durable_and_watched_by_redis_exporter(overlay, k8s_dir):
    docs = rendered(overlay, k8s_dir)
    name = "dynemb-redis" if overlay == "standalone" else "dynemb-redis-cluster"
    sts = find(docs, "StatefulSet", name)
    redis = container(sts, "redis")
    assert redis["image"] == "redis:7.0"
    conf = redis_conf_lines(named(docs, "ConfigMap", name)["data"]["redis.conf"])
    for line in ("appendonly yes", "appendfsync everysec", "maxmemory-policy noeviction"):
        assert line in conf, line
    assert any(m["mountPath"] == "/data" for m in redis["volumeMounts"])
    assert sts["spec"]["volumeClaimTemplates"][0]["metadata"]["name"] == "data"
    exporter = container(sts, "redis-exporter")
    version = subprocess.run([tool("redis_exporter"), "--version"], capture_output=True, text=True, timeout=30)
    tested = re.search(r"v?(\d+\.\d+\.\d+)", version.stdout + version.stderr).group(1)
    assert exporter["image"] == f"oliver006/redis_exporter:v{tested}", "deploy the exporter version the tests run"
    service = find(docs, "Service", sts["spec"]["serviceName"])
    assert {p["name"]: p["port"] for p in service["spec"]["ports"]}["metrics"] == ports(exporter)["metrics"]
    assert (
        f"_metrics._tcp.{service['metadata']['name']}.dynemb.svc"
        in (DEPLOY / "prometheus" / "prometheus-k8s.yml").read_text()
    )
    if overlay == "cluster":
        create = find(docs, "Job", "dynemb-redis-cluster-create")
        script = named(docs, "ConfigMap", name)["data"]["create-cluster.sh"]
        assert "--cluster-replicas 1" in script
        assert container(create, "create")["env"][0] == {"name": "NODES", "value": str(sts["spec"]["replicas"])}


def _bytes(quantity: str) -> int:
    """A Kubernetes memory quantity (8Gi, 512Mi, 8G) or a Redis one (4gb, 4g, 512mb) in bytes."""
    m = re.fullmatch(r"(\d+)\s*([a-zA-Z]*)", quantity.strip())
    assert m, quantity
    units = {"": 1, "k": 1000, "m": 1000**2, "g": 1000**3, "ki": 1 << 10, "mi": 1 << 20, "gi": 1 << 30}
    units |= {"kb": 1 << 10, "mb": 1 << 20, "gb": 1 << 30}  # Redis: kb, mb, gb are powers of 1024
    return int(m.group(1)) * units[m.group(2).lower()]


@pytest.mark.parametrize("overlay", ["standalone", "cluster"])
def test_k8s_redis_maxmemory_leaves_room_for_the_fork(overlay, k8s_dir):
    """maxmemory at most 60% of the container's memory limit: an AOF rewrite or snapshot forks,
    and the child's copy-on-write pages grow while pushes go on; past the limit Redis is killed."""
    docs = rendered(overlay, k8s_dir)
    name = "dynemb-redis" if overlay == "standalone" else "dynemb-redis-cluster"
    redis = container(find(docs, "StatefulSet", name), "redis")
    conf = dict(line.split(None, 1) for line in redis_conf_lines(named(docs, "ConfigMap", name)["data"]["redis.conf"]))
    limit = _bytes(redis["resources"]["limits"]["memory"])
    assert _bytes(redis["resources"]["requests"]["memory"]) == limit, "a Redis that is never squeezed"
    assert 0 < _bytes(conf["maxmemory"]) <= 0.6 * limit, (conf["maxmemory"], redis["resources"])


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_k8s_ps_survives_drains_and_a_lost_node(overlay, k8s_dir):
    """A PodDisruptionBudget keeps a PS serving through voluntary disruptions (disk PSes: all but
    one, each serving its own shard), and anti-affinity spreads the replicas over nodes; both
    select the PS's own pods."""
    docs = rendered(overlay, k8s_dir)
    deployment = ps_workload(docs)
    pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
    replicas = deployment["spec"]["replicas"]
    pdb = find(docs, "PodDisruptionBudget", "dynemb-ps")["spec"]
    assert pdb["selector"]["matchLabels"].items() <= pod_labels.items()
    if deployment["kind"] == "StatefulSet":
        assert pdb["maxUnavailable"] == 1 and "minAvailable" not in pdb, "one shard at a time"
    else:
        assert 1 <= pdb["minAvailable"] < replicas, "one PS always serves; a drain can still take one"
    terms = deployment["spec"]["template"]["spec"]["affinity"]["podAntiAffinity"][
        "preferredDuringSchedulingIgnoredDuringExecution"
    ]
    term = terms[0]["podAffinityTerm"]
    assert term["labelSelector"]["matchLabels"].items() <= pod_labels.items()
    assert term["topologyKey"] == "kubernetes.io/hostname"


@pytest.mark.parametrize("folder", ["redis", "redis-cluster"])
def test_k8s_redis_conf_starts_a_real_redis(folder, redis_process):
    """The deployed redis.conf, but for its port, address and folder, runs on the tested redis-server."""
    conf = redis_conf_lines((DEPLOY / "k8s" / folder / "redis.conf").read_text())
    local = [line for line in conf if line.split()[0] not in ("port", "bind", "dir", "cluster-config-file")]
    proc = redis_process(local)
    client = proc.client()
    assert client.config_get("appendonly")["appendonly"] == "yes"
    assert client.config_get("appendfsync")["appendfsync"] == "everysec"
    assert client.config_get("maxmemory-policy")["maxmemory-policy"] == "noeviction"
    assert int(client.config_get("maxmemory")["maxmemory"]) > 0
    if folder == "redis-cluster":
        assert client.info("cluster")["cluster_enabled"] == 1


@pytest.mark.slow
def test_make_secrets_makes_a_certificate_the_ps_and_its_client_accept(tmp_path):
    """make-secrets.sh's token and certificate work: a PS serves TLS with them, a client that
    trusts its CA and sends the token gets through, and the name in the k8s Service is covered."""
    import shutil

    k8s = tmp_path / "k8s"
    shutil.copytree(DEPLOY / "k8s", k8s, ignore=shutil.ignore_patterns("secrets"))
    subprocess.run([str(k8s / "make-secrets.sh")], check=True, capture_output=True, timeout=120)
    tls = k8s / "components" / "ps-tls" / "secrets"
    token = (k8s / "base" / "secrets" / "ps-token").read_text()
    assert re.fullmatch(r"[0-9a-f]{64}", token)
    sans = subprocess.run(
        ["openssl", "x509", "-in", str(tls / "tls.crt"), "-noout", "-ext", "subjectAltName"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert "DNS:dynemb-ps," in sans and "DNS:localhost" in sans
    ps = LocalPS(
        "--tls-cert",
        str(tls / "tls.crt"),
        "--tls-key",
        str(tls / "tls.key"),
        "--not-serving-seconds",
        "0",
        env={"DYNEMB_PS_AUTH_TOKEN": token},
    ).start()
    try:
        with PSClient(f"localhost:{ps.port}", tls_ca=str(tls / "ca.crt"), auth_token=token) as client:
            client.create_table("t", dim=2)
            assert client.health() == ["SERVING"]
        run = subprocess.run(
            [
                tool("dynemb"),
                "ps",
                "health",
                "--ps",
                f"localhost:{ps.port}",
                "--tls-ca",
                str(tls / "ca.crt"),
                "--timeout",
                "5",
            ],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert run.returncode == 0 and "SERVING" in run.stdout, run.stderr  # the TLS overlay's probe
    finally:
        ps.close()


# -- Docker ------------------------------------------------------------------------------


def test_dockerfile_builds_what_the_manifests_run():
    text = (DEPLOY / "docker" / "Dockerfile").read_text()
    assert 'ENTRYPOINT ["dynemb"]' in text
    assert f"-t dynemb:{__version__}" in text
    assert "torch==2.13.0" in text and "--no-deps -r requirements/torchrec.txt" in text
    for exposed in ("50051", "9090", "9400", "29500"):
        assert exposed in text.split("EXPOSE", 1)[1].splitlines()[0]


def _requirement_names(lines) -> set[str]:
    names = set()
    for line in lines:
        line = line.split("#", 1)[0].strip()
        if line and not line.startswith("-"):
            names.add(re.sub(r"[-_.]+", "-", re.match(r"[A-Za-z0-9_.-]+", line).group(0)).lower())
    return names


def _constraints() -> dict[str, str]:
    pins = {}
    for line in (REPO / "requirements" / "constraints.txt").read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            m = re.fullmatch(r"([A-Za-z0-9_.-]+)==([A-Za-z0-9_.+!-]+)", line)
            assert m, f"requirements/constraints.txt: {line!r} is no exact pin (name==version)"
            pins[re.sub(r"[-_.]+", "-", m.group(1)).lower()] = m.group(2)
    return pins


def test_constraints_pin_everything_and_are_what_the_tests_run_on():
    """requirements/constraints.txt pins every package the project, the torch set and the tests
    ask for, at the versions installed here (where the tests ran); requirements/*.txt pin each
    name they list; torch is 2.13.0."""
    import tomllib
    from importlib import metadata

    pins = _constraints()
    assert pins["torch"] == "2.13.0"
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    wanted = _requirement_names(project["dependencies"])
    for extra in project["optional-dependencies"].values():
        wanted |= _requirement_names(extra)
    for path in sorted((REPO / "requirements").glob("*.txt")):
        if path.name == "constraints.txt":
            continue
        lines = path.read_text().splitlines()
        wanted |= _requirement_names(lines)
        for line in lines:
            line = line.split("#", 1)[0].strip()
            assert not line or "==" in line, f"{path.name}: {line} is not pinned"
    assert wanted <= set(pins), f"not in requirements/constraints.txt: {sorted(wanted - set(pins))}"
    for name, version in pins.items():
        try:
            installed = metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
        assert installed.split("+")[0] == version.split("+")[0], f"{name}: pinned {version}, installed {installed}"
    setup = (REPO / "scripts" / "setup_env.sh").read_text()
    assert 'PIP_CONSTRAINT="$ROOT/requirements/constraints.txt"' in setup


def _dockerignored(patterns: list[str], path: str) -> bool:
    """Whether docker leaves `path` out of the build context: the last pattern that matches the
    path or a folder above it decides; `!` lets it in; `*` stays within a name, `**` does not."""
    ignored = False
    parts = path.split("/")
    for pattern in patterns:
        let_in = pattern.startswith("!")
        regex = re.escape(pattern.lstrip("!")).replace(r"\*\*/", "(.*/)?").replace(r"\*", "[^/]*")
        if any(re.fullmatch(regex, "/".join(parts[:i])) for i in range(1, len(parts) + 1)):
            ignored = not let_in
    return ignored


def test_image_is_reproducible():
    """The base image is pinned by digest, Debian's packages by version from one dated snapshot,
    every pip install by requirements/constraints.txt; .dockerignore lets in what the
    Dockerfile copies and nothing that is secret or local."""
    text = (DEPLOY / "docker" / "Dockerfile").read_text()
    instructions = re.sub(r"\\\n", " ", "\n".join(ln for ln in text.splitlines() if not ln.lstrip().startswith("#")))
    froms = re.findall(r"^FROM (\S+)", instructions, re.M)
    assert froms and all(re.fullmatch(r"[\w./:-]+@sha256:[0-9a-f]{64}", f) for f in froms), froms
    snapshot = re.search(r"ARG DEBIAN_SNAPSHOT=(\d{8}T\d{6}Z)", instructions)
    assert snapshot and "snapshot.debian.org/archive/debian/${DEBIAN_SNAPSHOT}" in instructions
    assert "deb.debian.org" not in instructions
    for install in re.findall(r"apt-get install ([^&\n]+)", instructions):
        packages = [w for w in install.split() if not w.startswith("-")]
        assert packages and all(re.fullmatch(r"[a-z0-9.+-]+=[\w.:+~-]+", p) for p in packages), install
    assert "ENV PIP_CONSTRAINT=/opt/dynemb/requirements/constraints.txt" in instructions
    assert instructions.index("ENV PIP_CONSTRAINT") < instructions.index("pip install")
    for pip in re.findall(r"pip install ([^&\n]+)", instructions):
        named = [w for w in pip.split() if not w.startswith("-") and "/" not in w and w != "."]
        assert all("==" in w or w in ("pip", "setuptools", "wheel") for w in named), pip
    assert "torch==2.13.0+cpu" in instructions

    patterns = [ln.strip() for ln in (REPO / ".dockerignore").read_text().splitlines() if ln.strip() and ln[0] != "#"]
    copied = [src for line in re.findall(r"^COPY (.+)$", instructions, re.M) for src in line.split()[:-1]]
    assert copied
    for src in copied:
        assert not _dockerignored(patterns, src.rstrip("/")), f"{src} is copied but left out of the context"
    for kept in (
        "dynemb/ps_server/server.py",
        "requirements/constraints.txt",
        "dynemb/ps_server/csrc/id_index_module.cpp",
    ):
        assert not _dockerignored(patterns, kept), kept
    for left_out in (
        ".venv/bin/python",
        ".bin/redis-server",
        ".git/HEAD",
        "deploy/k8s/base/secrets/ps-token",
        "deploy/k8s/components/ps-tls/secrets/tls.key",
        "tests/test_deploy.py",
        "dynemb/ps_server/__pycache__/server.cpython-311.pyc",
    ):
        assert _dockerignored(patterns, left_out), left_out


# -- systemd -----------------------------------------------------------------------------


def _unit() -> dict[str, list[str]]:
    unit: dict[str, list[str]] = {}
    section = ""
    for line in (DEPLOY / "systemd" / "dynemb-ps.service").read_text().splitlines():
        line = line.strip()
        if line.startswith("["):
            section = line.strip("[]")
        elif line and not line.startswith("#"):
            key, value = line.split("=", 1)
            unit.setdefault(f"{section}.{key}", []).append(value)
    return unit


def _env_file() -> dict[str, str]:
    env = {}
    for line in (DEPLOY / "systemd" / "dynemb-ps.env").read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            key, value = line.split("=", 1)
            env[key] = value
    return env


def test_systemd_unit_passes_systemd_analyze(tmp_path):
    """`systemd-analyze verify` on the unit, its ExecStart and EnvironmentFile pointed at this checkout."""
    unit = _unit()
    exec_start = shlex.split(unit["Service.ExecStart"][0])
    assert exec_start[1:] == ["ps", "serve"] and exec_start[0].endswith("/bin/dynemb")
    text = (DEPLOY / "systemd" / "dynemb-ps.service").read_text()
    text = text.replace(exec_start[0], tool("dynemb"))
    text = text.replace(unit["Service.EnvironmentFile"][0], str(DEPLOY / "systemd" / "dynemb-ps.env"))
    local = tmp_path / "dynemb-ps.service"
    local.write_text(text)
    run = subprocess.run(
        [tool("systemd-analyze"), "verify", "--man=no", str(local)], capture_output=True, text=True, timeout=60
    )
    problems = [line for line in (run.stdout + run.stderr).splitlines() if "dynemb-ps.service" in line]
    assert run.returncode == 0 and not problems, run.stdout + run.stderr


def test_systemd_unit_restarts_hardens_and_waits_for_the_drain():
    unit = _unit()
    assert unit["Service.Restart"] == ["on-failure"]
    for key in (
        "NoNewPrivileges",
        "ProtectSystem",
        "PrivateTmp",
        "ProtectHome",
        "RestrictAddressFamilies",
        "SystemCallFilter",
        "CapabilityBoundingSet",
    ):
        assert f"Service.{key}" in unit, key
    env = _env_file()
    drain = float(env["DYNEMB_PS_DRAIN_SECONDS"]) + float(env["DYNEMB_PS_NOT_SERVING_SECONDS"])
    assert float(unit["Service.TimeoutStopSec"][0].rstrip("s")) > drain
    assert unit["Service.StateDirectory"] == ["dynemb"]


@pytest.mark.slow
def test_systemd_env_file_is_what_dynemb_ps_serve_reads(tmp_path):
    """Every variable in the example env file is one `dynemb ps serve` reads, and the PS starts
    with them (but for the address, ports and backend, which would need this host's 50051 and Redis)."""
    env = _env_file()
    assert set(env) <= cli_env_names("ps", "serve"), set(env) - cli_env_names("ps", "serve")
    assert env["DYNEMB_PS_METRICS_PORT"] != "9090", "9090 is Prometheus' own port"
    targets = yaml.safe_load((DEPLOY / "prometheus" / "targets" / "dynemb-ps.yml").read_text())
    assert targets[0]["targets"] == [f"localhost:{env['DYNEMB_PS_METRICS_PORT']}"]
    ps = LocalPS("--backend", "embedded://", "--not-serving-seconds", "0", env=env).start()
    try:
        with PSClient(ps.address) as client:
            assert client.health() == ["SERVING"]
    finally:
        ps.close()
