"""scripts/gpu_check.sh and scripts/gpu_wheels.sh, as far as they run without a GPU, and the
`cuda` marker (tests/conftest.py): its cases run on a GPU and are skipped elsewhere."""

from __future__ import annotations

import base64
import hashlib
import json
import os
import re
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
CHECK = ROOT / "scripts" / "gpu_check.sh"
WHEELS = ROOT / "scripts" / "gpu_wheels.sh"
STEPS = ["setup", "versions", "build", "tests", "bench-idtransformer", "bench-train"]
NO_GPU = not torch.cuda.is_available()


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_a_tensor_on_each_device(device):
    # the "cuda" case carries the cuda marker (conftest) and is skipped without a GPU
    assert torch.arange(4, device=device).sum().item() == 6


@pytest.mark.cuda
def test_a_cuda_marked_test_sees_a_gpu():
    assert torch.cuda.is_available()
    assert torch.cuda.get_device_properties(0).total_memory > 0


@pytest.mark.slow
def test_cuda_selects_the_marked_and_device_cases():
    out = subprocess.run(
        [sys.executable, "-m", "pytest", "-m", "cuda", "-v", "-rs", "-p", "no:cacheprovider", __file__],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env=_env(),
        timeout=300,
    ).stdout
    # the two cuda tests are selected, the cpu case and the other tests are not
    ran = dict(re.findall(r"test_gpu_check\.py::(\S+) (PASSED|SKIPPED|FAILED|ERROR)", out))
    want = "SKIPPED" if NO_GPU else "PASSED"
    assert ran == {"test_a_tensor_on_each_device[cuda]": want, "test_a_cuda_marked_test_sees_a_gpu": want}, out
    if NO_GPU:
        assert out.count(": needs a CUDA GPU") == 2, out


def _env(**extra: str) -> dict[str, str]:
    env = dict(os.environ, PYTHON=sys.executable, PYTHONPATH=str(ROOT))
    env.pop("OUT", None)  # the device tool's results folder: never the tests'
    env.update(extra)
    return env


def _run(script: Path, *args: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", str(script), *args], cwd=ROOT, capture_output=True, text=True, env=_env(**env), timeout=600
    )


def _table(stdout: str) -> dict[str, tuple[str, str]]:
    """The final table: step -> (status, key figure)."""
    lines = stdout.splitlines()
    start = max(i for i, line in enumerate(lines) if line.startswith("step ") and "key figure" in line)
    rows = {}
    for line in lines[start + 2 :]:
        m = re.match(r"(\S+)\s+(pass|fail|skipped)\s+(\d+)\s+(.*)$", line)
        if m:
            rows[m[1]] = (m[2], m[4])
    return rows


def test_dry_run_names_every_step_and_runs_nothing(tmp_path):
    proc = _run(CHECK, "--dry-run", OUT=str(tmp_path / "out"), GPU_SITE=str(tmp_path / "site"))
    assert proc.returncode == 0, proc.stderr
    table = _table(proc.stdout)
    assert list(table) == STEPS
    assert all(row == ("skipped", "dry run") for row in table.values())
    assert "would run: " + sys.executable + " -m pytest -m cuda" in proc.stdout
    assert "bench/idtransformer_bench.py --device cuda" in proc.stdout
    assert not (tmp_path / "out").exists() and not (tmp_path / "site").exists()


def test_bad_arguments_are_refused():
    proc = _run(CHECK, "--only", "everything")
    assert proc.returncode == 2 and "--only takes 'tests' or 'bench', not 'everything'" in proc.stderr
    proc = _run(CHECK, "--fast")
    assert proc.returncode == 2 and "unknown argument '--fast'" in proc.stderr


@pytest.mark.slow
@pytest.mark.skipif(not NO_GPU, reason="checks the run on a machine without a GPU")
def test_a_run_without_a_gpu_skips_the_gpu_steps_cleanly(tmp_path):
    out = tmp_path / "out"
    proc = _run(CHECK, OUT=str(out), GPU_WHEELS=str(tmp_path / "no-wheels"), GPU_SITE=str(tmp_path / "site"))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    table = _table(proc.stdout)
    assert list(table) == STEPS
    assert table["setup"][0] == "skipped" and "no " in table["setup"][1]
    assert table["versions"][0] == "pass" and "no GPU" in table["versions"][1]
    for step in STEPS[2:]:
        assert table[step] == ("skipped", "no GPU: skipped")
    # the table is the last thing printed, and results.json holds the same rows
    assert proc.stdout.rstrip().splitlines()[-1].startswith("(logs: ")
    results = json.loads((out / "results.json").read_text())
    assert [(s["step"], s["status"], s["figure"]) for s in results["steps"]] == [(k, *v) for k, v in table.items()]
    assert results["failed"] is False
    assert "===== versions" in (out / "gpu_check.log").read_text()


