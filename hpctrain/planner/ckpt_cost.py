"""What checkpoints cost a run: their size (as hpctrain's checkpointer writes them), the time to save and load one
at a storage bandwidth, the interval that loses the least time to failures (Young/Daly), and whether a save fits
in the warning Slurm gives before it ends a job (job.signal_delay_s).

    size = checkpoint_bytes(dims, world)                     # fp32 weights, AdamW moments, every rank's RNG state
    cost = checkpoint_cost(size, storage_gbps=5, nodes=16, node_mtbf_h=6000, signal_delay_s=120)

Size: the weights (fp32 masters) and AdamW's two moments, 12 bytes per parameter whatever the layout (shards add up
to the whole), a 4-byte step count per parameter tensor, the (world, 5056) uint8 RNG table, and per stored dataset
about 3.2 kB of HDF5 headers and index.json entry (2.7 to 3.6 kB measured) (16 datasets per parameter tensor:
weight, moments, step and the JSON hyperparameters). The headers dominate only for toy models: 0.7 MB of 1.8 MB at
49k parameters. A sharded layout stores one dataset per shard: more headers, a few MB at most for real models. Time:
size over the aggregate bandwidth the file system gives the job (measured by benchmarks/checkpoint_io.py, or
configured); a load reads the same bytes. Young/Daly: with a save taking C and the job failing on average every M (a
node's MTBF over the job's nodes), the interval sqrt(2 C M) minimises the expected time lost (work redone plus
saves); valid while C << M.

Default node MTBF: 6000 h, from Meta's Llama 3 report (arXiv 2407.21783, section 3.3.4): 419 unexpected
interruptions in 54 days on 16,384 H100 GPUs (2,048 nodes of 8), about one per 3.1 h for the job, so about
6,300 h per node.
"""
from __future__ import annotations

import math

from hpctrain.model.dims import ModelDims

RNG_BYTES = 5056  # torch's CPU generator state, per rank
DATASET_BYTES = 3200  # HDF5 object header and index.json entry per stored dataset: 2.7-3.6 kB measured
DATASETS_PER_TENSOR = 16
NODE_MTBF_H = 6000.0


def payload_bytes(dims: ModelDims, world: int) -> int:
    """The tensors' own bytes: fp32 weights and moments, step counts, the RNG table."""
    return 12 * dims.num_params() + 4 * len(dims.param_shapes()) + RNG_BYTES * world


def checkpoint_bytes(dims: ModelDims, world: int) -> int:
    return payload_bytes(dims, world) + DATASET_BYTES * (DATASETS_PER_TENSOR * len(dims.param_shapes()) + 1)


def checkpoint_cost(size_bytes: int, storage_gbps: float, nodes: int, node_mtbf_h: float = NODE_MTBF_H,
                    signal_delay_s: float = 0.0) -> dict:
    """Save and load seconds, the Young/Daly interval and the job's MTBF; `fits_warning` says whether a save
    finishes within the preemption warning (None when no warning is configured)."""
    for name, value in (("storage_gbps", storage_gbps), ("node_mtbf_h", node_mtbf_h), ("nodes", nodes)):
        if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
            raise ValueError(f"{name} = {value!r} must be a positive number")
    save_s = size_bytes / (storage_gbps * 1e9)
    job_mtbf_s = node_mtbf_h * 3600 / nodes
    return {"size_gb": size_bytes / 1e9, "save_s": save_s, "load_s": save_s, "job_mtbf_h": job_mtbf_s / 3600,
            "young_daly_interval_s": math.sqrt(2 * save_s * job_mtbf_s),
            "fits_warning": save_s <= signal_delay_s if signal_delay_s else None, "signal_delay_s": signal_delay_s}
