"""What a training job returns on each rank (train.train, plain.train_plain)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class TrainResult:
    """What train() returns on each rank."""

    losses: list[float] = field(default_factory=list)  # this rank's loss per step
    first_step: int = 0  # the step the job began at (> 0 when resumed from a checkpoint)
    data_start: int = 0  # the batch of each rank's stream it began at (first_step unless resharded)
    auc: float = float("nan")
    logloss: float = float("nan")
    samples_per_second: float = 0.0
    hit_rate: float = float("nan")  # dynamic tables: of every lookup of the run, on every rank
    table_hit_rates: dict[str, float] = field(default_factory=dict)  # the same per table
    hit_rates: list[float] = field(default_factory=list)  # dynamic tables: this rank's, per batch
    evals: list[tuple[int, float, float]] = field(default_factory=list)  # (step, AUC, log-loss), eval_every
    data_ran_out: bool = False  # the data ended before the planned steps
    versions: list[tuple[int, dict[str, int]]] = field(default_factory=list)  # (step, version by table) published
    # with train(..., collect_tables=True): this rank's block of every table after training,
    # {name: (first row, rows (n, dim + state width))}; dynamic tables read back from the PS
    tables: dict = field(default_factory=dict)
