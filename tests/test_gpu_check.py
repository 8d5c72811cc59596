"""scripts/gpu_check.sh (on a python3 that pretends to have a GPU, for its order, its budget and
what a killed run leaves) and scripts/gpu_wheels.sh, as far as they run without a GPU; the `cuda`
marker (tests/conftest.py): its cases run on a GPU and are skipped elsewhere; and the `torchrec`
marker, which splits them in two."""

from __future__ import annotations

import base64
import hashlib
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
CHECK = ROOT / "scripts" / "gpu_check.sh"
WHEELS = ROOT / "scripts" / "gpu_wheels.sh"
STEPS = [
    "setup",
    "setup-fbgemm",
    "versions",
    "build",
    "tests-plain",
    "bench-idtransformer",
    "profile-idtransformer",
    "tests-torchrec",
    "bench-train",
]
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


def test_dry_run_names_every_step_in_order_and_runs_nothing(tmp_path):
    proc = _run(CHECK, "--dry-run", OUT=str(tmp_path / "out"), GPU_SITE=str(tmp_path / "site"))
    assert proc.returncode == 0, proc.stderr
    table = _table(proc.stdout)
    assert list(table) == STEPS
    assert all(row == ("skipped", "dry run") for row in table.values())
    # what needs no fbgemm-gpu first: the plain CUDA tests, the transformer's benchmark, then
    # the CUDA tests that need TorchRec, then the training benchmark
    commands = [
        f"would run: {sys.executable} -m pytest -m 'cuda and not torchrec' ",
        "would run: " + sys.executable + " bench/idtransformer_bench.py --device cuda",
        "would run: " + sys.executable + " bench/idtransformer_profile.py --trace ",
        f"would run: {sys.executable} -m pytest -m 'cuda and torchrec' ",
        "would run: " + sys.executable + " bench/train_bench.py --device cuda",
    ]
    at = [proc.stdout.find(c) for c in commands]
    assert -1 not in at and at == sorted(at), proc.stdout
    assert "step tests-torchrec (at most 240 s; starts only with 60 s of the budget left):" in proc.stdout
    assert not (tmp_path / "out").exists() and not (tmp_path / "site").exists()


def test_bad_arguments_are_refused():
    proc = _run(CHECK, "--only", "everything")
    assert proc.returncode == 2 and "--only takes 'tests' or 'bench', not 'everything'" in proc.stderr
    proc = _run(CHECK, "--fast")
    assert proc.returncode == 2 and "unknown argument '--fast'" in proc.stderr
    proc = _run(CHECK, GPU_CHECK_BUDGET="8m")
    assert proc.returncode == 2 and "GPU_CHECK_BUDGET must be whole seconds, not '8m'" in proc.stderr


