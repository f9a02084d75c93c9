"""benchmarks/scale_sim.py, the compile-only memory simulator, on a tiny MoE model.

One subprocess (JAX reads ``XLA_FLAGS`` once, at start-up; the simulator sets 4 simulated
devices itself) runs the simulator's ``main`` three times: the update extrapolated from 1
and 2 layers and compiled whole at 3, and two rollouts (through the engine, and one
generate_fn call), then with LoRA adapters an update and a rollout; it writes the records
as JSON.
"""

import json
import os
import subprocess
import sys
import textwrap

import pytest

from benchmarks.scale_sim import collectives
from tests.flags import subprocess_env

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_SCRIPT = textwrap.dedent("""
    import json, os, sys
    from benchmarks import scale_sim
    out = sys.argv[1]
    base = ["--preset", "tiny_moe", "--devices", "4", "--mesh", "fsdp=4",
            "--model.num_layers=3", "--model.dtype=bfloat16"]
    update = ["--step", "update", *base, "--seq-len", "128", "--prompt-len", "16"]
    LORA = ["--config.model.lora.rank=2", "--config.model.lora.base_dtype=bfloat16"]
    rollout = ["--step", "rollout", *base, "--model.num_layers=1", "--prompts", "4",
               "--samples", "2", "--prompt-len", "16", "--new-tokens", "8"]
    records = {
        "extrapolated": scale_sim.main(update + ["--json", os.path.join(out, "update.json")]),
        "full": scale_sim.main(update + ["--full-depth"]),
        "rollout": scale_sim.main(rollout + ["--engine-kv-tokens", "64"]),
        "rollout_generate": scale_sim.main(rollout + ["--engine-kv-tokens", "0"]),
        "lora": scale_sim.main(update + ["--full-depth", *LORA]),
        "lora_rollout": scale_sim.main(rollout + ["--engine-kv-tokens", "64", *LORA]),
    }
    with open(os.path.join(out, "records.json"), "w") as f:
        json.dump(records, f, default=str)
""")


@pytest.fixture(scope="module")
def records(tmp_path_factory):
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
    assert "per-device peak" in proc.stdout  # the table
    with open(out / "records.json") as f:
        loaded = json.load(f)
    with open(out / "update.json") as f:  # --json writes the same record
        assert json.load(f)["per_device_peak_gib"] == loaded["extrapolated"]["per_device_peak_gib"]
    return loaded


def test_update_record_fields(records):
    record = records["extrapolated"]
    assert record["step"] == "update" and record["devices"] == 4 and record["num_layers"] == 3
    assert record["mesh"] == {"data": 1, "fsdp": 4, "tensor": 1, "expert": 1}
    assert record["extrapolated"] is True and records["full"]["extrapolated"] is False
    assert [c["num_layers"] for c in record["calls"][0]["compiles"]] == [1, 2]
    assert record["rows"] == 4 and record["rows_on_each_device"] == 1
    assert record["model"]["dtype"] == "bfloat16"  # --model.* reaches the ModelConfig
    assert record["compile_s"] > 0
    for kind in (
        "all-reduce",
        "all-gather",
        "reduce-scatter",
        "all-to-all",
        "collective-permute",
        "ragged-all-to-all",
    ):
        assert kind in record["collectives"]


def test_state_is_params_and_adam_moments_over_fsdp(records):
    # tiny_moe at 3 layers, float32 parameters: the state is 3 copies (params, mu, nu);
    # sharded over fsdp=4 where the dimensions divide, so between a quarter and all of it.
    record = records["extrapolated"]
    params = record["params_gib_per_device"]
    assert record["state_gib_per_device"] == pytest.approx(3 * params, rel=1e-3)
    total = 3 * sum(_num_params_tiny_moe_3_layers()) * 4 / 2**30
    assert total / 4 <= record["state_gib_per_device"] < total


def _num_params_tiny_moe_3_layers():
    # V=512, D=64, 4 heads / 2 kv heads of 16, 4 experts of F=64, untied embeddings.
    V, D, L, E, F, Dh = 512, 64, 3, 4, 64, 16
    attention = 2 * D * 4 * Dh + 2 * D * 2 * Dh + 2 * Dh
    return [2 * V * D, L * (attention + E * D + E * 3 * D * F + 2 * D), D]


def test_lora_counts_the_frozen_base_and_the_adapters_state_apart(records):
    # Rank 2 on every target of tiny_moe at 3 layers: the state is 3 copies of the
    # adapters (float32), the base is counted apart in bfloat16, both inside the peak.
    record = records["lora"]
    assert record["lora"]["rank"] == 2 and record["lora"]["targets"] == ["all"]
    assert record["model"]["param_dtype"] == "bfloat16"  # the base
    assert record["state_gib_per_device"] == pytest.approx(
        3 * record["params_gib_per_device"], rel=1e-3
    )
    D, L, E, F, Dh, r = 64, 3, 4, 64, 16, 2
    attention = r * (D + 4 * Dh) * 2 + r * (D + 2 * Dh) * 2
    experts = E * 3 * r * (D + F)
    router = r * (D + E)
    adapters = L * (attention + experts + router) * 4 / 2**30
    assert adapters / 4 <= record["params_gib_per_device"] <= adapters
    base = sum(_num_params_tiny_moe_3_layers()) * 2 / 2**30
    assert base / 4 <= record["frozen_gib_per_device"] <= base
    full = records["full"]
    assert record["state_gib_per_device"] < full["state_gib_per_device"] / 5
    assert record["calls"][0]["compiles"][0]["argument_bytes"] / 2**30 >= (
        record["frozen_gib_per_device"] + record["state_gib_per_device"]
    )
    rollout = records["lora_rollout"]
    assert rollout["lora"]["sampler"] == "merged"
    assert {c["call"] for c in rollout["calls"]} == {
        "engine_admit",
        "engine_decode",
        "engine_evict",
    }


def test_extrapolation_matches_the_full_compile(records):
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
    "name,calls",
    [
        ("rollout", ["engine_admit", "engine_decode", "engine_evict"]),
        ("rollout_generate", ["generate_fn"]),
    ],
)
def test_rollout_record(records, name, calls):
    record = records[name]
    assert record["step"] == "rollout" and record["rows"] == 8
    assert record["prompt_rows_on_each_device"] == 1  # 4 prompts over fsdp=4
    assert record["extrapolated"] is False and record["num_layers"] == 1
    assert [c["call"] for c in record["calls"]] == calls
    assert record["per_device_peak_gib"] == max(c["per_device_peak_gib"] for c in record["calls"])
    assert record["per_device_peak_gib"] > 0
    opt_state = record["state_gib_per_device"] - record["params_gib_per_device"]
    assert record["peak_with_resident_state_gib"] == pytest.approx(
        record["per_device_peak_gib"] + opt_state
    )


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
