"""The ID transformer's kernel loads even when a build that was cut off left torch's lock behind
(a machine restart mid-build once made every later import wait forever)."""

import subprocess
import sys
from pathlib import Path

LOAD = """
import hashlib, torch
from pathlib import Path
from torch.utils import cpp_extension
from idtransformer import kernel
digest = hashlib.sha1(kernel.SOURCE.read_bytes() + torch.__version__.encode()).hexdigest()[:12]
print(cpp_extension._get_build_directory(f"dynemb_idt_{digest}", verbose=False))
"""


def test_a_stale_build_lock_is_removed_not_waited_on():
    root = Path(__file__).resolve().parents[1]
    build = Path(subprocess.run([sys.executable, "-c", LOAD], cwd=root, check=True,
                                capture_output=True, text=True).stdout.strip())
    build.mkdir(parents=True, exist_ok=True)
    (build / "lock").touch()  # what a killed build leaves
    done = subprocess.run([sys.executable, "-c", "from idtransformer.kernel import ops; ops(); print('loaded')"],
                          cwd=root, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr
    assert "loaded" in done.stdout
    assert "left by a build of the ID transformer's kernel that was cut off" in done.stderr
    assert not (build / "lock").exists()
