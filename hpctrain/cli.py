"""The `hpctrain` command.

    hpctrain submit CONFIG [--set section.key=value ...] [--dry-run] [--wait]
    hpctrain train CONFIG [--set ...] [--run-dir DIR]      # what each rank runs
    hpctrain topo CONFIG [--set ...]                       # the rank map the job will use

Config and layout errors exit with status 2 and a message naming the value, before anything is submitted.
"""
from __future__ import annotations

import functools
import sys
from pathlib import Path

import click

from hpctrain.config import Config, load_config

CONFIG_ARG = click.argument("config", type=click.Path(dir_okay=False))
SET_OPT = click.option("--set", "overrides", multiple=True, metavar="SECTION.KEY=VALUE",
                       help="Override one config value (repeatable), e.g. --set parallel.tp=2")


def user_errors(fn):
    """ValueError from config or layout checks becomes a usage error (exit 2) with its message."""
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except ValueError as e:
            raise click.UsageError(str(e)) from None
    return wrapper


def _load(config: str, overrides: tuple[str, ...]) -> Config:
    try:
        return load_config(config, overrides)
    except ValueError as e:
        raise click.UsageError(str(e)) from None


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
def main() -> None:
    """hpctrain: Slurm-native distributed training toolkit."""


@main.command()
@CONFIG_ARG
@SET_OPT
@click.option("--dry-run", is_flag=True, help="Validate config and layout, print the sbatch script, submit nothing.")
@click.option("--wait", is_flag=True, help="Follow the job to its end; exit non-zero if it fails.")
@user_errors
def submit(config: str, overrides: tuple[str, ...], dry_run: bool, wait: bool) -> None:
    """Submit CONFIG as a job: to Slurm when it is reachable, else run locally."""
    from hpctrain import launch, mesh

    cfg = _load(config, overrides)
    layout = launch.check_layout(cfg)
    if dry_run:
        rows = mesh.rank_table(layout, mesh.block_placement(cfg.job.nodes, cfg.job.tasks_per_node))
        click.echo(mesh.format_rank_map(layout, rows))
        click.echo(f"\n# sbatch script for {cfg.job.nodes} node(s) x {cfg.job.tasks_per_node} task(s); "
                   f"nothing submitted\n")
        click.echo(launch.render_sbatch(cfg, Path(cfg.job.run_root).absolute() / "<run dir>" / "submitit"))
        return
    try:
        run_dir, job, kind = launch.submit(cfg, echo=click.echo)
    except launch.SubmitError as e:
        raise click.ClickException(str(e)) from None
    click.echo(f"submitted job {job.job_id} ({kind}); run directory {run_dir}")
    if not wait:
        return
    try:
        launch.wait(job, run_dir, kind, cfg, echo=click.echo)
    except launch.SubmitError as e:
        raise click.ClickException(str(e)) from None
    click.echo(f"job {job.job_id} finished; summary in {run_dir / 'summary.json'}")


@main.command()
@CONFIG_ARG
@SET_OPT
@click.option("--run-dir", default=None, type=click.Path(file_okay=False),
              help="Existing run directory (submit passes it); default: a fresh one made by rank 0.")
@user_errors
def train(config: str, overrides: tuple[str, ...], run_dir: str | None) -> None:
    """Run one rank of the job (under mpiexec, srun, torchrun, or alone)."""
    from hpctrain import train as train_mod

    cfg = _load(config, overrides)
    train_mod.run(cfg, run_dir)


@main.command()
@CONFIG_ARG
@SET_OPT
@user_errors
def topo(config: str, overrides: tuple[str, ...]) -> None:
    """Print the rank map of CONFIG's layout on its nodes x tasks_per_node (block placement)."""
    from hpctrain import launch, mesh

    cfg = _load(config, overrides)
    layout = launch.check_layout(cfg)
    rows = mesh.rank_table(layout, mesh.block_placement(cfg.job.nodes, cfg.job.tasks_per_node))
    click.echo(mesh.format_rank_map(layout, rows))


if __name__ == "__main__":
    sys.exit(main())
