"""Regenerate protos/ps_pb2.py, ps_pb2_grpc.py and ps_pb2.pyi from protos/ps.proto.

    python -m protos.generate            # write them beside ps.proto
    python -m protos.generate --out DIR  # write them under DIR/protos/ (the test compares)

Run from the repository root; needs grpcio-tools (in the `test` extra), pinned to the
grpcio version so the generated code matches the runtime.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTO = "protos/ps.proto"
GENERATED = ("ps_pb2.py", "ps_pb2_grpc.py", "ps_pb2.pyi")


def generate(out_dir: Path) -> list[Path]:
    from grpc_tools import protoc  # imported here: only the build and the test need it
    import grpc_tools

    out_dir.mkdir(parents=True, exist_ok=True)
    include = os.path.join(os.path.dirname(grpc_tools.__file__), "_proto")
    args = [
        "protoc",
        f"-I{ROOT}",
        f"-I{include}",
        f"--python_out={out_dir}",
        f"--pyi_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        str(ROOT / PROTO),
    ]
    if protoc.main(args) != 0:
        raise RuntimeError(f"protoc failed on {PROTO}")
    return [out_dir / "protos" / name for name in GENERATED]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=ROOT, help="root to write protos/*.py under (default: the repo)")
    args = parser.parse_args(argv)
    for path in generate(args.out):
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
