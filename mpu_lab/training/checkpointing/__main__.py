"""``python -m mpu_lab.training.checkpointing info|consolidate`` (see :func:`mpu_lab.training.checkpointing.main`)."""
import sys

from mpu_lab.training.checkpointing.consolidate import main

sys.exit(main())
