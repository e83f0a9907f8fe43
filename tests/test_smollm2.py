"""SmolLM2-135M-Instruct from the GGUF: our model and tokenizer against transformers' GGUF loader."""
import numpy as np
import pytest
import torch

from ssd_jax import SamplingParams
from ssd_jax.loading import smollm2_gguf

PROMPTS = ["What is the capital of France?",
           "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
           "Tom has 3 apples and buys 12 more. How many apples does he have?"]


@pytest.fixture(scope="module")
def hf_smollm2():
    import transformers
    path = smollm2_gguf()
    model = transformers.AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, torch_dtype=torch.float32)
    tok = transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    return model.eval(), tok


def test_tokenizer_matches_transformers(smollm2, hf_smollm2):
    _, hf_tok = hf_smollm2
    texts = PROMPTS + ["Prices: 12345.67 €, naïve café — 日本語 ok?\n\n  indented\tTAB",
                       "<|im_start|>user\nhi<|im_end|>\n"]
    for text in texts:
        assert smollm2.tokenizer.encode(text) == hf_tok.encode(text), text
        ids = smollm2.tokenizer.encode(text)
        assert smollm2.tokenizer.decode(ids, skip_special_tokens=False) == text


def test_chat_template_matches_transformers(smollm2, hf_smollm2):
    _, hf_tok = hf_smollm2
    msgs = [{"role": "user", "content": PROMPTS[0]}]
    ours = smollm2.tokenizer.apply_chat_template(msgs)
    theirs = hf_tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert ours == theirs


def test_logits_match_transformers(smollm2, hf_smollm2):
    import jax.numpy as jnp
    from ssd_jax.models import causal_mask
    hf_model, _ = hf_smollm2
    for text in PROMPTS:
        ids = np.array([smollm2.tokenizer.encode(text)])
        T = ids.shape[1]
        logits, _ = smollm2.runner.forward(jnp.asarray(ids), jnp.arange(T)[None],
                                           smollm2.runner.new_cache(1, T),
                                           jnp.zeros((1,), jnp.int32), causal_mask(1, T))
        with torch.no_grad():
            ref = hf_model(torch.tensor(ids)).logits.numpy()
        np.testing.assert_allclose(np.asarray(logits), ref, atol=1e-3, rtol=0)


def test_greedy_continuation_matches_transformers(smollm2, hf_smollm2):
    hf_model, _ = hf_smollm2
    ids = smollm2.tokenizer.encode(PROMPTS[1])
    ours = smollm2.generate([ids], SamplingParams(max_new_tokens=32, ignore_eos=True))[0]
    with torch.no_grad():
        ref = hf_model.generate(torch.tensor([ids]), max_new_tokens=32, do_sample=False,
                                min_new_tokens=32)[0, len(ids):].tolist()
    assert ours.token_ids == ref


def test_chat_answer_is_coherent(smollm2):
    out = smollm2.generate("What is the capital of France?", SamplingParams(max_new_tokens=24))[0]
    assert "Paris" in out.text
    assert out.finish_reason == "stop"


@pytest.fixture(scope="module")
def smollm2_pair(smollm2):
    from ssd_jax import LLM, EngineConfig
    from ssd_jax.config import SpecConfig
    return LLM(smollm2.model, tokenizer=smollm2.tokenizer, draft="smollm2-draft",
               spec=SpecConfig(k=4), engine=EngineConfig(max_batch=2, driver="single"))


def test_sd_and_ssd_equal_ar_on_smollm2_with_shipped_draft(smollm2_pair):
    """The embedded default pair, greedy, 64 tokens, two prompts of different lengths."""
    prompts = [PROMPTS[0], PROMPTS[2]]
    p = SamplingParams(max_new_tokens=64, ignore_eos=True)
    want = [o.token_ids for o in smollm2_pair.generate(prompts, p, mode="ar")]
    sd = smollm2_pair.generate(prompts, p, mode="sd")
    assert [o.token_ids for o in sd] == want
    # Some draft tokens were accepted: a random draft over a 49k vocabulary essentially never is.
    assert sum(sd[0].metrics.accept_hist[1:]) > 0
    ssd = smollm2_pair.generate(prompts, p, mode="ssd")
    assert [o.token_ids for o in ssd] == want
    assert ssd[0].metrics.ssd.hits > 0


