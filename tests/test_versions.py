"""Facts about megatron-core that differ between the supported versions (0.13 to 0.19).

Golden files are byte-identical across versions; what megatron itself accepts is not, and is
recorded here rather than in comments.
"""

from __future__ import annotations

import re

import megatron.core
import pytest

from inspector.job.recompute_modules import FIRST_VERSION

VERSION = tuple(int(p) for p in megatron.core.__version__.split(".")[:2])
SMALL = "--hidden-size 64 --num-attention-heads 4 --seq-length 32 --vocab-size 1000 --num-layers 2".split()
MOE = SMALL + "--num-experts 4 --moe-ffn-hidden-size 32".split()
SHARED_EXPERT_GATE = VERSION >= (0, 16)  # TransformerConfig.moe_shared_expert_gate
# fusions/fused_mla_yarn_rope_apply.py: ApplyMLARotaryEmbKV takes cp_rank, cp_size from 0.14
MLA_ROPE_KV_CP_ARGS = VERSION >= (0, 14)
# MoE layers with biases: megatron-core 0.15 on (0.13-0.14 TransformerConfig: "Bias is not
# supported for MoE")
MOE_BIASES = VERSION >= (0, 15)
GPT_OSS = VERSION >= (0, 15)  # TransformerConfig.softmax_type, glu_linear_offset, ...; quick_gelu
# 0.13.1 refuses "m" in --pipeline-model-parallel-layout ("MTP layer is not supported for flexible
# pipeline layout"); 0.16.1 places it. Checked on 0.13.1 and 0.16.1 only.
MTP_IN_LAYOUT = VERSION >= (0, 14)
MTP_IN_A_MIDDLE_CHUNK = VERSION >= (0, 16)  # an 'm' in a virtual chunk away from the loss
GROUPED_MLP = VERSION < (0, 17)  # 0.17 removed the legacy GroupedMLP (moe/experts.py)
NULL_TOKENIZER_EOD = VERSION < (0, 18)  # NullTokenizer's vocab_size counts an extra EOD token
# GPTModel._postprocess keeps the MTP head's logits alive while the main logits are made in
# 0.14-0.16; 0.13 and 0.17+ (process_mtp_loss, multi_token_prediction.py) free them before
MTP_LOGITS_HELD = (0, 14) <= VERSION < (0, 17)
# moe_utils.py `permute` without a capacity (the all-to-all dispatcher's, alltoall dispatch_preprocess)
# picks the tokens with `masked_select(routing_map)` to 0.16, whose backward keeps the transposed
# probs (their dtype) and the bool routing map (0.16.1 moe_utils.py 363-372; 0.13.1 314-317);
# from 0.17 (Megatron-LM #3373, for CUDA graphs) with one `argsort` of the flattened map, whose
# int64 indices the probs' gather keeps to the backward (0.19.2 moe_utils.py 457-462): per token
# and expert 8 bytes held instead of 2 + 1 with bf16 probs, 5 more (tests/test_same_numbers.py)
PERMUTE_BY_ARGSORT = VERSION >= (0, 17)
# The fused unpermute (--moe-permute-fusion) hands TE 2.12+'s `pad_offsets` on from 0.17 (0.17.1
# moe_utils.py 473-474 `if is_te_min_version("2.12.0")`; 0.16.1 414-418 without): None unless the
# flex dispatcher padded, which the stand-in's moe_unpermute (kernels/permutation.py) takes as such
UNPERMUTE_PASSES_PAD_OFFSETS = VERSION >= (0, 17)
# The sigmoid router (topk_routing_with_score_function): to 0.17 the sigmoid's fp32 scores are cast
# to the logits' dtype at once (0.16.1 moe_utils.py 717 `torch.sigmoid(logits.float()).type_as(
# logits)`; 0.13.1 595, 0.17.1 790), so with an expert bias the top-k `gather` keeps that bf16 copy
# (tokens x experts) to the backward, beside the bf16 top-k scores and sum the normalisation keeps
# (721, 724); from 0.18 (Megatron-LM #3673) the scores stay fp32 until `probs.type_as(logits)`
# (0.19.2 856, 865, 868, 875): no bf16 copy, the top-k scores and sum in fp32. Per MoE layer
# 2 x tokens x (experts - topk - 1) bytes fewer from 0.18 (bf16 logits; tests/test_same_numbers.py)
SIGMOID_SCORES_STAY_FP32 = VERSION >= (0, 18)
# TEDotProductAttention under rope fusion (Megatron-LM's default) on 0.13: its "WAR for peak memory
# usage" makes q, k, v bshd contiguous copies and hands linear_proj a transposed output, which it
# copies (0.13.1 extensions/transformer_engine.py 894-902, 945-946); 0.14 removed it (sbhd kept:
# the rotated q and k beside v, a view of the fused QKV output, which TE's get_qkv_layout copies
# contiguous: tests/test_te_qkv_layout.py). Held per attention layer: 0.13 q, k, v and
# linear_proj's input copies, 0.14+ q, k and v: one q-sized tensor less (tokens x heads x head
# dim x 2 / tp; tests/test_same_numbers.py)
ATTENTION_BSHD_COPIES = VERSION < (0, 14)
# The output layer's placeholder weight gradient under gradient-accumulation fusion: 0.13 makes a
# fresh torch.empty each backward (0.13.1 tensor_parallel/layers.py 578-583), 0.14+ keep Transformer
# Engine's get_dummy_wgrad, one per shape (0.16.1 layers.py 588-602): its bf16 weight shard static
WGRAD_PLACEHOLDER_KEPT = VERSION >= (0, 14)
# MultiTokenPredictionBlock on 0.13 runs the output layer on the MTP norm's output inside the block
# (0.13.1 multi_token_prediction.py 484, 666-668); from 0.14 it returns torch.cat of the main and
# MTP hidden states (0.16.1 1132, 0.19.2 1848) for GPTModel's output layer, which keeps that
# concatenation: s x b x h x 2 bytes more held per MTP layer
MTP_HIDDEN_CONCATENATED = VERSION >= (0, 14)
# CheckpointWithoutOutput (selective recompute of mla_up_proj, moe_act, layernorm, ...): to 0.16 its
# recompute restores each discarded output by `resize_` + `copy_` from the recomputation's output,
# which ctx.outputs keeps too (0.16.1 tensor_parallel/random.py 714-719; 0.13.1 584): each output
# held twice from the recompute to the checkpointed function's backward; from 0.17 (Megatron-LM
# #3649) the output's storage is made to share the recomputation's (0.19.2 random.py 821-823
# `share_storage`): once (tests/test_same_numbers.py "mla recompute")
RECOMPUTE_SHARES_STORAGE = VERSION >= (0, 17)
# clip_grads.py get_grad_norm_fp32 makes `total_norm = torch.zeros(1)` before the l2 norm from
# 0.19 (before: the kernel's result is the norm), and MixedPrecisionOptimizer.clip_grad_norm
# asks for separate grad-norm groups (`_compute_grad_norms_by_group`)
GRAD_NORM_MADE_FIRST = VERSION >= (0, 19)
# Megatron-FSDP with pipeline parallelism: 0.13's custom_fsdp builds no device mesh; 0.14-0.19's
# FullyShardedDataParallel lays the whole world out as dp x cp x ep x tp (mcore_fsdp_adapter.py
# `_get_dp_tp_mesh`), so pp > 1 stops on einops' "Shape mismatch" (Megatron-LM's validate_args,
# core_v0.16.1 and core_v0.19.0, has no check of its own)
FSDP_WITH_PIPELINE = VERSION < (0, 14)
# TE's FusedAdam updates bf16 moments in place from TE 2.13 (fused_adam.py `fuse_unscale`); the
# stand-in declares 2.11 to megatron-core 0.16, 2.14 from 0.17 (world/te TE_RELEASES); before,
# its step makes an fp32 temporary of each (`get_unscaled_state`) and writes it back
# (`_apply_scale`): the engine's memory and plan's priced passes (formulas/optimizer.py) both
# follow it
BF16_MOMENTS_UNSCALED = VERSION < (0, 17)
# megatron's ColumnParallelLinear / RowParallelLinear print `bias=False` always to 0.16 (they test
# `self.bias is True`), and whether the layer has a bias from 0.17 (`self.bias is not None`);
# golden files hold the 0.16 text (tests/conftest.py compares through `as_printed_by_0_16`)
LINEAR_REPR_SHOWS_BIAS = VERSION >= (0, 18)
_LINEAR_REPR = re.compile(r"(?<!\w)((?:Column|Row)ParallelLinear\(in_features=\d+, out_features=\d+, )bias=True")


