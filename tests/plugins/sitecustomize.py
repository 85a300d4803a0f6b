"""Python imports this module at start-up when tests/plugins is on PYTHONPATH (helpers.launch.seam_env puts it there for
the ranks a test launches): the test seams named in the environment (SEAM_FAULT, SEAM_DOCTOR_SLOW; see seams.py)
are patched into hpctrain as its modules are imported. Without those variables it does nothing."""
import seams

seams.install_from_env()
