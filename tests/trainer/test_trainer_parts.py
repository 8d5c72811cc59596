"""Trainer pieces: configuration from flags and files, Criteo TSV reading, per-rank metrics."""

from __future__ import annotations

import argparse
import json
import re
import urllib.request

import numpy as np
import pytest
import torch
from helpers import TESTS, readme_output, steady

from dynemb.trainer.config import DataConfig, TableConfig, TrainConfig, add_arguments, from_args
from dynemb.trainer.data import SyntheticCriteo, criteo_tsv_batches, parse_criteo_line

pytestmark = pytest.mark.torchrec  # TorchRec and fbgemm-gpu: needed by every test here


def parse(*argv: str) -> TrainConfig:
    p = argparse.ArgumentParser()
    add_arguments(p)
    return from_args(p.parse_args(list(argv)))


def test_flags_override_a_yaml_file(tmp_path):
    f = tmp_path / "run.yaml"
    f.write_text(
        "optimizer: adagrad\nsteps: 7\ndata:\n  universe: 5000\ntable:\n  dim: 8\n  policy: lru\ndense_arch: [32, 8]\n"
    )
    cfg = parse("--config", str(f), "--steps", "9", "--capacity-fraction", "0.2", "--no-pipeline")
    got = (cfg.optimizer, cfg.steps, cfg.data.universe, cfg.table.dim, cfg.table.policy)
    assert got == ("adagrad", 9, 5000, 8, "lru")
    assert cfg.table.capacity_fraction == 0.2 and cfg.pipeline is False and cfg.dense_arch == [32, 8]
    j = tmp_path / "run.json"
    j.write_text(json.dumps({"lr": 0.5, "data": {"zipf": 1.3}}))
    cfg = parse("--config", str(j), "--over-arch", "8,1")
    assert cfg.lr == 0.5 and cfg.data.zipf == 1.3 and cfg.over_arch == [8, 1]


@pytest.mark.parametrize(
    "text,message",
    [
        ("stepz: 3\n", "unknown file settings"),
        ("table:\n  dims: 3\n", "unknown table settings"),
        ("optimizer: lamb\n", "optimizer 'lamb' is not one of"),
        ("table:\n  dim: 32\n", "dense_arch must end at the embedding dim 32"),
        ("data:\n  zipf: 0\n", r"zipf must be > 0 \(got 0"),
    ],
)
def test_bad_settings_are_named(tmp_path, text, message):
    f = tmp_path / "bad.yaml"
    f.write_text(text)
    with pytest.raises(ValueError, match=message):
        parse("--config", str(f))


def _line(label="1", dense=None, cats=None) -> str:
    dense = dense if dense is not None else [str(i) for i in range(13)]
    cats = cats if cats is not None else [f"{i:08x}" for i in range(26)]
    return "\t".join([label, *dense, *cats]) + "\n"


def test_criteo_tsv_lines_become_batches(tmp_path):
    lines = [
        _line(str(i % 2), cats=[f"{(i * 31 + j) % 7:08x}" if j != 3 else "" for j in range(26)]) for i in range(10)
    ]
    lines[4] = _line("0", dense=[""] * 13)  # missing dense values read as 0
    f = tmp_path / "day_0.tsv"
    f.write_text("".join(lines))
    cfg = DataConfig(source=str(f), eval_fraction=0.0)
    got = list(criteo_tsv_batches(cfg, batch_size=4))
    assert [len(b.labels) for b in got] == [4, 4, 2]
    b = got[0]
    assert b.labels.tolist() == [0.0, 1.0, 0.0, 1.0]
    assert torch.allclose(b.dense_features[1], torch.log1p(torch.arange(13, dtype=torch.float32)))
    kjt = b.sparse_features
    assert kjt.keys()[:2] == ["cat_0", "cat_1"] and kjt.lengths().shape == (26 * 4,)
    assert kjt.lengths().view(26, 4)[3].tolist() == [0, 0, 0, 0]  # column 3 is empty everywhere
    # the same hex in the same column is the same ID; in another column a different one
    label, dense, ids = parse_criteo_line(_line(cats=["0000abcd"] * 26))
    assert ids[0] != ids[1] and parse_criteo_line(_line(cats=["0000abcd"] * 26))[2] == ids
    assert np.all(np.array(got[1].dense_features[0]) == 0.0)  # line 5 had no dense values
    # two ranks split the lines, and held-out lines are apart from training ones
    r0 = sum(len(b.labels) for b in criteo_tsv_batches(cfg, 4, rank=0, world_size=2))
    r1 = sum(len(b.labels) for b in criteo_tsv_batches(cfg, 4, rank=1, world_size=2))
    assert (r0, r1) == (5, 5)
    held = DataConfig(source=str(f), eval_fraction=0.5)
    train_n = sum(len(b.labels) for b in criteo_tsv_batches(held, 4, split=0))
    eval_n = sum(len(b.labels) for b in criteo_tsv_batches(held, 4, split=1))
    assert (train_n, eval_n) == (5, 5)