# A python3 for gpu_check.sh that has a GPU: the commands of the steps (the versions script, the
# builds, pytest, the benchmarks) are written to $FAKE_LOG and faked, with what the script reads
# back from them; the script's own helpers (results.json, the junit counts) run for real. The
# command of kind $FAKE_SLEEP (e.g. "pytest cuda and not torchrec") writes its pid to
# $FAKE_PIDFILE and sleeps instead.
FAKE_PYTHON = """#!/usr/bin/env bash
case "$1 $2 $3" in
  "- "*) what=versions ;;
  "-c from dynemb"*) what="build $2" ;;
  "-m pytest -m") what="pytest $4" ;;
  bench/*) what="$*" ;;
  *) exec {real} "$@" ;;
esac
echo "$what" >>"$FAKE_LOG"
if [ "$what" = "${{FAKE_SLEEP:-}}" ]; then echo $$ >"$FAKE_PIDFILE"; exec sleep 60; fi
case $what in
  versions) cat >/dev/null; printf '%s\\n' "$FAKE_FACTS" >"$2"; echo "faked versions" ;;
  pytest*)
    while [ $# -gt 0 ] && [ "$1" != --junitxml ]; do shift; done
    n=5; [[ $what == *"not torchrec"* ]] || n=13
    echo "<testsuites><testsuite tests=\\"$n\\" failures=\\"0\\" errors=\\"0\\" skipped=\\"1\\"/></testsuites>" >"$2" ;;
  bench/idtransformer_profile*)
    if [[ $what == *"--tables 26"* ]]; then busy=12.98 wall=20.10; else busy=3.38 wall=6.50; fi
    echo "  wall per batch (unprofiled)       $wall ms   40,263,290 IDs/s"
    echo "  device busy per batch             $busy ms   (profiled batches)" ;;
  bench/idtransformer*)
    printf 'idtransformer (triton):  50%%|#####     | 20/40 [00:00<00:01]\r'
    echo "  idtransformer (triton)   67,700,000 IDs/s   hit rate 0.5120"
    [[ $what == *--skip-mch* ]] || echo "  ratio IDs/s ours / MCH             0.15   (goal >= 10)" ;;
  bench/train*)
    echo "  dynamic tables           5,165 samples/s"
    echo "  ratio dynamic / full                  0.11   (goal >= 0.8)" ;;
esac
"""
WITH_FBGEMM = dict(HAVE_GPU="1", HAVE_FBGEMM="1", HAVE_TORCHREC="1", NO_FBGEMM="", NO_TORCHREC="")
NO_FBGEMM = dict(
    HAVE_GPU="1",
    HAVE_FBGEMM="",
    HAVE_TORCHREC="",
    NO_FBGEMM="not installed",
    NO_TORCHREC="does not import (ImportError: no fbgemm_gpu)",
)


def _fake_gpu(tmp_path: Path, facts: dict[str, str] = WITH_FBGEMM, **env: str) -> dict[str, str]:
    """The environment for a run of gpu_check.sh on FAKE_PYTHON; FACTS: what its versions step finds."""
    facts = {**facts, "STEP_FIGURE": "torch 9, fake GPU"}
    tmp_path.mkdir(exist_ok=True)
    fake = tmp_path / "python3"
    fake.write_text(FAKE_PYTHON.format(real=sys.executable))
    fake.chmod(0o755)
    return dict(
        PYTHON=str(fake),
        FAKE_LOG=str(tmp_path / "calls.log"),
        FAKE_FACTS="\n".join(f"{k}={shlex.quote(v)}" for k, v in facts.items()),
        FAKE_PIDFILE=str(tmp_path / "sleeper.pid"),
        OUT=str(tmp_path / "out"),
        GPU_WHEELS=str(tmp_path / "no-wheels"),
        GPU_SITE=str(tmp_path / "site"),
        TMPDIR=str(tmp_path),
        **env,
    )


def _calls(tmp_path: Path) -> list[str]:
    return (tmp_path / "calls.log").read_text().splitlines()


def _results(out: Path) -> dict:
    return json.loads((out / "results.json").read_text())


