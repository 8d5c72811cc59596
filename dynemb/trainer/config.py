"""Training configuration: dataclasses, read from flags or a YAML/JSON file (flags win).

dynemb train --config run.yaml --steps 500
torchrun --nproc_per_node 2 -m dynemb.trainer --optimizer adagrad --capacity-fraction 0.1
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
from dataclasses import dataclass, field
from pathlib import Path

from dynemb.ps_server.addresses import ps_addresses
from dynemb.ps_server.lifecycle import Lifecycle
from dynemb.ps_server.schema import OPTIMIZERS
from dynemb.publish import DEFAULT_FULL_EVERY, DTYPES

SYNTHETIC_UNIVERSE = 100_000  # synthetic data's distinct IDs per feature, unless --universe
JOB_NAME = re.compile(r"([A-Za-z0-9][A-Za-z0-9._:-]{0,127})?")  # a label value that reads well in a query
DEVICES = ("auto", "cpu", "cuda")
MODELS = ("dlrm", "plain")


def table_name(feature: int) -> str:
    """The name of the trainer's table of sparse feature number `feature` (data.feature_names):
    t_<feature>. On the PS it carries --ps-table-prefix in front (schemas.ps_schema)."""
    return f"t_{feature}"


@dataclass
class DataConfig:
    """Where the batches come from: synthetic Criteo-like data, or Criteo TSV files."""

    source: str = "synthetic"  # "synthetic" or a Criteo TSV file / folder of them
    num_dense: int = 13
    num_sparse: int = 26
    universe: int = 0  # distinct IDs per feature; 0: synthetic 100,000, file data counted (train.size_tables)
    zipf: float = 1.05  # synthetic: skew of the ID draw
    ids_per_feature: int = 1  # synthetic: IDs per sample and feature (bag size)
    eval_fraction: float = 0.1  # TSV: share of lines held out for evaluation (unless eval_source)
    eval_source: str = ""  # TSV: a file or folder evaluated instead (source's lines then all train)
    epochs: int = 0  # TSV: passes over the training lines; the run is as long as they are (0: `steps`)
    skip_bad_lines: bool = False  # TSV: skip malformed lines (logged, counted) instead of stopping
    data_seed: int = 0  # synthetic: which stream of batches

    def __post_init__(self) -> None:
        if self.universe == 0 and self.source == "synthetic":
            self.universe = SYNTHETIC_UNIVERSE


@dataclass
class TableConfig:
    """Dynamic-table settings, the same for every sparse feature's table."""

    dim: int = 16
    capacity_fraction: float = 0.1  # device rows, as a share of the ID universe
    capacity: int = 0  # device rows per table across all ranks (overrides the fraction)
    policy: str = "hybrid"  # lru | lfu | hybrid
    evict_fraction: float = 0.05
    admit_threshold: int = 1
    ttl_steps: int = 0  # 0: no TTL
    ps_ttl_seconds: int = 0  # rows unused this long leave the PS (0: the PS table's setting stays)
    ps_max_rows: int = 0  # past this many rows the PS drops the least recently used (0: as it is)
    init_scale: float = 0.0  # uniform(-s, s) for never-seen IDs; 0: 1/sqrt(dim)
    dynamic: bool = True  # False: plain TorchRec tables holding the whole universe

    def lifecycle(self) -> Lifecycle | None:
        """When the table's rows leave the PS, if the flags set it (None: left as the PS has it)."""
        if not (self.ps_ttl_seconds or self.ps_max_rows):
            return None
        return Lifecycle(ttl_s=self.ps_ttl_seconds, max_rows=self.ps_max_rows)