@pytest.mark.parametrize(
    "line,message",
    [
        ("1\t2\t3\n", "expected 40 tab-separated columns, got 3"),
        (_line(label="2"), "label must be 0 or 1"),
        (_line(dense=["x"] * 13), "invalid literal"),
        (_line(cats=["zz"] * 26), "invalid literal for int"),
    ],
)
def test_malformed_tsv_lines_are_named(tmp_path, line, message):
    f = tmp_path / "bad.tsv"
    f.write_text(_line() + line)
    with pytest.raises(ValueError, match=f"bad.tsv:2: .*{message}"):
        list(criteo_tsv_batches(DataConfig(source=str(f), eval_fraction=0.0), 8))
    skipped = list(criteo_tsv_batches(DataConfig(source=str(f), eval_fraction=0.0), 8, skip_bad_lines=True))
    assert sum(len(b.labels) for b in skipped) == 1


def test_synthetic_batches_are_reproducible_and_learnable():
    data = SyntheticCriteo(DataConfig(universe=1000), batch_size=256, rank=1, world_size=2)
    a, b = data.batch(5), data.batch(5)
    assert torch.equal(a.sparse_features.values(), b.sparse_features.values()) and torch.equal(a.labels, b.labels)
    other = SyntheticCriteo(DataConfig(universe=1000), batch_size=256, rank=0, world_size=2).batch(5)
    assert not torch.equal(a.sparse_features.values(), other.sparse_features.values())
    assert 0.2 < float(a.labels.mean()) < 0.8
    assert int(a.sparse_features.values().max()) < 1000


def test_the_main_job_prints_what_the_readme_quotes_and_learns(capsys):
    """`dynemb train` as scripts/train.sh runs it (its set-up aside), in this process: it prints
    the losses, AUC and hit rates README.md quotes (the job is deterministic; what the machine
    decides, times and samples/s, left out), and its held-out AUC says the model learned the
    labels' dependence on the dense features and on each ID's hidden score."""
    from dynemb.cli import main

    assert main(["train"]) == 0
    out, err = capsys.readouterr()
    bar = err.split("\r")[-1].strip()  # the progress bar as it ends
    printed = [bar, *out.strip().splitlines()[-2:]]
    quoted = readme_output("scripts/train.sh")
    assert [steady(line) for line in quoted] == [steady(line) for line in printed], printed
    auc = float(re.search(r"eval AUC ([\d.]+)", printed[1]).group(1))
    assert auc > 0.65, printed[1]


def test_training_serves_metrics_per_rank():
    """A short run with --metrics-port: the rank's /metrics has the dynamic-table counters."""
    import threading

    from dynemb.testing.local_redis import free_port
    from dynemb.trainer.train import train

    port = free_port()
    # room for the 4 batches in flight at a transform (the pipeline's 3 and one transformed ahead)
    cfg = TrainConfig(
        data=DataConfig(num_sparse=3, universe=2000),
        table=TableConfig(dim=8, capacity_fraction=0.2),
        batch_size=64,
        steps=30,
        eval_batches=1,
        dense_arch=[8],
        over_arch=[8, 1],
        progress=False,
        metrics_port=port,
        metrics_linger_seconds=0,
    )
    scraped: list[str] = []

    def scrape():  # while the job runs (the server stops with the process, not the job)
        import time

        for _ in range(200):
            try:
                scraped.append(urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2).read().decode())
                return
            except OSError:
                time.sleep(0.05)

    t = threading.Thread(target=scrape)
    t.start()
    result = train(cfg)
    t.join()
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2).read().decode()
    assert len(result.losses) == 30 and scraped
    for name in (
        "dynemb_trainer_lookups_total",
        "dynemb_trainer_hits_total",
        "dynemb_trainer_admissions_total",
        "dynemb_trainer_rows_pulled_total",
        "dynemb_trainer_table_occupancy_ratio",
    ):
        assert f'{name}{{rank="0",table="dynemb_t_0",train_job="dynemb"}}' in text, name
    lookups = float(
        text.split('dynemb_trainer_lookups_total{rank="0",table="dynemb_t_0",train_job="dynemb"} ')[1].split()[0]
    )
    assert lookups == 64 * 30  # every ID of the 30 training batches; evaluation looks up without counting
    hits = float(text.split('dynemb_trainer_hits_total{rank="0",table="dynemb_t_0",train_job="dynemb"} ')[1].split()[0])
    misses = float(
        text.split('dynemb_trainer_misses_total{rank="0",table="dynemb_t_0",train_job="dynemb"} ')[1].split()[0]
    )
    assert hits + misses == lookups and hits > 0 and misses > 0
    assert 'dynemb_trainer_steps_total{rank="0",train_job="dynemb"} 30.0' in text
    # one pull per step that admitted IDs, timed per table and direction
    pulls = float(
        text.split(
            'dynemb_trainer_ps_request_seconds_count{op="pull",rank="0",table="dynemb_t_0",train_job="dynemb"} '
        )[1].split()[0]
    )
    assert 1 <= pulls <= 31


