"""A truncated draft vocabulary, and the draft model that speaks target ids.

The draft's LM head is the largest matmul of a small model, so the draft predicts only the
V_draft - 1 most frequent target tokens plus one reserved OOV slot (the last id) that absorbs
every other token during training. Handed to verification, the draft's distribution must be a
proper distribution over the *target* vocabulary: `target_logits` gathers the draft logits to
their target ids and puts -inf everywhere else, the OOV slot included, so softmax gives zero
probability outside the draft vocabulary and renormalises over the tokens the draft can name.
Losslessness is untouched: verification only needs q(x) > 0 wherever the draft proposes x.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import jax.numpy as jnp
import numpy as np
from flax import nnx
from jaxtyping import Array, Bool, Float, Int, Shaped

from ssd_jax.config import ModelConfig
from ssd_jax.models.transformer import KVCache, Linear, Transformer


@dataclass(frozen=True, eq=False)
class VocabMap:
    """to_draft: int32[V_target], target id -> draft id (`oov` for tokens outside the draft vocab).
    to_target: int32[V_draft], draft id -> target id; to_target[oov] = -1 (names no target token).
    """

    to_draft: np.ndarray
    to_target: np.ndarray

    @classmethod
    def from_target_ids(cls, target_ids, target_vocab_size: int) -> "VocabMap":
        """Draft ids 0..n-1 are `target_ids` in the given order; draft id n is the OOV slot."""
        ids = np.asarray(target_ids, np.int64)
        if len(set(ids.tolist())) != len(ids):
            raise ValueError("target_ids has duplicates: each target token may appear once")
        if ids.size and not (0 <= ids.min() and ids.max() < target_vocab_size):
            raise ValueError(f"target_ids must lie in [0, {target_vocab_size}): got "
                             f"[{ids.min()}, {ids.max()}]")
        oov = len(ids)
        to_draft = np.full(target_vocab_size, oov, np.int32)
        to_draft[ids] = np.arange(oov, dtype=np.int32)
        return cls(to_draft, np.concatenate([ids, [-1]]).astype(np.int32))

    @property
    def oov(self) -> int:
        return len(self.to_target) - 1

    @property
    def draft_size(self) -> int:
        return len(self.to_target)

    @property
    def target_size(self) -> int:
        return len(self.to_draft)

    def draft_ids(self, target_ids: Int[Array, "*S"]) -> Int[Array, "*S"]:
        """Target ids -> the ids the draft model's input embedding takes."""
        return jnp.asarray(self.to_draft)[target_ids]

    def out_ids(self, target_ids: Int[Array, "*S"]) -> Int[Array, "*S"]:
        """Target ids -> columns of the draft's logits (`oov` for tokens it cannot name)."""
        return jnp.asarray(self.to_draft)[target_ids]

    def target_ids(self, draft_ids: Int[Array, "*S"]) -> Int[Array, "*S"]:
        return jnp.asarray(self.to_target)[draft_ids]

    def target_logits(self, draft_logits: Float[Array, "*S Vd"]) -> Float[Array, "*S Vt"]:
        return to_target_vocab(draft_logits, jnp.asarray(self.to_draft), self.oov, -jnp.inf)

    def target_probs(self, draft_probs: Float[Array, "*S Vd"]) -> Float[Array, "*S Vt"]:
        """The same distribution over the target vocabulary (zero outside the draft's)."""
        return to_target_vocab(draft_probs, jnp.asarray(self.to_draft), self.oov, 0.0)

    def draft_columns(self, per_target: Shaped[Array, "B Vt"]) -> Shaped[Array, "B Vd"]:
        """Per-token values over the target vocabulary (the penalties' counts) read at the
        draft's logit columns; zero at the OOV column."""
        cols = jnp.asarray(self.to_target)
        return jnp.where(cols >= 0, per_target[:, jnp.maximum(cols, 0)],
                         jnp.zeros((), per_target.dtype))

    def proposable(self, draft_logits: Float[Array, "*S Vd"]) -> Float[Array, "*S Vd"]:
        """The draft's own logits with the OOV slot masked (it names no target token).
        Proposals are drawn here, over the draft's vocabulary: the same distribution as over
        the target's (zero elsewhere), at a fraction of the softmax / top-k / Gumbel work."""
        return jnp.where(jnp.arange(draft_logits.shape[-1]) == self.oov, -jnp.inf, draft_logits)

    # JSON-friendly form, stored in the orbax checkpoint's `extra` (to_draft is derived).
    def to_dict(self) -> dict:
        return {"to_target": self.to_target[:-1].tolist(), "target_vocab_size": self.target_size}

    @classmethod
    def from_dict(cls, d: dict) -> "VocabMap":
        return cls.from_target_ids(d["to_target"], int(d["target_vocab_size"]))

    def __hash__(self) -> int:
        # Hashable so jitted programs can take the map as a static argument (its index arrays
        # become compile-time constants); consistent with __eq__.
        return hash((type(self).__name__, self.to_target.tobytes(), len(self.to_draft)))

    def __eq__(self, other) -> bool:
        return (type(other) is type(self) and np.array_equal(self.to_draft, other.to_draft)
                and np.array_equal(self.to_target, other.to_target))


