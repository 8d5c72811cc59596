"""Trainer inputs at their edges: IDs at the ends of int64 and of other integer types, empty
batches, batches larger than the table, malformed training data. Each gets a right answer or
an error that names it, never a silent wrong slot."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
import torch

from dynemb.idtransformer.transformer import IDTransformer, TooManyIDs
from dynemb.trainer.config import DataConfig
from dynemb.trainer.data import BadLine, criteo_tsv_batches

pytestmark = pytest.mark.torchrec  # TorchRec and fbgemm-gpu: needed by every test here

BACKENDS = pytest.mark.parametrize("backend", ["kernel", "torch"])
INT64 = torch.iinfo(torch.int64)
EDGES = [
    INT64.min,
    INT64.min + 1,
    -(1 << 32),
    -2,
    -1,
    0,
    1,
    (1 << 31) - 1,
    1 << 31,
    (1 << 32),
    INT64.max - 1,
    INT64.max,
]


@BACKENDS
def test_every_int64_is_an_id_negative_and_extreme_ones_included(backend):
    t = IDTransformer(64, backend=backend)
    ids = torch.tensor(EDGES, dtype=torch.int64)
    first = t.transform(ids).slots
    assert first.unique().numel() == len(EDGES) and bool((first >= 0).all())  # one slot each
    again = t.transform(ids.flip(0)).slots.flip(0)
    assert again.tolist() == first.tolist()  # and the same slot next time


@BACKENDS
def test_integer_types_are_taken_exactly_and_others_refused(backend):
    t = IDTransformer(64, backend=backend)
    as_int64 = t.transform(torch.tensor([-5, 7, 1 << 20], dtype=torch.int64)).slots
    assert t.transform(torch.tensor([-5, 7, 1 << 20], dtype=torch.int32)).slots.tolist() == as_int64.tolist()
    if hasattr(torch, "uint64"):  # uint64 IDs: bit for bit, so 2^64 - 1 is the same ID as -1
        big = torch.tensor([-1, INT64.min], dtype=torch.int64)
        want = t.transform(big).slots.tolist()
        assert t.transform(big.view(torch.uint64)).slots.tolist() == want
    for bad in (torch.tensor([1.0, 2.5]), torch.tensor([True, False]), torch.tensor([1.0], dtype=torch.float64)):
        with pytest.raises(TypeError, match=f"integer tensor.*got {bad.dtype}"):
            t.transform(bad)
    with pytest.raises(TypeError, match="torch tensor"):
        t.transform([1, 2, 3])


@BACKENDS
def test_an_empty_batch_is_a_step_with_nothing_to_do(backend):
    t = IDTransformer(8, backend=backend)
    t.transform(torch.tensor([1, 2, 3]))
    out = t.transform(torch.zeros(0, dtype=torch.int64), pin=True)
    assert out.slots.numel() == 0 and out.admitted_ids.numel() == 0 and out.evicted_ids.numel() == 0
    assert len(t) == 3


@BACKENDS
def test_more_distinct_ids_than_slots_is_refused_and_changes_nothing(backend):
    t = IDTransformer(4, backend=backend)
    kept = t.transform(torch.tensor([10, 11])).slots.tolist()
    with pytest.raises(TooManyIDs, match="5 distinct IDs but the table holds 4"):
        t.transform(torch.tensor([1, 2, 3, 4, 5, 1, 2]))
    assert t.transform(torch.tensor([10, 11])).slots.tolist() == kept and len(t) == 2


def _tsv(path, lines: list[str]) -> str:
    path.write_bytes("".join(lines).encode("utf-8", errors="surrogateescape"))
    return str(path)


def _line(label="1", cats=None) -> str:
    cats = cats if cats is not None else [f"{i:08x}" for i in range(26)]
    return "\t".join([label, *[str(i) for i in range(13)], *cats]) + "\n"


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        ("1\t2\n", "expected 40 tab-separated columns, got 2"),
        (_line(cats=["zz"] + [""] * 25), "invalid literal for int"),
        (_line(label="0.5"), "label must be 0 or 1"),
        ("\t".join(["1", "x", *[""] * 38]) + "\n", "invalid literal"),
        (_line(cats=["\udcff\udcfe"] + [""] * 25), "invalid literal"),  # bytes that are not UTF-8
    ],
)
def test_a_malformed_line_is_named_or_skipped(tmp_path, bad, message):
    source = _tsv(tmp_path / "day.tsv", [_line(), bad, _line("0")])
    cfg = DataConfig(source=source, eval_fraction=0.0)
    with pytest.raises(BadLine, match=f"day.tsv:2: .*{message}"):
        list(criteo_tsv_batches(cfg, 8))
    skipping = DataConfig(source=source, eval_fraction=0.0, skip_bad_lines=True)
    (batch,) = list(criteo_tsv_batches(skipping, 8))
    assert batch.labels.tolist() == [1.0, 0.0]  # the two good lines, nothing from the bad one


@pytest.mark.slow
def test_a_batch_whose_ids_are_all_missing_trains(tmp_path):
    """Lines with every categorical column empty make batches with no IDs at all."""
    lines = [_line(str(i % 2), cats=[""] * 26) for i in range(16)]
    lines += [_line(str(i % 2), cats=[f"{(i * 7 + j) % 50:08x}" for j in range(26)]) for i in range(32)]
    source = _tsv(tmp_path / "day.tsv", lines)
    out = tmp_path / "result.json"
    run = _train(
        "--source",
        source,
        *"--batch-size 16 --steps 3 --capacity 200 --eval-fraction 0 --eval-batches 0".split(),
        "--result-json",
        str(out),
    )
    assert run.returncode == 0, run.stderr[-3000:]
    losses = json.loads(out.read_text())["losses"]
    assert len(losses) == 3 and all(np.isfinite(losses))


def _train(*flags: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, *"-m dynemb.trainer --dim 8 --dense-arch 16,8 --no-progress".split(), *flags],
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.mark.slow
def test_the_training_cli_names_bad_data_and_too_small_tables(tmp_path):
    source = _tsv(tmp_path / "day.tsv", [_line()] * 5 + ["garbage\n"] + [_line("0")] * 10)
    run = _train("--source", source, "--batch-size", "4", "--steps", "3", "--capacity", "200", "--eval-fraction", "0")
    assert run.returncode == 1
    assert "malformed training data" in run.stderr and "day.tsv:6" in run.stderr and "--skip-bad-lines" in run.stderr
    assert "Traceback" not in run.stderr
    run = _train(
        "--source",
        source,
        *"--batch-size 4 --steps 3 --capacity 200 --eval-fraction 0 --skip-bad-lines".split(),
    )
    assert run.returncode == 0, run.stderr[-3000:]
    assert "skipping a malformed line" in run.stderr and "day.tsv:6" in run.stderr

    lines = [_line(cats=[f"{(i * 26 + j):08x}" for j in range(26)]) for i in range(64)]  # every ID new
    run = _train(
        "--source",
        _tsv(tmp_path / "wide.tsv", lines),
        "--batch-size",
        "64",
        "--steps",
        "1",
        "--capacity",
        "16",
        "--eval-fraction",
        "0",
    )
    assert run.returncode == 1
    assert "does not fit its table" in run.stderr and "64 distinct IDs but the table holds 16" in run.stderr
    assert "--capacity" in run.stderr and "Traceback" not in run.stderr


def test_an_error_starts_a_line_of_its_own_after_the_progress_bar(tmp_path):
    lines = [_line(cats=[f"{(i * 26 + j):08x}" for j in range(26)]) for i in range(64)]  # every ID new
    source = _tsv(tmp_path / "wide.tsv", lines)
    run = _train("--source", source, *"--batch-size 64 --steps 1 --capacity 16 --eval-fraction 0 --progress".split())
    assert run.returncode == 1 and "train (rank 0)" in run.stderr  # the bar was drawn
    (error,) = [line for line in run.stderr.split("\n") if "error:" in line]
    assert error.startswith("dynemb"), error  # not after the bar's \r on its line
