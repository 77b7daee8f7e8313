"""Measure the activation memory of one transformer layer at TP = t, without and with sequence
parallelism, against Korthikanti et al. 2022 (lab 09).

    torchrun --standalone --nproc-per-node 2 launch/activation_memory.py --tp 2 \
        --seq 128 --batch 2 --hidden 64 --heads 8 --attention explicit sdpa --recompute

Every rank builds one ``TransformerLayer`` (dropout 0, fp32), runs its forward on its
part of a batch and counts, through ``torch.autograd.graph.saved_tensors_hooks``, the bytes
autograd keeps for backward (:mod:`mpu_lab.perf.saved_activations`). Rank 0 prints the table; every
rank reports ``{"tp": t, "rows": [...]}``: for each ``--attention`` implementation a row
without and one with SP, each holding the measured bytes, this package's terms and the
paper's. ``--recompute`` adds, with dropout 0.1, a row per recompute mode (none, selective,
full) without and with SP for each implementation (:mod:`mpu_lab.perf.recompute`: measured,
derived for fp32 on this device, the paper's bf16 formula) under ``"recompute_rows"``, and the
FLOPs of one step per mode on this rank under ``"flops_rows"``. From a notebook::

    job = mpu_lab.launcher.run("activation_memory.py", ["--tp", 2], nproc=2, show="none")
"""
import sys

from mpu_lab.training import flag_errors, initialize
from mpu_lab import launcher
from mpu_lab.core import parallel_state
from mpu_lab.core.transformer import TransformerConfig
from mpu_lab.perf import recompute, saved_activations


def parse(argv):
    p = flag_errors.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tp", type=int, default=2, help="tensor-parallel size t (= ranks)")
    p.add_argument("--seq", type=int, default=128, help="sequence length s")
    p.add_argument("--batch", type=int, default=2, help="micro-batch size b")
    p.add_argument("--hidden", type=int, default=64, help="hidden size h")
    p.add_argument("--heads", type=int, default=8, help="attention heads a")
    p.add_argument("--attention", choices=["explicit", "sdpa"], nargs="+", default=["explicit"],
                   help="explicit softmax (keeps the s x s scores) and/or SDPA")
    p.add_argument("--activation", choices=["gelu", "relu"], default="gelu")
    p.add_argument("--recompute", action="store_true",
                   help="also measure none / selective / full recomputation with dropout 0.1")
    p.add_argument("--quiet", action="store_true", help="report only, print nothing")
    return p.parse_args(argv)


def _recompute_rows(a):
    """Saved bytes per recompute mode with dropout on, and FLOPs per step (rank 0 prints)."""
    rows = [recompute.saved_bytes_row(a.seq, a.batch, a.hidden, a.heads, mode, sp, impl)
            for impl in a.attention for sp in (False, True) for mode in recompute.MODES]
    flops = [recompute.flops_row(a.seq, a.batch, a.hidden, a.heads, mode)
             for mode in recompute.MODES]
    if parallel_state.get_tensor_model_parallel_rank() == 0 and not a.quiet:
        print(recompute.format_saved_bytes(rows, a.seq, a.batch, a.hidden, a.heads))
        print(recompute.format_flops(flops, a.seq, a.batch, a.hidden, a.heads))
    for row in rows:
        row.pop("terms")
    return {"recompute_rows": rows, "flops_rows": flops}


@launcher.entrypoint
def main(argv=None):
    a = parse(argv)
    # a shape that cannot be split fails here, before any communication
    TransformerConfig(num_layers=1, hidden_size=a.hidden, num_attention_heads=a.heads,
                      sequence_parallel=True).check(a.tp, a.seq)
    initialize.init()
    parallel_state.initialize_model_parallel(a.tp)
    rows = [saved_activations.measured_row(a.seq, a.batch, a.hidden, a.heads, sp, impl, a.activation)
            for impl in a.attention for sp in (False, True)]
    per_rank = launcher.gather_lines(" ".join(str(r["measured"]) for r in rows))
    if per_rank is not None and not a.quiet:
        print(saved_activations.format_comparison(rows, a.seq, a.batch, a.hidden, a.heads))
        print("bytes measured on each rank (in the rows' order): "
              + "; ".join(f"rank {i}: {line}" for i, line in enumerate(per_rank)))
    report = {"tp": a.tp, "rows": rows}
    if a.recompute:
        report.update(_recompute_rows(a))
    launcher.report(report)
    initialize.shutdown()


if __name__ == "__main__":
    main(sys.argv[1:])