def test_row_sparse_adam_is_lazy_adam_on_fbgemm_cpu_tables():
    """dynemb/tables/sparse_adam.py on a real FBGEMM CPU TBE (two tables, one looked up by two
    features, repeated rows) against Adam written out with autograd: the rows a batch used
    move as Adam moves them, the others stay, moments included."""
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from fbgemm_gpu.split_table_batched_embeddings_ops_common import EmbeddingLocation
    from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
        ComputeDevice,
        SplitTableBatchedEmbeddingBagsCodegen,
    )

    from dynemb.tables.sparse_adam import RowSparseAdam

    rows, dim, batch, lr = (12, 7), 4, 5, 0.05
    tbe = SplitTableBatchedEmbeddingBagsCodegen(
        [(r, dim, EmbeddingLocation.HOST, ComputeDevice.CPU) for r in rows],
        feature_table_map=[0, 1, 1],
        optimizer=EmbOptimType.EXACT_SGD,
        learning_rate=1.0,
    )
    gen = torch.Generator().manual_seed(3)
    for w in tbe.split_embedding_weights():
        w.copy_(torch.randn(w.shape, generator=gen))
    ref = [w.detach().clone() for w in tbe.split_embedding_weights()]
    ref_m, ref_v = [torch.zeros_like(w) for w in ref], [torch.zeros_like(w) for w in ref]
    adam = RowSparseAdam([tbe], lr=lr, eps=1e-8)
    fmap = [0, 1, 1]
    for step in range(1, 5):
        lengths = torch.randint(0, 4, (3 * batch,), generator=gen)
        idx = torch.cat(
            [torch.randint(0, rows[fmap[k // batch]], (int(n),), generator=gen) for k, n in enumerate(lengths)]
        )
        offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
        upstream = torch.randn(batch, 3 * dim, generator=gen)
        (tbe(idx, offsets) * upstream).sum().backward()
        adam.step()
        # the reference: pooled sums through autograd, then lazy Adam on the rows used
        leaves = [w.clone().requires_grad_() for w in ref]
        out = torch.zeros(batch, 3 * dim)
        for k in range(3 * batch):
            f, b = divmod(k, batch)
            bag = idx[offsets[k] : offsets[k + 1]]
            if len(bag):
                out[b, f * dim : (f + 1) * dim] = out[b, f * dim : (f + 1) * dim] + leaves[fmap[f]][bag].sum(0)
        (out * upstream).sum().backward()
        for t in range(2):
            used = torch.unique(
                torch.cat([idx[offsets[f * batch] : offsets[(f + 1) * batch]] for f in range(3) if fmap[f] == t])
            )
            g = leaves[t].grad[used]
            ref_m[t][used] = 0.9 * ref_m[t][used] + 0.1 * g
            ref_v[t][used] = 0.999 * ref_v[t][used] + 0.001 * g * g
            mh, vh = ref_m[t][used] / (1 - 0.9**step), ref_v[t][used] / (1 - 0.999**step)
            ref[t][used] = ref[t][used] - lr * mh / (vh.sqrt() + 1e-8)
    got = tbe.split_embedding_weights()
    for t in range(2):
        torch.testing.assert_close(got[t], ref[t], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(adam.tables[0].m[t], ref_m[t], rtol=1e-5, atol=1e-7)
        torch.testing.assert_close(adam.tables[0].v[t], ref_v[t], rtol=1e-5, atol=1e-9)
    assert adam.iter == 4


@pytest.mark.slow
def test_dynemb_train_on_a_criteo_tsv_file(tmp_path):
    """The CLI end to end on Criteo-format lines: trains, evaluates the held-out lines, and
    writes its figures."""
    import subprocess
    import sys

    rng = np.random.default_rng(0)
    lines = []
    for _ in range(800):
        cats = [f"{int(rng.zipf(1.3)) % 300:08x}" if rng.random() > 0.1 else "" for _ in range(26)]
        label = str(int(int(cats[0] or "0", 16) % 3 == 0))  # learnable from the first column
        lines.append(_line(label, dense=[str(int(rng.integers(0, 50))) for _ in range(13)], cats=cats))
    f = tmp_path / "day_0.tsv"
    f.write_text("".join(lines))
    out = tmp_path / "result.json"
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "dynemb.trainer",
            "--source",
            str(f),
            *(
                "--batch-size 64 --steps 12 --capacity 200 --dim 8 --dense-arch 16,8 "
                "--eval-fraction 0.2 --no-progress --result-json"
            ).split(),
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    assert "eval AUC" in run.stdout
    got = json.loads(out.read_text())
    assert len(got["losses"]) == 10  # 640 training lines make 10 batches of 64: the data ran out first
    assert 0.0 <= got["auc"] <= 1.0 and got["hit_rate"] < 1.0


@pytest.mark.slow
def test_a_finished_training_leaves_no_gloo_thread_behind():
    """`dynemb train` joins its process groups' gloo threads before it exits. They ran on into
    interpreter shutdown, where one finishing a collective's work takes the GIL and aborts the
    process ("terminate called without an active exception"): the default group could never be
    freed (torch.distributed.optim, imported after it was made, kept it in a default argument),
    and both groups waited in the job's cyclic garbage."""
    import subprocess
    import sys

    flags = [
        *(
            "--steps 3 --num-sparse 3 --universe 1000 --dim 8 --dense-arch 8 "
            "--over-arch 8,1 --batch-size 16 --eval-batches 1 --no-progress"
        ).split(),
    ]
    code = (
        "import sys; sys.path.insert(0, sys.argv[1]); from helpers import gloo_threads; "
        "from dynemb.trainer.cli import main; "
        f"code = main({flags!r}); print('exit', code, 'gloo threads left:', gloo_threads())"
    )
    run = subprocess.run([sys.executable, "-c", code, str(TESTS)], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.splitlines()[-1] == "exit 0 gloo threads left: []", run.stdout[-2000:]


def test_train_cli_names_bad_settings():
    import subprocess
    import sys

    run = subprocess.run(
        [sys.executable, "-m", "dynemb.trainer", "--optimizer", "lamb"], capture_output=True, text=True, timeout=120
    )
    assert run.returncode == 2 and "optimizer 'lamb' is not one of" in run.stderr


def test_per_table_settings_from_a_file(tmp_path):
    import torch.distributed as dist

    from dynemb.ps_server.lifecycle import Lifecycle
    from dynemb.tables.metrics import TrainerMetrics
    from dynemb.tables.row_store import LocalRowStore
    from dynemb.tables.table_rows import find_tables
    from dynemb.trainer.model import build
    from dynemb.trainer.train import init_distributed, make_dynamic

    f = tmp_path / "run.yaml"
    f.write_text(
        "data: {num_sparse: 3, universe: 1000}\ntable: {dim: 8, capacity_fraction: 0.1}\n"
        "dense_arch: [8]\nover_arch: [8, 1]\n"
        "tables:\n  t_1: {capacity: 40, policy: lru, admit_threshold: 2, ps_ttl_seconds: 3600}\n"
        "  t_2: {init_scale: 0.5}\n"
    )
    cfg = parse("--config", str(f), "--ps-max-rows", "5000")
    assert cfg.table_config("t_1").policy == "lru" and cfg.table_config("t_0").policy == "hybrid"
    created = init_distributed()
    try:
        built = build(cfg)
        rows = {name: r.local_rows for name, r in find_tables(built.model).items()}
        assert rows == {"t_0": 100, "t_1": 40, "t_2": 100}
        assert built.schemas["t_2"].initializer.b == 0.5
        assert built.schemas["t_0"].initializer.b == pytest.approx(8**-0.5)
        store = LocalRowStore()
        with make_dynamic(cfg, built, store, TrainerMetrics(0)) as dyn:
            configs = {c.name: c for c in dyn.configs}
            # when rows leave the store: the flag for every table, the file's TTL for one
            t_1, t_0 = store.lifecycle("dynemb_t_1"), store.lifecycle("dynemb_t_0")
            assert t_1 == Lifecycle(ttl_s=3600, max_rows=5000, since=t_1.since) and t_1.since > 0
            assert (t_0.ttl_s, t_0.max_rows) == (0, 5000)
        assert configs["t_1"].policy == "lru" and configs["t_1"].admit_threshold == 2
        assert configs["t_0"].policy == "hybrid" and configs["t_0"].admit_threshold == 1
    finally:
        if created:
            dist.destroy_process_group()
    bad = tmp_path / "bad.yaml"
    bad.write_text("data: {num_sparse: 3}\ntables: {t_9: {capacity: 5}}\n")
    with pytest.raises(ValueError, match="no table 't_9'"):
        parse("--config", str(bad))
    bad.write_text("data: {num_sparse: 3}\ntables: {t_0: {dim: 5}}\n")
    with pytest.raises(ValueError, match=r"tables.t_0: \['dim'\] cannot be set per table"):
        parse("--config", str(bad))
