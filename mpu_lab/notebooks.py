"""TEMPORARY: moved to mpu_lab.labkit.notebooks (this name is that package, pytest hooks included;
``python -m mpu_lab.notebooks`` still runs its command line); the integrator removes it."""
import sys

import mpu_lab.labkit.notebooks

if __name__ == "__main__":
    from mpu_lab.labkit.notebooks.cli import main
    sys.exit(main())
sys.modules[__name__] = mpu_lab.labkit.notebooks
