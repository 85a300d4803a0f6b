"""hpctrain: Slurm-native distributed transformer training."""

__version__ = "0.1.0"