@dataclass(frozen=True, eq=False)
class ShortList(VocabMap):
    """A draft that reads every token but proposes only a short list of frequent ones.

    The input embedding keeps the whole vocabulary (so `draft_ids` is the identity: a rare
    prompt token still enters as itself); only the LM head is cut to the listed tokens plus
    the never-proposed OOV column (`shorten_head`). For a large vocabulary the head is a big
    share of a small draft's forward (Qwen2.5-0.5B: 136M of 494M weights), and every draft
    pass of SD and SSD pays it. A token outside the list is simply never proposed: its q is 0,
    which verification handles like any other token the draft did not pick (lossless)."""

    def draft_ids(self, target_ids: Int[Array, "*S"]) -> Int[Array, "*S"]:
        return target_ids


@dataclass(frozen=True)
class SameVocab:
    """The identity map of a pair that shares one vocabulary: every method is a no-op, so the
    draft side has no `vocab is None` branches and pays no gather."""

    size: int

    @property
    def draft_size(self) -> int:
        return self.size

    @property
    def target_size(self) -> int:
        return self.size

    def draft_ids(self, target_ids: Int[Array, "*S"]) -> Int[Array, "*S"]:
        return target_ids

    def out_ids(self, target_ids: Int[Array, "*S"]) -> Int[Array, "*S"]:
        return target_ids

    def target_ids(self, draft_ids: Int[Array, "*S"]) -> Int[Array, "*S"]:
        return draft_ids

    def target_probs(self, draft_probs: Float[Array, "*S V"]) -> Float[Array, "*S V"]:
        return draft_probs

    def draft_columns(self, per_target: Shaped[Array, "B V"]) -> Shaped[Array, "B V"]:
        return per_target

    def proposable(self, draft_logits: Float[Array, "*S V"]) -> Float[Array, "*S V"]:
        return draft_logits


def to_target_vocab(values: Float[Array, "*S Vd"], to_draft: Int[Array, " Vt"], oov: int,
                    fill: float) -> Float[Array, "*S Vt"]:
    """A gather (not a scatter: scatters are slow on XLA:CPU) of each target token's draft
    value, `fill` (-inf for logits, 0 for probabilities) outside the draft vocabulary."""
    gathered = jnp.take(values, to_draft, axis=-1)
    return jnp.where(to_draft != oov, gathered, fill)


class VocabTable(nnx.Variable):
    """Non-trainable integer table carried in the model state (not an nnx.Param)."""