@dataclass
class TrainConfig:
    """A training job's settings: the model, the data, the tables, the PS, checkpoints, metrics.

    Raises:
        ValueError: a setting out of its range, or settings that contradict each other.
    """

    data: DataConfig = field(default_factory=DataConfig)
    table: TableConfig = field(default_factory=TableConfig)
    optimizer: str = "rowwise_adagrad"
    lr: float = 0.05
    dense_lr: float = 0.05
    batch_size: int = 512
    steps: int = 300
    eval_batches: int = 20
    eval_every: int = 0  # steps between evaluations during training (0: only at the end)
    dense_arch: list[int] = field(default_factory=lambda: [64, 16])
    over_arch: list[int] = field(default_factory=lambda: [64, 32, 1])
    device: str = "auto"  # auto (cuda when a GPU is visible), cpu or cuda: one rank per GPU on cuda
    model: str = "dlrm"  # dlrm (TorchRec, FBGEMM tables) or plain (torch EmbeddingBags, no fbgemm-gpu; 1 rank)
    pipeline: bool = True  # TrainPipelineSparseDist: next batch's transform/pull overlaps
    prefetch: int = 1  # batches a thread transforms ahead of the loop (dynemb/tables/prefetch.py); 0: inline
    transform_priority: str = "normal"  # that thread's scheduling: normal, low (nice 19), idle (SCHED_IDLE)
    ps: str = ""  # PS address(es), comma-separated; "" = embedded store in each rank's process
    ps_table_prefix: str = "dynemb_"
    ps_tls_ca: str = ""  # CA certificate (PEM) of a TLS PS; the auth token comes from DYNEMB_PS_AUTH_TOKEN
    ps_tls_cert: str = ""  # this trainer's certificate and key (PEM), for a PS that wants mutual TLS
    ps_tls_key: str = ""
    ps_timeout_seconds: float = 600.0  # how long one pull/push keeps retrying an unreachable PS
    ps_attempt_seconds: float = 30.0  # how long one try may take before it is abandoned and retried
    metrics_port: int = 0  # each rank serves /metrics on metrics_port + its local rank; 0: off
    metrics_address: str = "127.0.0.1"  # 0.0.0.0 where Prometheus scrapes from another host or pod
    # keep /metrics up this long after the job (when exported), for a last scrape: over the shipped
    # Prometheus' 15 s interval, so DynembTrainerDown sees the rank finished rather than crashed
    metrics_linger_seconds: float = 20.0
    job_name: str = ""  # the metrics' train_job label; "": ps_table_prefix without its trailing "_"
    seed: int = 0
    checkpoint_dir: str = ""  # where checkpoints go (step-NNNNNNNN/ folders); "" = none
    checkpoint_every: int = 0  # steps between checkpoints (0: only with --checkpoint-at-end)
    checkpoint_full_every: int = 1  # every k-th checkpoint is full, the others incremental
    checkpoint_keep: int = 3  # newest checkpoints kept (plus what their chains need)
    checkpoint_at_end: bool = False
    publish_to: str = ""  # where versions for serving go (dynemb.publish); "" = none
    publish_every: int = 0  # steps between versions (0: only with --publish-at-end)
    publish_every_seconds: float = 0.0  # or seconds between versions, looked at every log_every steps
    publish_at_end: bool = False
    publish_dtype: str = ""  # fp32, fp16, bf16, int8; "": the table's own
    publish_full_every: int = DEFAULT_FULL_EVERY  # every k-th version is full, the others deltas
    resume: str = ""  # a checkpoint folder, "latest" (in checkpoint_dir), or "auto" (latest if any)
    warm_start: bool = False  # train on from the rows an earlier run left on the PS (startup.py)
    fresh: bool = False  # drop the rows an earlier run left on the PS before training
    log_every: int = 20
    progress: bool = True
    # per-table settings over `table`, by table name (t_0 ... t_{num_sparse-1}); file only:
    #   tables: {t_3: {capacity: 50000, policy: lru}, t_7: {admit_threshold: 2}}
    tables: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(f"optimizer {self.optimizer!r} is not one of {OPTIMIZERS}")
        if self.device not in DEVICES:
            raise ValueError(f"device must be one of {DEVICES}, got {self.device!r}")
        if self.model not in MODELS:
            raise ValueError(f"model must be one of {MODELS}, got {self.model!r}")
        if self.prefetch < 0:
            raise ValueError(f"prefetch must be >= 0 (batches transformed ahead), got {self.prefetch}")
        if self.transform_priority not in ("idle", "low", "normal"):
            raise ValueError(f"transform_priority must be idle, low or normal, got {self.transform_priority!r}")
        if self.batch_size < 1 or self.steps < 0:
            raise ValueError("batch_size must be >= 1 and steps >= 0")
        if self.eval_every < 0 or self.data.epochs < 0:
            raise ValueError(f"eval_every and epochs must be >= 0, got {self.eval_every} and {self.data.epochs}")
        if (self.data.epochs or self.data.eval_source) and self.data.source == "synthetic":
            raise ValueError("epochs and eval_source are for file data: give --source FILE.tsv (or a folder)")
        if not self.data.zipf > 0 or self.data.universe < 0:
            raise ValueError(f"zipf must be > 0 (got {self.data.zipf}) and universe >= 0 (got {self.data.universe})")
        if (self.checkpoint_every or self.checkpoint_at_end) and not self.checkpoint_dir:
            raise ValueError("checkpoint_every / checkpoint_at_end need checkpoint_dir")
        if (self.publish_every or self.publish_every_seconds or self.publish_at_end) and not self.publish_to:
            raise ValueError("publish_every / publish_every_seconds / publish_at_end need publish_to")
        if self.publish_every and self.publish_every_seconds:
            raise ValueError("publish by steps (publish_every) or by time (publish_every_seconds), not both")
        if self.publish_to and not self.ps:
            raise ValueError(
                "publish_to needs ps: versions are cut from a PS's change log (run `dynemb ps serve`, give --ps)"
            )
        if self.publish_every < 0 or self.publish_every_seconds < 0 or self.publish_full_every < 1:
            raise ValueError("publish_every and publish_every_seconds must be >= 0, publish_full_every >= 1")
        if self.publish_dtype and self.publish_dtype not in DTYPES:
            raise ValueError(f"publish_dtype must be one of {', '.join(DTYPES)} or empty, got {self.publish_dtype!r}")
        if self.resume in ("latest", "auto") and not self.checkpoint_dir:
            raise ValueError(f"resume {self.resume!r} needs checkpoint_dir")
        if self.warm_start and self.fresh:
            raise ValueError("warm_start and fresh exclude each other: keep the PS's rows or drop them, not both")
        if self.checkpoint_every < 0 or self.checkpoint_full_every < 1 or self.checkpoint_keep < 1:
            raise ValueError("checkpoint_every must be >= 0, checkpoint_full_every and checkpoint_keep >= 1")
        if self.ps_timeout_seconds <= 0 or self.ps_attempt_seconds <= 0:
            raise ValueError("ps_timeout_seconds and ps_attempt_seconds must be > 0")
        if self.ps:
            ps_addresses(self.ps)  # a mistyped one refused now, not after the job's set-up (InvalidArgument)
        if not JOB_NAME.fullmatch(self.job_name):
            raise ValueError(
                f"job_name {self.job_name!r} must be 1 to 128 letters, digits and . _ : - (starting with a letter "
                "or digit), or empty for the PS table prefix"
            )
        if not 0 <= self.metrics_port < 65536 or self.metrics_linger_seconds < 0:
            raise ValueError(
                f"metrics_port must be in [0, 65535] (got {self.metrics_port}) and "
                f"metrics_linger_seconds >= 0 (got {self.metrics_linger_seconds})"
            )
        if self.dense_arch[-1] != self.table.dim:
            raise ValueError(f"dense_arch must end at the embedding dim {self.table.dim}, got {self.dense_arch}")
        names = {table_name(i) for i in range(self.data.num_sparse)}
        per_table = {f.name for f in dataclasses.fields(TableConfig)} - {"dim", "dynamic"}
        for name, over in self.tables.items():
            if name not in names:
                last = table_name(self.data.num_sparse - 1)
                raise ValueError(f"tables: no table {name!r} (the tables are {table_name(0)} ... {last})")
            bad = set(over) - per_table
            if bad:
                raise ValueError(f"tables.{name}: {sorted(bad)} cannot be set per table (only {sorted(per_table)})")

    def metrics_job(self) -> str:
        """The `train_job` label of this job's metrics: job_name, else the PS table prefix without
        its trailing "_" (what already tells jobs that share a PS apart; "dynemb" by default)."""
        return self.job_name or self.ps_table_prefix.rstrip("_") or "dynemb"

    def table_config(self, name: str) -> TableConfig:
        """The settings of one table: `table` with that table's entries in `tables` over it."""
        return dataclasses.replace(self.table, **self.tables.get(name, {}))


