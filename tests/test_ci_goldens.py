"""bench/ci_goldens.py on a fake Megatron-LM checkout written here, in the shapes it reads."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench"
sys.path.insert(0, str(BENCH))
import ci_goldens  # noqa: E402

# A small GPT as Megatron-LM's functional tests write one: MODEL_ARGS as the runner passes them
# (`true` is the bare flag), ENV_VARS and the runner's own keys beside them.
CONFIG = """\
ENV_VARS:
  CUDA_DEVICE_MAX_CONNECTIONS: 1
  NCCL_ALGO: Ring
MODEL_ARGS:
  --num-layers: 4
  --hidden-size: 256
  --num-attention-heads: 4
  --seq-length: 512
  --max-position-embeddings: 512
  --micro-batch-size: 1
  --global-batch-size: 8
  --tensor-model-parallel-size: 1
  --pipeline-model-parallel-size: 2
  --use-distributed-optimizer: true
  --transformer-impl: transformer_engine
  --tokenizer-type: NullTokenizer
  --vocab-size: 8191
  --bf16: true
  --log-memory-to-tensorboard: true
TEST_TYPE: regular
"""
# One product listing the case: 1 node x 4 GPUs, so dp = 4 / (tp 1 x pp 2) = 2.
RECIPE = """\
type: basic
spec:
  model: gpt
  nodes: 1
  gpus: 4
products:
  - test_case: [tiny_gpt]
    products:
      - environment: [dev]
        platforms: [dgx_h100]
