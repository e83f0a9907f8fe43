"""The distilled draft: vocab map, target-vocab proposals, the shipped checkpoint, a training smoke run."""
import numpy as np
import jax
import jax.numpy as jnp
import pytest
from flax import nnx

from ssd_jax.config import ModelConfig
from ssd_jax.distill import train as T
from ssd_jax.distill.prompts import held_out_prompts, is_training_module, stdlib_sources
from ssd_jax.draft_vocab import DraftModel, VocabMap
from ssd_jax.loading import orbax_ckpt
from ssd_jax.loading.registry import SHIPPED
from ssd_jax.models.attention import causal_mask
from ssd_jax.models.transformer import KVCache, Transformer
from ssd_jax.core.runner import ModelRunner, forward

V_TARGET = 100
KEEP = [3, 7, 0, 42, 99, 15, 8]  # draft ids 0..6 in this order, OOV = 7

TINY = ModelConfig(arch="llama", vocab_size=len(KEEP) + 1, hidden_size=32, intermediate_size=64,
                   num_layers=1, num_heads=2, num_kv_heads=1, head_dim=16, tie_embeddings=True)


def _vocab():
    return VocabMap.from_target_ids(KEEP, V_TARGET)


def test_vocab_map_ids():
    vm = _vocab()
    assert vm.oov == len(KEEP) and vm.draft_size == len(KEEP) + 1 and vm.target_size == V_TARGET
    assert np.asarray(vm.draft_ids(jnp.asarray(KEEP))).tolist() == list(range(len(KEEP)))
    outside = [t for t in range(V_TARGET) if t not in KEEP]
    assert (np.asarray(vm.draft_ids(jnp.asarray(outside))) == vm.oov).all()
    assert vm.to_target[vm.oov] == -1
    with pytest.raises(ValueError, match="duplicates"):
        VocabMap.from_target_ids([1, 1], V_TARGET)


def test_vocab_map_round_trips_through_checkpoint(tmp_path):
    vm = _vocab()
    assert VocabMap.from_dict(vm.to_dict()) == vm
    model = Transformer(TINY, rngs=nnx.Rngs(0))
    orbax_ckpt.save(model, None, tmp_path / "d", extra={"vocab_map": vm.to_dict()})
    draft, _ = DraftModel.load(tmp_path / "d")
    assert np.array_equal(np.asarray(draft.to_draft[...]), vm.to_draft)
    assert draft.oov == vm.oov and draft.vocab_size == V_TARGET


def test_proposal_is_a_distribution_over_the_target_vocab():
    vm = _vocab()
    draft_logits = jax.random.normal(jax.random.key(0), (3, vm.draft_size)) * 3
    q = np.asarray(jax.nn.softmax(vm.target_logits(draft_logits), axis=-1))
    assert q.shape == (3, V_TARGET)
    np.testing.assert_allclose(q.sum(-1), 1.0, rtol=1e-6)
    outside = [t for t in range(V_TARGET) if t not in KEEP]
    assert (q[:, outside] == 0).all()
    # Oracle: softmax over the draft logits of the real draft ids only (OOV dropped).
    dl = np.asarray(draft_logits, np.float64)[:, :len(KEEP)]
    ref = np.exp(dl - dl.max(-1, keepdims=True))
    ref /= ref.sum(-1, keepdims=True)
    np.testing.assert_allclose(q[:, KEEP], ref, rtol=1e-5, atol=1e-7)


def test_draft_model_is_called_like_a_target():
    vm = _vocab()
    inner = Transformer(TINY, rngs=nnx.Rngs(1))
    draft = DraftModel(inner, vm)
    tokens = jnp.asarray([[3, 42, 55, 99]])  # 55 is outside the draft vocabulary
    B, L = tokens.shape
    args = (jnp.arange(L)[None], KVCache.zeros(TINY, B, 8), jnp.zeros((B,), jnp.int32),
            causal_mask(B, L))
    runner = ModelRunner(draft)  # engines split it like any model
    got, kv = forward(runner.graphdef, runner.params, tokens, *args)
    ref, _ = inner(jnp.asarray([[0, 3, vm.oov, 4]]), *args)
    assert got.shape == (B, L, V_TARGET) and len(kv.k) == TINY.num_layers
    np.testing.assert_allclose(np.asarray(got)[..., KEEP], np.asarray(ref)[..., :len(KEEP)],
                               rtol=1e-5, atol=1e-5)
    assert np.isneginf(np.asarray(got)[..., [t for t in range(V_TARGET) if t not in KEEP]]).all()


