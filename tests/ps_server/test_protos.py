"""The checked-in generated code (dynemb/protos/*_pb2*.py, .pyi) is exactly what dynemb/protos/*.proto generate."""

from __future__ import annotations

from dynemb.protos import generate, ps_pb2


def test_checked_in_generated_code_matches_the_proto(tmp_path):
    paths = generate.generate(tmp_path)
    assert sorted(p.name for p in paths) == [
        "ps_pb2.py",
        "ps_pb2.pyi",
        "ps_pb2_grpc.py",
        "tf_bundle_pb2.py",
        "tf_bundle_pb2.pyi",
    ]
    for path in paths:
        checked_in = generate.ROOT / "dynemb" / "protos" / path.name
        fresh, kept = path.read_bytes(), checked_in.read_bytes()
        assert fresh, f"protoc wrote an empty {path.name}"
        assert fresh == kept, (
            f"{checked_in} differs from what its .proto generates: run `python -m dynemb.protos.generate`"
        )


def test_generated_module_describes_the_proto_service():
    # the imported module is the checked-in one, and it carries every rpc of ps.proto
    proto_text = (generate.ROOT / generate.PROTO).read_text()
    service = ps_pb2.DESCRIPTOR.services_by_name["ParameterServer"]
    names = [m.name for m in service.methods]
    assert names and all(f"rpc {name}(" in proto_text for name in names)
    assert proto_text.count("  rpc ") == len(names)
    assert ps_pb2.DESCRIPTOR.package == "dynemb.ps.v1"


def test_generate_command_line(tmp_path, capsys):
    assert generate.main(["--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    for name in generate.GENERATED:
        assert f"wrote {tmp_path / 'dynemb' / 'protos' / name}" in out
        assert (tmp_path / "dynemb" / "protos" / name).read_bytes() == (
            generate.ROOT / "dynemb" / "protos" / name
        ).read_bytes()
