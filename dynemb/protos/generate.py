"""Regenerate the Python code of the protos: ps_pb2.py, ps_pb2_grpc.py and ps_pb2.pyi from
dynemb/protos/ps.proto (the PS wire format), tf_bundle_pb2.py and .pyi from dynemb/protos/tf_bundle.proto
(TensorFlow's checkpoint records, read by dynemb/tf/bundle.py).

    python -m dynemb.protos.generate            # write them beside the .proto files
    python -m dynemb.protos.generate --out DIR  # write them under DIR/dynemb/protos/ (the test compares)

Run from the repository root; needs grpcio-tools (in the `test` extra), pinned to the
grpcio version so the generated code matches the runtime.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]  # the repository root: protoc names the files from it
# proto → (generated files, whether it has a gRPC service)
PROTOS = {
    "dynemb/protos/ps.proto": (("ps_pb2.py", "ps_pb2_grpc.py", "ps_pb2.pyi"), True),
    "dynemb/protos/tf_bundle.proto": (("tf_bundle_pb2.py", "tf_bundle_pb2.pyi"), False),
}
PROTO = "dynemb/protos/ps.proto"
GENERATED = tuple(name for names, _ in PROTOS.values() for name in names)


def generate(out_dir: Path) -> list[Path]:
    """Run protoc on the project's protos.

    Args:
        out_dir: the root to write dynemb/protos/*_pb2*.py under.

    Returns:
        The files written.

    Raises:
        RuntimeError: protoc failed.
    """
    import grpc_tools
    from grpc_tools import protoc  # imported here: only the build and the test need it

    out_dir.mkdir(parents=True, exist_ok=True)
    include = os.path.join(os.path.dirname(grpc_tools.__file__), "_proto")
    written = []
    for proto, (names, grpc) in PROTOS.items():
        args = ["protoc", f"-I{ROOT}", f"-I{include}", f"--python_out={out_dir}", f"--pyi_out={out_dir}"]
        if grpc:
            args.append(f"--grpc_python_out={out_dir}")
        if protoc.main([*args, str(ROOT / proto)]) != 0:
            raise RuntimeError(f"protoc failed on {proto}")
        written += [out_dir / "dynemb" / "protos" / name for name in names]
    return written


def main(argv: list[str] | None = None) -> int:
    """`python -m dynemb.protos.generate`: regenerate the protos' Python modules; exit status."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--out", type=Path, default=ROOT, help="root to write dynemb/protos/*.py under (default: the repo)"
    )
    args = parser.parse_args(argv)
    for path in generate(args.out):
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
