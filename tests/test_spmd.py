"""Issue 8: SPMD over a 4-device PJRT CPU, Megatron-sharded base and adapter weights.

SPMD must be on before any XLA tensor exists and this pytest process already
runs the single-device runtime, so the scenario (tests/spmd_scenario.py) runs
in a fresh process, once per module, and every check below reads its JSON.
"""
import json
import os
import subprocess
import sys
import types

import pytest

from xla_lora_pass.metadata.sharding import COLUMN, MEGATRON_LLAMA, REPLICATED, ROW, AdapterSharding, tile_dims

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOL = 1e-4  # fp32, absolute, against the unsharded eager reference


@pytest.fixture(scope="module")
def scenario(xla_device):
    # The scenario's process imports torch_xla: asking for xla_device marks these tests xla (tests/conftest.py),
    # skipped with the reason where torch_xla is not installed.
    env = dict(os.environ, PJRT_DEVICE="CPU", CPU_NUM_DEVICES="4")
    run = subprocess.run([sys.executable, "-m", "tests.spmd_scenario"], cwd=REPO, env=env, capture_output=True,
                         text=True, timeout=1200)
    assert run.returncode == 0, f"scenario failed ({run.returncode})\n{run.stdout[-3000:]}\n{run.stderr[-5000:]}"
    return json.loads(run.stdout.strip().splitlines()[-1])


def test_runs_on_four_spmd_devices_with_megatron_base_sharding(scenario):
    assert scenario["devices"] == 4 and scenario["spmd"] is True
    assert scenario["base_sharded"] == 14  # 7 linears x 2 decoder layers
    assert scenario["hook_vs_peft"] < 1e-5  # the per-token reference agrees with PEFT's per-sequence mixing


def test_layouts_read_off_the_base_weights_are_megatron(scenario):
    layouts = scenario["layouts"]
    assert len(layouts) == 14
    assert {s.rsplit(".", 1)[-1]: l for s, l in layouts.items()} == dict(MEGATRON_LLAMA)
    assert scenario["layouts_match_megatron_rule"] and scenario["explicit_rule_same"]


def test_mixed_per_token_batch_equals_unsharded_eager(scenario):
    assert scenario["adapters_in_mixed"] == ["chat", "code", "sql"]
    assert scenario["mixed_per_token_diff"] < TOL
    assert scenario["rewrites"] == {"lora_linear": 3 * 14}  # first trace, size 1, dynamic graph


def test_stacked_buffers_are_sharded_where_the_layout_says(scenario):
    for site, spec in scenario["specs"].items():
        leaf = site.rsplit(".", 1)[-1]
        if MEGATRON_LLAMA[leaf] == COLUMN:  # B [N, out, R] split on out, A replicated
            assert spec["B"] == "{devices=[1,4,1]0,1,2,3}", (site, spec)
            assert spec["A"] == "{replicated}", (site, spec)
        else:  # row: A [N, R, in] split on in, B replicated
            assert spec["A"] == "{devices=[1,1,4]0,1,2,3}", (site, spec)
            assert spec["B"] == "{replicated}", (site, spec)
    # Fused q+k+v and gate+up shrinks: one A over column-parallel sites, replicated.
    assert len(scenario["fused_specs"]) == 4
    assert set(scenario["fused_specs"].values()) == {"{replicated}"}
    assert scenario["index_specs"] == ["{replicated}"]


