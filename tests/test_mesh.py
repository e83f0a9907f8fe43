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


SCRIPT_8 = textwrap.dedent('''
    import json, sys
    import jax
    from jax import monitoring
    from ssd_jax import LLM, EngineConfig, SamplingParams
    from ssd_jax.config import SpecConfig
    from ssd_jax.loading import load
    compiles = []
    monitoring.register_event_duration_secs_listener(
        lambda name, secs, **kw: compiles.append(name)
        if name == "/jax/core/compile/backend_compile_duration" else None)
    target, draft = load(sys.argv[1])[0], load(sys.argv[2])[0]
    first = [[5, 9, 11], list(range(20, 39)), [7] * 8, [3, 1, 4, 1, 5]]
    second = [[6, 2], list(range(40, 59)), [9] * 5, [8, 1, 8]]  # same shape buckets
    p = SamplingParams(max_new_tokens=20, ignore_eos=True)
    base = dict(max_batch=4, max_seq_len=128, prefill_bucket=16, sync_every=2)
    spec = SpecConfig(k=3, budget=8)
    ref = LLM(target, draft=draft, spec=spec, engine=EngineConfig(**base))
    want = {i: [o.token_ids for o in ref.generate(ps, p, mode="ar")]
            for i, ps in enumerate((first, second))}
    out = {}
    for split in [(4, 4), (2, 6)]:
        llm = LLM(target, draft=draft, spec=spec, engine=EngineConfig(**base, mesh=split))
        kernel = llm.runner.params["layers"][0]["mlp"]["gate_proj"]["kernel"].value
        dkernel = llm.draft_runner.params["layers"][0]["mlp"]["gate_proj"]["kernel"].value
        out[f"{split}-layout"] = dict(
            target_devices=sorted(d.id for d in kernel.sharding.device_set),
            draft_devices=sorted(d.id for d in dkernel.sharding.device_set),
            target_shard_cols=kernel.addressable_shards[0].data.shape[1])
        for mode in ("ar", "sd", "ssd"):
            for i, prompts in enumerate((first, second)):
                ids, params = llm._prepare(prompts, p, False)
                rows = [[] for _ in ids]
                run = llm._run(ids, params, mode)
                for r, toks in zip(rows, next(run)[0]):  # prefill: may compile, may place
                    r.extend(toks)
                n0 = len(compiles)
                # The decode loop: no implicit device-to-device copy (no resharding), and on
                # the second batch of the same shapes nothing new is compiled.
                with jax.transfer_guard_device_to_device("disallow"):
                    for chunk, _ in run:
                        for r, toks in zip(rows, chunk):
                            r.extend(toks)
                out[f"{split}-{mode}-{i}"] = dict(
                    equal=[r[:20] for r in rows] == want[i],
                    loop_compiles=len(compiles) - n0 if i == 1 else 0)
    out["devices"] = len(jax.devices())
    print("RESULT" + json.dumps(out))
''')


def test_eight_devices_tp4_and_tp2_targets_with_draft_on_the_rest(tiny_llama, tmp_path):
    """Target tensor-parallel over 4 and over 2 of 8 devices, draft (also split by the rules)
    on the remaining 4 / 6: greedy AR, SD and SSD equal the one-device output, no implicit
    device-to-device transfer happens inside the decode loop, and a second batch of the same
    shapes compiles nothing (every loop program's outputs come back in its inputs' layout)."""
    from tests.conftest import make_hf_model
    draft = tmp_path / "draft"
    make_hf_model(draft, "llama", seed=1, num_hidden_layers=1)
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8")
    proc = subprocess.run([sys.executable, "-c", SCRIPT_8, str(tiny_llama[0]), str(draft)],
                          capture_output=True, text=True, env=env, timeout=1200)
    assert proc.returncode == 0, proc.stderr[-3000:]
    import json
    result = json.loads(proc.stdout.split("RESULT")[1])
    assert result.pop("devices") == 8
    # intermediate 160 split 4 ways -> 40 columns per device, 2 ways -> 80
    assert result.pop("(4, 4)-layout") == dict(target_devices=[0, 1, 2, 3],
                                                draft_devices=[4, 5, 6, 7], target_shard_cols=40)
    assert result.pop("(2, 6)-layout") == dict(target_devices=[0, 1],
                                                draft_devices=[2, 3, 4, 5, 6, 7],
                                                target_shard_cols=80)
    assert len(result) == 12 and all(v["equal"] for v in result.values()), result
    assert all(v["loop_compiles"] == 0 for v in result.values()), result
