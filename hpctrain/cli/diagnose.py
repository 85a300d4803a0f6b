"""`hpctrain diagnose RUN_DIR`: which ranks and hosts stopped where in a hung or failed run (hpctrain.hang.diagnose).

    hpctrain diagnose runs/tiny-cpu-20261125-155755-9a26ca          # a few lines, then the files behind them
    hpctrain diagnose RUN_DIR --json                                # the same as one JSON object

Exit status: 0 when the run finished or is still running, 1 when it hung or failed (scripts can test it).
"""
from __future__ import annotations

import json
import sys

import click

from hpctrain.cli.common import user_errors


@click.command(name="diagnose")
@click.argument("run_dir", type=click.Path(exists=True, file_okay=False))
@click.option("--json", "as_json", is_flag=True, help="Print the diagnosis as one JSON object.")
@user_errors
def diagnose_cmd(run_dir: str, as_json: bool) -> None:
    """Say which ranks and hosts of RUN_DIR's job stopped where, and what the others waited for."""
    from hpctrain.hang import diagnose

    report = diagnose.diagnose(run_dir)
    if as_json:
        click.echo(json.dumps(report, indent=2))
    else:
        click.echo(diagnose.format_report(report, run_dir))
    if report["kind"] in ("hang", "failed"):
        sys.exit(1)