def test_memory_per_device_matches_the_layout_arithmetic(scenario):
    n, r, h, kv, i = 4, 8, 32, 16, 64  # slots, max rank, hidden, k/v out, intermediate
    a_col = n * r * h  # A of q, k, v, gate, up (replicated)
    b_col = n * r * (h + 2 * kv + 2 * i)  # B of q, k, v, gate, up
    a_row = n * r * (h + i)  # A of o, down
    b_row = n * r * (h + h)  # B of o, down (replicated)
    whole = 2 * 4 * (5 * a_col + b_col + a_row + b_row)  # 2 layers, fp32
    per_device = 2 * 4 * (5 * a_col + b_col // 4 + a_row // 4 + b_row)
    assert scenario["bytes"]["site_stacks_whole"] == whole
    assert scenario["bytes"]["site_stacks_per_device"] == per_device < whole


def test_splitting_both_stacks_takes_a_quarter_per_device_and_stays_exact(scenario):
    """meta.shard(mesh, both=True): every stack split 4 ways; results unchanged."""
    assert scenario["both_diff"] < TOL
    assert scenario["both_all_split"]
    whole = scenario["both_bytes"]["site_stacks_whole"]
    assert whole == scenario["bytes"]["site_stacks_whole"]
    assert scenario["both_bytes"]["site_stacks_per_device"] == whole // 4


def test_bucketing_is_unchanged_under_spmd(scenario):
    # The first trace (2 tokens) and buckets 8 and 16 for the row kernel and for the masked one (the
    # scenario's mappings mix adapters within rows, so the masked programs serve it); size 1 once.
    assert scenario["precompiled"] == 2 * 1 + 1 + 2 * 2
    assert max(scenario["bucket_diffs"]) < TOL
    assert scenario["bucket_new_programs"] == 0
    # Only the tiny pad/slice programs of token counts not seen before, as on one device.
    assert scenario["bucket_xla_compiles"] <= len(scenario["bucket_sizes"])
    assert scenario["bucket_hits"]["(4, 8)"] >= 3 and scenario["bucket_hits"]["(4, 16)"] >= 2


def test_remap_compiles_nothing(scenario):
    assert scenario["remap_diff"] < TOL and scenario["remap_rows_diff"] < TOL
    assert scenario["remap_xla_compiles"] == 0


def test_adapter_reload_keeps_the_sharding_and_compiles_nothing(scenario):
    assert scenario["fresh_slot"] == 3 and scenario["reload_uses_fresh"] > 0
    assert scenario["reload_diff"] < TOL
    assert scenario["reload_xla_compiles"] == 0
    assert scenario["reload_specs"] == ["{devices=[1,1,4]0,1,2,3}", "{replicated}"]  # down_proj: row
    assert scenario["compiles_total"] == 7


# ---------------------------------------------------------------- no SPMD needed


def test_tile_dims_parses_xla_sharding_specs():
    assert tile_dims("{devices=[4,1]0,1,2,3}") == (4, 1)
    assert tile_dims("{devices=[1,4]0,1,2,3}") == (1, 4)
    assert tile_dims("{devices=[1,2,2]0,1,2,3 last_tile_dim_replicate}") == (1, 2)
    assert tile_dims("{replicated}") is None and tile_dims("") is None
    assert tile_dims("{devices=[1,1,4]0,1,2,3 last_tile_dim_replicate}") is None


def _fake(layout, sites=("l.q_proj", "l.k_proj", "l.o_proj"), both=False):
    meta = types.SimpleNamespace(sites={s: None for s in sites})
    mesh = types.SimpleNamespace(axis_names=("data", "model"), mesh_shape=(1, 4))
    return AdapterSharding(meta, mesh, layout, both=both)


def test_partition_specs_when_both_stacks_are_split():
    sh = _fake(MEGATRON_LLAMA, both=True)
    assert sh.partition_specs("l.q_proj") == ((None, None, "model"), (None, "model", None))
    assert sh.partition_specs("l.o_proj") == ((None, None, "model"), (None, "model", None))
    assert sh.partition_specs(("l.q_proj", "l.k_proj")) == ((None, None, "model"), None)
    assert sh.bias_spec("l.o_proj") == (None, "model")


def test_partition_specs_per_layout():
    sh = _fake(MEGATRON_LLAMA)
    assert sh.layouts() == {"l.q_proj": COLUMN, "l.k_proj": COLUMN, "l.o_proj": ROW}
    assert sh.axis == "model"
    assert sh.partition_specs("l.q_proj") == ((None, None, None), (None, "model", None))
    assert sh.partition_specs("l.o_proj") == ((None, None, "model"), (None, None, None))
    assert sh.partition_specs(("l.q_proj", "l.k_proj")) == ((None, None, None), None)
    assert sh.bias_spec("l.q_proj") == (None, "model") and sh.bias_spec("l.o_proj") == (None, None)
    rows = _fake(lambda site: ROW)
    assert rows.partition_specs(("l.q_proj", "l.k_proj")) == ((None, None, "model"), None)
    assert _fake({"l.k_proj": REPLICATED, "q_proj": ROW}).layout("l.k_proj") == REPLICATED


def test_bad_layouts_are_refused():
    with pytest.raises(ValueError, match="layouts must be one of"):
        _fake({"q_proj": "diagonal"})
    with pytest.raises(ValueError, match="not an axis"):
        AdapterSharding(types.SimpleNamespace(sites={}),
                        types.SimpleNamespace(axis_names=("x",), mesh_shape=(4,)), None, axis="model")
    with pytest.raises(ValueError, match="layout rule gave"):
        _fake(lambda site: "sideways").layout("l.q_proj")
