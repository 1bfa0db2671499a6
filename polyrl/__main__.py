import sys

from polyrl.cli import main

sys.exit(main())