def test_on_a_gpu_what_needs_no_fbgemm_runs_first_and_every_step_leaves_its_row(tmp_path):
    env = _fake_gpu(tmp_path)
    proc = _run(CHECK, **env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert _calls(tmp_path) == [
        "versions",
        "build from dynemb.idtransformer.kernel import ops; ops()",
        "build from dynemb.ps_server.native import id_index; id_index()",
        "pytest cuda and not torchrec",
        "bench/idtransformer_bench.py --device cuda",
        f"bench/idtransformer_profile.py --trace {env['OUT']}/profile-trace.json",
        "bench/idtransformer_profile.py --tables 26 --batch 65536 --warmup 8 --batches 3",
        "pytest cuda and torchrec",
        "bench/train_bench.py --device cuda --dlrm-sizes --batch-size 8192",
        "bench/train_bench.py --device cuda --steps 100",
    ]
    table = _table(proc.stdout)
    assert list(table) == STEPS
    assert table["versions"] == ("pass", "torch 9, fake GPU")
    assert table["tests-plain"] == ("pass", "4 passed, 0 failed, 0 errors, 1 skipped")
    assert table["tests-torchrec"] == ("pass", "12 passed, 0 failed, 0 errors, 1 skipped")
    assert table["bench-idtransformer"] == ("pass", "idtransformer (triton): 67,700,000 0.5120; ratio IDs/s: 0.15")
    assert table["profile-idtransformer"] == (
        "pass",
        "device busy of wall a batch, 1 and 26 tables: 3.38 of 6.50 ms; 12.98 of 20.10 ms",
    )
    train = "dynamic tables: 5,165; ratio dynamic / full: 0.11"
    assert table["bench-train"] == ("pass", f"{train}; 512 a step: {train}")
    # the table is printed last; table.txt and results.json hold the same rows, finished
    out = Path(env["OUT"])
    printed = proc.stdout[proc.stdout.rindex("\nstep ") :]
    assert printed.strip() == (out / "table.txt").read_text().strip()
    results = _results(out)
    assert [(s["step"], s["status"], s["figure"]) for s in results["steps"]] == [(k, *v) for k, v in table.items()]
    assert results["finished"] is True and results["running"] is None and results["failed"] is False
    assert results["budget_s"] == 480
    assert sorted(p.name for p in out.iterdir()) == [
        "gpu_check.log",
        "junit-plain.xml",
        "junit-torchrec.xml",
        "results.json",
        "table.txt",
    ]


def test_without_fbgemm_the_first_half_runs_and_the_rest_says_why(tmp_path):
    env = _fake_gpu(tmp_path, NO_FBGEMM)
    # the small wheels came (none here but the list of pieces), the pieces of fbgemm-gpu did not
    small = tmp_path / "no-wheels" / "small"
    small.mkdir(parents=True)
    (small / "pieces.sha256").write_text(f"{'0' * 64}  fbgemm_gpu-1.6.0-cp312-cp312-manylinux_2_28_x86_64.whl.tar.xz\n")
    proc = _run(CHECK, **env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    table = _table(proc.stdout)
    assert table["setup"] == ("pass", "0 small wheels")
    assert table["setup-fbgemm"] == (
        "skipped",
        f"no pieces here for fbgemm_gpu (carry the calls of {small.parent}/plan.txt)",
    )
    assert table["tests-plain"][0] == table["build"][0] == "pass"
    assert table["bench-idtransformer"] == (
        "pass",
        "idtransformer (triton): 67,700,000 0.5120; MCH not run: fbgemm-gpu not installed",
    )
    assert table["tests-torchrec"] == table["bench-train"] == ("skipped", "fbgemm-gpu not installed: skipped")
    assert _calls(tmp_path)[3:] == [
        "pytest cuda and not torchrec",
        "bench/idtransformer_bench.py --device cuda --skip-mch",
        f"bench/idtransformer_profile.py --trace {env['OUT']}/profile-trace.json",
        "bench/idtransformer_profile.py --tables 26 --batch 65536 --warmup 8 --batches 3",
    ]
    # again on the same machine: the pieces are looked for again (not "already installed");
    # fbgemm-gpu there but torchrec not importing: the row names torchrec
    env = _fake_gpu(tmp_path, {**NO_FBGEMM, "HAVE_FBGEMM": "1"})
    table = _table(_run(CHECK, **env).stdout)
    assert table["setup-fbgemm"][1].startswith("no pieces here for fbgemm_gpu")
    assert table["tests-torchrec"] == ("skipped", "torchrec does not import (ImportError: no fbgemm_gpu): skipped")


def test_a_step_without_enough_budget_left_is_skipped_with_a_row(tmp_path):
    # 50 s: the steps that start only with 60 (tests-torchrec) and 80 s (bench-train) left never start
    env = _fake_gpu(tmp_path, GPU_CHECK_BUDGET="50")
    proc = _run(CHECK, **env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    table = _table(proc.stdout)
    assert table["tests-plain"][0] == table["bench-idtransformer"][0] == "pass"
    for step, needs in (("tests-torchrec", 60), ("bench-train", 80)):
        status, figure = table[step]
        assert status == "skipped"
        assert re.fullmatch(rf"out of time: \d+ s left of GPU_CHECK_BUDGET=50, needs {needs}", figure), figure
    assert "pytest cuda and torchrec" not in _calls(tmp_path)
    assert _results(Path(env["OUT"]))["steps"][-1]["figure"] == table["bench-train"][1]
    # no budget at all: nothing starts
    table = _table(_run(CHECK, **_fake_gpu(tmp_path / "none", GPU_CHECK_BUDGET="0")).stdout)
    assert [figure.split(":")[0] for _, figure in table.values()] == ["out of time"] * len(STEPS)


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM])
def test_a_run_killed_in_a_step_leaves_the_steps_done(tmp_path, sig):
    env = _fake_gpu(tmp_path, FAKE_SLEEP="pytest cuda and not torchrec")
    out, pidfile = Path(env["OUT"]), Path(env["FAKE_PIDFILE"])
    proc = subprocess.Popen(
        ["bash", str(CHECK)], cwd=ROOT, env=_env(**env), stdout=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        deadline = time.monotonic() + 60
        while not pidfile.exists() or not (out / "results.json").exists() or not _results(out)["running"]:
            assert time.monotonic() < deadline and proc.poll() is None, "the run did not reach tests-plain"
            time.sleep(0.1)
        os.killpg(proc.pid, sig)
        stdout, _ = proc.communicate(timeout=30)
        sleeper_lives = _alive(int(pidfile.read_text()))
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        if pidfile.exists():  # under SIGKILL the step's command (its own process group) lives on
            subprocess.run(["kill", "-9", pidfile.read_text().strip()], capture_output=True)
    done = ["setup", "setup-fbgemm", "versions", "build"]
    results = _results(out)
    table_txt = (out / "table.txt").read_text()
    if sig == signal.SIGKILL:  # nothing ran after the kill: the files as they stood
        assert [s["step"] for s in results["steps"]] == done
        assert results["running"]["step"] == "tests-plain" and results["finished"] is False
        assert re.search(r"^tests-plain\s+running\s+\d+\s+\(at most 180 s\)$", table_txt, re.M), table_txt
        assert list(_table(table_txt)) == done
    else:  # the step gets its row, the table is printed and written, the step's command is ended
        assert proc.returncode == 128 + signal.SIGTERM
        table = _table(stdout)
        assert list(table) == [*done, "tests-plain"]
        assert table["tests-plain"][0] == "fail" and table["tests-plain"][1].startswith("killed (SIGTERM) after ")
        assert results["finished"] is True and results["failed"] is True and results["running"] is None
        assert _table(table_txt) == table
        assert not sleeper_lives


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.slow
@pytest.mark.skipif(not NO_GPU, reason="checks the run on a machine without a GPU")
def test_a_run_without_a_gpu_skips_the_gpu_steps_cleanly(tmp_path):
    out = tmp_path / "out"
    proc = _run(CHECK, OUT=str(out), GPU_WHEELS=str(tmp_path / "no-wheels"), GPU_SITE=str(tmp_path / "site"))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    table = _table(proc.stdout)
    assert list(table) == STEPS
    assert table["setup"][0] == table["setup-fbgemm"][0] == "skipped" and "no " in table["setup"][1]
    assert table["versions"][0] == "pass" and "no GPU" in table["versions"][1]
    for step in STEPS[3:]:
        assert table[step] == ("skipped", "no GPU: skipped")
    # the table is the last thing printed, and results.json holds the same rows
    assert proc.stdout.rstrip().splitlines()[-1].startswith("(logs: ")
    results = json.loads((out / "results.json").read_text())
    assert [(s["step"], s["status"], s["figure"]) for s in results["steps"]] == [(k, *v) for k, v in table.items()]
    assert results["failed"] is False
    assert "===== versions" in (out / "gpu_check.log").read_text()


@pytest.mark.slow
def test_the_cuda_tests_that_need_torchrec_are_marked_and_the_rest_collect_without_it(tmp_path):
    """The `torchrec` marker, written on the tests and modules that need TorchRec or fbgemm-gpu:
    where neither can be imported, `-m "cuda and not torchrec"` (gpu_check.sh's tests-plain)
    collects the whole suite without an error (a module that imports them at its top level
    says so with `pytestmark`, tests/conftest.py), and selects the CUDA tests that need neither."""

    def collected(expr: str, *paths: str, **env: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "-m", "pytest", "-m", expr, "--collect-only", "-q", "-p", "no:cacheprovider", *paths],
            cwd=ROOT,
            capture_output=True,
            text=True,
            env=_env(**env),
            timeout=300,
        )

    def names(proc: subprocess.CompletedProcess) -> set[str]:
        return {line.split("/")[-1] for line in proc.stdout.splitlines() if "::" in line}

    shim = tmp_path / "shim"
    for module in ("torchrec", "fbgemm_gpu"):
        (shim / module).mkdir(parents=True)
        (shim / module / "__init__.py").write_text(f"raise ImportError('no {module} here')\n")
    plain = collected("cuda and not torchrec", "tests", PYTHONPATH=f"{shim}:{ROOT}")
    assert plain.returncode == 0, plain.stdout[-4000:] + plain.stderr
    assert "error" not in plain.stdout.lower(), plain.stdout[-4000:]
    assert names(plain) == {
        "test_bucket_tables.py::test_on_cuda_the_call_does_not_sync_but_for_its_copy",
        "test_trainer_device.py::test_row_moves_on_a_gpu_use_events_not_device_syncs",
        "test_trainer_device.py::test_nccl_collectives_with_one_rank",
        "test_gpu_check.py::test_a_tensor_on_each_device[cuda]",
        "test_gpu_check.py::test_a_cuda_marked_test_sees_a_gpu",
    }, plain.stdout
    # a folder, not its files: pytest never leaves out a file named on its command line
    torchrec = names(
        collected("cuda and torchrec", "tests/trainer", "tests/test_examples.py", "tests/test_gpu_check.py")
    )
    assert "test_trainer_device.py::test_one_gpu_trains_like_the_cpu" in torchrec
    assert "test_examples.py::test_an_example_trains_on_a_gpu[two_tower.py-cuda]" in torchrec
    assert "test_trainer_exact.py::test_dynamic_tables_train_exactly_like_full_ones[cuda-plain-sgd]" in torchrec
    assert len(torchrec) == 11, torchrec


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
    # before the pieces came: the small wheels alone, and a row saying what is absent
    (whl / "pieces").rename(tmp_path / "away")
    proc = _run(CHECK, "--only", "tests", GPU_SITE=str(site), **common)
    table = _table(proc.stdout)
    assert table["setup"] == ("pass", "1 small wheels"), proc.stdout
    assert table["setup-fbgemm"] == ("skipped", f"no pieces here for gpuprobe (carry the calls of {whl}/plan.txt)")
    assert (site / "small" / "gpusmall").is_dir() and not (site / "pieces" / "gpuprobe").exists()
    # the pieces came: they are installed, the small wheels are not installed again
    (tmp_path / "away").rename(whl / "pieces")
    proc = _run(CHECK, "--only", "tests", GPU_SITE=str(site), **common)
    table = _table(proc.stdout)
    assert table["setup"] == ("pass", f"already installed in {site}/small"), proc.stdout
    assert table["setup-fbgemm"] == ("pass", "1 re-joined from pieces"), proc.stdout
    assert (site / "pieces" / "gpuprobe" / "blob.bin").read_bytes() == blob
    assert (site / "small" / "gpusmall" / "__init__.py").read_text() == "ANSWER = 42\n"
    assert table["bench-idtransformer"] == ("skipped", "not asked (--only tests)")

    # one byte changed in one piece: setup-fbgemm fails naming it; the run goes on and exits 1
    damaged = bytearray(pieces[2].read_bytes())
    damaged[10] ^= 0xFF
    pieces[2].write_bytes(damaged)
    proc = _run(CHECK, "--only", "tests", GPU_SITE=str(tmp_path / "site2"), **common)
    table = _table(proc.stdout)
    assert proc.returncode == 1
    assert table["setup"] == ("pass", "1 small wheels")
    assert table["setup-fbgemm"] == ("fail", "gpuprobe-0.1-py3-none-any.whl.tar.xz: pieces missing or damaged")
    assert "do not give sha256" in proc.stdout
    assert table["versions"][0] == "pass"
