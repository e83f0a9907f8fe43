"""Multi-device runs on fake CPU devices: a 2-way tensor-parallel target and a draft on other
devices give the same greedy output as the one-device run. Runs in a subprocess because the
device count is fixed when JAX starts."""
import os
import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent('''
    import json, sys
    import jax
    from ssd_jax import LLM, EngineConfig, SamplingParams
    from ssd_jax.config import SpecConfig
    from ssd_jax.loading import load
    target, draft = load(sys.argv[1])[0], load(sys.argv[2])[0]
    prompts = [[5, 9, 11], list(range(20, 39)), [7] * 8, [3, 1, 4, 1, 5]]
    p = SamplingParams(max_new_tokens=20, ignore_eos=True)
    base = dict(max_batch=4, max_seq_len=128, prefill_bucket=16)
    ref = LLM(target, draft=draft, spec=SpecConfig(k=3, budget=8), engine=EngineConfig(**base))
    want = [o.token_ids for o in ref.generate(prompts, p, mode="ar")]
    out = {}
    for split in [(2, 2), (1, 3), (2, 1)]:
        llm = LLM(target, draft=draft, spec=SpecConfig(k=3, budget=8),
                  engine=EngineConfig(**base, mesh=split))
        for mode in ("ar", "sd", "ssd"):
            got = [o.token_ids for o in llm.generate(prompts, p, mode=mode)]
            out[f"{split}-{mode}"] = got == want
    spec = llm.runner.params["layers"][0]["mlp"]["gate_proj"]["kernel"].value.sharding.spec
    out["tp_split"] = str(spec)
    out["devices"] = len(jax.devices())
    print("RESULT" + json.dumps(out))
''')


def test_tensor_parallel_target_and_draft_mesh_match_single_device(tiny_llama, tmp_path):
    from tests.conftest import make_hf_model
    draft = tmp_path / "draft"
    make_hf_model(draft, "llama", seed=1, num_hidden_layers=1)
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=4")
    proc = subprocess.run([sys.executable, "-c", SCRIPT, str(tiny_llama[0]), str(draft)],
                          capture_output=True, text=True, env=env, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    import json
    result = json.loads(proc.stdout.split("RESULT")[1])
    assert result.pop("devices") == 4
    assert result.pop("tp_split") == "P(None, 'tp')"
    assert all(result.values()), result


def test_device_split_errors():
    import pytest
    from ssd_jax.sharding import split_devices
    with pytest.raises(ValueError, match="needs 9 devices.*xla_force_host_platform_device_count=9"):
        split_devices(8, 1)
