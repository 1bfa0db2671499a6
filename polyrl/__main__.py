import sys

from polyrl.cpu_env import apply_cpu_defaults

apply_cpu_defaults()  # before anything imports torch: its OpenMP runtime reads the wait policy once, when loaded
from polyrl.cli import cli  # noqa: E402

sys.exit(cli())
