#!/bin/bash
# k1_layout: an uneven interleaved pipeline from a layout string (2 stages x 2 chunks).
# Megatron-LM pretrain_gpt.py on 16 GPUs (2 x 8), mock data.
export CUDA_DEVICE_MAX_CONNECTIONS=1
GPUS_PER_NODE=8
NNODES=2

MODEL_ARGS=(
  --num-layers 8 --hidden-size 4096 --ffn-hidden-size 14336
  --num-attention-heads 32 --group-query-attention --num-query-groups 8
  --seq-length 4096 --max-position-embeddings 4096
  --position-embedding-type rope --rotary-base 500000
  --normalization RMSNorm --swiglu --untie-embeddings-and-output-weights --disable-bias-linear
)
PARALLEL_ARGS=(
  --tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 --use-distributed-optimizer
  --pipeline-model-parallel-layout "Et*3|t|t*2|t*2L"
)
TRAINING_ARGS=(
  --micro-batch-size 1 --global-batch-size 32 --train-iters 3
  --lr 1e-4 --min-lr 1e-5 --lr-decay-style cosine --weight-decay 0.1 --clip-grad 1.0
  --bf16 --attention-dropout 0.0 --hidden-dropout 0.0
)
IMPL_ARGS=(
  --transformer-impl local --no-persist-layer-norm --no-gradient-accumulation-fusion
  --no-masked-softmax-fusion --no-rope-fusion
)
DATA_ARGS=(
  --mock-data --tokenizer-type NullTokenizer --vocab-size 128255 --split 99,1,0
)
LOGGING_ARGS=(
  --log-interval 1 --eval-iters 0 --eval-interval 1000 --fake-process-group
)

torchrun --nproc_per_node $GPUS_PER_NODE --nnodes $NNODES pretrain_gpt.py \
  "${MODEL_ARGS[@]}" "${PARALLEL_ARGS[@]}" "${TRAINING_ARGS[@]}" \
  "${IMPL_ARGS[@]}" "${DATA_ARGS[@]}" "${LOGGING_ARGS[@]}"