# SelfAttention registers IdentityOp q_layernorm / k_layernorm without --qk-layernorm up to 0.17
# (the spec's IdentityOp is built); from 0.18 (attention.py `q_norm_cls = k_norm_cls = None`) it
# holds None, and no submodule shows in the tree
QK_NORM_IDENTITY = VERSION < (0, 18)
_QK_IDENTITY = re.compile(r"^( *)Submodule: [qk]_layernorm \(IdentityOp\)\n\1  Module: IdentityOp\n", re.M)


def as_built_by_installed(golden: str) -> str:
    """Return a golden file (0.16's modules) as the installed megatron-core builds them: without
    the q/k norms' IdentityOps from 0.18."""
    return golden if QK_NORM_IDENTITY else _QK_IDENTITY.sub("", golden)


def as_printed_by_0_16(text: str) -> str:
    """Return output as megatron-core 0.16 prints it: the linears' reprs with `bias=False`."""
    return _LINEAR_REPR.sub(r"\1bias=False", text) if LINEAR_REPR_SHOWS_BIAS else text
# MultiTokenPredictionLayer's transformer layer: `transformer_layer` to 0.16, `mtp_model_layer`
# from 0.17 (tests/test_te.py and tests/test_mla.py read the parameter names)
MTP_INNER = "mtp_model_layer" if VERSION >= (0, 17) else "transformer_layer"
# MoEAlltoAllTokenDispatcher.cudagraph_attrs (token_dispatcher.py), returned by a moe_preprocess
# CUDA graph: 0.19 adds the router's `probs` [tokens, experts] (kept for combine), an output that
# needs a gradient. Checked on 0.16.1 (absent) and 0.19.2 (present) only.
ALLTOALL_GRAPH_RETURNS_PROBS = VERSION >= (0, 19)
# megatron-core 0.19 allocates CudaGraphManager's static buffers in the graphs' pool
# (cuda_graphs.py alloc_tensor_from_graph_mempool) instead of TensorReusePool
LOCAL_GRAPH_INPUTS_IN_POOL = VERSION >= (0, 19)
# TEGroupedMLP calls TE's Fp8Padding even when the router already padded each expert's rows
# (--moe-router-padding-for-fp8) up to 0.17; 0.18 skips it then (moe_utils.py
# skip_routed_expert_padding). Checked on 0.16.1, 0.17.1, 0.18.2 and 0.19.2.
EXPERTS_PAD_AFTER_ROUTER_PADS = VERSION < (0, 18)
# megatron-core 0.18's MultiTokenPredictionLayer passes `padding_mask` to its own
# `_checkpointed_forward`, which does not take it (transformer/multi_token_prediction.py at
# 0.18.2): megatron itself stops an MTP job under full recomputation; 0.19 takes the argument.
# Checked on 0.17.1, 0.18.2 and 0.19.2.
MTP_FULL_RECOMPUTE_FAILS = VERSION == (0, 18)
# DeepEP's _DeepepManager keeps its dispatched indices and probs after combine up to 0.17; 0.18
# drops them there (token_dispatcher.py `_DeepepManager.combine`, "avoid memory leak"), so
# autograd frees what the dispatch saved of them in backward. Checked on 0.16.1 to 0.19.2.
DEEPEP_KEEPS_DISPATCHED = VERSION < (0, 18)
# --cuda-graph-impl is modelled from 0.16 (TECudaGraphHelper's sample buffers, transformer/
# cuda_graphs.py `convert_schedule_table_to_order`); before, inspect-model refuses it
# (tests/test_cuda_graphs.py test_before_megatron_core_0_16_the_graphs_are_refused)
CUDA_GRAPHS_MODELLED = VERSION >= (0, 16)
# megatron-core 0.16's DynamicInferenceContext keywords (0.17+: InferenceConfig) run for
# --perform-rl-step (memory/engine/inference_context.py); before, it is refused
ROLLOUTS_MODELLED = VERSION >= (0, 16)


