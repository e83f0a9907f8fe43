"""A model's nnx graph as a static argument of jitted programs, hashed once, and its params as
a flat list of arrays.

Both are host time per program call, which a CPU step (~190 ms for the 1.5B target) hides and a
GPU step (~1 ms) does not:
- `jax.jit` hashes and compares every static argument on every call. An nnx GraphDef does that
  by walking its whole node tree in Python: ~340 nodes for a 28-layer model, 7.7 ms per call
  on this CPU. On an H200 every program of both Qwen models took ~5 ms whatever its size.
  `Graph` computes the hash once.
- jit flattens its array arguments on every call. An nnx State flattens through a Python
  callback per Variable (0.45 ms for 339 params here); a list of the same arrays takes 15 us.
  Programs take `ModelRunner.leaves` and `Graph.merge` rebuilds the State inside the trace.
"""
from __future__ import annotations

import jax
from flax import nnx


class Graph:
    """An nnx GraphDef and its params' tree structure, hashed once."""

    __slots__ = ("graphdef", "treedef", "_hash")

    def __init__(self, graphdef: nnx.GraphDef, treedef):
        self.graphdef, self.treedef = graphdef, treedef
        self._hash = hash((graphdef, treedef))

    def merge(self, params: list | nnx.State) -> nnx.Module:
        """The module, from the flat leaves (`ModelRunner.leaves`) or the State itself."""
        if isinstance(params, list):
            params = jax.tree.unflatten(self.treedef, params)
        return nnx.merge(self.graphdef, params)

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other) -> bool:
        # The identity test first: jit compares a cached key with the call's on every hit.
        return self is other or (isinstance(other, Graph) and self._hash == other._hash
                                 and self.treedef == other.treedef
                                 and self.graphdef == other.graphdef)

    def __repr__(self) -> str:
        return f"Graph({type(self.graphdef).__name__}, hash={self._hash:#x})"