"""
STEPS = 8


def _series(values: dict[int, float | str]) -> dict:
    return {"start_step": 1, "end_step": STEPS, "step_interval": 1,
            "values": {str(k): v for k, v in values.items()}}  # fmt: skip


def _golden() -> dict:
    times = {1: 9.0, 2: "nan", 3: 5.0, 4: 0.30, 5: 0.20, 6: "nan", 7: 0.40, 8: 0.25}
    return {
        "mem-allocated-bytes": _series({s: 1000 + s for s in range(1, STEPS + 1)}),
        "mem-max-allocated-bytes": _series({s: 5000 + 10 * s for s in range(1, STEPS + 1)}),
        "iteration-time": _series(times),
    }


@pytest.fixture
def checkout(tmp_path: Path) -> Path:
    cases = tmp_path / ci_goldens.CASES
    gpt = cases / "gpt" / "tiny_gpt"
    gpt.mkdir(parents=True)
    (gpt / "model_config.yaml").write_text(CONFIG)
    (gpt / ci_goldens.GOLDEN).write_text(json.dumps(_golden()))
    # another platform's file: never opened (it is not even JSON)
    (gpt / "golden_values_dev_dgx_gb200.json").write_text("not to be read")
    (gpt / "golden_values_dev_dgx_a100.json").write_text("not to be read")
    bert = cases / "bert" / "tiny_bert"  # not pretrain_gpt.py: a row, never predicted
    bert.mkdir(parents=True)
    (bert / "model_config.yaml").write_text(CONFIG)
    (bert / ci_goldens.GOLDEN).write_text(json.dumps(_golden()))
    a100_only = cases / "gpt" / "a100_only"  # no H100 file: no case
    a100_only.mkdir(parents=True)
    (a100_only / "golden_values_dev_dgx_a100.json").write_text("not to be read")
    recipes = tmp_path / ci_goldens.RECIPES
    recipes.mkdir(parents=True)
    (recipes / "gpt.yaml").write_text(RECIPE)
    return tmp_path


def test_discover_reads_h100_cases_and_their_recipe_world(checkout: Path) -> None:
    cases = ci_goldens.discover(checkout)
    assert [(c.model, c.name, c.world, c.gpt_family) for c in cases] == [
        ("bert", "tiny_bert", 8, False),  # no recipe lists it: the runner's 1 x 8
        ("gpt", "tiny_gpt", 4, True),  # recipes/h100/gpt.yaml: 1 node x 4 GPUs
    ]


def test_golden_takes_the_last_iteration_and_the_median_past_warmup(checkout: Path) -> None:
    found = ci_goldens.read_golden(checkout / ci_goldens.CASES / "gpt/tiny_gpt" / ci_goldens.GOLDEN)
    assert (found.allocated, found.peak) == (1000 + STEPS, 5000 + 10 * STEPS)
    # nan dropped, steps 1..3 are warm-up: 0.30, 0.20, 0.40, 0.25 -> median 0.275
    assert found.step == pytest.approx(0.275)


@pytest.mark.slow
def test_the_logging_rank_is_the_last_and_its_world_comes_from_the_recipe(checkout: Path) -> None:
    case = next(c for c in ci_goldens.discover(checkout) if c.gpt_family)
    assert ci_goldens.data_parallel(case) == 2  # 4 GPUs / (tp 1 x pp 2)
    predicted = ci_goldens.predict(case)
    assert predicted.refusal == "", predicted.refusal
    assert predicted.layout == "tp1 pp2 dp2 mbs1"
    # the last rank is on the last stage: the one `memory --stage 1` reports, whose peak (output
    # layer and loss) is not stage 0's
    from typer.testing import CliRunner

    from inspector.cli import app

    config = str(case.folder / "model_config.yaml")
    result = CliRunner().invoke(app, ["memory", "--config", config, "--dp", "2", "--format", "json"])
    assert result.exit_code == 0, result.output
    stages = json.loads(result.stdout[result.stdout.index("{"):])["stages"]
    peaks = [s["activations"]["total"] for s in stages]
    assert peaks[0] != peaks[1]
    assert predicted.peak - predicted.static == peaks[1]
    # the bench scores the command's own torch.cuda figures (memory/segments.py torch_counts);
    # the state is the last rank's own optimizer shard, the command's the stage's most loaded
    counted = stages[1]["torch_allocated"]
    assert counted["max"] - counted["after_step"] == peaks[1]
    assert 0 <= counted["after_step"] - predicted.static < counted["after_step"] / 100
    assert predicted.step is not None and predicted.step > 0


def test_table_and_summary(checkout: Path) -> None:
    cases = ci_goldens.discover(checkout)
    measured = ci_goldens.Measured(allocated=100 * 2**30, peak=200 * 2**30, step=1.0)
    rows = [
        ci_goldens.Row(cases[0], measured, ci_goldens.Predicted(refusal="not a GPT-family job")),
        ci_goldens.Row(cases[1], measured, ci_goldens.Predicted(
            "tp1 pp2 dp2 mbs1", static=101 * 2**30, peak=190 * 2**30, step=1.2)),
    ]
    table = ci_goldens.render_table(rows).splitlines()
    assert table[2].startswith("| bert/tiny_bert | 8 | - |") and "not a GPT-family job" in table[2]
    assert table[3] == ("| gpt/tiny_gpt | 4 | tp1 pp2 dp2 mbs1 | 190.00 / 200.00 | -5.0% "
                        "| 101.00 / 100.00 | +1.0% | 1.200 / 1.000 | +20.0% |  |")  # fmt: skip
    found = ci_goldens.summary(rows)
    assert (found["gpt_family"], found["modelled"], found["peak_under_5"]) == (1, 1, 0)
    assert found["world_unknown"] == 0
    assert found["peak_within"] == 0 and found["static_within"] == 1
    assert found["step_mae"] == pytest.approx(0.2)


def test_a_config_s_own_gpus_per_node_wins_over_the_recipe() -> None:
    # run_ci_test.sh exports MODEL_ENV_VARS.MODEL_ARGS.GPUS_PER_NODE before launching MODEL_ARGS
    per_run = {"MODEL_ENV_VARS": {"MODEL_ARGS": {"GPUS_PER_NODE": 1}, "MODEL_ARGS_2": {"GPUS_PER_NODE": 2}}}
    assert ci_goldens.runner_gpus(per_run, 8) == 1
    assert ci_goldens.runner_gpus({"ENV_VARS": {"GPUS_PER_NODE": 4}}, 8) == 4
    assert ci_goldens.runner_gpus({"ENV_VARS": {"NCCL_ALGO": "Ring"}}, 8) == 8


def test_a_recipe_that_runs_the_runner_without_gpus_per_node_launches_eight(checkout: Path) -> None:
    # gpt-grpo.yaml books `gpus: 1` and runs run_ci_test.sh, whose _run_training.sh L202 starts
    # GPUS_PER_NODE=${GPUS_PER_NODE:-8} processes: its tp4 x dp2 case runs on 8 GPUs
    script = "  script: |-\n    bash ./tests/functional_tests/shell_test_utils/run_ci_test.sh ARGS\n"
    grpo = RECIPE.replace("gpus: 4\n", "gpus: 1\n" + script)
    (checkout / ci_goldens.RECIPES / "gpt.yaml").write_text(grpo)
    assert [c.world for c in ci_goldens.discover(checkout)] == [8, 8]
    exported = grpo.replace("bash ./", "export GPUS_PER_NODE={gpus}\n    bash ./")  # GB200's
    (checkout / ci_goldens.RECIPES / "gpt.yaml").write_text(exported)
    assert [c.world for c in ci_goldens.discover(checkout)] == [8, 1]


def test_a_release_test_no_recipe_lists_has_an_unknown_world(tmp_path: Path) -> None:
    release = ci_goldens.Case("gpt", "gpt3_15b_8t_release", tmp_path, 1, 8, listed=False)
    assert release.world_unknown
    assert not ci_goldens.Case("gpt", "gpt3_15b_8t_release", tmp_path, 1, 8).world_unknown
    assert not ci_goldens.Case("gpt", "tiny_frozen_resume", tmp_path, 1, 8, listed=False).world_unknown


def test_hybrid_training_cases_are_predicted_and_summarised_apart(tmp_path: Path) -> None:
    hybrid = ci_goldens.Case("hybrid", "hybrid_mr_mcore_te_tp1_pp1_cp1", tmp_path, 1, 8)
    inference = ci_goldens.Case("hybrid", "hybrid_static_inference", tmp_path, 1, 8, "inference")
    assert hybrid.predicted and not hybrid.gpt_family
    assert not inference.predicted
    measured = ci_goldens.Measured(allocated=100 * 2**30, peak=200 * 2**30, step=1.0)
    rows = [ci_goldens.Row(hybrid, measured, ci_goldens.Predicted(
        "tp1 pp1 dp8 mbs4", static=99 * 2**30, peak=202 * 2**30))]
    found = ci_goldens.summary(rows)
    assert (found["gpt_family"], found["modelled"]) == (0, 0)  # the GPT summary leaves it out
    assert (found["hybrid"]["cases"], found["hybrid"]["modelled"]) == (1, 1)
    assert found["hybrid"]["peak"]["median"] == pytest.approx(0.01)
    assert "Hybrid (Mamba) training cases (pretrain_hybrid.py): 1; modelled: 1; peak: 1 cases, " \
        "median +1.0%" in ci_goldens.render_summary(found)


def test_host_bound_step_times_are_summarised_apart(tmp_path: Path) -> None:
    # the host paces the CI's tiny models: their step-time error is its own line, not the GPU's
    case = ci_goldens.Case("gpt", "tiny", tmp_path, 1, 8)
    measured = ci_goldens.Measured(allocated=2**30, peak=2**31, step=1.0)
    rows = [ci_goldens.Row(case, measured, ci_goldens.Predicted("tp1 pp1 dp8 mbs4", step=step,
                                                                 launch_bound=bound))
            for step, bound in ((0.9, False), (0.2, True), (0.4, True))]  # fmt: skip
    found = ci_goldens.summary(rows)
    assert found["step"]["n"] == 1 and found["step_mae"] == pytest.approx(0.1)
    assert found["launch_step"]["n"] == 2 and found["launch_mae"] == pytest.approx(0.7)
    assert "- step time of the host-bound cases, apart: 2 cases, median -70.0%" in \
        ci_goldens.render_summary(found)


def test_the_jobs_nccl_algo_is_read_from_its_env_vars(tmp_path):
    # the 7B deterministic cases set NCCL_ALGO: Ring in ENV_VARS (Megatron-LM's runner exports
    # them into the job's environment); the plan then prices no NVLink SHARP all-reduce
    (tmp_path / "model_config.yaml").write_text("ENV_VARS:\n  NCCL_ALGO: Ring\nMODEL_ARGS: {}\n")
    assert ci_goldens.nccl_algo(tmp_path) == "Ring"
    (tmp_path / "model_config.yaml").write_text("ENV_VARS:\n  CUDA_DEVICE_MAX_CONNECTIONS: 1\n")
    assert ci_goldens.nccl_algo(tmp_path) is None


def test_expandable_segments_are_read_from_the_jobs_allocator_conf(tmp_path):
    # PYTORCH_CUDA_ALLOC_CONF in ENV_VARS (quoted or not, with other options): with expandable
    # segments every block splits down to 512 bytes, so the set-up keeps no segment tail
    from inspector.memory.segments import expandable_segments

    conf = tmp_path / "model_config.yaml"

    def read(env: str) -> bool:
        conf.write_text(f"ENV_VARS:\n{env}\n")
        return expandable_segments(ci_goldens.env_var(tmp_path, "PYTORCH_CUDA_ALLOC_CONF"))

    assert read('  PYTORCH_CUDA_ALLOC_CONF: "expandable_segments:True, garbage_collection_threshold:0.8"')
    assert read("  PYTORCH_CUDA_ALLOC_CONF: expandable_segments:True")
    assert not read("  PYTORCH_CUDA_ALLOC_CONF: expandable_segments:False")
    assert not read("  NCCL_ALGO: Ring")


def test_cublas_workspace_config_is_read_from_the_jobs_env_vars(tmp_path):
    # Megatron-LM's functional tests set CUBLAS_WORKSPACE_CONFIG=:4096:8 in ENV_VARS (quoted or
    # not): torch's cuBLAS workspace is then 4096 KiB x 8 on any GPU (job/device.py), H100's
    # default; unset, the GPU's default
    from inspector.job.device import Device, torch_cublas_workspace

    conf = tmp_path / "model_config.yaml"

    def read(env: str, gpu: str) -> int:
        conf.write_text(f"ENV_VARS:\n{env}\n")
        return torch_cublas_workspace(Device(gpu, ci_goldens.env_var(tmp_path, "CUBLAS_WORKSPACE_CONFIG")))

    assert read('  CUBLAS_WORKSPACE_CONFIG: ":4096:8"', "a100-80gb") == 32 * 2**20
    assert read("  CUBLAS_WORKSPACE_CONFIG: :4096:8", "h100") == 32 * 2**20
    assert read("  NCCL_ALGO: Ring", "a100-80gb") == 8 * 2**20 + 128 * 1024


def test_the_step_time_is_priced_on_megatron_s_own_layer_split() -> None:
    # a config with no split flags runs megatron's even split (6 + 6 layers at pp 2); the plan
    # search also prices other splits of the same sizes, which are another job
    args = {"num_layers": 12, "hidden_size": 256, "num_attention_heads": 4, "seq_length": 512,
            "max_position_embeddings": 512, "micro_batch_size": 1, "global_batch_size": 8,
            "tensor_model_parallel_size": 1, "pipeline_model_parallel_size": 2,
            "vocab_size": 50304, "bf16": True, "transformer_impl": "transformer_engine"}  # fmt: skip
    plan, note = ci_goldens.matching_plan(args, 2)
    assert note == "" and plan.split == (6, 6)