def test_supported_version():
    assert (0, 13) <= VERSION <= (0, 19)


def test_moe_biases_are_accepted_from_0_15():
    result = __import__("tests.conftest", fromlist=["run_cli"]).run_cli("params", *MOE)
    if VERSION >= (0, 15):
        assert result.code == 0
        # the router carries a bias too when biases are on
        assert "decoder.layers.0.mlp.router.bias;" in result.out
    else:
        assert (result.code, result.err) == (
            2,
            "Error: megatron-core refused to build stage 0: Bias is not supported for MoE "
            "(the flags it names: --disable-bias-linear; --debug shows its traceback)\n",
        )


@pytest.mark.parametrize("extra", [[], ["--sequence-parallel"]])
def test_experts_with_tensor_parallel_need_sequence_parallel(cli, extra):
    # Our own check, so every version answers the same (0.15.3 would crash with a NameError).
    result = cli(
        "params", *MOE, "--disable-bias-linear", "--tp", "2", "--dp", "2", "--ep", "2", *extra
    )
    if extra:
        assert result.code == 0, result.err
    else:
        assert result.err == (
            "Error: --expert-model-parallel-size 2 with --tp 2 needs --sequence-parallel "
            "(Megatron-LM requires it when experts and tensor parallelism are combined)\n"
        )


def test_layout_string_chatter_stays_off_stdout(cli):
    # megatron-core 0.13 prints the parsed layout to stdout; the table must stay clean
    result = cli("params", *SMALL[:-2], "--num-layers", "3", "--pp", "2",
                 "--pipeline-model-parallel-layout", "Et|ttL")  # fmt: skip
    assert result.code == 0, result.err
    assert result.out.splitlines()[1] == "name;module;shape;partitioning_ranks;precs"


