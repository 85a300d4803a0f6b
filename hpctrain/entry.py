"""How every `hpctrain` process starts: takes the signals first, then imports the rest.

    hpctrain train CONFIG ...                                          # the console script calls main()
    python -u -m hpctrain.entry -u -m submitit.core._submit FOLDER     # a submitted task (launch.TASK_PYTHON)

Importing hpctrain.cli.main costs ~0.1 s (click, the config, every command's module), and submitit's task runner
imports submitit and waits for its pickle before it runs anything of ours; a rank's launcher may signal it meanwhile
(a preemption during start-up, a scancel), and with the default handlers that signal would kill the process. Here
the process's flag (hpctrain/job/preempt.py) is installed before those imports, and hpctrain.cli.main's group
decides what a signal received meanwhile means once the command is known. `python -m hpctrain.cli` does the same in
hpctrain/cli/__main__.py. This module imports only hpctrain.job.preempt at its top.
"""
from __future__ import annotations

import sys

from hpctrain.job import preempt

SUBMITIT_TASK = ["-u", "-m", "submitit.core._submit"]  # what submitit puts after its python command


def main() -> None:
    preempt.process_flag()
    from hpctrain.cli.main import main as cli_main

    cli_main()


def task_main(argv: list[str]) -> None:
    """One task of a submitted job: submitit's task runner (`-m submitit.core._submit FOLDER`), with the flag taken
    first and kept. submitit would install its own USR2/TERM handlers once it has loaded the pickle (USR2: its
    checkpoint-and-requeue, TERM: ignored); hpctrain's flag takes those signals for the whole task instead, as
    the task's first step always did, so a signal while submitit loads is kept rather than lost or fatal."""
    preempt.process_flag()
    if argv[:3] != SUBMITIT_TASK or len(argv) != 4:
        raise SystemExit(f"usage: python -u -m hpctrain.entry {' '.join(SUBMITIT_TASK)} FOLDER (got {argv})")
    from submitit.core import job_environment, submission

    job_environment.JobEnvironment._handle_signals = lambda self, paths, delayed: None
    sys.argv = [submission.__file__, argv[3]]
    submission.submitit_main()


if __name__ == "__main__":
    task_main(sys.argv[1:])
