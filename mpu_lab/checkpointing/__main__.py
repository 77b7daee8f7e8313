"""``python -m mpu_lab.checkpointing info|consolidate`` (see :func:`mpu_lab.checkpointing.main`)."""
import sys

from mpu_lab.checkpointing.consolidate import main

sys.exit(main())
