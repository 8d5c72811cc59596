"""File data as a user runs it: epochs, a held-out file, evaluation during training, a run
whose data runs out."""

from __future__ import annotations

import logging

import numpy as np
import pytest
from helpers import dynemb, learnable_tsv

from dynemb.trainer.config import DataConfig, TableConfig, TrainConfig
from dynemb.trainer.data import batches_per_epoch
from dynemb.trainer.train import train

pytestmark = pytest.mark.torchrec  # TorchRec and fbgemm-gpu: needed by every test here


def _cfg(source: str, **extra) -> TrainConfig:
    data = {k: extra.pop(k) for k in ("epochs", "eval_source", "eval_fraction") if k in extra}
    return TrainConfig(
        data=DataConfig(source=source, universe=2000, **data),
        table=TableConfig(dim=8, capacity=400),
        batch_size=16,
        dense_arch=[8],
        over_arch=[8, 1],
        progress=False,
        **extra,
    )


def test_batches_per_epoch_count_the_fewest_any_rank_gets(tmp_path):
    source = learnable_tsv(tmp_path / "a.tsv", 100)  # lines 10, 20, ... 100 held out: 90 train
    assert batches_per_epoch(DataConfig(source=source), 16, 1) == 6  # 90 = 5 x 16 + 10
    assert batches_per_epoch(DataConfig(source=source), 16, 2) == 3  # 45 each
    assert batches_per_epoch(DataConfig(source=source), 16, 4) == 2  # 22 for the last rank
    assert batches_per_epoch(DataConfig(source=source, eval_source=source), 16, 1) == 7  # all 100 train
    (tmp_path / "b.tsv").write_text(open(source).read().rstrip("\n"))  # no newline at the end
    assert batches_per_epoch(DataConfig(source=str(tmp_path / "b.tsv"), eval_fraction=0.0), 10, 1) == 10


@pytest.mark.usefixtures("one_process_group")
def test_epochs_set_the_run_length_and_a_short_file_says_it_ran_out(tmp_path, caplog):
    source = learnable_tsv(tmp_path / "a.tsv", 100)
    result = train(_cfg(source, epochs=3, steps=5))  # --steps is not used with --epochs
    assert len(result.losses) == 18 and not result.data_ran_out
    assert np.isfinite(result.auc)
    with caplog.at_level(logging.WARNING, logger="dynemb.trainer"):
        short = train(_cfg(source, steps=100))
    assert len(short.losses) == 6 and short.data_ran_out
    assert "the training data ran out after step 6 of 100" in caplog.text and "--epochs" in caplog.text


@pytest.mark.usefixtures("one_process_group")
def test_an_eval_source_is_evaluated_and_every_source_line_trains(tmp_path):
    source = learnable_tsv(tmp_path / "train.tsv", 100, seed=1)
    held_out = learnable_tsv(tmp_path / "eval.tsv", 64, seed=2)
    result = train(_cfg(source, eval_source=held_out, epochs=2))
    assert len(result.losses) == 14  # 2 x 7 batches of 100 lines: none held out of the source
    assert 0.5 < result.auc <= 1.0  # the label is learnable from the first column


@pytest.mark.usefixtures("one_process_group")
@pytest.mark.parametrize("pipeline", [True, False], ids=["pipelined", "plain"])
def test_evaluating_during_training_changes_no_step(tmp_path, pipeline):
    source = learnable_tsv(tmp_path / "a.tsv", 400)
    plain = train(_cfg(source, steps=12, pipeline=pipeline))
    evaluated = train(_cfg(source, steps=12, pipeline=pipeline, eval_every=5))
    assert [step for step, _, _ in evaluated.evals] == [5, 10]
    assert all(np.isfinite(auc) and np.isfinite(loss) for _, auc, loss in evaluated.evals)
    assert evaluated.losses == plain.losses  # evaluation trained nothing, admitted nothing
    assert (evaluated.auc, evaluated.logloss) == (plain.auc, plain.logloss)


def test_file_settings_are_refused_on_synthetic_data():
    with pytest.raises(ValueError, match="epochs and eval_source are for file data"):
        TrainConfig(data=DataConfig(epochs=2))


@pytest.mark.usefixtures("one_process_group")
@pytest.mark.parametrize("dynamic", [True, False], ids=["dynamic", "full"])
def test_file_data_without_a_universe_sizes_the_tables_from_a_count(tmp_path, capsys, dynamic):
    from dynemb.trainer.model import table_rows_total
    from dynemb.trainer.train import size_tables

    source = learnable_tsv(tmp_path / "a.tsv", 300)  # column 0: 16 values, the others 40
    cfg = _cfg(source, steps=2)
    cfg.data.universe, cfg.table.capacity, cfg.table.dynamic = 0, 0, dynamic
    cfg.table.capacity_fraction = 0.5
    sized = size_tables(cfg)
    assert [table_rows_total(sized, 1, f"t_{i}") for i in (0, 1)] == ([8, 20] if dynamic else [16, 40])
    assert "16 to 40 distinct IDs per feature" in capsys.readouterr().err
    given = _cfg(source, steps=2)  # --capacity given: nothing to count
    given.data.universe = 0
    assert size_tables(given) is given
    cfg.table.capacity_fraction = 1.0  # room for a batch's distinct IDs in every table
    result = train(cfg)
    assert len(result.losses) == 2 and np.isfinite(result.auc)


@pytest.mark.usefixtures("one_process_group")
def test_the_hit_rate_is_over_every_lookup_and_names_each_table():
    from helpers import config

    # t_0 thrashes: room for a quarter of what the others hold (one batch in flight at a time)
    tables = {"t_0": {"capacity": 150, "evict_fraction": 0.5}}
    cfg = config("adagrad", dynamic=True, steps=30, pipeline=False, prefetch=0, tables=tables)
    result = train(cfg)
    rates = result.table_hit_rates
    assert set(rates) == {f"t_{i}" for i in range(6)}
    assert min(rates, key=rates.get) == "t_0" and rates["t_0"] < min(v for k, v in rates.items() if k != "t_0")
    # every table looks up as many IDs a batch (2 per sample, none missing): the mean is the ID-weighted rate
    assert result.hit_rate == pytest.approx(np.mean(list(rates.values())), rel=1e-9)


def test_the_summary_names_the_lowest_hit_rates_and_the_json_has_the_evaluations(tmp_path):
    import json

    (tmp_path / "run.json").write_text(json.dumps({"tables": {"t_1": {"capacity": 150, "evict_fraction": 0.5}}}))
    flags = "--num-sparse 4 --universe 6000 --capacity-fraction 0.1 --batch-size 48 --steps 20 --eval-every 10"
    flags += " --dim 8 --dense-arch 8 --over-arch 8,1 --no-pipeline --prefetch 0 --no-progress"
    run = dynemb(
        "train",
        "--config",
        str(tmp_path / "run.json"),
        *flags.split(),
        "--result-json",
        str(tmp_path / "out.json"),
        timeout=300,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    (line,) = [x for x in run.stdout.splitlines() if x.startswith("lowest hit rates:")]
    assert line.split()[3] == "t_1", line  # the thrashing table first
    got = json.loads((tmp_path / "out.json").read_text())
    assert [e["step"] for e in got["evals"]] == [10] and not got["data_ran_out"]
    assert min(got["table_hit_rates"], key=got["table_hit_rates"].get) == "t_1"
