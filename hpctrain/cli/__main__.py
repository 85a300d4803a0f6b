"""`python -m hpctrain.cli`: the hpctrain command, with the signals taken before click and the commands import (as
the console script does, hpctrain/entry.py)."""
import sys

from hpctrain.job import preempt

preempt.process_flag()

from hpctrain.cli.main import main  # noqa: E402 (after the signals are taken)

sys.exit(main())
