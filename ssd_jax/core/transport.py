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

    def swap(self, x: jax.Array, sender: int | None = None) -> jax.Array:
        """Send `x`, get the other process's buffer (`sender`: unused, both send)."""
        x = jax.device_put(jnp.asarray(x).reshape(1, -1), self.lead)
        g = jax.make_array_from_single_device_arrays((2, x.shape[1]), self.sharding, [x])
        return self.place(self._swap(g).addressable_shards[0].data[0])


class GroupExchange:
    """Messages between two process groups of one `jax.distributed` job (a pod): the target
    group's processes hold the target mesh, the draft group's the draft mesh, each possibly
    spanning several processes.

    A message is one jitted collective over every device of both meshes: each device holds a
    row, the sending group's first device the message and every other device zeros, and a psum
    leaves the message on every device (adding zeros is exact, for floats too). Each process
    then reassembles, from its own devices' rows, the message replicated over its group's mesh:
    no array crosses devices outside the collective (the decode loop may run under
    jax.transfer_guard_device_to_device("disallow")), and no process outside the two groups
    takes part.
    """

    def __init__(self, target_mesh: Mesh, draft_mesh: Mesh):
        devices = list(target_mesh.devices.flat) + list(draft_mesh.devices.flat)
        if len({d.id for d in devices}) != len(devices):
            raise ValueError("the target and draft meshes share devices: a pod needs disjoint "
                             "groups (see sharding.plan_split)")
        self.mesh = Mesh(np.array(devices), ("p",))
        self.sharding = NamedSharding(self.mesh, P("p"))
        me = jax.process_index()
        self.local = [d for d in devices if d.process_index == me]  # in mesh order
        self.meshes = {TARGET: target_mesh, DRAFT: draft_mesh}
        self.role = (TARGET if any(d.process_index == me for d in target_mesh.devices.flat)
                     else DRAFT)
        self.home = NamedSharding(self.meshes[self.role], P())
        home = {d.id for d in self.meshes[self.role].devices.flat}
        self.home_devices = [d for d in self.local if d.id in home]
        self.first = {TARGET: 0, DRAFT: len(target_mesh.devices.flat)}  # senders' row index

        @partial(jax.jit, static_argnames=("src",))
        def bcast(x, src: int):
            @partial(jax.shard_map, mesh=self.mesh, in_specs=P("p"), out_specs=P("p"))
            def one(x):
                mine = jax.lax.axis_index("p") == src
                return jax.lax.psum(jnp.where(mine, x, jnp.zeros_like(x)), "p")
            return one(x)

        self._bcast = bcast

    def place(self, tree):
        """Host-made arrays onto this process's group mesh, replicated."""
        from ssd_jax.sharding import put
        return put(tree, self.home)

    def open(self) -> None:
        """Make the link's first exchange now, while every process of both groups is at the
        same point (Engine start-up, after pod.meet). On CPU that first collective sets up
        gloo's context, which gives up after 30 s if a peer has not arrived; later exchanges
        wait as long as it takes. Opened lazily instead, the first round's exchange failed
        whenever one group was still loading its model 30 s after the other had finished (a
        1.5B target beside a 0.5B draft, each on one core)."""
        self.swap(jnp.zeros((1,), jnp.int32), TARGET)

    def swap(self, x: jax.Array, sender: int) -> jax.Array:
        """The sending group passes the message (replicated over its mesh), the other group
        zeros of its shape; every process gets the message replicated over its group's mesh."""
        x = jnp.asarray(x)
        n = x.size
        if len(x.sharding.device_set) > 1:
            if not x.is_fully_replicated:  # every local device needs the whole message
                x = jax.device_put(x, self.home)
            by_device = {s.device.id: s.data for s in x.addressable_shards}
            rows = [by_device[d.id].reshape(1, n) for d in self.local]
        else:  # a single-device (or host) value: one explicit put per local device
            rows = [jax.device_put(x.reshape(1, n), d) for d in self.local]
        g = jax.make_array_from_single_device_arrays((len(self.mesh.devices), n),
                                                     self.sharding, rows)
        # Synchronous: with several CPU devices per process, a 4-process job hung after a few
        # rounds when this collective was in flight beside the target's TP collectives (found
        # by tests/test_pod.py); waiting here keeps one cross-process program in flight.
        g.block_until_ready()
        out = self._bcast(g, src=self.first[sender])
        out.block_until_ready()
        mine = {s.device.id: s.data for s in out.addressable_shards}
        return jax.make_array_from_single_device_arrays(
            (n,), self.home, [mine[d.id].reshape(n) for d in self.home_devices])


# Packing and unpacking are jitted: one dispatch each, and no eager slicing, whose index
# arrays would be moved onto a multi-device mesh implicitly (a transfer-guard violation).
@jax.jit
def _pack_outcome(outcome: Outcome) -> jax.Array:
    return jnp.concatenate([outcome.n.astype(jnp.int32), outcome.t.astype(jnp.int32)])


@partial(jax.jit, static_argnames=("b",))
def _unpack_outcome(buf: jax.Array, b: int) -> Outcome:
    return Outcome(buf[:b], buf[b:])


@jax.jit
def _pack_spec(tokens: jax.Array, point_mass: jax.Array, hit: jax.Array) -> jax.Array:
    return jnp.concatenate([tokens.reshape(-1), point_mass.astype(jnp.int32),
                            hit.astype(jnp.int32)])


@partial(jax.jit, static_argnames=("b", "k"))
def _unpack_spec(buf: jax.Array, q: jax.Array | None, b: int, k: int) -> Speculation:
    return Speculation(tokens=buf[:b * k].reshape(b, k), q=q,
                       point_mass=buf[b * k:b * k + b].astype(bool),
                       hit=buf[b * k + b:].astype(bool))


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
            self.ex.swap(_pack_outcome(outcome), TARGET)
            return None
        return _unpack_outcome(self.ex.swap(self._outcome_zeros, TARGET), b=self.B)

    def speculation(self, spec: Speculation | None) -> Speculation | None:
        B, K = self.B, self.K
        if self.role == DRAFT:
            self.ex.swap(_pack_spec(spec.tokens, spec.point_mass, spec.hit), DRAFT)
            if not self.greedy_only:
                self.ex.swap(spec.q.reshape(-1).astype(jnp.float32), DRAFT)
            return None
        buf = self.ex.swap(self._spec_zeros, DRAFT)
        q = None if self.greedy_only else self.ex.swap(self._q_zeros, DRAFT).reshape(
            B, K, self.V)
        return _unpack_spec(buf, q, b=B, k=K)
