"""torchrun worker (4 ranks): activation recomputation at TP = 2 with dropout on, against no
recomputation from the same weights, data and dropout seeds.

    torchrun --standalone --nproc-per-node 4 tests/mp/recompute_checks.py

* TP = 2 with sequence parallelism (DP = 2): every recompute mode's loss and local gradients
  against no recomputation (the hidden dropout of sequence parallelism and the attention
  dropout both draw from the tracker's stream);
* TP = 2 without sequence parallelism: full recomputation with ``distribute_saved_activations``
  equal too, and the input the checkpoint keeps is this rank's half of the layer input
  (counted with ``torch.autograd.graph.saved_tensors_hooks``).

* TP = 2 x PP = 2 with sequence parallelism, 1F1B over 4 micro-batches, through
  ``launch/train_gpt.py``'s flags (``training.setup`` and ``train``): 2 iterations' losses and
  gradient norms of every mode (``--recompute-activations``, ``--recompute-granularity
  full --recompute-method uniform|block``) against no recomputation, dropout on.

Part of the shared 4-rank job (tests/mp/four_rank_checks.py); tests/models/test_recompute_mp.py
asserts.
"""
import torch
import torch.distributed as dist

from mpu_lab import launcher, training
from mpu_lab.core import parallel_state
from mpu_lab.core.models.gpt import GPTModel
from mpu_lab.core.tensor_parallel import model_parallel_manual_seed
from mpu_lab.core.transformer import TransformerConfig
from mpu_lab.training import initialize

MODES = {
    "selective": dict(recompute_granularity="selective"),
    "selective_mlp": dict(recompute_granularity="selective", recompute_modules=["core_attn", "mlp"]),
    "full_uniform_2": dict(recompute_granularity="full", recompute_method="uniform",
                           recompute_num_layers=2),
    "full_block_1": dict(recompute_granularity="full", recompute_method="block",
                         recompute_num_layers=1),
}
DISTRIBUTED = dict(recompute_granularity="full", recompute_method="uniform",
                   recompute_num_layers=1, distribute_saved_activations=True)
SEQ, BATCH, VOCAB = 16, 2, 128


def config(sequence_parallel, **recompute):
    return TransformerConfig(num_layers=3, hidden_size=32, num_attention_heads=4,
                             hidden_dropout=0.1, attention_dropout=0.1,
                             sequence_parallel=sequence_parallel, **recompute)


def step(cfg, saved=None, dropout_seed=99):
    """Loss and this rank's gradients of one training step; ``saved``: a list that receives
    the element count of every tensor autograd saves (pack hook)."""
    model_parallel_manual_seed(1234)
    model = GPTModel(cfg, VOCAB, SEQ).train()
    g = torch.Generator().manual_seed(parallel_state.get_data_parallel_rank())
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g).to(initialize.get_device())
    labels = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g).to(initialize.get_device())
    model_parallel_manual_seed(dropout_seed)
    if saved is None:
        loss = model(ids, labels=labels).mean()
    else:
        def pack(t):
            saved.append(t.numel())
            return t
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = model(ids, labels=labels).mean()
    loss.backward()
    return loss.item(), {n: p.grad.clone() for n, p in model.named_parameters()}


LOOP_BASE = ["--num-layers", 4, "--hidden-size", 32, "--num-attention-heads", 4,
             "--seq-length", 16, "--micro-batch-size", 2, "--global-batch-size", 8,
             "--vocab-size", 128, "--make-vocab-size-divisible-by", 32, "--train-iters", 2,
             "--log-interval", 1, "--hidden-dropout", 0.1, "--attention-dropout", 0.1,
             "--tensor-model-parallel-size", 2, "--pipeline-model-parallel-size", 2,
             "--sequence-parallel", "--pipeline-schedule", "1f1b", "--quiet"]
LOOP_MODES = {
    "none": [],
    "recompute_activations": ["--recompute-activations"],
    "full_uniform_1": ["--recompute-granularity", "full", "--recompute-method", "uniform",
                       "--recompute-num-layers", 1],
    "full_block_1": ["--recompute-granularity", "full", "--recompute-method", "block",
                     "--recompute-num-layers", 1],
}


def loop_runs():
    """Losses and gradient norms of 2 iterations at TP = 2 x PP = 2 per mode (DP = 1)."""
    out = {}
    for name, flags in LOOP_MODES.items():
        args = training.validate_args(training.parse_args([str(a) for a in LOOP_BASE + flags]),
                                      dist.get_world_size())
        state = training.setup(args, log=lambda s: None)
        metrics = training.train(state, log=lambda s: None)
        out[name] = {"lm_loss": [m["lm_loss"] for m in metrics],
                     "grad_norm": [m["grad_norm"] for m in metrics],
                     "granularity": state.model_chunks[0].decoder.config.recompute_granularity}
        parallel_state.destroy_model_parallel()
    return out


def worst(a, b):
    return max((a[1][n] - g).abs().max().item() for n, g in b[1].items())


def checks():
    out = {}
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=2)
    reference = step(config(True))
    recomputed = {m: step(config(True, **f)) for m, f in MODES.items()}
    out["sp_loss_diff"] = {m: abs(got[0] - reference[0]) / reference[0]
                           for m, got in recomputed.items()}
    out["sp_grad_diff"] = {m: worst(got, reference) for m, got in recomputed.items()}
    # the masks matter: other dropout seeds give another loss and other gradients
    out["other_masks_grad_diff"] = worst(step(config(True), dropout_seed=100), reference)
    plain = step(config(False))
    saved_plain, saved_distributed = [], []
    full = step(config(False, **{**DISTRIBUTED, "distribute_saved_activations": False}),
                saved_plain)
    distributed = step(config(False, **DISTRIBUTED), saved_distributed)
    out["distributed_loss_diff"] = abs(distributed[0] - plain[0]) / plain[0]
    out["distributed_grad_diff"] = worst(distributed, plain)
    out["full_grad_diff"] = worst(full, plain)
    # the tensors of the three checkpoints' inputs ([s, b, h] = 16 x 2 x 32 each) and, with
    # the split, this rank's half of each; the rest (embedding, final LayerNorm, loss) is equal
    out["layer_input_numel"] = SEQ * BATCH * 32
    out["saved_tensors"] = {"full": len(saved_plain), "distributed": len(saved_distributed)}
    out["saved_numel_difference"] = sum(saved_plain) - sum(saved_distributed)
    parallel_state.destroy_model_parallel()
    out["loop"] = loop_runs()
    return out


@launcher.entrypoint
def main():
    initialize.init()
    launcher.report({"rank": dist.get_rank(), "recompute": checks()})
    initialize.shutdown()


if __name__ == "__main__":
    main()
