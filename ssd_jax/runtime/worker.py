"""A decode worker process: the target role (AR, SD and SSD's target side) or the draft role
(SSD's draft side). Started and stopped by `ssd_jax.runtime.pool.WorkerPool`, never by hand:

    python -m ssd_jax.runtime.worker --role target|draft --address HOST:PORT --coordinator HOST:PORT
                             --target MODEL --draft MODEL [--core N] [--dtype float32]

The process pins itself to one core before JAX starts (XLA:CPU would otherwise spread every
computation over all cores and the two roles would fight for them), asks the kernel to kill it
when its parent dies (no orphans), joins `jax.distributed`, loads its models, then serves
requests from the parent over an authenticated local connection.
"""
from __future__ import annotations

import argparse
import os
import sys
import traceback

from ssd_jax.runtime.procs import die_with_parent, pin_process
from ssd_jax.xla_cpu import prefer_wide_vectors


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m ssd_jax.runtime.worker")
    ap.add_argument("--role", choices=["target", "draft"], required=True)
    ap.add_argument("--address", required=True)
    ap.add_argument("--coordinator", required=True)
    ap.add_argument("--target", required=True)
    ap.add_argument("--draft", required=True)
    ap.add_argument("--core", type=int, default=None)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--draft-vocab", type=int, default=None)
    ap.add_argument("--no-cpu-kernels", dest="cpu_kernels", action="store_false")
    ap.add_argument("--draft-precision", choices=["fp32", "bf16"], default="fp32")
    args = ap.parse_args(argv)
    die_with_parent()
    prefer_wide_vectors()  # before JAX starts its backend
    if args.core is not None and hasattr(os, "sched_setaffinity"):
        pin_process({args.core})
    from multiprocessing.connection import Client
    host, port = args.address.rsplit(":", 1)
    conn = Client((host, int(port)), authkey=os.environ["SSD_JAX_WORKER_KEY"].encode())
    try:
        import jax
        jax.config.update("jax_platforms", "cpu")
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        from ssd_jax import compile_cache
        if compile_cache.enable():  # the directory the caller passed in the environment
            compile_cache.write_from_any_process()  # the draft worker is process 1
        role_id = 0 if args.role == "target" else 1
        jax.distributed.initialize(coordinator_address=args.coordinator, num_processes=2,
                                   process_id=role_id, initialization_timeout=120)
        server = _Server(args, conn)
        conn.send(("ready", args.role, server.layout()))
        server.serve()
    except (EOFError, KeyboardInterrupt):
        return 0
    except Exception:
        try:
            conn.send(("error", traceback.format_exc()))
        except OSError:
            pass
        return 1
    return 0


