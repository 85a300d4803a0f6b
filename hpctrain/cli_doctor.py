"""`hpctrain doctor`: a short preflight of the nodes on the job's own shape (hpctrain/doctor.py measures,
hpctrain/doctor_report.py judges).

    hpctrain doctor CONFIG [--set ...] [--json]              # submitted like the job (Slurm, else local), waited for
    mpiexec -n 4 hpctrain doctor CONFIG --here               # as the ranks of a launch: what the job runs

Prints the table, the failed nodes and a ready --exclude= line; the run directory keeps doctor.json. Exit status
1 when a check failed, 2 for a config or option error.

This module sits below hpctrain.cli, which registers the command with cli's own launch helpers (the wrapper that
ends a launch on a failed rank, and the submit-and-wait function): command(ends_launch_on_error, submit).
"""
from __future__ import annotations

import contextlib
import json
import sys
from pathlib import Path
from typing import Any, Callable

import click

from hpctrain.cliutil import CONFIG_ARG, SET_OPT, user_errors
from hpctrain.config import load_config

RULE_OPTIONS = ("margin", "storage_margin", "expected_fraction", "max_skew_ms")


def _rule_argv(rules: dict[str, float | None]) -> list[str]:
    """The rule options given, as the submitted ranks' command line."""
    return [a for k, v in rules.items() if v is not None for a in (f"--{k.replace('_', '-')}", repr(v))]


def command(ends_launch_on_error: Callable, submit: Callable[..., Path]) -> click.Command:
    """The `doctor` command. ends_launch_on_error wraps what the ranks run; submit(cfg, wait, argv=...) submits a
    command line as the job and returns its run directory (hpctrain.cli passes its own)."""

    @ends_launch_on_error
    def ranks(cfg, run_dir: str | None, opts) -> tuple[int, dict[str, Any]]:
        from hpctrain import doctor, session

        with session.start(cfg, run_dir) as s:
            report = doctor.run(s, opts)
        return s.rank, report

    @click.command(name="doctor")
    @CONFIG_ARG
    @SET_OPT
    @click.option("--here", is_flag=True, help="Run as a rank of this launch (mpiexec, srun, torchrun, alone) "
                  "instead of submitting; what the submitted job runs.")
    @click.option("--run-dir", default=None, type=click.Path(file_okay=False),
                  help="With --here: an existing run directory (submission passes it); default: a fresh one.")
    @click.option("--json", "as_json", is_flag=True, help="Print the report as JSON instead of the table.")
    @click.option("--margin", type=float, default=None, help="Fail a GEMM, CPU count or bandwidth below (1 - "
                  "margin) x its peers' median [default: 0.2 on GPUs, 0.6 on CPUs].")
    @click.option("--storage-margin", type=float, default=None,
                  help="The same for a node's write and read rate [default: 0.5].")
    @click.option("--expected-fraction", type=float, default=None, help="With job.gpu naming a GPU: fail below "
                  "this share of its datasheet GEMM peak or link bandwidth [default: 0.4].")
    @click.option("--max-skew-ms", type=float, default=None, help="Fail a node whose clock is further than this "
                  "from rank 0's [default: 100].")
    @click.option("--storage-mb", type=click.IntRange(1), default=128, show_default=True,
                  help="MiB written and read back per node in the checkpoint directory.")
    @user_errors
    def doctor(config: str, overrides: tuple[str, ...], here: bool, run_dir: str | None, as_json: bool,
               margin, storage_margin, expected_fraction, max_skew_ms, storage_mb: int) -> None:
        """Screen the job's nodes before a long run: per rank GPU visibility and GEMM rate, per communicator
        all-reduce bandwidth, per node checkpoint storage, free space, clock skew and environment. Outliers
        against the median (and the datasheet for job.gpu) fail their node; exit status 1 on any failure."""
        from hpctrain import doctor as doctor_mod
        from hpctrain import doctor_report

        # the doctor trains nothing: train.steps=0 spares it the training checks (data files, batch)
        cfg = load_config(config, overrides + ("train.steps=0",))
        rules = dict(zip(RULE_OPTIONS, (margin, storage_margin, expected_fraction, max_skew_ms)))
        # a bad rule is refused here, not in the job
        doctor_report.Rules.for_device("cuda" if cfg.job.gpus_per_node else "cpu", **rules)
        if cfg.job.gpu:
            try:
                doctor_report.expected_figures(cfg.job.gpu)
            except ValueError as e:
                raise ValueError(f"job.gpu = {cfg.job.gpu!r}: {e}") from None
        if here:
            rank, report = ranks(cfg, run_dir, doctor_mod.Options(rules=rules, storage_mb=storage_mb))
            if rank == 0:
                click.echo(json.dumps(report, indent=1) if as_json else doctor_report.render(report))
        else:
            argv = ["--here", "--storage-mb", str(storage_mb), *_rule_argv(rules)]
            with contextlib.redirect_stdout(sys.stderr) if as_json else contextlib.nullcontext():
                path = submit(cfg, True, argv=lambda cfg_path, rdir: ["doctor", str(cfg_path), "--run-dir",
                                                                      str(rdir), *argv])
            if not (path / "doctor.json").is_file():
                raise click.ClickException(f"the job left no doctor.json in {path}")
            report = json.loads((path / "doctor.json").read_text())
            click.echo(json.dumps(report, indent=1) if as_json else doctor_report.render(report))
        if not report["ok"]:
            raise click.exceptions.Exit(1)

    return doctor

