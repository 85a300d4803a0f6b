"""Stands in for click on the PYTHONPATH of tests/multiproc/doctor/test_doctor_signals.py: the process's first
`import click` (hpctrain.cli.main's first heavy import, ~0.1 s before the command line is parsed) sends the process the
signal named by HPCTRAIN_TEST_SIGNAL, then puts the real click in its place. A launcher's signal in the first
milliseconds of a rank, at the same moment every run."""
import importlib
import os
import signal
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))
os.kill(os.getpid(), signal.Signals[os.environ["HPCTRAIN_TEST_SIGNAL"]])  # delivered before kill() returns
del sys.modules["click"]
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != _HERE]
sys.modules["click"] = importlib.import_module("click")  # what `import click` returns once this module has run