def test_shipped_draft_loads_and_gives_finite_logits():
    draft, tok = DraftModel.load("smollm2-draft")
    size = sum(f.stat().st_size for f in SHIPPED["smollm2-draft"].rglob("*") if f.is_file())
    assert size <= 40 * 2**20, f"checkpoint is {size / 2**20:.1f} MB, over the 40 MB budget"
    ids = tok.encode(tok.apply_chat_template([{"role": "user", "content": "Hi there!"}]),
                     add_special_tokens=False)
    L = len(ids)
    logits, _ = draft(jnp.asarray([ids]), jnp.arange(L)[None], KVCache.zeros(draft.config, 1, 1),
                      jnp.zeros((1,), jnp.int32), causal_mask(1, L))
    assert logits.shape == (1, L, tok.vocab_size)
    in_vocab = np.asarray(draft.to_draft[...]) != draft.oov
    assert np.isfinite(np.asarray(logits)[..., in_vocab]).all()
    q = np.asarray(jax.nn.softmax(logits[0, -1]))
    assert abs(q.sum() - 1) < 1e-5 and (q[~in_vocab] == 0).all()


def test_training_prompts_are_disjoint_from_held_out_code():
    train_mods, eval_mods = stdlib_sources(training=True), stdlib_sources(training=False)
    assert train_mods and eval_mods and not set(train_mods) & set(eval_mods)
    assert all(is_training_module(m) for m in train_mods)
    assert len(held_out_prompts()) > 12


def test_twenty_training_steps_lower_the_loss(tmp_path):
    # Tiny random data with a learnable rule: the target's top-1 next token is (3 * token) % 7.
    rng = np.random.default_rng(0)
    N, L, k = 32, 16, 4
    tokens = rng.choice(KEEP, (N, L)).astype(np.int32)
    nxt = np.asarray(KEEP)[(3 * np.searchsorted(np.sort(KEEP), tokens)) % len(KEEP)]
    top_ids = np.stack([nxt] + [rng.choice(KEEP, (N, L)) for _ in range(k - 1)], -1).astype(np.int32)
    top_lp = np.log(np.broadcast_to([0.85, 0.05, 0.05, 0.05], (N, L, k))).astype(np.float16)
    data = {"tokens": tokens, "weight": np.ones((N, L), np.float16), "top_ids": top_ids,
            "top_lp": top_lp}
    vm = _vocab()
    cfg = T.TrainConfig(steps=20, batch=8, lr=1e-2, warmup=2, ckpt_every=10, eval_every=1000)
    batches = T.Batches(data, vm, cfg.seed, cfg.batch)
    model = Transformer(TINY, rngs=nnx.Rngs(0))
    empty = KVCache.zeros(TINY, cfg.batch, 1)
    fixed = batches(10_000)
    before = float(T.eval_step(model, empty, *fixed, ce_weight=cfg.ce_weight)[0])
    summary = T.train(model, batches, cfg, tmp_path, log=lambda *_: None)
    after = float(T.eval_step(model, empty, *fixed, ce_weight=cfg.ce_weight)[0])
    assert summary["steps"] == 20 and (tmp_path / "state.npz").exists()
    assert after < 0.8 * before, (before, after)
    # Resuming a finished run restores its state and takes no further step.
    again = Transformer(TINY, rngs=nnx.Rngs(5))
    logs = []
    assert T.train(again, batches, cfg, tmp_path, log=logs.append)["steps"] == 20
    assert "resumed" in logs[0]
    np.testing.assert_allclose(float(T.eval_step(again, empty, *fixed, ce_weight=cfg.ce_weight)[0]),
                               after, rtol=1e-5)


