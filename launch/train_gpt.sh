#!/usr/bin/env bash
# Train the small GPT on one machine, in the lecture's GPT_ARGS style (COMP4901Y, "Launch
# Scripts"). The lecture trains 24 layers x 1024 hidden with TP=2, PP=2 for 500k iterations;
# these numbers fit a laptop CPU (about a minute). PP stays 1 here, so the 4 ranks are
# TP=2 x DP=2; for the lecture's TP=2 x PP=2 pass the pipeline flags after the script
# (the last flags win), e.g. with 4 layers and 1F1B:
#
#   bash launch/train_gpt.sh                 # 4 ranks (NPROC=2 bash launch/train_gpt.sh for 2)
#   bash launch/train_gpt.sh --pipeline-model-parallel-size 2 --num-layers 4 --pipeline-schedule 1f1b
set -euo pipefail
cd "$(dirname "$0")/.."

NPROC=${NPROC:-4}

GPT_ARGS="
  --tensor-model-parallel-size 2 \
  --pipeline-model-parallel-size 1 \
  --sequence-parallel \
  --num-layers 2 \
  --hidden-size 64 \
  --num-attention-heads 4 \
  --seq-length 64 \
  --max-position-embeddings 64 \
  --micro-batch-size 8 \
  --global-batch-size 16 \
  --lr 0.003 \
  --train-iters 300 \
  --lr-decay-iters 300 \
  --lr-decay-style cosine \
  --min-lr 3.0e-4 \
  --weight-decay 1e-2 \
  --lr-warmup-fraction .01 \
  --clip-grad 1.0
"
# On GPUs add --bf16 (or --fp16) to GPT_ARGS.

DATA_ARGS="--mock-data --vocab-size 512"          # or: --data-path some_text_file.txt
OUTPUT_ARGS="
  --log-interval 25 \
  --metrics-file runs/train_gpt_metrics.jsonl \
  --save checkpoints/gpt \
  --save-interval 100
"

mkdir -p runs
# shellcheck disable=SC2086
torchrun --standalone --nproc-per-node "$NPROC" launch/train_gpt.py $GPT_ARGS $DATA_ARGS $OUTPUT_ARGS "$@"
