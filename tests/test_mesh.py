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
    # (2, 2) is left to the 8-device test's (4, 4) and (2, 6): a target and a draft both split.
    for split in [(1, 3), (2, 1)]:
        llm = LLM(target, draft=draft, spec=SpecConfig(k=3, budget=8),
                  engine=EngineConfig(**base, mesh=split))
        for mode in ("ar", "sd", "ssd"):
            got = [o.token_ids for o in llm.generate(prompts, p, mode=mode)]
            out[f"{split}-{mode}"] = got == want
    spec = llm.runner.params["layers"][0]["mlp"]["gate_proj"]["kernel"].get_value().sharding.spec
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
        kernel = llm.runner.params["layers"][0]["mlp"]["gate_proj"]["kernel"].get_value()
        dkernel = llm.draft_runner.params["layers"][0]["mlp"]["gate_proj"]["kernel"].get_value()
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


def test_split_gives_the_draft_whole_hosts():
    from collections import namedtuple
    import pytest
    from ssd_jax.sharding import plan_split
    Dev = namedtuple("Dev", "id process_index")
    pod = [Dev(8 * h + i, h) for h in range(4) for i in range(8)][::-1]  # any order in
    target, draft = plan_split(pod, 24, 8)
    assert {d.process_index for d in draft} == {3} and len(draft) == 8
    assert {d.process_index for d in target} == {0, 1, 2} and len(target) == 24
    target, draft = plan_split(pod, 16, 16)  # two draft hosts
    assert {d.process_index for d in draft} == {2, 3}
    assert [d.id for d in target] == list(range(16))
    target, draft = plan_split(pod, 8, 8)  # spare hosts stay idle, the draft still gets one
    assert {d.process_index for d in draft} == {3} and {d.process_index for d in target} == {0}
    target, draft = plan_split(pod, 30, 2)  # not a whole host: the last two devices
    assert [d.id for d in draft] == [30, 31] and not {d.id for d in target} & {30, 31}
    one_host = [Dev(i, 0) for i in range(8)]
    target, draft = plan_split(one_host, 4, 2)
    assert [d.id for d in target] == [0, 1, 2, 3] and [d.id for d in draft] == [4, 5]
    with pytest.raises(ValueError, match="needs 33 devices"):
        plan_split(pod, 32, 1)


def test_distributed_start_up_reads_the_environment():
    import pytest
    from ssd_jax.runtime.distributed import ClusterEnv, detect
    assert detect({}) is None
    assert detect({"SLURM_JOB_ID": "7", "SLURM_NTASKS": "1"}) is None  # one task: single process
    env = {"SSD_JAX_COORDINATOR": "10.0.0.1:1234", "SSD_JAX_NUM_PROCESSES": "4",
           "SSD_JAX_PROCESS_ID": "2"}
    assert detect(env) == ClusterEnv("environment", "10.0.0.1:1234", 4, 2)
    assert detect({"JAX_COORDINATOR_ADDRESS": "h:1", "JAX_NUM_PROCESSES": "2",
                   "JAX_PROCESS_ID": "0"}) == ClusterEnv("environment", "h:1", 2, 0)
    assert detect({"SLURM_JOB_ID": "7", "SLURM_NTASKS": "16"}) == ClusterEnv("slurm")
    assert detect({"OMPI_COMM_WORLD_SIZE": "2"}) == ClusterEnv("open-mpi")
    assert detect({"TPU_WORKER_HOSTNAMES": "t0,t1,t2,t3"}) == ClusterEnv("cloud-tpu")
    assert detect({"TPU_WORKER_HOSTNAMES": "t0"}) is None  # a single-host slice
    assert detect({**env, "SSD_JAX_DISTRIBUTED": "0"}) is None
    with pytest.raises(ValueError, match="SSD_JAX_PROCESS_ID"):
        detect({"SSD_JAX_COORDINATOR": "h:1", "SSD_JAX_NUM_PROCESSES": "2"})
    with pytest.raises(ValueError, match="outside 0..1"):
        detect({**env, "SSD_JAX_NUM_PROCESSES": "2", "SSD_JAX_PROCESS_ID": "2"})


def test_llm_leaves_multihost_start_up_to_the_caller(tiny_llama, monkeypatch):
    """Start-up is an explicit call: LLM(...) ignores a multi-host environment (joining from
    inside it, after JAX was used, could only fail)."""
    import jax
    from ssd_jax import LLM, EngineConfig
    jax.numpy.zeros(1).block_until_ready()  # JAX in use, as in any program that built a model
    for name, value in (("SSD_JAX_COORDINATOR", "127.0.0.1:1"), ("SSD_JAX_NUM_PROCESSES", "2"),
                        ("SSD_JAX_PROCESS_ID", "1")):
        monkeypatch.setenv(name, value)
    llm = LLM(tiny_llama[0], engine=EngineConfig(max_batch=1, max_seq_len=64, prefill_bucket=8))
    assert llm.config.vocab_size == 128
    assert not jax.distributed.is_initialized() and jax.process_count() == 1


MULTIHOST = textwrap.dedent('''
    import json
    import os
    from ssd_jax.runtime import distributed
    assert distributed.initialize()  # from SSD_JAX_* in the environment, before any JAX use
    import jax
    import numpy as np
    from jax.experimental import multihost_utils
    from ssd_jax.sharding import split_devices
    split = split_devices(2, 2)
    # a real cross-process collective over all 4 devices of the 2 "hosts"
    ids = multihost_utils.process_allgather(np.array([jax.process_index()]))
    # a file, not stdout: gloo's threads write to stdout too and can land inside our line
    with open(os.environ["RESULT_FILE"], "w") as f:
        json.dump(dict(
            processes=jax.process_count(), devices=len(jax.devices()),
            local=len(jax.local_devices()), gathered=np.asarray(ids).ravel().tolist(),
            target_hosts=sorted({d.process_index for d in split.target.devices.flat}),
            draft_hosts=sorted({d.process_index for d in split.draft.devices.flat})), f)
''')


def test_two_hosts_start_from_the_environment_and_the_draft_gets_a_host(tmp_path):
    """Two processes with two CPU devices each, started only with SSD_JAX_* variables (as a
    launcher would on two hosts), form one 4-device job; the draft gets the second host."""
    import json
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = []
    for pid in range(2):
        env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=2",
                   JAX_PLATFORMS="cpu", SSD_JAX_COORDINATOR=f"127.0.0.1:{port}",
                   SSD_JAX_NUM_PROCESSES="2", SSD_JAX_PROCESS_ID=str(pid),
                   RESULT_FILE=str(tmp_path / f"result{pid}.json"))
        procs.append(subprocess.Popen([sys.executable, "-c", MULTIHOST], env=env, text=True,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE))
    outs = []
    for pid, p in enumerate(procs):
        out, err = p.communicate(timeout=300)
        assert p.returncode == 0, err[-3000:]
        outs.append(json.loads((tmp_path / f"result{pid}.json").read_text()))
    for r in outs:
        assert r == dict(processes=2, devices=4, local=2, gathered=[0, 1], target_hosts=[0],
                         draft_hosts=[1]), r
