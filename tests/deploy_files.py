"""Shared by the deploy/ tests: where the tools are, the metric names the code exports, and
the Kubernetes manifests rendered by kustomize."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from functools import cache
from pathlib import Path

import yaml

from dynemb.testing.local_ps import REPO

DEPLOY = REPO / "deploy"
BIN = REPO / ".bin"
OVERLAYS = ("standalone", "cluster", "standalone-tls", "disk")


def tool(name: str) -> str:
    """A binary from .bin/ (scripts/setup_env.sh puts it there) or, for some, the PATH."""
    for path in (BIN / name, Path(sys.executable).parent / name, shutil.which(name)):
        if path and os.access(path, os.X_OK):
            return str(path)
    raise AssertionError(f"{name} missing: scripts/setup_env.sh installs it")


def exported_samples() -> dict[str, str]:
    """{sample name as Prometheus stores it: metric family type}, from the PS's and a trainer
    rank's own registries (counters as *_total, histograms as *_bucket/_sum/_count)."""
    from dynemb.ps_server.metrics import PSMetrics
    from dynemb.tables.metrics import TrainerMetrics

    suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"), "gauge": ("",)}
    out = {}
    for registry in (PSMetrics().registry, TrainerMetrics(0).registry):
        for family in registry.collect():
            if family.name.startswith("process_"):  # prometheus-client's standard process collector
                continue
            for suffix in suffixes[family.type]:
                out[family.name + suffix] = family.type
    return out


def metric_labels() -> dict[str, list[str]]:
    """{family name as documented (counters with _total): its label names}."""
    from dynemb.ps_server.metrics import PSMetrics
    from dynemb.tables.metrics import TrainerMetrics

    out = {}
    for holder in (PSMetrics(), TrainerMetrics(0)):
        for collector in vars(holder).values():
            if hasattr(collector, "_labelnames"):
                name = collector._name + ("_total" if collector._type == "counter" else "")
                out[name] = list(collector._labelnames)
            elif hasattr(collector, "label_names"):  # a custom collector (trainer.metrics.TableStats)
                out.update(collector.label_names())
    return out


PROMQL_NAME = re.compile(r"\b(dynemb_[a-z0-9_]+|redis_[a-z0-9_]+|up)\b(?!\s*\()")
RECORDED_NAME = re.compile(r"\b[a-z_]+:[a-z0-9_]+:[a-z0-9_]+\b")


def rule_groups() -> list[dict]:
    groups = []
    for path in sorted((DEPLOY / "prometheus" / "rules").glob("*.yml")):
        groups += yaml.safe_load(path.read_text())["groups"]
    return groups


def dashboard() -> dict:
    import json

    return json.loads((DEPLOY / "grafana" / "dashboards" / "dynemb.json").read_text())


def dashboard_exprs() -> list[tuple[str, str]]:
    """(panel title, PromQL) of every dashboard query."""
    return [(p["title"], t["expr"]) for p in dashboard()["panels"] for t in p.get("targets", [])]


@cache
def rendered(overlay: str, workdir: str) -> list[dict]:
    """`kubectl kustomize` of an overlay, on a copy of deploy/k8s with make-secrets.sh's files."""
    copy = Path(workdir) / "k8s"
    if not copy.exists():
        shutil.copytree(DEPLOY / "k8s", copy, ignore=shutil.ignore_patterns("secrets"))
        run = subprocess.run([str(copy / "make-secrets.sh")], capture_output=True, text=True, timeout=120)
        assert run.returncode == 0, run.stderr
    run = subprocess.run(
        [tool("kubectl"), "kustomize", str(copy / "overlays" / overlay)], capture_output=True, text=True, timeout=120
    )
    assert run.returncode == 0, f"kubectl kustomize overlays/{overlay}:\n{run.stderr}"
    return [d for d in yaml.safe_load_all(run.stdout) if d]


def find(docs: list[dict], kind: str, name: str) -> dict:
    hits = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name]
    assert len(hits) == 1, f"{kind}/{name}: {len(hits)} found"
    return hits[0]


def named(docs: list[dict], kind: str, prefix: str) -> dict:
    """A generated ConfigMap or Secret (kustomize adds a hash suffix to its name)."""
    hits = [
        d
        for d in docs
        if d["kind"] == kind and re.fullmatch(re.escape(prefix) + r"-[a-z0-9]{10}", d["metadata"]["name"])
    ]
    assert len(hits) == 1, f"{kind}/{prefix}-*: {len(hits)} found"
    return hits[0]


def ps_workload(docs: list[dict]) -> dict:
    """The PS's pods' owner: the Deployment dynemb-ps (PSes over Redis), or the StatefulSet of
    that name (disk PSes, each with its own volume)."""
    hits = [d for d in docs if d["kind"] in ("Deployment", "StatefulSet") and d["metadata"]["name"] == "dynemb-ps"]
    assert len(hits) == 1, f"Deployment or StatefulSet dynemb-ps: {len(hits)} found"
    return hits[0]


def container(doc: dict, name: str) -> dict:
    return next(c for c in doc["spec"]["template"]["spec"]["containers"] if c["name"] == name)


def ports(c: dict) -> dict[str, int]:
    return {p["name"]: p["containerPort"] for p in c.get("ports", [])}


def cli_env_names(*command: str) -> set[str]:
    """The DYNEMB_* variables a `dynemb ... --help` names."""
    run = subprocess.run(
        [tool("dynemb"), *command, "--help"],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "COLUMNS": "200"},
    )
    assert run.returncode == 0, run.stderr
    return set(re.findall(r"env\s+(DYNEMB_[A-Z_]+)", run.stdout))  # a long help may wrap after "env"


def redis_conf_lines(text: str) -> list[str]:
    return [line.strip() for line in text.splitlines() if line.strip() and not line.strip().startswith("#")]
