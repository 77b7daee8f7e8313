#!/usr/bin/env bash
# Train the GPT across several machines with torchrun's own rendezvous (c10d).
# Run the same command on every node, changing only NODE_RANK:
#
#   NNODES=2 NODE_RANK=0 MASTER_ADDR=node0.example MASTER_PORT=29500 NPROC_PER_NODE=8 \
#       bash launch/train_gpt_multinode.sh
#   NNODES=2 NODE_RANK=1 MASTER_ADDR=node0.example MASTER_PORT=29500 NPROC_PER_NODE=8 \
#       bash launch/train_gpt_multinode.sh
#
# 16 ranks: TP=8 within a node (tensor parallelism wants the fastest links) x DP=2 across
# nodes, the order Megatron's rank groups give (tp fastest-varying: ranks 0-7 share a node).
# Extra flags go after the script, e.g. --bf16.
set -euo pipefail
cd "$(dirname "$0")/.."

: "${NNODES:?set NNODES (number of machines)}"
: "${NODE_RANK:?set NODE_RANK (0 .. NNODES-1, different on each machine)}"
: "${MASTER_ADDR:?set MASTER_ADDR (host name of node 0, reachable from all nodes)}"
MASTER_PORT=${MASTER_PORT:-29500}
NPROC_PER_NODE=${NPROC_PER_NODE:-8}
TP=${TP:-$NPROC_PER_NODE}

GPT_ARGS="
  --tensor-model-parallel-size $TP \
  --sequence-parallel \
  --num-layers 12 \
  --hidden-size 768 \
  --num-attention-heads 16 \
  --seq-length 1024 \
  --max-position-embeddings 1024 \
  --micro-batch-size 4 \
  --global-batch-size 64 \
  --lr 0.0006 \
  --min-lr 6.0e-5 \
  --train-iters 2000 \
  --lr-decay-style cosine \
  --lr-warmup-fraction .01 \
  --weight-decay 1e-1 \
  --clip-grad 1.0 \
  --bf16
"

# shellcheck disable=SC2086
torchrun \
  --nnodes "$NNODES" \
  --node-rank "$NODE_RANK" \
  --nproc-per-node "$NPROC_PER_NODE" \
  --rdzv-backend c10d \
  --rdzv-endpoint "$MASTER_ADDR:$MASTER_PORT" \
  --rdzv-id "${RDZV_ID:-mpu_lab_gpt}" \
  launch/train_gpt.py $GPT_ARGS \
  --log-interval 10 --metrics-file runs/multinode_metrics.jsonl --save checkpoints/gpt_multinode \
  "$@"