def test_pipeline_schedule_takes_its_group_from_0_14():
    # memory's schedule replay is checked against get_pp_rank_microbatches (tests/test_formulas.py):
    # 0.13 reads the pipeline rank from parallel_state, 0.14+ from a p2p_communicator argument.
    import inspect

    from megatron.core.pipeline_parallel import schedules

    takes = "p2p_communicator" in inspect.signature(schedules.get_pp_rank_microbatches).parameters
    assert takes == (VERSION >= (0, 14))


@pytest.mark.parametrize(
    "model, builds, refusal",
    [
        # 0.13-0.15 build shared experts with gate=False in the layer spec and have no config
        # field for it, so Qwen1.5-MoE (a gated shared expert) is exact only from 0.16.
        ("qwen1.5-moe-a2.7b", SHARED_EXPERT_GATE,
         "--moe-shared-expert-gate needs megatron-core 0.16 or newer: {v} builds shared experts "
         "without a gate"),
        # 0.13-0.14 have no quick_gelu, softmax_type, glu_linear_offset, clamp or window skip
        ("gpt-oss-20b", GPT_OSS,
         "--quick-geglu needs megatron-core 0.15 or newer: {v} has no "
         "TransformerConfig.glu_linear_offset"),
    ],
)  # fmt: skip
def test_features_from_the_version_that_builds_them(cli, model, builds, refusal):
    result = cli("tree", "--model", model, "--num-layers", "1")
    if builds:
        assert result.code == 0, result.err
    else:
        message = refusal.format(v=megatron.core.__version__)
        assert (result.code, result.err) == (2, f"Error: {message}\n")


@pytest.mark.slow
def test_the_planner_emits_mtp_layout_strings_only_where_megatron_builds_them():
    # 5 layers over pp 2 split only by a layout string ('Etttt|tmL'): 0.13 has no plan with it
    from inspector.errors import ConfigError
    from inspector.inputs.resolve import Sources, merge_sources
    from inspector.job.versions import mtp_in_layouts
    from inspector.plan.request import PlanFlags, make_request
    from inspector.plan.search import search

    flags = dict(num_layers=5, hidden_size=64, num_attention_heads=4, seq_length=32,
                 vocab_size=1000, position_embedding_type="rope", mtp_num_layers=1,
                 untie_embeddings_and_output_weights=True, global_batch_size=4)
    args = merge_sources(Sources(flags=flags), ("model", "layout", "training")).args
    req = make_request(args, PlanFlags(2, gpu_memory=1, top=50))
    from dataclasses import replace

    assert mtp_in_layouts() == MTP_IN_LAYOUT
    if not MTP_IN_LAYOUT:
        with pytest.raises(ConfigError, match="admits no layout"):
            search(replace(req, fixed={"pp": 2}))
        return
    plans = search(replace(req, fixed={"pp": 2})).plans
    assert plans
    layouts = [f for p in plans for f in p.flags() if f.startswith("--pipeline-model-parallel-layout")]
    assert len(layouts) == len(plans) and all(f.endswith("mL'") for f in layouts)


def test_mtp_in_a_layout_string_from_0_14(cli):
    args = [*SMALL[:-2], "--num-layers", "2", "--position-embedding-type", "rope",
            "--mtp-num-layers", "1", "--pp", "2", "--pipeline-model-parallel-layout", "Et|tmL",
            "--untie-embeddings-and-output-weights"]  # fmt: skip
    result = cli("params", *args)
    if MTP_IN_LAYOUT:
        assert result.code == 0, result.err
        assert "mtp.layers.0.eh_proj.weight" in result.out
    else:
        assert (result.code, result.err) == (
            2,
            "Error: megatron-core refused to build stage 0: MTP layer is not supported for "
            "flexible pipeline layout (--debug shows its traceback)\n",
        )


@pytest.mark.parametrize(
    "layout",
    ["Et|tt|tt|ttL", "Et*2|(tt|)*2,t*2L", "E(t|)*7tL", "Ettt|(tt|)*29,m|L", "(|ab)*2", "((t|)*2)*2"],
)
def test_layout_grammar_is_megatrons(layout):
    # 0.13-0.16 parse --pipeline-model-parallel-layout with the same parse_str_to_list; the job is
    # checked without megatron (inspector.job.pipeline_layout.expand_layout), so the two must agree.
    from megatron.core.transformer.pipeline_parallel_layer_layout import (
        PipelineParallelLayerLayout,
    )

    from inspector.job.pipeline_layout import expand_layout

    names = {"embedding": "E", "loss": "L", "decoder": "t", "mtp": "m"}
    try:
        theirs = [
            "".join(names[t.name] for t in stage)
            for stage in PipelineParallelLayerLayout.parse_str_to_list(layout)
        ]
    except AssertionError:  # a character megatron does not know: our check names it
        theirs = None
    ours = expand_layout(layout)
    if theirs is None:
        assert set("".join(ours)) - set("ELtm")
    else:
        assert ours == theirs


