"""The PS wire format (ps.proto) and its generated Python code (checked in).

Regenerate after editing ps.proto with `python -m dynemb.protos.generate`;
tests/ps_server/test_protos.py fails when the checked-in code does not match the .proto.
"""