def test_stop_strings_end_sd_and_ssd_rows_as_ar(smollm2_pair):
    """A stop string from the middle of each row's greedy answer, at the shapes of the test
    above: SD and SSD end each row where the AR answer cut by hand ends, with the same tokens,
    and the run ends there (closed early: the programs do not see stop strings)."""
    prompts = [PROMPTS[0], PROMPTS[2]]
    p = SamplingParams(max_new_tokens=64, ignore_eos=True)
    want = smollm2_pair.generate(prompts, p, mode="ar")
    stops = [w.text[20:24] for w in want]
    tok = smollm2_pair.tokenizer
    keep = [next(j for j in range(1, 65) if s in tok.decode(w.token_ids[:j]))
            for w, s in zip(want, stops)]
    assert max(keep) < 40
    params = [SamplingParams(max_new_tokens=64, ignore_eos=True, stop=s) for s in stops]
    for mode in ("sd", "ssd"):
        got = smollm2_pair.generate(prompts, params, mode=mode)
        for g, w, s, n in zip(got, want, stops, keep):
            assert (g.text, g.finish_reason) == (w.text[:w.text.find(s)], "stop"), mode
            assert g.token_ids == w.token_ids[:n], mode
        assert got[0].metrics.decode_steps < 40, mode  # rounds; the budget allows 63


def test_warmup_compiles_every_program_of_the_run(smollm2):
    """After `warmup`, the `generate` it prepared compiles nothing, in every mode. SSD's
    fan-out refit between chunks hands the draft new lists: they must reach the programs
    placed as the old ones were, or build_cache and select compile again inside the timed run
    (the bench's single-driver SSD cells ran 15-30x slow). A context length no other test
    uses keeps programs compiled elsewhere out of the count."""
    from jax import monitoring
    from ssd_jax import LLM, EngineConfig, SamplingParams
    from ssd_jax.config import SpecConfig
    compiles = []

    def listen(name, secs, **kw):
        if name == "/jax/core/compile/backend_compile_duration":
            compiles.append(name)
    llm = LLM(smollm2.model, tokenizer=smollm2.tokenizer, draft="smollm2-draft",
              spec=SpecConfig(k=2), engine=EngineConfig(max_batch=1, max_seq_len=136,
                                                        driver="single", sync_every=2))
    p = SamplingParams(max_new_tokens=24, ignore_eos=True)
    monitoring.register_event_duration_secs_listener(listen)
    try:
        for mode in ("ar", "sd", "ssd"):
            llm.warmup(PROMPTS[0], p, mode=mode)
            n = len(compiles)
            llm.generate(PROMPTS[0], p, mode=mode)
            assert len(compiles) == n, mode
    finally:
        monitoring.unregister_event_duration_listener(listen)


@pytest.mark.slow
def test_default_pair_in_worker_processes_equals_ar_on_every_suite():
    """`make test-slow`: the embedded default pair the way the CLI runs it on CPU (pinned worker
    processes), one prompt from each bench suite in one batch, 128 greedy tokens, every backup
    and the adaptive fan-outs: SSD equals AR token for token."""
    from bench import suites
    from ssd_jax import LLM, EngineConfig
    from ssd_jax.config import SpecConfig
    prompts = [suites.load_suite(s, 1, seed=0)[0].text
               for s in ("code", "math", "instructions", "chat")]
    p = SamplingParams(max_new_tokens=128, ignore_eos=True)
    ref = LLM("smollm2", engine=EngineConfig(max_batch=4, max_seq_len=1024))
    want = [o.token_ids for o in ref.generate(prompts, p, mode="ar")]
    for backup, fanout in (("neural", "geometric"), ("fast", "empirical"), ("auto", "uniform")):
        llm = LLM("smollm2", draft="smollm2-draft", spec=SpecConfig(backup=backup, fanout=fanout),
                  engine=EngineConfig(max_batch=4, max_seq_len=1024, driver="processes"))
        with llm:
            out = llm.generate(prompts, p, mode="ssd")
        assert [o.token_ids for o in out] == want, (backup, fanout)
        assert out[0].metrics.ssd.hits > 0
