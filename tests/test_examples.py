"""The examples, run as a user runs them: each trains, resumes from a checkpoint exactly (the
losses after the resume equal the uninterrupted run's) and exports its tables, on one process
with the embedded store and on 2 torchrun ranks over a PS on Redis."""

from __future__ import annotations

import ast
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from helpers import dynemb, readme_output, torchrun

from dynemb.checkpoint.format import checkpoints

pytestmark = pytest.mark.torchrec  # TorchRec and fbgemm-gpu: needed by every test here

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
STEPS, HALF = 40, 20


def _one_process(script: str, *args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.run(
        [sys.executable, str(EXAMPLES / script), *args], capture_output=True, text=True, timeout=300, env=env
    )


def _run(script: str, ranks: int, *args: str) -> subprocess.CompletedProcess:
    done = torchrun(ranks, EXAMPLES / script, *args, timeout=300) if ranks > 1 else _one_process(script, *args)
    assert done.returncode == 0, done.stderr[-4000:]
    return done


def _resumes_exactly(script: str, ranks: int, tmp_path: Path, *store: str) -> None:
    """A run of STEPS that saves a checkpoint at HALF and at the end; its last checkpoint
    removed, a resume from HALF to STEPS: the same losses after HALF, the same AUC (on a PS the
    restore replaces the rows the run left at STEPS); and the export holds every row the store has."""
    ck, full, resumed = tmp_path / "ck", tmp_path / "full.json", tmp_path / "resumed.json"
    _run(
        script, ranks, "--steps", str(STEPS), "--checkpoint-dir", str(ck), "--checkpoint-every", str(HALF),
        "--result-json", str(full), *store,
    )  # fmt: skip
    assert [p.name for p in checkpoints(ck)] == [f"step-{HALF:08d}", f"step-{STEPS:08d}"]
    shutil.rmtree(ck / f"step-{STEPS:08d}")
    done = _run(
        script, ranks, "--steps", str(STEPS), "--checkpoint-dir", str(ck), "--resume",
        "--result-json", str(resumed), "--export", str(tmp_path / "tables"), *store,
    )  # fmt: skip
    a, b = json.loads(full.read_text()), json.loads(resumed.read_text())
    assert b["first"] == HALF and len(b["losses"]) == STEPS - HALF
    np.testing.assert_array_equal(b["losses"], a["losses"][HALF:])
    assert b["auc"] == a["auc"]
    assert f"steps {STEPS}  final loss" in done.stdout
    assert "exported " in done.stdout
    from dynemb.checkpoint import TableReader

    for table in (tmp_path / "tables").iterdir():
        ids = np.concatenate([i for i, _, _ in TableReader(table).chunks()])
        assert len(ids) > 0 and len(np.unique(ids)) == len(ids), table.name


@pytest.mark.slow
@pytest.mark.parametrize("script", ["two_tower.py", "sequence.py"])
def test_an_example_on_one_process_resumes_exactly_and_exports(script, tmp_path):
    _resumes_exactly(script, 1, tmp_path)


@pytest.mark.dist
@pytest.mark.parametrize("script", ["two_tower.py", "sequence.py"])
def test_an_example_on_two_ranks_over_redis_resumes_exactly_and_exports(
    script, tmp_path, make_ps, redis_url, redis_namespace
):
    ps = make_ps("--backend", redis_url, "--namespace", redis_namespace)
    _resumes_exactly(script, 2, tmp_path, "--store", ps.address)


def _final_line(done: subprocess.CompletedProcess) -> list[str]:
    """An example's line of figures (steps, loss, AUC, hit rate), as README.md quotes it."""
    return [line for line in done.stdout.splitlines() if line.startswith("steps ")]


@pytest.mark.dist
def test_an_example_on_two_ranks_with_the_embedded_store(tmp_path):
    """README.md's 2-rank run, with a flag after the script: its figures are the README's."""
    # --warm-start: a flag torchrun passes on (`--start warm` was refused: "ambiguous option: --start could
    # match --start-method"); on an empty store, a start like any other. --export: after the figures are made
    done = _run("two_tower.py", 2, "--warm-start", "--export", str(tmp_path / "tables"))
    assert "exported user" in done.stdout
    assert _final_line(done) == readme_output(".venv/bin/torchrun --nproc_per_node 2 examples/two_tower.py")


def test_an_example_on_one_process_prints_what_the_readme_quotes():
    done = _run("two_tower.py", 1)
    assert _final_line(done) == readme_output(".venv/bin/python examples/two_tower.py")


def _flags(script: str) -> list[str]:
    """The flags an example's parser takes, read from its add_argument calls."""
    tree = ast.parse((EXAMPLES / script).read_text())
    return [
        arg.value
        for call in ast.walk(tree)
        if isinstance(call, ast.Call) and isinstance(call.func, ast.Attribute) and call.func.attr == "add_argument"
        for arg in call.args
        if isinstance(arg, ast.Constant) and str(arg.value).startswith("--")
    ]


def test_the_example_commands_of_the_docs_use_flags_the_examples_take():
    """Every `examples/NAME.py --flag ...` of README.md, docs/ and the examples' own docstrings."""
    pages = [EXAMPLES.parent / "README.md", *(EXAMPLES.parent / "docs").glob("*.md"), *EXAMPLES.glob("*.py")]
    command = re.compile(r"examples/(\w+\.py)((?:[ \t]+[^\s#`]+)*)")
    unknown, seen = [], 0
    for page in pages:
        for script, args in command.findall(page.read_text()):
            flags = re.findall(r"(?<!\S)(--[\w-]+)", args)
            seen += len(flags)
            unknown += [f"{page.name}: examples/{script} {flag}" for flag in flags if flag not in _flags(script)]
    assert seen and not unknown, unknown


@pytest.mark.parametrize("script", ["two_tower.py", "sequence.py"])
def test_every_example_flag_passes_through_torchrun_as_given(script, capsys):
    """torchrun's parser reads the flags after the script too, and refuses one that could abbreviate
    one of its own (argparse's prefix matching); each flag, alone and as --flag=value, reaches the script."""
    from torch.distributed.run import get_args_parser

    flags = _flags(script)
    assert "--steps" in flags and "--warm-start" in flags, flags
    refused = []
    for given in [form for flag in flags for form in ([flag, "1"], [f"{flag}=1"])]:
        try:
            passed = get_args_parser().parse_args([script, *given]).training_script_args
        except SystemExit:
            passed = capsys.readouterr().err.strip().splitlines()[-1:]
        if passed != given:
            refused.append(f"{' '.join(given)}: {passed}")
    assert not refused, refused


@pytest.mark.dist
def test_a_checkpoint_of_two_ranks_resumes_on_one_and_verifies(tmp_path):
    """An own model's checkpoint restores on another number of ranks (rows and ID transformers
    resharded to their new owners), and `dynemb checkpoint inspect --verify` accepts it."""
    ck = tmp_path / "ck"
    _run("two_tower.py", 2, "--steps", "20", "--checkpoint-dir", str(ck))
    (saved,) = sorted(ck.iterdir())
    verified = dynemb("checkpoint", "inspect", "--verify", str(saved))
    assert verified.returncode == 0 and "sha256 match" in verified.stdout + verified.stderr, verified.stderr[-2000:]
    assert "ranks        2" in verified.stdout
    done = _run("two_tower.py", 1, "--steps", "30", "--checkpoint-dir", str(ck), "--resume")
    assert "steps 30  final loss" in done.stdout


@pytest.mark.parametrize("device", ["cuda"])  # the CPU runs above; skipped without a GPU (conftest)
@pytest.mark.parametrize("script", ["two_tower.py", "sequence.py"])
def test_an_example_trains_on_a_gpu(script, device, tmp_path):
    done = _run(script, 1, "--device", device, "--steps", "20", "--export", str(tmp_path / "tables"))
    assert "steps 20  final loss" in done.stdout and "exported " in done.stdout
