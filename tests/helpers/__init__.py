"""What the tests share, by domain; import from the module that holds it (`from helpers.launch import tool`):

- launch: the repository's paths, the virtualenv's executables, the CLI and mpiexec in a fresh process,
  torchrun-style spawns of tests/workers/ scripts and the worker side of a spawn over several cases;
- runs: a finished run's directory and summary;
- refusals: `refused`, the check of a ValueError naming the offending values;
- training: the tiny model's settings, the 1-rank training reference and the layout comparison, initialisation
  draws;
- ckpt_bytes: checkpoint tensors, a flipped byte, bitwise comparison of stored datasets;
- locks: checkpoint directory lock records, a dead pid;
- hang: hang files as ranks write them (heartbeats, dumps, requests, metrics rows), a watchdog under test;
- blends: token files for blend tests;
- tokenized: inputs for tokenized builds and the split of a built stream into documents.

Test files of every tier (tests/pure, tests/multiproc, tests/cluster) import these: tests/conftest.py puts tests/
on sys.path. The worker scripts in tests/workers/ put it there themselves (they run as scripts). Nothing of
hpctrain is imported at module level (torch only in training and ckpt_bytes), so that loading helpers.launch,
which conftest does for every test, never depends on the package importing cleanly.
"""
