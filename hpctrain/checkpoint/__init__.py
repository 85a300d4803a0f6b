"""Checkpoints: torch.distributed.checkpoint (DCP) plans the sharding and resharding; hdf5_storage owns the bytes.

    dcp.save(state_dict, storage_writer=hdf5_storage.HDF5Writer(step_dir))
    dcp.load(state_dict, storage_reader=hdf5_storage.HDF5Reader(step_dir, verify="full"))

Nothing is imported here: `hpctrain ckpt ls` (listing.py) reads a checkpoints directory without torch.
"""
