"""Checkpoints: torch.distributed.checkpoint (DCP) plans the sharding and resharding; hdf5_storage owns the bytes.

    dcp.save(state_dict, storage_writer=HDF5Writer(step_dir))
    dcp.load(state_dict, storage_reader=HDF5Reader(step_dir, verify="full"))
"""
from hpctrain.checkpoint.hdf5_storage import CheckpointCorrupt, HDF5Reader, HDF5Writer

__all__ = ["CheckpointCorrupt", "HDF5Reader", "HDF5Writer"]
