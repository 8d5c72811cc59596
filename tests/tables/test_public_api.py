"""The public API: what dynemb.tables and dynemb.checkpoint export resolves, and nothing else
is exported; importing dynemb.tables loads no TorchRec until a name that needs it is used (the
plain model trains where TorchRec cannot load)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from dynemb import checkpoint, tables


@pytest.mark.parametrize("package", [tables, checkpoint], ids=lambda p: p.__name__)
def test_every_public_name_resolves_and_all_lists_exactly_them(package):
    assert sorted(package.__all__) == sorted(package._PUBLIC)
    for name in package.__all__:
        getattr(package, name)  # TORCHREC_ERROR is None where TorchRec loads
    with pytest.raises(AttributeError, match="has no attribute 'DynamicTable'"):
        package.DynamicTable  # noqa: B018 - a misspelt name is refused by name


def test_importing_the_package_loads_no_torchrec():
    code = "import sys, dynemb.tables; print('torchrec' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.stdout.strip() == "False", done.stderr[-2000:]
