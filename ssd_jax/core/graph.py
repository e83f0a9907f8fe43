"""A model's nnx graph as a static argument of jitted programs, hashed once.

`jax.jit` hashes every static argument on every call to find the compiled program. An nnx
GraphDef hashes by walking its whole node tree in Python: ~340 nodes for a 28-layer model, ~5 ms
on this CPU. That is noise beside a 186 ms CPU step but the whole of a ~1 ms GPU step (measured
on an H200: every program of both Qwen models took ~5 ms whatever its size). `Graph` computes the
hash once; equal graphs still compare equal, so two runners of one architecture share programs.
"""
from __future__ import annotations

from flax import nnx


class Graph:
    """An nnx GraphDef with its hash computed once; `merge(params)` rebuilds the module."""

    __slots__ = ("graphdef", "_hash")

    def __init__(self, graphdef: nnx.GraphDef):
        self.graphdef = graphdef
        self._hash = hash(graphdef)

    def merge(self, params) -> nnx.Module:
        return nnx.merge(self.graphdef, params)

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other) -> bool:
        # The identity test first: jit compares a cached key with the call's on every hit.
        return self is other or (isinstance(other, Graph) and self._hash == other._hash
                                 and self.graphdef == other.graphdef)

    def __repr__(self) -> str:
        return f"Graph({type(self.graphdef).__name__}, hash={self._hash:#x})"


def split(model: nnx.Module) -> tuple[Graph, nnx.State]:
    """nnx.split, with the graph wrapped for cheap static hashing."""
    graphdef, params = nnx.split(model)
    return Graph(graphdef), params