class _Server:
    def __init__(self, args, conn):
        import jax
        import numpy as np
        from jax.sharding import Mesh, NamedSharding
        from jax.sharding import PartitionSpec as P
        from ssd_jax.sharding import TP
        from ssd_jax.loading import pair_vocab
        from ssd_jax.loading import describe, load
        from ssd_jax.core.transport import Exchange
        from ssd_jax.core.runner import ModelRunner
        from ssd_jax.draft_vocab import draft_for
        self.role, self.conn = args.role, conn
        # This side's devices: every local device, tensor-parallel (a GPU host per side); with
        # one device the runners keep the plain single-device path.
        local = jax.local_devices()
        self.mesh = Mesh(np.array(local), (TP,)) if len(local) > 1 else None
        self.replicated = None if self.mesh is None else NamedSharding(self.mesh, P())
        target = describe(args.target, dtype=args.dtype)
        self.vocab = pair_vocab(target, describe(args.draft, dtype=args.dtype), args.draft_vocab)
        self.vocab_size = target[0].vocab_size
        # The target role needs the draft only for SD: load it then, not for AR/SSD, so the two
        # processes together hold each model once (a 1.5B + 0.5B pair is ~9.6 GB in fp32).
        self._load_draft = lambda: ModelRunner(
            draft_for(load(args.draft, dtype=args.dtype)[0], self.vocab), self.mesh,
            args.cpu_kernels, args.draft_precision)
        self._draft = self._load_draft() if self.role == "draft" else None
        self.target = None
        if self.role == "target":
            self.target = ModelRunner(load(args.target, dtype=args.dtype)[0], self.mesh,
                                      args.cpu_kernels)
        self.exchange = Exchange(self.replicated)
        self.live = None  # this side of a continuous batch (runtime/pool_live.py), if open

    @property
    def draft(self):
        if self._draft is None:
            self._draft = self._load_draft()
        return self._draft

    def layout(self) -> dict:
        """This side's devices and how its model's MLP is split (for checks and logs)."""
        runner = self.target if self.target is not None else self.draft
        kernel = runner.params["layers"][0]["mlp"]["gate_proj"]["kernel"].get_value()
        return {"devices": len(self.mesh.devices.flat) if self.mesh is not None else 1,
                "mlp_columns_per_device": kernel.addressable_shards[0].data.shape[1]}

    def serve(self):
        while True:
            msg = self.conn.recv()
            if msg[0] == "stop":
                return
            if msg[0] == "costs":
                self.conn.send(("costs", self.step_costs(**msg[1])))
                continue
            if msg[0] == "probs":
                self.conn.send(("probs", self.probs(**msg[1])))
                continue
            if msg[0] == "live":
                reply = self.live_call(msg[1])
                # The target answers each call but the end; the draft side's results stay here.
                if self.role == "target" and msg[1]["op"] != "end":
                    self.conn.send(("live", reply))
                continue
            self.conn.send(self.run(msg[1]))

    def step_costs(self, rows: int, tokens) -> dict:
        """This side's forward cost per token count (autotune): the target scores, the draft
        runs its glue and tree steps."""
        from ssd_jax.autotune import time_scoring
        runner = self.target if self.role == "target" else self.draft
        return time_scoring(runner, rows, tokens)

    def probs(self, tokens, temperature: float, top_k: int, top_p: float, last: int | None,
              min_p: float = 0.0):
        """saguaro_curve's calibration. The target: sample `last` tokens after `tokens`, return
        them and its probabilities for them; the draft: its probabilities for the last `last`
        tokens of `tokens`."""
        from ssd_jax.saguaro_curve import target_calibration, teacher_forced_probs
        if self.role == "target":
            return target_calibration(self.target, tokens, temperature, top_k, top_p, last,
                                      self.replicated, min_p)
        return teacher_forced_probs(self.draft, tokens, temperature, top_k, top_p, self.vocab,
                                    last=last, min_p=min_p)

    def live_call(self, msg: dict):
        """One call on this side of a continuous batch (runtime/pool_live.py): the parent
        makes it on both workers in one order, so the two sides meet in each exchange. Returns
        the call's result and the free slots after it (the target's; None on the draft)."""
        from ssd_jax.config import SamplingParams
        op = msg["op"]
        if op == "open":
            self.live = None  # a batch the parent abandoned goes first (its caches)
            self.live = self._open_live(msg)
            out = self.live.slots
        elif op == "end":
            self.live = None
            return None, None
        elif self.live is None:
            raise RuntimeError(f"live-batch call {op!r} before the batch was opened")
        elif op == "join":
            out = self.live.join(msg["slot"], msg["ids"], SamplingParams(**msg["params"]),
                                 msg["stops"], msg["logprobs"], msg["prompt_logprobs"])
        elif op == "leave":
            out = self.live.leave(msg["slot"])
        elif op == "step":
            out = self.live.step(msg["logprobs"])
        else:
            raise ValueError(f"unknown live-batch call {op!r} from the parent")
        return out, (self.live.free_slots() if self.role == "target" else None)

    def _open_live(self, msg: dict):
        """This side of a continuous batch of `slots` rows: in SSD each worker holds one side
        and the two meet over CollectiveLinks (the batch's and a joining row's), as a pod's
        processes do; AR and SD run in the target worker alone."""
        from ssd_jax.config import SpecConfig
        from ssd_jax.core.batch import padded_shape
        from ssd_jax.core.live import LiveBatch
        from ssd_jax.core.transport import DRAFT, TARGET, CollectiveLink
        mode, spec, bucket = msg["mode"], SpecConfig(**msg["spec"]), msg["prefill_bucket"]
        links = {}
        if mode == "ssd":
            rows = padded_shape([1] * msg["slots"], bucket)[0]
            role = DRAFT if self.role == "draft" else TARGET
            links = {name: CollectiveLink(self.exchange, role, b, spec.k, self.vocab_size,
                                          msg["greedy_only"])
                     for name, b in (("link", rows), ("join_link", 1))}
        target = self.target if self.role == "target" else None
        draft = None if mode == "ar" or (mode == "ssd") != (self.role == "draft") else self.draft
        return LiveBatch(mode, target, draft, self.vocab, slots=msg["slots"],
                         seq_len=msg["seq_len"], prefill_bucket=bucket, spec=spec,
                         side=self.role if mode == "ssd" else None,
                         shardings=(self.replicated, self.replicated),
                         greedy_only=msg["greedy_only"], penalties=msg["penalties"], **links)

    def run(self, req: dict):
        """One request: this side's loop of the mode, over the same core functions as the
        single-process driver; the transport is a collective with the other worker."""
        from ssd_jax.config import SamplingParams, SpecConfig
        from ssd_jax.core.batch import make_batch
        from ssd_jax.core.metrics import RunMetrics
        from ssd_jax.core.rounds import DraftSide, TargetSide, ar_loop, sd_loop, ssd_loop
        from ssd_jax.core.transport import DRAFT, TARGET, CollectiveLink
        params = [SamplingParams(**p) for p in req["params"]]
        batch = make_batch(req["ids"], params, req["stops"], req["prefill_bucket"])
        batch = batch.place(self.replicated)
        spec = SpecConfig(**req["spec"])
        mode, seq_len, sync_every = req["mode"], req["seq_len"], req["sync_every"]
        metrics = RunMetrics(mode=mode, batch=batch.n, k=spec.k if mode != "ar" else 0,
                             sync_phases=True)
        if mode == "ssd":
            link = CollectiveLink(self.exchange, DRAFT if self.role == "draft" else TARGET,
                                  batch.size, spec.k, self.vocab_size, batch.greedy_only)
        if self.role == "draft":
            side = DraftSide.create(self.draft, self.vocab, batch, spec, seq_len,
                                    self.exchange.place)
            for _ in ssd_loop(None, side, link, metrics, sync_every, timed=True):
                pass
            return ("done", side.stats.to_dict())
        target = TargetSide(self.target, batch, self.target.new_cache(batch.size, seq_len))
        if mode == "ar":
            chunks = ar_loop(target, metrics, sync_every)
        elif mode == "sd":
            chunks = sd_loop(target, self.draft, self.vocab,
                             self.draft.new_cache(batch.size, seq_len), metrics, sync_every)
        else:
            chunks = ssd_loop(target, None, link, metrics, sync_every, timed=True)
        for chunk in chunks:
            self.conn.send(("chunk", chunk))
        return ("done", metrics.to_dict())


if __name__ == "__main__":
    sys.exit(main())
