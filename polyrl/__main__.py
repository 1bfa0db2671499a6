import sys

from polyrl.cli import cli

sys.exit(cli())
