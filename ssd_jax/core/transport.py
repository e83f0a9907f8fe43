"""The transport of an SSD round: the two messages between the target side and the draft side.

  outcome      target -> draft   (n accepted, t emitted) per row, after verification
  speculation  draft -> target   the next K tokens (+ q, point-mass and hit flags)

`LocalLink`: both sides in this process on disjoint devices; a message is an explicit
device_put (asynchronous: the host only enqueues it). `CollectiveLink`: each side in its own
process under `jax.distributed`; a message is a jitted collective (`Exchange.swap`) that both
processes call at the same point of the round, the sender with the message, the receiver with
zeros of its shape. Either way the round (rounds.py) is the same code.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from ssd_jax.core.speculation import Outcome, Speculation

TARGET, DRAFT = 0, 1


@dataclass(frozen=True)
class LocalLink:
    """One process. `target` / `draft`: each side's replicated sharding (None: one device)."""

    target: jax.sharding.Sharding | None = None
    draft: jax.sharding.Sharding | None = None

    def to_target(self, tree):
        return tree if self.target is None else jax.device_put(tree, self.target)

    def to_draft(self, tree):
        return tree if self.draft is None else jax.device_put(tree, self.draft)

    def outcome(self, outcome: Outcome) -> Outcome:
        return self.to_draft(outcome)

    def speculation(self, spec: Speculation) -> Speculation:
        return self.to_target(spec)


class Exchange:
    """Swap equal-shaped int32/float32 buffers between process 0 (target) and process 1 (draft).

    Each process may own several devices (a tensor-parallel target slice, a draft host): the
    swap runs between the two processes' first devices, and what arrives is put, explicitly,
    on `local` (this side's replicated sharding) so this side's programs can read it. A round
    trip costs one small collective (~1.3 ms on localhost with gloo, measured); the device
    arrays never pass through the host on GPU/TPU interconnects.
    """

    def __init__(self, local: jax.sharding.Sharding | None = None):
        if jax.process_count() != 2:
            raise RuntimeError(f"the multi-controller exchange needs 2 processes (target, draft), "
                               f"found {jax.process_count()}")
        leads = [min((d for d in jax.devices() if d.process_index == p), key=lambda d: d.id)
                 for p in range(2)]
        self.mesh = Mesh(np.array(leads), ("p",))
        self.lead = leads[jax.process_index()]
        self.local = local
        self.sharding = NamedSharding(self.mesh, P("p"))

        @jax.jit
        @partial(jax.shard_map, mesh=self.mesh, in_specs=P("p"), out_specs=P("p"))
        def swap(x):
            return jax.lax.ppermute(x, "p", perm=[(0, 1), (1, 0)])

        self._swap = swap

    def place(self, tree):
        """This side's arrays (created on its default device) onto its devices."""
        return tree if self.local is None else jax.device_put(tree, self.local)

    def swap(self, x: jax.Array) -> jax.Array:
        x = jax.device_put(jnp.asarray(x).reshape(1, -1), self.lead)
        g = jax.make_array_from_single_device_arrays((2, x.shape[1]), self.sharding, [x])
        return self.place(self._swap(g).addressable_shards[0].data[0])


class CollectiveLink:
    """One side of the round in each process. Shapes are fixed per run: B rows, K tokens, q over
    the target's V (absent when every row is greedy)."""

    def __init__(self, exchange: Exchange, role: int, batch: int, k: int, vocab_size: int,
                 greedy_only: bool):
        self.ex, self.role = exchange, role
        self.B, self.K, self.V, self.greedy_only = batch, k, vocab_size, greedy_only
        self._outcome_zeros = exchange.place(jnp.zeros((2 * batch,), jnp.int32))
        self._spec_zeros = exchange.place(jnp.zeros((batch * k + 2 * batch,), jnp.int32))
        self._q_zeros = None if greedy_only else exchange.place(
            jnp.zeros((batch * k * vocab_size,), jnp.float32))

    def to_target(self, tree):
        return self.ex.place(tree)

    to_draft = to_target  # each process holds one side: "here" is that side's devices

    def outcome(self, outcome: Outcome | None) -> Outcome | None:
        if self.role == TARGET:
            self.ex.swap(jnp.concatenate([outcome.n.astype(jnp.int32),
                                          outcome.t.astype(jnp.int32)]))
            return None
        buf = self.ex.swap(self._outcome_zeros)
        return Outcome(buf[:self.B], buf[self.B:])

    def speculation(self, spec: Speculation | None) -> Speculation | None:
        B, K = self.B, self.K
        if self.role == DRAFT:
            self.ex.swap(jnp.concatenate([spec.tokens.reshape(-1), spec.point_mass.astype(
                jnp.int32), spec.hit.astype(jnp.int32)]))
            if not self.greedy_only:
                self.ex.swap(spec.q.reshape(-1).astype(jnp.float32))
            return None
        buf = self.ex.swap(self._spec_zeros)
        q = None if self.greedy_only else self.ex.swap(self._q_zeros).reshape(B, K, self.V)
        return Speculation(tokens=buf[:B * K].reshape(B, K), q=q,
                           point_mass=buf[B * K:B * K + B].astype(bool),
                           hit=buf[B * K + B:].astype(bool))
