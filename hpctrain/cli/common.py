"""What the `hpctrain` command's modules share: the CONFIG argument, --set, and user errors as exit status 2."""
from __future__ import annotations

import functools

import click

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
