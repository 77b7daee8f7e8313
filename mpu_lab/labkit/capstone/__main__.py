"""``python -m mpu_lab.labkit.capstone --code DIR --tensor-model-parallel-size T
--pipeline-model-parallel-size P [--data-parallel-size D] [--train-iters N] [--plot FILE]``:
train a tiny GPT with the learner's own pieces and with the mirror's, from the same seed, and
say whether the losses are equal (exit 0) or where they part and which piece it is (exit 1).
Flags that cannot work are refused before any process starts (exit 2)."""
import sys

from mpu_lab.labkit.capstone.args import build_parser, check_args
from mpu_lab.labkit.capstone.run import run_checked
from mpu_lab.training.flag_errors import FlagError


def main(argv=None) -> int:
    parser = build_parser()
    a = parser.parse_args(argv)
    try:
        check_args(a)
    except FlagError as e:
        parser.exit(2, f"{parser.prog}: error: {e}\n")
    return run_checked(a).exit_code


if __name__ == "__main__":
    sys.exit(main())
