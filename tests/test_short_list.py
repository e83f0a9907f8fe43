"""A draft whose LM head is cut to a short list of frequent tokens (EngineConfig.draft_vocab):
the list (specials kept, frequency order), the cut head (the listed columns of the full
logits), and exactness: greedy SD/SSD == AR on both drivers, sampled SD/SSD follow the
target distribution while the draft cannot propose two of the six tokens."""
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from ssd_jax import LLM, EngineConfig, SamplingParams
from ssd_jax.config import ModelConfig, SpecConfig
from ssd_jax.draft_vocab import ShortList, shorten_head
from ssd_jax.loading import describe
from ssd_jax.loading.token_freq import ranking, short_list
from ssd_jax.loading.tokenizer import Tokenizer
from ssd_jax.models.attention import causal_mask
from ssd_jax.models.transformer import KVCache, Transformer
from tests.oracles import chi2_pvalue, exact_sequence_probs, sequence_counts
from tests.test_ssd import N_OUT, vocab6  # noqa: F401  (fixture)


def test_short_list_keeps_specials_and_frequent_tokens(tmp_path):
    _, tok, _ = describe("smollm2")
    n_real = tok.vocab_size
    ids = short_list(tok, n_real, 2000, tmp_path)
    assert len(ids) == len(set(ids.tolist())) == 2000
    assert set(tok.eos_token_ids) <= set(ids.tolist())
    common = [tok.encode(w, add_special_tokens=False)[0] for w in (" the", "def", " self")]
    assert set(common) <= set(ids.tolist())
    order = ranking(tok, n_real, tmp_path)  # cached now: read back, same answer
    assert sorted(order.tolist()) == list(range(n_real))
    assert not np.array_equal(order[:2000], np.arange(2000))  # frequency, not id order
    with pytest.raises(ValueError, match="out of range"):
        short_list(tok, n_real, n_real + 1, tmp_path)


@pytest.mark.parametrize("tied", [True, False])
def test_cut_head_gives_the_listed_columns(tied):
    cfg = ModelConfig(vocab_size=50, hidden_size=32, intermediate_size=64, num_layers=2,
                      num_heads=2, num_kv_heads=1, head_dim=16, tie_embeddings=tied)
    model = Transformer(cfg, rngs=nnx.Rngs(0))
    vm = ShortList.from_target_ids(np.array([7, 3, 41, 0]), 50)
    short = shorten_head(model, vm)
    tokens = jnp.array([[45, 3, 9, 12]])  # 45, 9, 12 are not listed: they enter as themselves
    args = (tokens, jnp.arange(4)[None], KVCache.zeros(cfg, 1, 8), jnp.zeros(1, jnp.int32),
            causal_mask(1, 4))
    full, kv_full = model(*args)
    cut, kv_cut = short(*args)
    assert cut.shape == (1, 4, 5)
    np.testing.assert_allclose(cut[..., :4], full[..., [7, 3, 41, 0]], rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(cut[..., 4], 0.0)  # the OOV column, masked before proposing
    np.testing.assert_array_equal(kv_cut.k[0], kv_full.k[0])
    assert model.lm_head is None if tied else model.lm_head.kernel.shape == (32, 50)


# The worker processes are what the real pair runs with a short list (--draft-vocab). Both
# drivers (2-2.5 min each on two cores) are in `make test-slow`; the default run keeps the
# cut head (above), the short list end to end in the sampled tests below, greedy exactness
# with a draft over part of the vocabulary (test_ssd's VocabMap, which ShortList extends) and
# the worker processes' (test_multiprocess).
@pytest.mark.parametrize("driver", [pytest.param("single", marks=pytest.mark.slow),
                                    pytest.param("processes", marks=pytest.mark.slow)])
def test_greedy_with_short_list_equals_ar(driver):
    """SmolLM2 drafting for itself with its head cut to 1,000 tokens: every target token
    outside the list is a rejection, so acceptance is partial; output is still AR's."""
    prompts = ["Write a Python function that reverses a string.",
               "Name three rivers of Europe and one fact about each."]
    p = SamplingParams(max_new_tokens=24, ignore_eos=True)
    llm = LLM("smollm2", draft="smollm2", spec=SpecConfig(k=3, budget=6),
              engine=EngineConfig(max_batch=2, max_seq_len=256, driver=driver,
                                  draft_vocab=1000), progress=False)
    want = [o.token_ids for o in llm.generate(prompts, p, mode="ar")]
    for mode in ("sd", "ssd"):
        out = llm.generate(prompts, p, mode=mode)
        assert [o.token_ids for o in out] == want, (driver, mode)
        m = out[0].metrics
        assert 0.2 < m.acceptance < 1.0, (driver, mode, m.acceptance)
    llm.close()


def _word_tokenizer(n: int) -> Tokenizer:
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers.models import WordLevel
    return Tokenizer(HFTokenizer(WordLevel({f"w{i}": i for i in range(n)}, unk_token="w1")),
                     eos_token_ids=(0,))


@pytest.mark.parametrize("mode", ["sd", "ssd"])
def test_sampled_with_short_list_follows_target(vocab6, mode, tmp_path):  # noqa: F811
    """A head of 4 columns over the 6 tokens: the draft names 3 of them (EOS and the two
    most frequent), so q' is zero on the other three; the output still follows the target."""
    target, draft, hf_target = vocab6
    llm = LLM(target, draft=draft, tokenizer=_word_tokenizer(6), cache_dir=tmp_path,
              spec=SpecConfig(k=2, c=0.5, budget=4),
              engine=EngineConfig(max_batch=64, max_seq_len=64, prefill_bucket=8, sync_every=4,
                                  draft_vocab=4))
    assert isinstance(llm.core.vocab, ShortList) and llm.core.vocab.draft_size == 4
    probs = exact_sequence_probs(hf_target, [1, 2, 3], 1.0, 1.0, N_OUT)
    assert chi2_pvalue(sequence_counts(llm, mode, N_OUT), probs) > 1e-3


def test_bad_draft_vocab_is_one_clear_error(vocab6):  # noqa: F811
    target, draft, _ = vocab6
    with pytest.raises(ValueError, match="draft_vocab=1 is invalid"):
        EngineConfig(draft_vocab=1)
    with pytest.raises(ValueError, match="needs the target's tokenizer"):
        LLM(target, draft=draft, engine=EngineConfig(draft_vocab=4))
    with pytest.raises(ValueError, match="out of range"):
        LLM(target, draft=draft, tokenizer=_word_tokenizer(6),
            engine=EngineConfig(draft_vocab=7))
