"""The ID transformer's kernel loads even when a build that was cut off left torch's lock behind
(a machine restart mid-build once made every later import wait forever)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import REPO

from dynemb.common.native_build import digest

pytestmark = pytest.mark.slow  # each builds or loads the kernel in a new process

LOAD = """
from torch.utils import cpp_extension
from dynemb.idtransformer import kernel
print(cpp_extension._get_build_directory(kernel.build_name(), verbose=False))
"""
LOAD_OPS = "from dynemb.idtransformer.kernel import ops; ops(); print('loaded')"


@pytest.fixture(scope="module")
def own_build() -> tuple[Path, dict[str, str]]:
    """The kernel built in a folder of these tests' own (TORCH_EXTENSIONS_DIR), and the
    environment that loads it from there: what they plant or time must not be met (a lock
    removed, a build redone) by the other processes of a parallel run, which load the kernel
    from the shared folder all the while. The folder is this checkout's and outlives the run,
    as the shared one does: a build from nothing (~15 s of a core at -O3, a minute on a
    loaded machine) happens once per version of the sources, not once per run."""
    folder = Path.home() / ".cache" / "dynemb" / "tests" / f"kernel-build-{digest(str(REPO).encode())}"
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(folder)}
    subprocess.run([sys.executable, "-c", LOAD_OPS], cwd=REPO, env=env, check=True, capture_output=True, timeout=600)
    build = subprocess.run([sys.executable, "-c", LOAD], cwd=REPO, env=env, check=True, capture_output=True, text=True)
    return Path(build.stdout.strip()), env


def test_a_stale_build_lock_is_removed_not_waited_on(own_build):
    root = REPO
    build, env = own_build
    (build / "lock").touch()  # what a killed build leaves
    done = subprocess.run(
        [sys.executable, "-c", LOAD_OPS], cwd=root, env=env, capture_output=True, text=True, timeout=240
    )
    assert done.returncode == 0, done.stderr
    assert "loaded" in done.stdout
    assert "left by a build of the ID transformer's kernel that was cut off" in done.stderr
    assert not (build / "lock").exists()


def test_a_second_checkout_of_the_same_source_reuses_the_build(own_build, tmp_path):
    """Two checkouts of one version (worktrees, copies) share the build folder; the build must
    not depend on which path the source was read from, or each load rebuilds the other's."""
    import shutil

    root = REPO
    build, env = own_build
    built = {p.name: p.stat().st_mtime_ns for p in build.iterdir() if p.suffix in (".so", ".ninja", ".o")}
    assert any(name.endswith(".so") for name in built), sorted(built)
    shutil.copytree(root / "dynemb", tmp_path / "dynemb", ignore=shutil.ignore_patterns("__pycache__"))
    done = subprocess.run(
        [sys.executable, "-c", LOAD_OPS], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240
    )
    assert done.returncode == 0, done.stderr
    after = {p.name: p.stat().st_mtime_ns for p in build.iterdir() if p.suffix in (".so", ".ninja", ".o")}
    assert after == built, "loading from a second checkout rebuilt the kernel"
