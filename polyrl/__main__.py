import sys

from polyrl.cpu_env import start_process

start_process()  # before anything imports torch: its OpenMP runtime reads the wait policy once, when loaded
from polyrl.cli import cli  # noqa: E402

sys.exit(cli())