class DraftModel(nnx.Module):
    """A draft `Transformer` over a truncated vocabulary that looks like a target model.

    Called exactly like `Transformer` — `model(tokens[B,T], positions[B,T], cache, prefix_len[B],
    mask[B,T,T], logit_index=None) -> (logits, new KVCache)` — but `tokens` are *target* ids and
    the logits are fp32 over the *target* vocabulary, -inf outside the draft vocabulary. Target ids
    outside the draft vocabulary (e.g. a prompt token) enter as the OOV embedding. `config` is
    the inner model's (its KV shapes are what engines need); `vocab_size` is the target's.
    """

    def __init__(self, model: Transformer, vocab: VocabMap):
        if model.config.vocab_size != vocab.draft_size:
            raise ValueError(f"draft model vocab_size={model.config.vocab_size} but the vocab map "
                             f"has {vocab.draft_size} draft ids: they must agree")
        self.model = model
        self.config: ModelConfig = model.config
        self.to_draft = VocabTable(jnp.asarray(vocab.to_draft))
        self.oov = vocab.oov
        self.vocab_size = vocab.target_size

    def __call__(self, tokens: Int[Array, "B T"], positions: Int[Array, "B T"], cache: KVCache,
                 prefix_len: Int[Array, " B"], mask: Bool[Array, "B T T"],
                 logit_index: Int[Array, "B N"] | None = None
                 ) -> tuple[Float[Array, "B N Vt"], KVCache]:
        to_draft = self.to_draft[...]
        logits, kv = self.model(to_draft[tokens], positions, cache, prefix_len, mask, logit_index)
        return to_target_vocab(logits, to_draft, self.oov, -jnp.inf), kv

    @classmethod
    def load(cls, name_or_path: str | Path = "smollm2-draft", **kw) -> tuple["DraftModel", object]:
        """(DraftModel, tokenizer) from a checkpoint whose `extra` holds the vocab map."""
        from ssd_jax.loading import load
        model, tokenizer, extra = load(name_or_path, **kw)
        if "vocab_map" not in extra:
            raise ValueError(f"{name_or_path!r} has no vocab_map in its extra metadata: it is not "
                             "a draft checkpoint saved by `python -m ssd_jax.distill train`")
        return cls(model, VocabMap.from_dict(extra["vocab_map"])), tokenizer


def shorten_head(model: Transformer, vocab: ShortList) -> Transformer:
    """The same model with its LM head cut to `vocab`'s columns (the OOV column zero: it is
    masked before anything is proposed). The input embedding is kept whole; a tied model gets
    an untied head of the listed rows. Returns a new model; `model` is left as it was."""
    emb = model.embed_tokens.embedding.get_value()
    kernel = (emb.T if model.lm_head is None else model.lm_head.kernel.get_value())
    if kernel.ndim == 3:  # packed for the CPU kernel by a runner (models/packing.py)
        from ssd_jax.kernels.cpu import unpack
        kernel = unpack(kernel, model.lm_head.out_features)
    ids = np.asarray(vocab.to_target[:-1])
    if kernel.shape[1] <= ids.max():
        raise ValueError(f"the short list names token {ids.max()} but the draft's head has "
                         f"{kernel.shape[1]} columns")
    cols = jnp.concatenate([jnp.take(kernel, jnp.asarray(ids), axis=1),
                            jnp.zeros((kernel.shape[0], 1), kernel.dtype)], axis=1)
    graphdef, state = nnx.split(model)
    short = nnx.merge(graphdef, state)  # a copy sharing the (immutable) arrays
    head = Linear(kernel.shape[0], cols.shape[1], use_bias=False, dtype=kernel.dtype,
                  param_dtype=kernel.dtype, rngs=nnx.Rngs(0))
    head.kernel.set_value(cols)
    short.lm_head = nnx.data(head)  # a tied model had None here (a static field)
    return short


def draft_for(model: Transformer, vocab) -> Transformer:
    """The draft model a pair's vocab map calls for: its head cut for a ShortList."""
    return shorten_head(model, vocab) if isinstance(vocab, ShortList) else model
