"""A tiny GPT's training state in this process (a one-rank world must be up: the ``world``
fixture), for the tests of the training loop's seams and of what its checkpoints keep."""
from mpu_lab import training

TINY = ["--num-layers", 1, "--hidden-size", 16, "--num-attention-heads", 2, "--seq-length", 8,
        "--micro-batch-size", 2, "--global-batch-size", 4, "--vocab-size", 32,
        "--make-vocab-size-divisible-by", 16, "--train-iters", 3, "--log-interval", 1,
        "--quiet"]


def tiny_state(*extra):
    """``training.setup`` of TINY plus ``extra`` (a flag given again wins)."""
    args = training.validate_args(training.parse_args([str(a) for a in TINY + list(extra)]), 1)
    return training.setup(args, log=lambda s: None)
