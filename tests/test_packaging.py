"""What `pip install` puts into site-packages: the one `dynemb` namespace, nothing else."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def test_the_wheel_holds_only_the_dynemb_namespace(tmp_path):
    subprocess.run(
        [
            sys.executable,
            *"-m pip wheel --no-deps --no-build-isolation -q -w".split(),
            str(tmp_path),
            str(REPO),
        ],
        check=True,
        capture_output=True,
        timeout=300,
    )
    (wheel,) = tmp_path.glob("dynemb-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    top = {n.split("/", 1)[0] for n in names if not n.split("/", 1)[0].endswith(".dist-info")}
    assert top == {"dynemb"}, top
    # the native sources and the protos travel with the code that builds and reads them
    for needed in (
        "dynemb/idtransformer/csrc/slot_map.cpp",
        "dynemb/ps_server/csrc/id_index.h",
        "dynemb/common/csrc/hash.h",
        "dynemb/protos/ps.proto",
        "dynemb/protos/ps_pb2.py",
    ):
        assert needed in names, needed
    assert not any(n.startswith(("dynemb/tests", "tests/", "bench/")) for n in names)


def test_outside_the_repository_only_dynemb_is_importable(tmp_path):
    # the editable install maps the namespace; the old top-level names are gone
    code = (
        "import importlib.util as u, dynemb.trainer, dynemb.ps_server.client, dynemb.idtransformer, dynemb.protos;"
        "print([n for n in ('trainer', 'protos', 'ps_server', 'idtransformer') if u.find_spec(n)])"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def _imported_after(module: str, prefixes: tuple[str, ...]) -> list[str]:
    code = f"import sys, {module}; print(sorted(m for m in sys.modules if m.startswith({prefixes!r})))"
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return eval(out.stdout)


@pytest.mark.slow
@pytest.mark.torchrec
def test_the_trainer_does_not_import_test_scaffolding_or_redis():
    assert _imported_after("dynemb.trainer.train", ("dynemb.testing", "redis")) == []


def test_a_client_does_not_import_the_server():
    # a client needs neither the service, the stores nor prometheus_client
    assert (
        _imported_after(
            "dynemb.ps_server.client",
            ("dynemb.testing", "dynemb.ps_server.service", "dynemb.ps_server.backends", "prometheus_client", "redis"),
        )
        == []
    )
