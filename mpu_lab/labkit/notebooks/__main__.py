"""``python -m mpu_lab.labkit.notebooks``: see :mod:`mpu_lab.labkit.notebooks.cli`."""
import sys

from mpu_lab.labkit.notebooks.cli import main

sys.exit(main())
