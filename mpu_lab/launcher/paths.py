"""Where the launcher finds things: the repository, its ``launch/`` scripts, and the environment
variable that tells a worker where to write its results (the lab's own; no Megatron
counterpart)."""
import pathlib

REPO_ROOT = pathlib.Path(__file__).resolve().parent.parent.parent
LAUNCH_DIR = REPO_ROOT / "launch"
RESULT_DIR_ENV = "MPU_LAB_RESULT_DIR"
