"""The blend tests' token files, as module-scoped fixtures (tests/helpers/blends.py)."""
from helpers.blends import blend, files  # noqa: F401 (fixtures)
