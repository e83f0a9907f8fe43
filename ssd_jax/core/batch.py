"""A batch of requests as padded host/device arrays with static, bucketed shapes."""
from __future__ import annotations

import math
from dataclasses import dataclass, replace

import jax
import jax.numpy as jnp
import numpy as np

from ssd_jax.config import MAX_LOGPROBS, SamplingParams
from ssd_jax.core.rows import Requests, RowSampling
from ssd_jax.sharding import put


def round_up(x: int, multiple: int) -> int:
    return int(math.ceil(x / multiple) * multiple)


@dataclass(frozen=True)
class Batch:
    """Rows 0..n-1 are real requests; the rest pad the batch to a power of two (copies of row 0
    that stop after one token), so batches of 3 and 4 share one compiled program."""

    n: int
    tokens: jax.Array  # [B, T] right-padded prompts, T a multiple of the prefill bucket
    prompt_len: jax.Array  # [B]
    req: Requests  # sampling, stop ids, budgets per row
    greedy_only: bool  # every row greedy: programs skip softmax and randomness entirely
    max_steps: int  # the largest max_new_tokens of a real row
    # The target's top-N width when a real row asked for log-probabilities, else None: the
    # loops then run the programs that compute none. Always MAX_LOGPROBS when asked (rows keep
    # their own N on the host), so calls asking for different N share one compiled program.
    logprobs: int | None = None
    # A real row asked for its prompt's log-probabilities (then `logprobs` is set too): the
    # prefill scores every prompt position (runner.prefill).
    prompt_logprobs: bool = False
    # A real row asked for a penalty: the target's rows carry token counts (rows.Seen).
    penalties: bool = False

    @property
    def size(self) -> int:
        return self.tokens.shape[0]

    def place(self, sharding) -> "Batch":
        """The batch's arrays put on `sharding` explicitly, so the decode programs never move
        them implicitly (a run under jax.transfer_guard("disallow") stays legal)."""
        if sharding is None:
            return self
        # put: also onto a pod's group mesh, which spans processes
        tokens, prompt_len, req = put((self.tokens, self.prompt_len, self.req), sharding)
        return replace(self, tokens=tokens, prompt_len=prompt_len, req=req)


def padded_shape(lengths: list[int], prefill_bucket: int) -> tuple[int, int]:
    """(rows, prompt length) of a batch of prompts of these lengths: rows padded to a power of
    two, prompts to a multiple of the prefill bucket (the shapes programs compile for)."""
    return 1 << (len(lengths) - 1).bit_length(), round_up(max(lengths), prefill_bucket)


def _seed(p: SamplingParams) -> int:
    if p.seed is not None:
        return p.seed
    if p.temperature == 0:  # greedy rows draw no random numbers
        return 0
    # LLM gives every request a seed; direct callers must too, or sampled rows would share one.
    raise ValueError("SamplingParams.seed is None for a sampled request: give each sampled "
                     "request its own seed before batching (LLM.generate does this)")


def make_batch(ids: list[list[int]], params: list[SamplingParams], stops: list[list[int]],
               prefill_bucket: int) -> Batch:
    n = len(ids)
    B, T = padded_shape([len(t) for t in ids], prefill_bucket)
    ids = list(ids) + [ids[0]] * (B - n)
    params = list(params) + [SamplingParams(max_new_tokens=1, seed=0)] * (B - n)
    stops = list(stops) + [[]] * (B - n)
    tokens = np.zeros((B, T), np.int32)
    for i, t in enumerate(ids):
        tokens[i, :len(t)] = t
    width = max(1, max(len(s) for s in stops))
    stop_ids = np.full((B, width), -1, np.int32)
    for i, s in enumerate(stops):
        stop_ids[i, :len(s)] = s
    # One width per batch, a power of two: batches whose biases differ in size share programs.
    bias_w = 1 << (max(1, max(len(p.logit_bias) for p in params)) - 1).bit_length()
    bias_ids, bias = np.zeros((B, bias_w), np.int32), np.zeros((B, bias_w), np.float32)
    for i, p in enumerate(params):
        for j, (t, v) in enumerate(p.logit_bias):
            bias_ids[i, j], bias[i, j] = t, v
    sampling = RowSampling(
        temperature=jnp.asarray([p.temperature for p in params], jnp.float32),
        top_k=jnp.asarray([p.top_k for p in params], jnp.int32),
        top_p=jnp.asarray([p.top_p for p in params], jnp.float32),
        keys=jax.vmap(jax.random.key)(jnp.asarray([_seed(p) for p in params], jnp.uint32)),
        bias_ids=jnp.asarray(bias_ids), bias=jnp.asarray(bias),
        presence=jnp.asarray([p.presence_penalty for p in params], jnp.float32),
        frequency=jnp.asarray([p.frequency_penalty for p in params], jnp.float32),
        repetition=jnp.asarray([p.repetition_penalty for p in params], jnp.float32),
        min_p=jnp.asarray([p.min_p for p in params], jnp.float32))
    req = Requests(sampling, jnp.asarray(stop_ids),
                   jnp.asarray([p.max_new_tokens for p in params], jnp.int32),
                   jnp.asarray([p.min_tokens for p in params], jnp.int32))
    return Batch(n=n, tokens=jnp.asarray(tokens),
                 prompt_len=jnp.asarray([len(t) for t in ids], jnp.int32), req=req,
                 greedy_only=all(p.temperature == 0 for p in params[:n]),
                 max_steps=max(p.max_new_tokens for p in params[:n]),
                 logprobs=MAX_LOGPROBS if any(p.logprobs is not None or p.prompt_logprobs
                                              is not None for p in params[:n]) else None,
                 prompt_logprobs=any(p.prompt_logprobs is not None for p in params[:n]),
                 penalties=any(p.penalized for p in params[:n]))
