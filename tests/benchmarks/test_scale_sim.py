"""benchmarks/scale_sim.py, the compile-only memory simulator, on a tiny MoE model.

One subprocess (JAX reads ``XLA_FLAGS`` once, at start-up; the simulator sets 4 simulated
devices itself) runs the simulator's ``main`` four times: the unrolled update extrapolated
from 1 and 2 layers and compiled whole at 3, a rollout of scanned layers through the
engine, and one generate_fn call of GRPO's recipe (then with LoRA adapters an update and a
rollout); the resident arrays of the KL, critic
and asynchronous recipes without compiling, and the errors of ordinary mistakes. It prints
the records as JSON.
"""

import argparse
import json
import subprocess
import sys
import textwrap

import pytest

from benchmarks import scale_fit, scale_sim
from benchmarks.scale_sim import collectives
from policyopt.models import preset
from tests.flags import ROOT, subprocess_env

_SCRIPT = textwrap.dedent("""
    import contextlib, io, json, os, sys
    from benchmarks import scale_fit, scale_sim
    out = sys.argv[1]
    base = ["--preset", "tiny_moe", "--devices", "4", "--mesh", "fsdp=4",
            "--model.num_layers=3", "--model.dtype=bfloat16"]
    update = ["--step", "update", *base, "--seq-len", "128", "--prompt-len", "16"]
    rollout = ["--step", "rollout", "--devices", "4", "--mesh", "fsdp=4", "--prompts", "4",
               "--samples", "2", "--prompt-len", "16", "--new-tokens", "8"]
    records, printed, errors = {}, {}, {}

    def run(name, argv):
        stdout = io.StringIO()
        with contextlib.redirect_stdout(stdout):
            records[name] = scale_sim.main(argv)
        printed[name] = stdout.getvalue()

    run("extrapolated", update + ["--device-memory-gib", "1e-4",
                                  "--json", os.path.join(out, "update.json")])
    run("full", update + ["--full-depth", "--device-memory-gib", "80"])
    run("rollout", rollout + ["--preset", "tiny_moe", "--model.num_layers=2",
                              "--model.scan_layers=true", "--engine-kv-tokens", "64"])
    run("rollout_generate", rollout + ["--config", "configs/grpo.py:model.num_layers=1",
                                       "--engine-kv-tokens", "0"])
    LORA = ["--config.model.lora.rank=2", "--config.model.lora.base_dtype=bfloat16"]
    run("lora", update + ["--model.num_layers=1", *LORA])  # one layer: compiled whole
    # generate_fn: the merged sampler is the base graph whichever calls take it (the
    # engine's calls: the "rollout" run).
    run("lora_rollout", rollout + ["--preset", "tiny_moe", "--model.num_layers=1",
                                   "--engine-kv-tokens", "0", *LORA])

    # What stays resident, from the shapes alone: params replicated over data=4, so each
    # device holds all of them (the test compares with a count by hand).
    from policyopt import sharding
    resident = {}
    for name, recipe in (("kl", "grpo"), ("critic", "ppo"), ("async", "magistral_async"),
                         ("async_engine", "magistral_async")):
        variant = "sampling.engine_kv_tokens=4096" if name == "async_engine" else ""
        args = scale_sim.parse_args(["--step", "update", "--method", recipe, "--variant",
                                     variant, "--devices", "4", "--mesh", "data=4",
                                     "--seq-len", "128", "--prompt-len", "16",
                                     "--rows-per-device", "2"])
        config = scale_sim.recipe_config(args)
        scale_sim.resolve_inputs(args, config)
        args.preset = config.model.preset
        mesh = sharding.make_mesh(scale_sim.mesh_shape(args, config))
        setup = scale_sim.build(args, config, mesh, 2)
        batch = scale_sim.update_batch(args, config, setup, mesh)
        items = scale_fit.resident("update", config, setup, mesh, batch=batch, prompt_len=16)
        resident[name] = dict(
            items={r.name: r.bytes for r in items},
            params=scale_fit.per_device_bytes(setup.state.params),
            config=dict(n_async=config.async_mode.n_async, n_prompts=config.batch.n_prompts,
                        group=config.batch.group_size, new=config.sampling.max_new_tokens,
                        segment=config.async_mode.segment_steps,
                        buckets=list(config.batch.prompt_buckets)),
        )

    for name, argv in {
        "group": ["--step", "update", "--devices", "4", "--method", "dapo", "--variant",
                  "batch.group_size=8", "--seq-len", "64", "--prompt-len", "16"],
        "budget": ["--step", "update", "--devices", "4", "--method", "gspo", "--variant",
                   "scale=paper", "--seq-len", "64", "--prompt-len", "16"],
        "file": ["--step", "update", "--devices", "4", "--config", "configs/nope.py:x=1"],
        "field": ["--step", "update", "--devices", "4", "--seq-len", "64",
                  "--prompt-len", "16", "--config.algo.no_such_field=1"],
        "critic": ["--step", "update", "--devices", "4", "--method", "ppo", "--variant",
                   "critic.init_checkpoint=runs/big/checkpoints", "--seq-len", "64",
                   "--prompt-len", "16"],
    }.items():
        stderr = io.StringIO()
        with contextlib.redirect_stderr(stderr):
            try:
                scale_sim.main(argv)
            except SystemExit as exit_:
                errors[name] = dict(code=exit_.code, stderr=stderr.getvalue())

    with open(os.path.join(out, "records.json"), "w") as f:
        json.dump(dict(records=records, printed=printed, resident=resident, errors=errors),
                  f, default=str)
""")


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("scale_sim")
    env = subprocess_env(PYTHONPATH=ROOT)  # the simulator adds its device count
    proc = subprocess.run(
        [sys.executable, "-c", _SCRIPT, str(out)],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    with open(out / "records.json") as f:
        loaded = json.load(f)
    with open(out / "update.json") as f:  # --json writes the same record
        assert (
            json.load(f)["per_device_peak_gib"]
            == loaded["records"]["extrapolated"]["per_device_peak_gib"]
        )
    return loaded


@pytest.fixture(scope="module")
def records(results):
    return results["records"]


def test_update_record_fields(records):
    record = records["extrapolated"]
    assert record["step"] == "update" and record["devices"] == 4 and record["num_layers"] == 3
    assert record["method"] == "gspo"  # the default recipe
    assert record["mesh"] == {"data": 1, "fsdp": 4, "tensor": 1, "expert": 1}
    assert record["extrapolated"] is True and records["full"]["extrapolated"] is False
    assert [c["num_layers"] for c in record["calls"][0]["compiles"]] == [1, 2]
    assert record["rows"] == 4 and record["rows_on_each_device"] == 1
    # GSPO's CPU geometry: 8 prompts x 8 samples in 4 minibatches.
    assert record["recipe_minibatch_rows"] == 16
    assert record["model"]["dtype"] == "bfloat16"  # --model.* reaches the ModelConfig
    assert record["compile_s"] > 0
    for kind in scale_sim.KINDS:
        assert kind in record["collectives"]


def test_state_is_params_and_adam_moments_over_fsdp(records):
    # tiny_moe at 3 layers, float32 parameters: the state is 3 copies (params, mu, nu);
    # sharded over fsdp=4 where the dimensions divide, so between a quarter and all of it.
    record = records["extrapolated"]
    params = record["params_gib_per_device"]
    assert record["state_gib_per_device"] == pytest.approx(3 * params, rel=1e-3)
    total = 3 * sum(_num_params_tiny_moe(3)) * 4 / 2**30
    assert total / 4 <= record["state_gib_per_device"] < total


def _num_params_tiny_moe(layers):
    # V=512, D=64, 4 heads / 2 kv heads of 16, 4 experts of F=64, untied embeddings.
    V, D, E, F, Dh = 512, 64, 4, 64, 16
    attention = 2 * D * 4 * Dh + 2 * D * 2 * Dh + 2 * Dh
    return [2 * V * D, layers * (attention + E * D + E * 3 * D * F + 2 * D), D]


def test_extrapolation_of_unrolled_layers_matches_the_full_compile(records):
    extrapolated = records["extrapolated"]["per_device_peak_gib"]
    full = records["full"]["per_device_peak_gib"]
    assert extrapolated == pytest.approx(full, rel=0.03)
    compiled = records["full"]["calls"][0]["compiles"][0]
    assert compiled["peak_bytes"] == (
        compiled["argument_bytes"]
        + compiled["output_bytes"]
        - compiled["alias_bytes"]
        + compiled["temp_bytes"]
    )
    # The donated state is aliased to the new state.
    assert compiled["alias_bytes"] > 0


def test_scanned_layers_compile_whole_without_full_depth(records):
    record = records["rollout"]
    assert record["model"]["scan_layers"] is True and record["num_layers"] == 2
    assert record["extrapolated"] is False
    assert "scanned" in record["depth"]
    assert all([c["num_layers"] for c in call["compiles"]] == [2] for call in record["calls"])


def test_extrapolate_refuses_a_shrinking_second_layer():
    assert scale_sim.extrapolate(10, 12, 5) == 18  # 10 + 4 x 2
    assert scale_sim.extrapolate(10, 10, 48) == 10
    assert scale_sim.extrapolate(10, 8, 5) is None  # would print 2 and fall below zero
    model = preset("tiny_moe", num_layers=6)
    args = argparse.Namespace(full_depth=False)
    assert scale_sim.depth_plan(args, model)[0] == (1, 2)
    scanned = preset("tiny_moe", num_layers=6, scan_layers=True)
    assert scale_sim.depth_plan(args, scanned)[0] == (6,)
    assert scale_sim.depth_plan(argparse.Namespace(full_depth=True), model)[0] == (6,)


def test_collectives_are_read_on_an_fsdp_mesh(records):
    found = records["full"]["collectives"]
    assert found["all-reduce"]["count"] > 0 and found["all-gather"]["count"] > 0
    # The embedding [512, 64] is fsdp-sharded on its D dimension: gathered whole.
    shapes = [op["shape"] for op in found["all-gather"]["largest"]]
    assert any("[512,64]" in s or "[64,512]" in s for s in shapes), shapes
    # Three layers hold more collectives than two (counted once per op in the program).
    two = records["extrapolated"]["collectives"]
    assert found["all-gather"]["count"] > two["all-gather"]["count"]


@pytest.mark.parametrize(
    "name,calls,method",
    [
        ("rollout", ["engine_admit", "engine_decode", "engine_evict"], "gspo"),
        ("rollout_generate", ["generate_fn"], "grpo"),
    ],
)
def test_rollout_record(records, name, calls, method):
    record = records[name]
    assert record["step"] == "rollout" and record["rows"] == 8
    assert record["method"] == method  # --config configs/grpo.py:... names the recipe
    assert record["prompt_rows_on_each_device"] == 1  # 4 prompts over fsdp=4
    assert [c["call"] for c in record["calls"]] == calls
    assert record["per_device_peak_gib"] == max(c["per_device_peak_gib"] for c in record["calls"])
    assert record["per_device_peak_gib"] > 0
    # Beside the rollout: the optimiser's moments, and with GRPO's KL term the reference
    # policy's parameters (a copy of the parameters, sharded as they are).
    opt_state = record["state_gib_per_device"] - record["params_gib_per_device"]
    expected = {"the policy's optimiser state": opt_state}
    if method == "grpo":
        expected["the reference policy's parameters"] = record["params_gib_per_device"]
    assert {r["name"]: r["gib"] for r in record["resident"]} == pytest.approx(expected, rel=1e-4)
    assert record["resident_gib"] == pytest.approx(sum(expected.values()))
    for call in record["calls"]:
        assert call["total_gib"] == pytest.approx(
            call["per_device_peak_gib"] + record["resident_gib"]
        )
    assert record["fits"] is None  # no --device-memory-gib


def test_resident_reference_and_critic_counted_by_hand(results):
    # data=4: every device holds every parameter (float32), 2 layers of tiny_moe.
    params = 4 * sum(_num_params_tiny_moe(2))
    kl, critic = results["resident"]["kl"], results["resident"]["critic"]
    assert kl["params"] == params
    assert kl["items"] == {"the reference policy's parameters": params}
    # The critic: the policy's parameters plus a value head (D weights and a bias), each
    # with Adam's two moments; the optimiser's step counters (int32) replicated.
    head = 4 * (64 + 1)
    counted = critic["items"]["the critic's parameters and optimiser state"]
    assert 3 * (params + head) <= counted <= 3 * (params + head) + 64


def test_resident_asynchronous_generator_counted_by_hand(results):
    # tiny_moe, float32: bytes of one token slot's keys (or values) over 2 layers x 2 KV
    # heads of 16.
    slot = 2 * 2 * 16 * 4
    dense, paged = results["resident"]["async"], results["resident"]["async_engine"]
    c = dense["config"]
    rows = 2 * c["n_prompts"] * c["group"] if c["n_async"] is None else c["n_async"]
    slots = 16 + c["new"] + min(c["segment"], c["new"])  # prompt + new tokens + a segment
    cache = 2 * rows * slots * slot  # every row on each device (data=4 splits rows: / 4)
    assert dense["items"]["the asynchronous generator's parameters"] == dense["params"]
    kv = dense["items"]["the asynchronous generator's KV cache"]
    assert cache / 4 <= kv <= cache / 4 * 1.5, (kv, cache / 4)
    # The engine: each device's pool of 4096 token slots, keys and values.
    pool = 4096 * 2 * slot
    kv = paged["items"]["the asynchronous generator's page pools"]
    assert pool <= kv <= pool * 1.5, (kv, pool)


def test_fits_verdict_ends_the_output(results):
    printed, records = results["printed"], results["records"]
    full, tight = records["full"], records["extrapolated"]
    assert full["fits"] is True and tight["fits"] is False
    total = f"{full['total_gib']:.2g}"
    assert printed["full"].rstrip().splitlines()[-1] == f"fits: yes ({total} GiB of 80)"
    last = printed["extrapolated"].rstrip().splitlines()[-1]
    assert last.startswith(f"fits: no ({tight['total_gib']:.2g} GiB of 0.0001): try ")
    # bfloat16 but unrolled, no remat, small MoE blocks: those levers, each named.
    settings = [lever["setting"] for lever in tight["levers"]]
    assert settings[:3] == [
        "model.remat=full",
        "model.scan_layers=True",
        "model.moe_block_size=4096",
    ]
    assert all(s in last for s in settings)
    # The total: the compiled peak plus what stays resident (GSPO's 4 minibatches).
    assert tight["total_gib"] == pytest.approx(tight["per_device_peak_gib"] + tight["resident_gib"])
    assert [r["name"] for r in tight["resident"]] == ["the iteration's batch"]
    assert "extrapolated from 1 and 2 unrolled layers" in printed["extrapolated"]


def test_levers_for_several_rows_and_a_data_axis():
    model = preset("tiny_moe", moe_dispatch="ragged", attention="xla", dtype="float32")
    record = dict(
        step="update",
        inputs=dict(seq_len=1024),
        mesh=dict(data=2, fsdp=4, tensor=1, expert=1),
        rows_on_each_device=4,
        state_gib_per_device=30.0,
        resident=[dict(name="the reference policy's parameters", gib=10.0)],
        total_gib=100.0,
        device_memory_gib=80.0,
    )
    settings = dict(scale_fit.levers(record, model))
    assert list(settings) == [
        "batch.micro_batch_tokens=8192",  # one 1,024-token row on each of 8 row devices
        "model.remat=full",
        "model.scan_layers=True",
        "model.dtype=bfloat16",
        "model.attention=blockwise",
        "model.moe_dispatch=blocked",
        "mesh.fsdp=8,mesh.data=1",  # 40 GiB of state and copies, half of it saved
    ]
    # Micro-batches of one row per device already: not proposed again.
    record["micro_batch_tokens"] = 8192
    assert "batch.micro_batch_tokens=8192" not in dict(scale_fit.levers(record, model))
    # A run whose excess is activations: no fsdp lever while another lever applies.
    record.update(state_gib_per_device=1.0, resident=[], total_gib=500.0)
    assert "mesh.fsdp=8,mesh.data=1" not in dict(scale_fit.levers(record, model))


def test_moe_chunk_lever_where_a_device_holds_more_than_65536_copies():
    """4 rows x 32,768 tokens x k=2 = 262,144 copies per device: the blocked dispatch in
    chunks is proposed unless chunks of at most 65,536 rows are set; 8,192 copies: never."""
    model = preset("tiny_moe", moe_dispatch="blocked", moe_block_size=4096)
    record = dict(
        step="update",
        inputs=dict(seq_len=32768),
        mesh=dict(data=1, fsdp=8, tensor=1, expert=1),
        rows_on_each_device=4,
        micro_batch_tokens=8 * 32768,
        state_gib_per_device=1.0,
        resident=[],
        total_gib=500.0,
        device_memory_gib=80.0,
    )

    def proposed(model, **inputs):
        record["inputs"].update(inputs)
        return "model.moe_chunk_rows=65536" in dict(scale_fit.levers(record, model))

    assert proposed(model)
    assert proposed(model.replace(moe_chunk_rows=131072))
    assert not proposed(model.replace(moe_chunk_rows=65536))
    assert not proposed(model, seq_len=1024)


def test_ordinary_mistakes_are_one_line_errors(results):
    errors = results["errors"]
    for name, expect in {
        # DAPO's group_token_mean over 4 rows, groups of 8.
        "group": "does not hold whole groups of batch.group_size=8, which "
        "algo.aggregation='group_token_mean' needs: use --rows-per-device 2",
        "budget": "scale=paper: this recipe's paper records no value for sampling.max_new_tokens",
        "file": "config file not found: 'configs/nope.py'",
        "field": "algo.no_such_field",
        "critic": "a critic of its own (another model) is not estimated here",
    }.items():
        error = errors[name]
        assert error["code"] == 2, name
        lines = error["stderr"].splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: "), error["stderr"]
        assert expect in lines[0], lines[0]


def test_config_string_is_the_method_and_variant():
    by_file = scale_sim.parse_args(
        [
            "--step",
            "update",
            "--rows-per-device",
            "2",
            "--config",
            "configs/dapo.py:scale=paper,model.remat=save_dots",
        ]
    )
    by_name = scale_sim.parse_args(
        ["--step", "update", "--method", "dapo", "--variant", "scale=paper,model.remat=save_dots"]
    )
    a, b = scale_sim.recipe_config(by_file), scale_sim.recipe_config(by_name)
    assert a.to_dict() == b.to_dict() and by_file.recipe == by_name.recipe == "dapo"
    assert a.model.remat == "save_dots" and a.model.moe_block_size == 4096
    # The recipe fills the geometry left out: its widest row, its round.
    scale_sim.resolve_inputs(by_file, a)
    assert by_file.prompt_len == max(a.batch.prompt_buckets)
    assert by_file.seq_len == by_file.prompt_len + a.sampling.max_new_tokens
    with pytest.raises(SystemExit):  # both forms at once
        scale_sim.parse_args(["--step", "update", "--config", "configs/dapo.py", "--method", "x"])


def test_a_paper_size_preset_without_scale_paper_is_noted():
    args = argparse.Namespace(preset="qwen3_8b", variant_items=[])
    cpu = preset("qwen3_8b")
    (note,) = scale_fit.paper_scale_notes(args, cpu, 8_190_735_360)
    assert note.startswith("note: qwen3_8b (8.2B parameters) compiles with the recipe's CPU")
    assert "float32 matmuls, unscanned layers, no remat" in note and "scale=paper" in note
    args.variant_items = ["scale=paper", "sampling.max_new_tokens=20480"]
    assert scale_fit.paper_scale_notes(args, cpu, 8_190_735_360) == []
    args.variant_items = []
    paper = preset("qwen3_8b", dtype="bfloat16", scan_layers=True, remat="full")
    assert scale_fit.paper_scale_notes(args, paper, 8_190_735_360) == []
    assert scale_fit.paper_scale_notes(args, cpu, 5 * 10**8) == []  # not paper-sized


def test_collectives_parser_on_hand_written_hlo():
    hlo = textwrap.dedent("""
        %all-reduce.1 = f32[1024,64]{1,0} all-reduce(f32[1024,64]{1,0} %p), replica_groups={}
        %ag = bf16[8,128]{1,0} all-gather(bf16[1,128]{1,0} %q), dimensions={0}
        %t = (f32[4]{0}, s32[2,2]{1,0}) all-reduce(f32[4]{0} %a, s32[2,2]{1,0} %b)
        ROOT %r = s32[16]{0} ragged-all-to-all(s32[16]{0} %x, s32[16]{0} %y)
        %s = (f32[2]{0}, f32[16]{0}) all-gather-start(f32[2]{0} %z)
        %d = f32[16]{0} all-gather-done((f32[2]{0}, f32[16]{0}) %s)
        %add = f32[4]{0} add(f32[4]{0} %a, f32[4]{0} %a)
    """)
    found = collectives(hlo)
    assert found["all-reduce"]["count"] == 2
    assert found["all-reduce"]["bytes"] == 1024 * 64 * 4 + 4 * 4 + 4 * 4
    assert found["all-reduce"]["largest"][0] == {"shape": "f32[1024,64]", "bytes": 262144}
    assert found["all-gather"]["count"] == 2  # the plain op and the -start, not the -done
    assert found["all-gather"]["bytes"] == 8 * 128 * 2 + 16 * 4
    assert found["ragged-all-to-all"]["count"] == 1 and found["all-to-all"]["count"] == 0
    assert found["reduce-scatter"] == {"count": 0, "bytes": 0, "largest": []}


def test_lora_counts_the_frozen_base_and_the_adapters_state_apart(records, results):
    # Rank 2 on every target of tiny_moe at 1 layer: the state is 3 copies of the
    # adapters (float32), the base is counted apart in bfloat16, both inside the peak.
    record = records["lora"]
    assert record["lora"]["rank"] == 2 and record["lora"]["targets"] == ["all"]
    assert record["num_layers"] == 1 and record["extrapolated"] is False
    assert record["model"]["param_dtype"] == "bfloat16"  # the base
    assert record["state_gib_per_device"] == pytest.approx(
        3 * record["params_gib_per_device"], rel=1e-3
    )
    D, L, E, F, Dh, r = 64, 1, 4, 64, 16, 2
    attention = r * (D + 4 * Dh) * 2 + r * (D + 2 * Dh) * 2
    experts = E * 3 * r * (D + F)
    router = r * (D + E)
    adapters = L * (attention + experts + router) * 4 / 2**30
    assert adapters / 4 <= record["params_gib_per_device"] <= adapters
    base = sum(_num_params_tiny_moe(1)) * 2 / 2**30
    assert base / 4 <= record["frozen_gib_per_device"] <= base
    # Under a fifth of the least a full-weights state of 1 layer (float32 params and Adam's
    # two moments, at most fsdp=4 ways sharded) holds on a device.
    full_state = 3 * sum(_num_params_tiny_moe(1)) * 4 / 2**30
    assert record["state_gib_per_device"] < full_state / 4 / 5
    assert record["calls"][0]["compiles"][0]["argument_bytes"] / 2**30 >= (
        record["frozen_gib_per_device"] + record["state_gib_per_device"]
    )
    assert "frozen base per device" in results["printed"]["lora"]
    rollout = records["lora_rollout"]
    assert rollout["lora"]["sampler"] == "merged"
    assert [c["call"] for c in rollout["calls"]] == ["generate_fn"]
    # The merged sampler decodes a copy: the base and the adapters stay resident beside it.
    resident = {r["name"]: r["gib"] * 2**30 for r in rollout["resident"]}
    base_1 = sum(_num_params_tiny_moe(1)) * 2
    beside = resident["the frozen base and the adapters"]
    assert base_1 / 4 <= beside <= base_1 + adapters * 2**30
