"""The `hpctrain` console script (setup.cfg's entry point): takes the signals first, then runs the command line.

    hpctrain train CONFIG ...        # the installed script calls main()

Importing hpctrain.cli costs ~0.1 s (click, the config, every command's module) and a rank's launcher may signal
it meanwhile (a preemption during start-up, a scancel): with the default handlers that signal would kill the
process. Here the process's flag (hpctrain/preempt.py) is installed before that import, and hpctrain.cli's group
decides what a signal received meanwhile means once the command is known. `python -m hpctrain.cli` does the same
in cli.py's first lines. This module imports only hpctrain.preempt at its top.
"""
from __future__ import annotations

from hpctrain import preempt


def main() -> None:
    preempt.process_flag()
    from hpctrain.cli import main as cli_main

    cli_main()