# -- flags and files --------------------------------------------------------------

HELP = {
    "source": "'synthetic', or a Criteo TSV file or folder of *.tsv/*.txt files",
    "num_dense": "dense features per sample",
    "num_sparse": "sparse features per sample (one table each)",
    "universe": "distinct IDs per feature: sizes each table (--capacity-fraction of it; a full table's rows, "
    "into which any data's IDs go by id mod rows, the hashing trick: colliding IDs share a row). Synthetic "
    "data: also the IDs drawn [100,000]. File data: 0 counts each feature's distinct IDs in one pass over "
    "--source first (not needed where --capacity is given)",
    "zipf": "synthetic: Zipf exponent of the ID draw over the universe (> 0; ID k-1 has probability ~ k^-zipf)",
    "ids_per_feature": "synthetic: IDs per sample and feature (bag size)",
    "eval_fraction": "TSV: share of lines held out for evaluation (every k-th line; not with --eval-source)",
    "eval_source": "TSV: a file or folder of held-out data, evaluated after training (and every --eval-every "
    "steps); every line of --source then trains",
    "epochs": "TSV: passes over the training data; the run then lasts epochs x the data's batches (--steps is "
    "not used). 0: --steps decides, and a run whose data runs out first stops there and says so",
    "skip_bad_lines": "TSV: skip a malformed line (each logged with file, line and reason; counted at the end) "
    "instead of stopping the job",
    "data_seed": "synthetic: which stream of batches",
    "dim": "embedding dimension",
    "capacity_fraction": "device rows per table, as a share of the universe",
    "capacity": "device rows per table across all ranks (overrides --capacity-fraction; a full table's rows, "
    "overriding --universe)",
    "policy": "eviction: lru, lfu or hybrid (LFU with decay, Redis-style)",
    "evict_fraction": "share of a rank's rows freed at once when its table is full",
    "admit_threshold": "sightings before an ID gets a row (1: at once)",
    "ttl_steps": "IDs idle longer than this many steps go first (0: no TTL)",
    "ps_ttl_seconds": "rows that no trainer has written or read for this long are deleted from the PS (rows "
    "resident on the devices count as read: the job touches them); 0: the PS table's setting is left as it is "
    "(dynemb ps lifecycle changes it)",
    "ps_max_rows": "past this many rows in a PS table, the least recently used are deleted first (none in use); "
    "0: the PS table's setting is left as it is",
    "init_scale": "never-seen IDs start uniform(-s, s); 0 means 1/sqrt(dim)",
    "dynamic": "dynamic tables over the PS (--no-dynamic: plain full TorchRec tables of --capacity, else "
    "--universe rows each; an ID v takes row v mod rows, the hashing trick, as TorchRec's Criteo examples do)",
    "optimizer": "sgd, adagrad, rowwise_adagrad, adam "
    "(fused into backward; Adam on CPU through dynemb/tables/sparse_adam.py)",
    "lr": "learning rate of the embedding tables",
    "dense_lr": "learning rate of the dense layers",
    "batch_size": "samples per step and rank",
    "steps": "training steps (with file data and --epochs: not used)",
    "eval_batches": "synthetic: held-out batches per rank for AUC and log-loss (a file's held-out data is "
    "evaluated whole)",
    "eval_every": "also evaluate every N steps during training (0: only after the last step)",
    "dense_arch": "bottom MLP sizes, comma-separated; the last must equal --dim",
    "over_arch": "top MLP sizes, comma-separated; the last is 1",
    "pipeline": "TrainPipelineSparseDist: the next batch's transform, pull and input dist overlap",
    "prefetch": "batches that a thread of their own transforms (IDs to slots, rows pulled and pushed) ahead "
    "of the training loop; 0: on the training thread",
    "transform_priority": "scheduling of that thread: normal (as any thread; never starved), low (nice 19), or "
    "idle (Linux SCHED_IDLE: only on cores nothing else wants; a little faster on a machine the job has to "
    "itself, but any other busy process can stall it, and the training loop waits for its batches)",
    "device": "where the tables and the model live: cuda (one rank per GPU: torchrun --nproc_per_node <GPUs>; "
    "NCCL), cpu (gloo), or auto (cuda when a GPU is visible)",
    "model": "dlrm: TorchRec's DLRM over FBGEMM tables; plain: torch EmbeddingBags with a sparse optimizer "
    "(no fbgemm-gpu needed; one process, --no-pipeline implied)",
    "ps": "PS address(es) host:port, comma-separated; empty: the embedded store, in-process (each rank keeps "
    "the rows of the IDs it owns; they last as long as the job, and its checkpoints)",
    "ps_table_prefix": "prefix of the PS table names (several jobs can share one PS)",
    "ps_tls_ca": "CA certificate (PEM) to reach a TLS PS; a PS that wants a token gets env DYNEMB_PS_AUTH_TOKEN",
    "ps_tls_cert": "client certificate (PEM) for a PS that wants mutual TLS (--tls-client-ca)",
    "ps_tls_key": "private key (PEM) of --ps-tls-cert",
    "ps_timeout_seconds": "how long a pull or push keeps retrying a PS that is down, restarting or unreachable "
    "before the step fails (retries are safe: every PS call is idempotent)",
    "ps_attempt_seconds": "how long one try of a PS call may take before it is abandoned and retried "
    "(a paused or cut-off PS is not waited on to the end)",
    "metrics_port": "each rank serves Prometheus /metrics on this port + its local rank "
    "(its rank within the machine or pod, env LOCAL_RANK; 0: off)",
    "metrics_address": "address of the ranks' /metrics endpoints (0.0.0.0: reachable from other hosts and pods)",
    "metrics_linger_seconds": (
        "keep /metrics up this long after training, so Prometheus scrapes the final counts and "
        "dynemb_trainer_finished (over a scrape interval: else DynembTrainerDown takes the end for a crash)"
    ),
    "job_name": "this job's name in its metrics (label train_job), so the jobs that one Prometheus watches stay "
    "apart; empty: --ps-table-prefix without its trailing _ (dynemb)",
    "seed": "seed of the model and the tables' initializers",
    "checkpoint_dir": "folder for checkpoints (one step-NNNNNNNN/ folder each; shared by all ranks)",
    "checkpoint_every": "steps between checkpoints (0: none during training)",
    "checkpoint_full_every": "every k-th checkpoint holds every row; the ones between only rows changed since the last",
    "checkpoint_keep": "newest checkpoints to keep (older ones go, unless a kept one builds on them)",
    "checkpoint_at_end": "also checkpoint after the last step",
    "publish_to": "folder for versions of the tables for serving (<table>/vNNNNNNNN/; `dynemb table apply` "
    "applies them); needs --ps",
    "publish_every": "steps between versions: every rank pushes the rows it changed, then one cuts the rows "
    "changed and ids deleted since the last version (0: none during training)",
    "publish_every_seconds": "or seconds between versions: rank 0 looks every --log-every steps (the loop's "
    "batches in flight drain there) and every rank publishes when it says so",
    "publish_at_end": "also publish a version after the last step",
    "publish_dtype": "the published rows' dtype: fp32, fp16, bf16, or int8 (a scale per row); empty: the table's own",
    "publish_full_every": "every k-th version holds every row (a new serving replica starts there)",
    "resume": "continue from a checkpoint: its folder, 'latest' in --checkpoint-dir, or 'auto': the latest if "
    "there is one, else start afresh (for torchrun's elastic restarts); on any number of ranks",
    "warm_start": "train on from the rows an earlier run left in this job's PS tables (without it, or --fresh, "
    "or --resume, a job that finds such rows refuses to start)",
    "fresh": "drop the rows an earlier run left in this job's PS tables before training (see --warm-start)",
    "log_every": "steps between loss reports: the progress bar's, or a line each without it",
    "progress": "show the progress bar (rank 0); --no-progress: a loss line every --log-every steps instead",
}


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _fields(cls) -> list[dataclasses.Field]:
    return [f for f in dataclasses.fields(cls) if f.name not in ("data", "table", "tables")]


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Give parser `p` --config and one flag per setting of TrainConfig, DataConfig and TableConfig."""
    p.add_argument("--config", help="YAML or JSON file with any of the settings below (flags override it)")
    for group, cls in (("training", TrainConfig), ("data", DataConfig), ("tables", TableConfig)):
        g = p.add_argument_group(group)
        for f in _fields(cls):
            if f.default is not dataclasses.MISSING:
                default = f.default
            elif f.default_factory is not dataclasses.MISSING:
                default = f.default_factory()
            else:
                raise TypeError(f"{cls.__name__}.{f.name} has no default; every setting needs one")
            kind = type(default)
            text = HELP.get(f.name, "")
            dest = f"{group}.{f.name}"
            if kind is bool:
                g.add_argument(
                    _flag(f.name),
                    dest=dest,
                    action=argparse.BooleanOptionalAction,
                    default=None,
                    help=f"{text} [default {default}]",
                )
            elif kind is list:
                g.add_argument(
                    _flag(f.name),
                    dest=dest,
                    default=None,
                    metavar="N,N,...",
                    help=f"{text} [default {','.join(map(str, default))}]",
                )
            else:
                g.add_argument(
                    _flag(f.name),
                    dest=dest,
                    type=kind,
                    default=None,
                    metavar=f.name.upper(),
                    help=f"{text} [default {default!r}]" if kind is str else f"{text} [default {default}]",
                )


def _read_file(path: str) -> dict:
    text = Path(path).read_text()
    if path.endswith((".yaml", ".yml")):
        import yaml

        return yaml.safe_load(text) or {}
    return json.loads(text)


def from_args(args: argparse.Namespace) -> TrainConfig:
    """The TrainConfig of parsed flags over the --config file's settings.

    Raises:
        ValueError: an unknown or invalid setting. OSError: the --config file cannot be read.
    """
    raw = _read_file(args.config) if args.config else {}
    data = dict(raw.pop("data", {}) or {})
    table = dict(raw.pop("table", {}) or {})
    train = raw
    for key, value in vars(args).items():
        if value is None or "." not in key:
            continue
        group, name = key.split(".", 1)
        if isinstance(value, str) and name in ("dense_arch", "over_arch"):
            value = [int(v) for v in value.split(",")]
        {"training": train, "data": data, "tables": table}[group][name] = value
    for name, d, cls in (("file", train, TrainConfig), ("data", data, DataConfig), ("table", table, TableConfig)):
        unknown = set(d) - {f.name for f in dataclasses.fields(cls)}
        if unknown:
            raise ValueError(f"unknown {name} settings: {sorted(unknown)}")
    return TrainConfig(data=DataConfig(**data), table=TableConfig(**table), **train)
