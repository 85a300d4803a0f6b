"""`hpctrain doctor`: a short preflight of the nodes on the job's own shape (hpctrain/doctor/measure.py measures,
hpctrain/doctor/report.py judges).

    hpctrain doctor CONFIG [--set ...] [--json]              # submitted like the job (Slurm, else local), waited for
    mpiexec -n 4 hpctrain doctor CONFIG --here               # as the ranks of a launch: what the job runs

Prints the table, the failed nodes and a ready --exclude= line; the run directory keeps doctor.json. Exit status
1 when a check failed, 2 for a config or option error.

This module sits below hpctrain.cli.main, which registers the command with cli's own launch helpers (the wrapper that
ends a launch on a failed rank, and the submit-and-wait function): command(ends_launch_on_error, submit).
"""
from __future__ import annotations

import contextlib
import json
import os
import sys
from pathlib import Path
from typing import Any, Callable

import click

from hpctrain import untrusted
from hpctrain.cli.common import CONFIG_ARG, SET_OPT, user_errors
from hpctrain.config import load_config
from hpctrain.hostprobe import MAX_STORAGE_MB

REPORT_LIMIT = 64 << 20  # bytes of doctor.json: about 1 KB per rank as written (indented), room for 60,000 ranks

RULE_OPTIONS = ("margin", "storage_margin", "expected_fraction", "max_skew_ms")


def _rule_argv(rules: dict[str, float | None]) -> list[str]:
    """The rule options given, as the submitted ranks' command line."""
    return [a for k, v in rules.items() if v is not None for a in (f"--{k.replace('_', '-')}", repr(v))]


def _read_report(path: Path) -> dict[str, Any]:
    """The job's doctor.json, read as any file of a run directory is (hpctrain.untrusted): bounded, no link, a JSON
    object whose "ok" is true or false; else a clean error naming the file."""
    if not os.path.lexists(path):
        raise click.ClickException(f"the job left no doctor.json in {path.parent}")
    try:
        report = untrusted.read_json(path, REPORT_LIMIT)
    except untrusted.Untrusted as e:
        raise click.ClickException(str(e)) from None
    if not isinstance(report, dict) or not isinstance(report.get("ok"), bool):
        raise click.ClickException(f"{str(path)!r} is not a doctor report (no true or false \"ok\")")
    return report


def _render(report: dict[str, Any], path: Path) -> str:
    """The table of a report read back from a file: one that does not have the shape render() reads is refused
    with its name instead of a traceback."""
    from hpctrain.doctor import report as doctor_report

    try:
        return doctor_report.render(report)
    except (KeyError, TypeError, ValueError, AttributeError, IndexError) as e:
        raise click.ClickException(f"{str(path)!r} is not a doctor report this version can show "
                                   f"({type(e).__name__}: {e})") from None


def command(ends_launch_on_error: Callable, submit: Callable[..., Path]) -> click.Command:
    """The `doctor` command. ends_launch_on_error wraps what the ranks run; submit(cfg, wait, argv=...) submits a
    command line as the job and returns its run directory (hpctrain.cli.main passes its own)."""

    @ends_launch_on_error
    def ranks(cfg, run_dir: str | None, opts) -> tuple[int, dict[str, Any]]:
        from hpctrain.doctor import measure as doctor
        from hpctrain.job import session

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
    @click.option("--storage-mb", type=click.IntRange(1, MAX_STORAGE_MB), default=128, show_default=True,
                  help=f"MiB written and read back per node in the checkpoint directory (at most {MAX_STORAGE_MB}; "
                  "a node writes at most a tenth of the free space it sees, split between the nodes writing at "
                  "once, and says so when it writes less).")
    @user_errors
    def doctor(config: str, overrides: tuple[str, ...], here: bool, run_dir: str | None, as_json: bool,
               margin, storage_margin, expected_fraction, max_skew_ms, storage_mb: int) -> None:
        """Screen the job's nodes before a long run: per rank GPU visibility and GEMM rate, per communicator
        all-reduce bandwidth, per node checkpoint storage, free space, clock skew and environment. Outliers
        against the median (and the datasheet for job.gpu) fail their node; exit status 1 on any failure."""
        from hpctrain.doctor import measure as doctor_mod
        from hpctrain.doctor import report as doctor_report

        # the doctor trains nothing: train.steps=0 spares it the training checks (data files, batch)
        cfg = load_config(config, overrides + ("train.steps=0",))
        rules = dict(zip(RULE_OPTIONS, (margin, storage_margin, expected_fraction, max_skew_ms)))
        # a bad rule is refused here, not in the job
        doctor_report.Rules.for_device("cuda" if cfg.job.gpus_per_node else "cpu", **rules)
        if cfg.job.gpu or cfg.job.hw_profile:
            try:
                doctor_report.expected_figures(cfg.job.gpu, cfg.job.hw_profile)
            except ValueError as e:
                key = "job.hw_profile" if cfg.job.hw_profile else "job.gpu"
                raise ValueError(f"{key} = {cfg.job.hw_profile or cfg.job.gpu!r}: {e}") from None
        if here:
            rank, report = ranks(cfg, run_dir, doctor_mod.Options(rules=rules, storage_mb=storage_mb))
            if rank == 0:
                click.echo(json.dumps(report, indent=1) if as_json else doctor_report.render(report))
        else:
            argv = ["--here", "--storage-mb", str(storage_mb), *_rule_argv(rules)]
            with contextlib.redirect_stdout(sys.stderr) if as_json else contextlib.nullcontext():
                path = submit(cfg, True, argv=lambda cfg_path, rdir: ["doctor", str(cfg_path), "--run-dir",
                                                                      str(rdir), *argv])
            report = _read_report(path / "doctor.json")
            click.echo(json.dumps(report, indent=1) if as_json else _render(report, path / "doctor.json"))
        if not report["ok"]:
            raise click.exceptions.Exit(1)

    return doctor