@pytest.mark.slow
def test_mtp_in_a_middle_virtual_chunk(cli):
    """DeepSeek-V3's recipe layout puts the MTP on stage 14, chunk 1, and the loss on stage 15.

    0.16 builds it there. 0.15 refuses (the MTP must sit with the loss); 0.14 accepts the string
    but builds no MTP at all, which the tool turns into an error instead of a model without its
    MTP; 0.13 refuses MTP in any layout string.
    """
    layout = ["--model", "deepseek-v3", "--tp", "1", "--pp", "16", "--ep", "64", "--dp", "64",
              "--pipeline-model-parallel-layout", "Et*3|(tt|)*29,m|L", "--stage", "14"]  # fmt: skip
    result = cli("params", *layout)
    if MTP_IN_A_MIDDLE_CHUNK:
        assert result.code == 0 and "mtp.layers.0." in result.out, result.err
        return
    assert result.code == 2 and result.out == ""
    expected = {
        (0, 13): "MTP layer is not supported for flexible pipeline layout",
        (0, 14): f"megatron-core {megatron.core.__version__} builds no multi-token prediction layer",
        (0, 15): "MTP layers must be in the last stage together with Loss stage",
    }[VERSION[:2]]
    assert expected in result.err, result.err


def test_null_tokenizer_vocabulary_is_the_installed_megatrons():
    # Megatron-LM pads tokenizer.vocab_size; NullTokenizer's is --vocab-size + 1 up to 0.17 (its
    # end-of-document token after the vocabulary) and --vocab-size from 0.18 (checked in
    # Megatron-LM's tags core_v0.16.1, core_v0.17.1, core_v0.18.0).
    from inspector.inputs.tokenizers import vocabulary
    from inspector.inputs.versions import megatron_core_version, null_tokenizer_adds_eod

    assert megatron_core_version() == VERSION
    assert null_tokenizer_adds_eod() == (VERSION < (0, 18))
    ours = vocabulary("NullTokenizer", None, 128256, None, "s.sh").size
    assert ours == 128256 + (VERSION < (0, 18))
    # megatron.core.tokenizers (0.15+; Megatron-LM's training builds it from 0.17) agrees
    null = pytest.importorskip("megatron.core.tokenizers.text.libraries.null_tokenizer")
    assert null.NullTokenizer(128256).vocab_size == ours


def test_llama3_8b_null_tokenizer_padded_vocabulary(tmp_path, cli):
    # Megatron-LM's Llama 3 8B example trains with NullTokenizer --vocab-size 128256 at tp 1:
    # 0.13-0.17 pad 128256 + 1 to 128384 rows (Megatron-LM's tags core_v0.16.1, core_v0.17.1:
    # null_tokenizer.py, vocab_size = _vocab_size_without_eod + 1); 0.18+ keep 128256, already a
    # multiple of 128 (core_v0.18.2, core_v0.19.0: vocab_size = _vocab_size, EOD inside it).
    script = tmp_path / "llama3.sh"
    script.write_text("python pretrain_gpt.py --num-layers 1 --hidden-size 64 "
                      "--num-attention-heads 4 --seq-length 32 --max-position-embeddings 32 "
                      "--tokenizer-type NullTokenizer --vocab-size 128256\n")  # fmt: skip
    result = cli("params", "--from-script", str(script), "--dp", "1")
    assert result.code == 0, result.err
    rows = 128384 if NULL_TOKENIZER_EOD else 128256
    assert f"embedding.word_embeddings.weight;VocabParallelEmbedding();({rows}, 64);" in result.out


def test_null_tokenizer_padding_is_megatrons_own_from_0_17():
    # From 0.17 Megatron-LM builds its tokenizer and pads the vocabulary in megatron-core
    # (megatron/core/tokenizers/utils/build_tokenizer.py): run it beside the tool's padding.
    if VERSION < (0, 17):
        with pytest.raises(ImportError):
            __import__("megatron.core.tokenizers.utils.build_tokenizer")
        return
    from argparse import Namespace

    from megatron.core.tokenizers.utils.build_tokenizer import build_tokenizer

    from inspector.inputs.tokenizers import vocabulary
    from inspector.job.model import ModelConfig

    for tp in (1, 2, 8):
        args = Namespace(tokenizer_type="NullTokenizer", vocab_size=128256, rank=0,
                         make_vocab_size_divisible_by=128, tensor_model_parallel_size=tp,
                         padded_vocab_size=None, pad_vocab_size=True, metadata_path=None)  # fmt: skip
        build_tokenizer(args)
        size = vocabulary("NullTokenizer", None, 128256, None, "s.sh").size
        assert ModelConfig(vocab_size=size).embedding_rows(tp) == args.padded_vocab_size


