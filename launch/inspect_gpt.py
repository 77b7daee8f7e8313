"""Show the lecture's shape table and count the collectives of one GPT training step.

    torchrun --standalone --nproc-per-node 2 launch/inspect_gpt.py --tp 2 --batch 2 --seq 8 \
        --hidden 16 --heads 4          # add --sequence-parallel for Megatron-LM's SP

Each rank reports ``{"shape_table": [...], "collectives": [...], "per_layer": {...}}``; from a
notebook::

    job = mpu_lab.launcher.run("inspect_gpt.py", ["--tp", "2"], nproc=2, show="none")
    print(mpu_lab.perf.layer_shapes.format_shape_table(job.results[0]["shape_table"]))
"""
import sys

import torch

from mpu_lab.training import flag_errors, initialize
from mpu_lab import launcher
from mpu_lab.core import parallel_state, tensor_parallel
from mpu_lab.core.models.gpt import GPTModel
from mpu_lab.core.transformer import TransformerConfig
from mpu_lab.perf.layer_shapes import format_shape_table, shape_table
from mpu_lab.perf.comm_counts import count_collectives, format_collectives, per_layer_counts


def parse(argv):
    p = flag_errors.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tp", type=int, default=2, help="tensor-parallel size d_tp")
    p.add_argument("--batch", type=int, default=2, help="B")
    p.add_argument("--seq", type=int, default=8, help="L")
    p.add_argument("--hidden", type=int, default=16, help="D")
    p.add_argument("--heads", type=int, default=4, help="n_H")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--activation", choices=["relu", "gelu"], default="relu")
    p.add_argument("--sequence-parallel", action="store_true")
    p.add_argument("--steps", type=int, default=1)
    p.add_argument("--quiet", action="store_true", help="report only, print nothing")
    return p.parse_args(argv)


@launcher.entrypoint
def main(argv=None):
    a = parse(argv)
    config = TransformerConfig(num_layers=a.layers, hidden_size=a.hidden, num_attention_heads=a.heads,
                               activation=a.activation, sequence_parallel=a.sequence_parallel)
    config.check(a.tp, a.seq)   # a bad shape fails here, before any communication
    initialize.init()
    parallel_state.initialize_model_parallel(a.tp)
    rows = shape_table(a.batch, a.seq, a.hidden, a.heads, tensor_model_parallel_size=a.tp,
                       activation=a.activation)
    tensor_parallel.model_parallel_manual_seed(1234)
    vocab = 128 * a.tp
    model = GPTModel(config, vocab, a.seq)
    device = initialize.get_device()
    ids = torch.randint(0, vocab, (a.batch, a.seq),   # cpu: a seeded CPU generator, the same
                        generator=torch.Generator().manual_seed(0)).to(device)  # ids anywhere
    events = count_collectives(model, ids, ids, steps=a.steps)
    rank = torch.distributed.get_rank()
    if rank == 0 and not a.quiet:
        print(f"shape table on rank 0 (B={a.batch}, L={a.seq}, D={a.hidden}, n_H={a.heads}, d_tp={a.tp}):")
        print(format_shape_table(rows))
        print(f"\ncollectives of one step on rank 0 (sequence_parallel={a.sequence_parallel}):")
        print(format_collectives(events))
    launcher.report({"shape_table": rows, "collectives": events,
                   "per_layer": per_layer_counts(events)})
    initialize.shutdown()


if __name__ == "__main__":
    main(sys.argv[1:])