def test_labels_taken_while_generating_equal_teacher_forced_labels(tiny_llama):
    """The distillation data labels responses from the generation step's own logits; they must
    equal a separate teacher-forced pass, and greedy responses must be the engine's."""
    from ssd_jax import LLM
    from ssd_jax.config import EngineConfig, SamplingParams
    from ssd_jax.distill.data import DataConfig, generate_labelled, label

    path, _ = tiny_llama
    cfg = DataConfig(batch=3, max_new_tokens=12, max_prompt_tokens=20, seq_len=40, top_k=4,
                     label_batch=3)
    llm = LLM(str(path), engine=EngineConfig(max_batch=3, max_seq_len=40, prefill_bucket=21))
    prompts = [[1, 5, 9, 13], [1, 7, 7, 3, 22, 90, 4, 8, 8], [1, 60]]
    seqs, (ids, lp) = generate_labelled(llm.runner, prompts, cfg, temperature=0.0,
                                        stop_ids=np.array([2], np.int32), seed=0)
    ref = llm.generate(prompts, SamplingParams(max_new_tokens=12, stop_token_ids=[2]), chat=False)
    for p, s, r in zip(prompts, seqs, ref):
        assert s == p + r.token_ids
    tokens = np.zeros((3, 40), np.int32)
    for i, s in enumerate(seqs):
        tokens[i, :len(s)] = s
    tf_ids, tf_lp = label(llm.runner, tokens, cfg, "test")
    for i, (p, s) in enumerate(zip(prompts, seqs)):
        n = len(s) - 1  # positions with a next token
        np.testing.assert_array_equal(ids[i, :n, 0], tf_ids[i, :n, 0])
        # greedy: on the response, the top-1 label is the token that was generated next
        np.testing.assert_array_equal(ids[i, len(p) - 1:n, 0], s[len(p):])
        np.testing.assert_allclose(lp[i, :n].astype(np.float32), tf_lp[i, :n].astype(np.float32),
                                   atol=2e-3)


def test_data_folder_refuses_another_configuration(tmp_path):
    from ssd_jax.distill.data import DataConfig, _claim
    _claim(tmp_path, DataConfig(), "smollm2")
    _claim(tmp_path, DataConfig(), "smollm2")  # same configuration: resume is fine
    with pytest.raises(ValueError, match="another configuration.*another --out"):
        _claim(tmp_path, DataConfig(seed=1), "smollm2")


def test_data_folder_refuses_a_changed_prompt_set(tmp_path, monkeypatch):
    from ssd_jax.distill import prompts
    from ssd_jax.distill.data import DataConfig, _claim
    _claim(tmp_path, DataConfig(), "smollm2")
    monkeypatch.setattr(prompts, "TOPICS", prompts.TOPICS + ["one more topic"])
    with pytest.raises(ValueError, match="another configuration"):
        _claim(tmp_path, DataConfig(), "smollm2")


def _greedy_by_full_forwards(model, prompt: list[int], n: int) -> list[int]:
    """Oracle: n greedy tokens, each from a full cache-free forward over the whole sequence."""
    seq = list(prompt)
    for _ in range(n):
        L = len(seq)
        logits, _ = model(jnp.asarray([seq]), jnp.arange(L)[None], KVCache.zeros(model.config, 1, 1),
                          jnp.zeros((1,), jnp.int32), causal_mask(1, L))
        seq.append(int(jnp.argmax(logits[0, -1])))
    return seq