def test_arguments_the_installed_megatron_lm_does_not_know(tmp_path, cli):
    # --no-scatter-gather-tensors-in-pipeline: up to 0.17; --step-batch-size-schedule: from 0.18;
    # --inference-shards: from 0.19 (add_megatron_arguments at core_v0.16.1 ... core_v0.19.0).
    # Each is ignored (it changes nothing a GPU holds) and noted where Megatron-LM would stop.
    script = tmp_path / "s.sh"
    script.write_text(f"python pretrain_gpt.py {' '.join(SMALL)} "
                      "--no-scatter-gather-tensors-in-pipeline --step-batch-size-schedule 0:8 "
                      "--inference-shards 2\n")  # fmt: skip
    result = cli("params", "--from-script", str(script), "--dp", "1")
    assert result.code == 0, result.err
    version = f"{VERSION[0]}.{VERSION[1]}"
    expected = [
        ("--no-scatter-gather-tensors-in-pipeline", "removed in 0.18", VERSION >= (0, 18)),
        ("--step-batch-size-schedule", "added in 0.18", VERSION < (0, 18)),
        ("--inference-shards", "added in 0.19", VERSION < (0, 19)),
    ]
    for flag, since, noted in expected:
        note = (f"Note from {script}: {flag} is not an argument of Megatron-LM {version} (the "
                f"installed megatron-core; {since}): its pretrain_gpt.py would stop with "
                "'unrecognized arguments'\n")  # fmt: skip
        assert (note in result.err) == noted, (flag, result.err)


def test_local_grouped_gemm_experts(cli):
    # --moe-grouped-gemm under the local spec: GroupedMLP (weight1/weight2 over the local experts)
    # up to 0.16; 0.17 removed it, and the local spec builds SequentialMLP
    # (models/backends.py, LocalSpecProvider.grouped_mlp_modules). The parameter count is the same.
    result = cli("params", *MOE, "--disable-bias-linear", "--moe-grouped-gemm",
                 "--transformer-impl", "local", "--num-layers", "1")  # fmt: skip
    assert result.code == 0, result.err
    experts = [line.split(";")[:3] for line in result.out.splitlines() if ".experts." in line]
    if GROUPED_MLP:
        assert experts == [
            ["decoder.layers.0.mlp.experts.0-3.weight1", "GroupedMLP()", "(64, 128)"],
            ["decoder.layers.0.mlp.experts.0-3.weight2", "GroupedMLP()", "(128, 64)"],
        ]
    else:
        assert len(experts) == 8 and experts[0] == [
            "decoder.layers.0.mlp.experts.local_experts.0.linear_fc1.weight",
            "ColumnParallelLinear(in_features=64, out_features=32, bias=False, TP=1)", "(32, 64)"]


# in allowed_modules from core_v0.14.0 (read at the tag); run on 0.13.1 and 0.16.1
SHARED_EXPERTS_RECOMPUTE = VERSION >= FIRST_VERSION["shared_experts"]


