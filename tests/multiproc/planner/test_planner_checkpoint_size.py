"""The planner's checkpoint size against a checkpoint a training run in the test process wrote (the rest of the
report: tests/pure/planner/test_planner_report.py).

    PATH=$PWD/.venv/bin:$PATH .venv/bin/python -m pytest -q tests/multiproc/planner/test_planner_checkpoint_size.py
"""
from __future__ import annotations

from helpers.training import SMALL
from hpctrain.config import load_config
from hpctrain.job import session
from hpctrain.planner.ckpt_cost import checkpoint_bytes, payload_bytes


def test_checkpoint_size_matches_a_written_checkpoint(tmp_path) -> None:
    """A model other than the one the header constant was measured on: 3 blocks, grouped-query attention."""
    from hpctrain.train.trainer import Trainer
    cfg = load_config(None, SMALL + ["model.n_layers=3", "model.dim=48", "model.n_heads=4", "model.n_kv_heads=2",
                                     "train.steps=1", f"job.run_root={tmp_path}"])
    with session.start(cfg) as s:
        Trainer(cfg, s).fit()
        ckpt = next((s.run_dir / "checkpoints").glob("step_*"))
    import h5py

    from hpctrain.model.dims import ModelDims
    real = sum(f.stat().st_size for f in ckpt.iterdir())
    stored = []
    with h5py.File(ckpt / "shard-0.h5") as f:
        f.visititems(lambda name, obj: stored.append(obj.size * obj.dtype.itemsize)
                     if isinstance(obj, h5py.Dataset) else None)
    dims = ModelDims.from_config(cfg.model)
    # the tensors' bytes to 1% (the JSON hyperparameters are the rest); with the headers, which are most of a toy
    # checkpoint (1 MB of 2.5 MB here) and nothing of a real one, to 15%
    assert abs(payload_bytes(dims, 1) / sum(stored) - 1) < 0.01, (payload_bytes(dims, 1), sum(stored))
    assert abs(checkpoint_bytes(dims, 1) / real - 1) < 0.15, (checkpoint_bytes(dims, 1), real)