def _wheel(folder: Path, name: str, files: dict[str, bytes]) -> Path:
    """A minimal pure-Python wheel NAME-0.1 holding FILES, with a RECORD as pip writes one."""
    info = f"{name}-0.1.dist-info"
    files = dict(files)
    files[f"{info}/METADATA"] = f"Metadata-Version: 2.1\nName: {name}\nVersion: 0.1\n".encode()
    files[f"{info}/WHEEL"] = b"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
    record = []
    for path, data in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
        record.append(f"{path},sha256={digest},{len(data)}")
    record.append(f"{info}/RECORD,,")
    files[f"{info}/RECORD"] = ("\n".join(record) + "\n").encode()
    path = folder / f"{name}-0.1-py3-none-any.whl"
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as z:
        for member, data in files.items():
            z.writestr(member, data)
    return path


def _size(path: Path) -> int:
    """Bytes as du -sb counts them (a folder's own entry included)."""
    return int(subprocess.run(["du", "-sb", str(path)], capture_output=True, text=True, check=True).stdout.split()[0])


def _plan(plan_txt: Path) -> list[list[str]]:
    """The carry list of each call in plan.txt, in order."""
    lines = plan_txt.read_text().splitlines()
    return [json.loads(line.split(": ", 1)[1]) for line in lines if line.startswith("call ")]


@pytest.mark.slow
def test_pieces_rejoin_install_and_a_damaged_piece_fails_setup(tmp_path):
    whl = tmp_path / "whl"
    (whl / "download").mkdir(parents=True)
    blob = os.urandom(300_000)  # random: xz cannot shrink it, so it needs several pieces
    _wheel(whl / "download", "gpuprobe", {"gpuprobe/__init__.py": b"", "gpuprobe/blob.bin": blob})
    _wheel(whl / "download", "gpusmall", {"gpusmall/__init__.py": b"ANSWER = 42\n"})
    proc = _run(
        WHEELS,
        *("--no-download", "--no-debs", "--dir", str(whl), "--piece-size", "100K", "--group-size", "150K"),
        *("--wheel", "gpuprobe==0.1", "--wheel", "gpusmall==0.1"),
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "gpuprobe-0.1-py3-none-any.whl: every file of the re-packed tar matches the wheel RECORD" in proc.stdout
    assert "gpuprobe-0.1-py3-none-any.whl.tar.xz: 5 pieces; they rejoin to the recorded sha256" in proc.stdout
    pieces = sorted((whl / "pieces").iterdir())
    assert [p.name for p in pieces] == [f"gpuprobe-0.1-py3-none-any.whl.tar.xz.part-{i:02d}" for i in range(5)]
    assert all(p.stat().st_size <= 100 * 1024 for p in pieces)
    assert sorted(p.name for p in (whl / "small").iterdir()) == ["gpusmall-0.1-py3-none-any.whl", "pieces.sha256"]
    # .whl/small opens call 1, every piece travels once, each call holds at most --group-size,
    # and the calls are as few as that allows
    plan = _plan(whl / "plan.txt")
    carried = [path for call in plan for path in call]
    assert plan[0][0] == f"{whl}/small"
    assert carried[1:] == [str(p) for p in pieces]
    sizes = [sum(_size(Path(p)) for p in call) for call in plan]
    assert max(sizes) <= 150 * 1024
    assert len(plan) == -(-sum(sizes) // (150 * 1024)) == 3

    site = tmp_path / "site"
    common = dict(OUT=str(tmp_path / "out"), GPU_WHEELS=str(whl), GPU_CHECK_BUDGET="200")
    # before the pieces came: the small wheels alone, and a line saying what is absent
    (whl / "pieces").rename(tmp_path / "away")
    proc = _run(CHECK, "--only", "tests", GPU_SITE=str(site), **common)
    setup = _table(proc.stdout)["setup"]
    assert setup == ("pass", "1 small wheels, 0 re-joined from pieces; gpuprobe absent: no pieces")
    assert (site / "gpusmall").is_dir() and not (site / "gpuprobe").exists()
    # the pieces came: the same folder is installed again, with them
    (tmp_path / "away").rename(whl / "pieces")
    proc = _run(CHECK, "--only", "tests", GPU_SITE=str(site), **common)
    table = _table(proc.stdout)
    assert table["setup"] == ("pass", "1 small wheels, 1 re-joined from pieces"), proc.stdout
    assert (site / "gpuprobe" / "blob.bin").read_bytes() == blob
    assert (site / "gpusmall" / "__init__.py").read_text() == "ANSWER = 42\n"
    assert table["bench-idtransformer"] == ("skipped", "not asked (--only tests)")

    # one byte changed in one piece: setup fails naming it; the run goes on and exits 1
    damaged = bytearray(pieces[2].read_bytes())
    damaged[10] ^= 0xFF
    pieces[2].write_bytes(damaged)
    proc = _run(CHECK, "--only", "tests", GPU_SITE=str(tmp_path / "site2"), **common)
    table = _table(proc.stdout)
    assert proc.returncode == 1
    assert table["setup"] == ("fail", "gpuprobe-0.1-py3-none-any.whl.tar.xz: pieces missing or damaged")
    assert "do not give sha256" in proc.stdout
    assert table["versions"][0] == "pass"