def test_recompute_modules_megatron_allows():
    """0.13.1's TransformerConfig allows six modules; "shared_experts" came in 0.14 (0.16.1 has
    seven): the tool's version table (job/recompute_modules.py FIRST_VERSION) says the same."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    def build(modules):
        return TransformerConfig(num_layers=2, hidden_size=64, num_attention_heads=4,
                                 recompute_granularity="selective", recompute_modules=modules)  # fmt: skip

    assert build(["core_attn", "mlp", "layernorm"]).recompute_modules == ["core_attn", "mlp", "layernorm"]
    if SHARED_EXPERTS_RECOMPUTE:
        build(["shared_experts"])
    else:
        with pytest.raises(AssertionError, match="Invalid choices for recompute_modules"):
            build(["shared_experts"])


def test_version_fields_are_the_installed_transformer_configs():
    # job/versions.py reads both from the flag table; each must name a field this megatron has
    # (0.13.1: moe_router_padding_for_fp8 only; 0.16.1: moe_router_padding_for_quantization and
    # moe_flex_dispatcher_backend)
    import dataclasses

    from megatron.core.transformer import TransformerConfig

    from inspector.job.versions import FLEX_BACKEND_SINCE, router_padding_field

    fields = {f.name for f in dataclasses.fields(TransformerConfig)}
    assert router_padding_field() in fields
    assert ("moe_router_padding_for_quantization" in fields) == (VERSION >= (0, 16))
    assert ("moe_flex_dispatcher_backend" in fields) == (VERSION >= FLEX_BACKEND_SINCE)


def test_mtp_logits_are_freed_before_the_main_logits_except_on_0_14_to_0_16():
    # The MTP head's bf16 logits [s, b, vocab / tp] are a local of GPTModel._postprocess in
    # 0.14-0.16, alive while the main logits are made; 0.17 moved the MTP loss into
    # multi_token_prediction.py `process_mtp_loss`, which frees them on return. The k2_mtp GPU
    # run (0.16.1) holds them: tests/test_engine.py expects the other versions 2-3% under it.
    from inspector.job.job import make_job
    from inspector.memory.engine.stage import trace_stage

    job = make_job(dict(num_layers=1, hidden_size=64, num_attention_heads=4, seq_length=32,
                        vocab_size=4096, position_embedding_type="rope", mtp_num_layers=1,
                        untie_embeddings_and_output_weights=True, micro_batch_size=2,
                        global_batch_size=2, bf16=True, transformer_impl="local"))  # fmt: skip
    (trace,) = trace_stage(job, 0)
    logits = 32 * 2 * 4096 * 2  # [s, b, vocab] in bf16
    live = held = 0
    for event in trace.forward:
        if abs(event.bytes) == logits and "output_layer" in event.where:
            live += 1
            held = max(held, live)
        elif event.bytes == -logits:
            live -= 1
    assert held == (2 if MTP_LOGITS_HELD else 1)


def test_the_grad_norm_is_made_before_the_kernel_from_0_19():
    import inspect

    from megatron.core.optimizer import clip_grads, optimizer

    source = inspect.getsource(clip_grads.get_grad_norm_fp32)
    first = "total_norm = torch.zeros(1, dtype=torch.float, device='cuda')"
    assert (first in source.split("l2_norm_impl")[0]) == GRAD_NORM_MADE_FIRST
    groups = hasattr(optimizer.MixedPrecisionOptimizer, "_compute_grad_norms_by_group")
    assert groups == GRAD_NORM_MADE_FIRST


def test_the_fused_unpermute_passes_pad_offsets_from_0_17():
    import inspect

    from inspector.world import te

    te.install()
    from megatron.core.transformer.moe import moe_utils

    assert ("pad_offsets" in inspect.getsource(moe_utils.unpermute)) == UNPERMUTE_PASSES_PAD_OFFSETS


@pytest.mark.parametrize("impl", ["local", "transformer_engine"])
def test_expert_weights_go_to_the_expert_buffer_at_ep_1_from_0_19(impl):
    # allreduce=False (DDP's expert buffer, reduced over expert data parallel): 0.13-0.18 only
    # with ep > 1; 0.19 also when --expert-tensor-parallel-size differs from --tp
    from inspector.job.job import make_job
    from inspector.job.versions import experts_flagged_without_ep
    from inspector.world.pieces import build_pieces

    job = make_job(dict(num_layers=1, hidden_size=64, num_attention_heads=4, seq_length=32,
                        vocab_size=1000, num_experts=4, moe_ffn_hidden_size=32,
                        disable_bias_linear=True, tensor_model_parallel_size=2,
                        sequence_parallel=True, expert_tensor_parallel_size=1,
                        data_parallel_size=2, transformer_impl=impl))  # fmt: skip
    flags = {p.expert for named in build_pieces(job).parts() for _, p in named}
    assert flags == ({False, True} if experts_flagged_without_ep() else {False})
    assert experts_flagged_without_ep() == (VERSION >= (0, 19))


def test_linear_reprs_show_the_bias_from_0_17(cli):
    result = cli("params", *SMALL, "--untie-embeddings-and-output-weights", "--transformer-impl", "local")
    assert result.code == 0, result.err
    rows = [row.split(";") for row in result.out.splitlines()[2:] if not row.startswith("#")]
    modules = {row[0]: row[1] for row in rows}
    qkv = modules["decoder.layers.0.self_attention.linear_qkv.bias"]
    assert qkv == f"ColumnParallelLinear(in_features=64, out_features=192, bias={LINEAR_REPR_SHOWS_BIAS}, TP=1)"
    assert "bias=False" in modules["output_layer.weight"]  # no bias: False on every version
    assert as_printed_by_0_16(qkv) == "ColumnParallelLinear(in_features=64, out_features=192, bias=False, TP=1)"


def test_attention_holds_identity_qk_norms_up_to_0_17(cli):
    result = cli("tree", *SMALL, "--transformer-impl", "local")
    assert result.code == 0, result.err
    assert ("Submodule: q_layernorm (IdentityOp)" in result.out) == QK_NORM_IDENTITY
    assert as_built_by_installed(result.out) == result.out  # nothing left to strip


def test_packed_sequences_are_refused_by_name_before_0_16(cli):
    result = cli("memory", *SMALL, "--micro-batch-size", "1", "--bf16", "--sft")
    if VERSION >= (0, 16):
        assert result.code == 0, result.err
    else:
        assert (result.code, result.err) == (2, "Error: --sft: packed sequences are modelled as "
                f"megatron-core 0.16 and later run them; {VERSION[0]}.{VERSION[1]}'s THD path is "
                "not checked\n")  # fmt: skip


MESH = """
import sys, torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore
from megatron.core import parallel_state as ps
from megatron.core.distributed.fsdp.mcore_fsdp_adapter import _get_dp_tp_mesh
pp = int(sys.argv[1])
dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=4 * pp)
ps.initialize_model_parallel(tensor_model_parallel_size=2, pipeline_model_parallel_size=pp,
                             create_gloo_process_groups=False)
