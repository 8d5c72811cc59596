"""What the project's JIT-built C++ code shares: a build folder per source version and an
flock around the build.

dynemb/idtransformer/kernel.py builds a torch extension with torch's builder inside `build_lock`;
dynemb/ps_server/native.py builds a CPython extension (no torch) with `compile_library`.
Set DYNEMB_VERBOSE_BUILD=1 to see the compiler's output.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import subprocess
import sys
import sysconfig
import warnings
from pathlib import Path


def digest(*parts: bytes) -> str:
    """A short hash naming one version of a build: checkouts of different versions on one
    machine (branches, worktrees, upgrades) never load each other's build."""
    return hashlib.sha1(b"".join(parts)).hexdigest()[:12]


def verbose() -> bool:
    """Whether DYNEMB_VERBOSE_BUILD=1 asks for the compiler's output."""
    return os.environ.get("DYNEMB_VERBOSE_BUILD") == "1"


class build_lock:
    """An flock on <build>/dynemb.flock around a build.

    torch's own guard is a plain `lock` file that a waiting process polls for forever; a build
    that was killed (machine restart, OOM, Ctrl-C at the wrong moment) leaves it behind and
    every later import hangs. An flock dies with its holder, so while we hold it no other
    dynemb process is building here and a leftover `lock` can only be stale: remove it.
    `what` names the build in that warning.
    """

    def __init__(self, build: Path, what: str) -> None:
        self.build = build
        self.what = what

    def __enter__(self):
        self.build.mkdir(parents=True, exist_ok=True)
        self.fd = os.open(self.build / "dynemb.flock", os.O_CREAT | os.O_RDWR, 0o644)
        fcntl.flock(self.fd, fcntl.LOCK_EX)
        stale = self.build / "lock"
        if stale.exists():
            warnings.warn(f"removing {stale}, left by a build of {self.what} that was cut off", stacklevel=1)
            stale.unlink(missing_ok=True)
        return self

    def __exit__(self, *exc) -> None:
        fcntl.flock(self.fd, fcntl.LOCK_UN)
        os.close(self.fd)


def cache_root() -> Path:
    """Where plain (non-torch) builds go: $DYNEMB_BUILD_DIR, else ~/.cache/dynemb/build."""
    root = os.environ.get("DYNEMB_BUILD_DIR")
    if root:
        return Path(root)
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "dynemb" / "build"


# no -march=native: a cache folder may be shared by machines with different CPUs
# -ffp-contract=off: floating point as written (the PS's initial rows must match numpy's bit for bit)
FLAGS = (
    "-O3",
    "-std=c++17",
    "-shared",
    "-fPIC",
    "-fno-exceptions",
    "-fvisibility=hidden",
    "-Wall",
    "-ffp-contract=off",
)


def compile_library(
    source: Path, name: str, what: str, *, depends: tuple[Path, ...] = (), python_module: bool = False
) -> Path:
    """Build `source` (including `depends`, from their folders) into a shared library, once per
    version of them and of Python, and return its path. python_module: a CPython extension
    module `name` (Python's headers on the include path). Linked to nothing but libc and
    libstdc++, so loading it costs milliseconds, where a torch extension needs torch
    imported (seconds, ~180 MB)."""
    compiler = os.environ.get("CXX", "g++")
    # the source's folder and each dependency's: headers are included by bare name
    flags = [*FLAGS, *(f"-I{d}" for d in dict.fromkeys([source.parent, *(p.parent for p in depends)]))]
    if python_module:
        flags.append(f"-I{sysconfig.get_paths()['include']}")
    tag = digest(
        *(p.read_bytes() for p in (source, *depends)),
        sysconfig.get_platform().encode(),
        str(sysconfig.get_config_var("EXT_SUFFIX")).encode(),
        " ".join([compiler, *FLAGS, str(python_module)]).encode(),
    )
    build = cache_root() / f"{name}_{tag}"
    lib = build / f"{name}.so"
    if lib.exists():  # written by rename once complete, so it is whole if it is there
        return lib
    with build_lock(build, what):
        if lib.exists():  # another process built it while we waited
            return lib
        tmp = build / f".{name}.{os.getpid()}.so"
        cmd = [compiler, *flags, str(source), "-o", str(tmp)]
        try:
            done = subprocess.run(cmd, capture_output=True, text=True)
        except OSError as e:  # no compiler at all
            raise RuntimeError(f"could not build {what} ({source}): {e}. It needs a C++ compiler (g++)") from e
        if verbose() or done.returncode:
            print(" ".join(cmd), done.stdout, done.stderr, sep="\n", file=sys.stderr)
        if done.returncode:
            tmp.unlink(missing_ok=True)
            raise RuntimeError(f"could not build {what} ({source}): {done.stderr.strip()[-2000:]}")
        os.replace(tmp, lib)
    return lib
