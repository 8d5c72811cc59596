"""Optimizer slots and variable names of TF2 object-based checkpoints (and SavedModels), from
the object graph.

A TF2 checkpoint stores, under _CHECKPOINTABLE_OBJECT_GRAPH, the graph of objects saved:
each node's children (by local name), the tensors it holds (checkpoint keys), and, on an
optimizer node, its slot variables. Two kinds of optimizer show up:

- tf.compat.v1 and Keras 2 optimizers list `slot_variables` (original variable node, slot
  name, slot variable node); slot names are accumulator (Adagrad), m and v (Adam).
- Keras 3 optimizers keep parallel lists: `_trainable_variables` [var0, var1, ...] and one
  list per slot kind (`_accumulators` of Adagrad, `_momentums` and `_velocities` of Adam),
  whose i-th entry belongs to the i-th trainable variable.

slots() returns {variable key: {canonical slot name: slot key}}.

A variable's checkpoint key is the first path to it found breadth-first, which may say little:
a Keras model saved with tf.train.Checkpoint(model=..., optimizer=...) has its variables under
optimizer/_trainable_variables/N (three steps from the root) rather than under
model/_operations/2/_embeddings (four). variables() returns, per key, what else the graph
knows: the variable's own name (its `full_name`; Keras 3: the layer path, user_emb/embeddings)
and the other object paths that lead to it.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from google.protobuf.message import DecodeError

from dynemb.protos import tf_bundle_pb2 as pb
from dynemb.tf.errors import TFMigrationError

# slot names → dynemb's canonical ones (accumulator, m, v); others keep their own name
SLOT_NAMES = {"accumulator": "accumulator", "m": "m", "v": "v", "momentum": "momentum"}
KERAS3_LISTS = {"_accumulators": "accumulator", "_momentums": "m", "_velocities": "v"}


def _value_key(node: pb.TrackableObjectGraph.TrackableObject) -> str | None:
    for attr in node.attributes:
        if attr.name == "VARIABLE_VALUE":
            return attr.checkpoint_key
    return None


def parse(graph_bytes: bytes, path: str) -> pb.TrackableObjectGraph:
    """The object graph stored under _CHECKPOINTABLE_OBJECT_GRAPH.

    Raises:
        TFMigrationError: it does not parse.
    """
    graph = pb.TrackableObjectGraph()
    try:
        graph.ParseFromString(graph_bytes)
    except DecodeError:
        raise TFMigrationError(f"{path}: the object graph (_CHECKPOINTABLE_OBJECT_GRAPH) does not parse") from None
    return graph


@dataclass(frozen=True)
class VariableNames:
    """What the object graph calls a variable besides its checkpoint key."""

    name: str  # its own name (tf.Variable name; Keras 3: the variable's path, layer/variable)
    paths: tuple[str, ...]  # object paths to it other than its key's, shortest first


def _escape(local_name: str) -> str:
    """A local name as checkpoint keys spell it (TensorFlow escapes '.' and '/')."""
    return local_name.replace(".", "..").replace("/", ".S")


def variables(graph: pb.TrackableObjectGraph) -> dict[str, VariableNames]:
    """{checkpoint key of a variable: its VariableNames}.

    Each other path is the first path to one of the variable's parents plus the edge from it:
    one per parent, so a graph with cycles (a Keras model tracks its optimizer) stays finite.
    """
    nodes = graph.nodes
    first = {0: ""}  # node → its first path breadth-first, the one its keys are built from
    queue = deque([0])
    while queue:
        node = queue.popleft()
        for c in nodes[node].children:
            if c.node_id not in first and 0 <= c.node_id < len(nodes):
                first[c.node_id] = f"{first[node]}/{_escape(c.local_name)}".lstrip("/")
                queue.append(c.node_id)
    paths: dict[int, list[str]] = {}
    for node in sorted(first):
        for c in nodes[node].children:
            if 0 <= c.node_id < len(nodes):
                paths.setdefault(c.node_id, []).append(f"{first[node]}/{_escape(c.local_name)}".lstrip("/"))
    out = {}
    for node_id, node in enumerate(nodes):
        key = _value_key(node)
        if key is None:
            continue
        full_name = next(a.full_name for a in node.attributes if a.name == "VARIABLE_VALUE")
        own = key.removesuffix("/.ATTRIBUTES/VARIABLE_VALUE")
        others = sorted({p for p in paths.get(node_id, ()) if p != own}, key=lambda p: (p.count("/"), p))
        out[key] = VariableNames(full_name.removesuffix(":0"), tuple(others))
    return out


def slots(graph: pb.TrackableObjectGraph) -> dict[str, dict[str, str]]:
    """{variable key: {canonical slot name (accumulator, m, v...): slot key}}."""
    nodes = graph.nodes

    def key_of(node_id: int) -> str | None:
        return _value_key(nodes[node_id]) if 0 <= node_id < len(nodes) else None

    out: dict[str, dict[str, str]] = {}
    for node in nodes:
        for ref in node.slot_variables:
            var, slot = key_of(ref.original_variable_node_id), key_of(ref.slot_variable_node_id)
            if var and slot:
                out.setdefault(var, {})[SLOT_NAMES.get(ref.slot_name, ref.slot_name)] = slot
        children = {c.local_name: c.node_id for c in node.children}
        if "_trainable_variables" not in children:
            continue
        # Keras 3: _momentums and _velocities are Adam's m and v only when both are there and
        # the optimizer is Adam-like (RMSprop keeps the same two lists for other quantities).
        lists = {name: kind for name, kind in KERAS3_LISTS.items() if name in children}
        if "m" in lists.values() and not ({"_momentums", "_velocities"} <= set(lists) and _is_adam(nodes, children)):
            lists = {n: k for n, k in lists.items() if k == "accumulator"}
        variables = [key_of(c.node_id) for c in nodes[children["_trainable_variables"]].children]
        for list_name, kind in lists.items():
            members = [key_of(c.node_id) for c in nodes[children[list_name]].children]
            for var, slot in zip(variables, members):
                if var and slot:
                    out.setdefault(var, {})[kind] = slot
    return out


def _is_adam(nodes, children: dict[str, int]) -> bool:
    """Keras 3 names an optimizer's variables '<optimizer name>/...' (adam/iteration...)."""
    for list_name in ("_momentums", "_velocities"):
        for c in nodes[children[list_name]].children:
            for attr in nodes[c.node_id].attributes:
                return "adam" in attr.full_name.split("/")[0].lower()
    return False