try:
    _get_dp_tp_mesh(ps.get_data_parallel_group(with_context_parallel=True),
                    ps.get_tensor_model_parallel_group())
    print("mesh built")
except Exception as exc:
    print(type(exc).__name__, str(exc).splitlines()[-1])
"""


@pytest.mark.skipif(FSDP_WITH_PIPELINE, reason="0.13's custom_fsdp builds no device mesh")
@pytest.mark.parametrize("pp", [1, 2])
def test_megatron_fsdp_device_mesh_spans_one_pipeline_stage(pp):
    # megatron's own mesh, in a fake world of dp 2 x tp 2 x pp ranks: at pp 2 the world's 8 ranks
    # do not fit its (dp_cp ep tp) = 4, as in a real run
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", MESH, str(pp)], capture_output=True, text=True,
                          timeout=300)  # fmt: skip
    said = done.stdout.strip().splitlines()[-1] if done.stdout.strip() else done.stderr[-500:]
    assert said == "mesh built" if pp == 1 else said.startswith("EinopsError"), said


def test_megatron_fsdp_with_pipeline_parallelism(cli):
    from inspector.job.versions import fsdp_with_pipeline

    assert fsdp_with_pipeline() == FSDP_WITH_PIPELINE
    fsdp = "--use-megatron-fsdp --use-distributed-optimizer --ckpt-format fsdp_dtensor".split()
    result = cli("params", *SMALL, *fsdp, "--pp", "2", "--dp", "2")
    if FSDP_WITH_PIPELINE:
        assert result.code == 0, result.err
        return
    release = f"{VERSION[0]}.{VERSION[1]}"
    assert (result.code, result.err) == (2, (
        "Error: --use-megatron-fsdp with --pipeline-model-parallel-size 2 fails in megatron-core "
        f"0.14 to 0.19 (installed: {release}): FullyShardedDataParallel's device mesh "
        "(mcore_fsdp_adapter.py `_get_dp_tp_mesh`) spans dp x cp x tp = 2 x 1 x 1 = 2 of the "
        "world's 4 ranks, and einops stops on 'Shape mismatch' when pp > 1; pass "
        "--pipeline-model-parallel-size 1, or the distributed optimizer without --use-megatron-fsdp\n"))
    planned = cli("plan", *SMALL, *fsdp, "--gpus", "8", "--global-batch-size", "8", "--pp", "2")
    assert planned.code == 2 and "spans one pipeline stage's ranks" in planned.err, planned.err


# Megatron-LM validate_args on Megatron-FSDP with arguments this tool otherwise ignores (sweep46c):
# meta-device initialisation under no_shard refused from core_v0.18.0; --use-nccl-ub turns the
# FSDP double buffer on from core_v0.19.0 (both were "Ignored" and the job went on)
FSDP_META_NO_SHARD_REFUSED = VERSION >= (0, 18)
FSDP_NCCL_UB_DOUBLE_BUFFER = VERSION >= (0, 19)


@pytest.mark.parametrize(("extra", "refused", "words"), [
    ("--init-model-with-meta-device", FSDP_META_NO_SHARD_REFUSED,
     "--init-model-with-meta-device with --data-parallel-sharding-strategy no_shard is refused by "
     "Megatron-LM: validate_args: 'Meta device initialization"),
    ("--use-nccl-ub", FSDP_NCCL_UB_DOUBLE_BUFFER, "--use-nccl-ub with --use-megatron-fsdp is not modelled"),
])  # fmt: skip
def test_megatron_fsdp_with_arguments_otherwise_ignored(tmp_path, cli, extra, refused, words):
    script = tmp_path / "s.sh"
    script.write_text(f"python pretrain_gpt.py {' '.join(SMALL)} --micro-batch-size 1 --use-megatron-fsdp "
                      f"--use-distributed-optimizer --ckpt-format fsdp_dtensor {extra}\n")  # fmt: skip
    result = cli("memory", "--from-script", str(script), "--dp", "1")  # --use-nccl-ub: buffers
    if not refused:
        assert result.code == 0, result.err
        return
    assert result.code == 2 and result.err == f"Error: {script} line 1: {words}" + result.err.split(words)[1]
    assert result.err.count("\n") == 1
