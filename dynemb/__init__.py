"""dynemb: dynamic-embedding training for recommendation models.

Parts: `dynemb.idtransformer` (global ID -> slot of a bounded table), `dynemb.ps_server`
(the parameter server and its client), `dynemb.trainer` (TorchRec training behind dynamic
tables), `dynemb.protos` (the wire format); `dynemb.common` is what they share and
`dynemb.cli` the `dynemb` command on top. `dynemb.testing` starts PS and Redis processes
for tests and benchmarks; nothing of the runtime imports it.
"""

from dynemb.common.version import __version__

__all__ = ["__version__"]