@pytest.mark.slow  # 40 s: the draft-training pipeline's on-policy stage (make draft)
def test_onpolicy_batch_is_the_drafts_text_labelled_by_the_target(tiny_llama):
    """On-policy data: the draft's own greedy answer (in target ids), labelled with the
    target's next-token distribution at every position."""
    from ssd_jax import LLM
    from ssd_jax.config import EngineConfig
    from ssd_jax.distill.data import PROMPT_WEIGHT, DataConfig, onpolicy_batch

    path, _ = tiny_llama
    cfg = DataConfig(batch=2, max_new_tokens=10, max_prompt_tokens=20, seq_len=40, top_k=4,
                     label_batch=2)
    llm = LLM(str(path), engine=EngineConfig(max_batch=2, max_seq_len=40, prefill_bucket=21))
    draft = DraftModel(Transformer(TINY, rngs=nnx.Rngs(3)), VocabMap.from_target_ids(KEEP, 128))
    prompts = [[1, 5, 9, 13], [1, 7, 7, 3, 22, 90]]  # 5, 9, 13, 22, 90 are outside the draft vocab
    shard = onpolicy_batch(llm.runner, draft, prompts, cfg, temperature=0.0,
                           stop_ids=np.array([2], np.int32), seed=0)
    target = llm.runner
    for i, p in enumerate(prompts):
        want = _greedy_by_full_forwards(draft, p, cfg.max_new_tokens)  # 2 is not in KEEP: no stop
        L = len(want)
        np.testing.assert_array_equal(shard["tokens"][i, :L], want)
        assert (shard["tokens"][i, L:] == 0).all()
        w = shard["weight"][i].astype(np.float32)
        np.testing.assert_allclose(w[:len(p) - 1], PROMPT_WEIGHT, rtol=1e-3)
        assert (w[len(p) - 1:L - 1] == 1).all() and (w[L - 1:] == 0).all()
        logits, _ = forward(target.graphdef, target.params, jnp.asarray([want]), jnp.arange(L)[None],
                            target.new_cache(1, 1), jnp.zeros((1,), jnp.int32), causal_mask(1, L))
        logp = np.asarray(jax.nn.log_softmax(logits[0], -1))
        np.testing.assert_array_equal(shard["top_ids"][i, :L, 0], logp.argmax(-1))
        np.testing.assert_allclose(shard["top_lp"][i, :L, 0].astype(np.float32), logp.max(-1),
                                   atol=2e-3)
    # Sampled answers stay inside the draft vocabulary and are a function of the seed.
    a = onpolicy_batch(llm.runner, draft, prompts, cfg, temperature=0.8,
                       stop_ids=np.array([2], np.int32), seed=1)
    b = onpolicy_batch(llm.runner, draft, prompts, cfg, temperature=0.8,
                       stop_ids=np.array([2], np.int32), seed=1)
    np.testing.assert_array_equal(a["tokens"], b["tokens"])
    for i, p in enumerate(prompts):
        answer = a["tokens"][i, len(p):len(p) + cfg.max_new_tokens]
        assert set(answer.tolist()) <= set(KEEP)


def test_labels_cover_sequences_with_a_generated_endoftext(tiny_llama):
    """Id 0 is padding *and* a token a model can generate: a 0 inside a sequence must not
    shorten the labelled width."""
    from ssd_jax import LLM
    from ssd_jax.config import EngineConfig
    from ssd_jax.distill.data import DataConfig, label

    path, _ = tiny_llama
    cfg = DataConfig(batch=1, max_new_tokens=10, max_prompt_tokens=20, seq_len=128, top_k=2,
                     label_batch=1)
    llm = LLM(str(path), engine=EngineConfig(max_batch=1, max_seq_len=128, prefill_bucket=21))
    tokens = np.zeros((1, 128), np.int32)
    tokens[0, :66] = np.arange(66) % 5  # 14 zeros inside: 52 non-zero tokens, last at 65
    ids, lp = label(llm.runner, tokens, cfg, "test", progress=False)
    assert np.isfinite(lp[0, :66].astype(np.float32)).all()


def test_measure_ranks_agree_with_a_sort_of_the_draft_logits():
    from ssd_jax.distill.measure import rank_coverage, target_ranks

    vm = _vocab()
    draft = DraftModel(Transformer(TINY, rngs=nnx.Rngs(4)), vm)
    prompt, answer = [3, 7, 55], [42, 99, 3, 60, 8]  # 60 is outside the draft vocabulary
    ranks = target_ranks(draft, [prompt], [answer])[0]
    seq = prompt + answer
    L = len(seq)
    logits, _ = draft(jnp.asarray([seq]), jnp.arange(L)[None], KVCache.zeros(TINY, 1, 1),
                      jnp.zeros((1,), jnp.int32), causal_mask(1, L))
    lg = np.asarray(logits[0])
    for j, tok in enumerate(answer):
        order = np.argsort(-lg[len(prompt) - 1 + j], kind="stable")  # ties: lowest id first
        assert ranks[j] == int(np.flatnonzero(order == tok)[0]) + 1
    assert ranks[3] > len(KEEP)  # an out-of-vocabulary token is never a hit
    cov = rank_coverage([ranks], cutoffs=(1, 100))
    assert cov["top1"] == np.mean(ranks == 1) and cov["top100"] == 1.0
