"""The run configuration: typed sections validated on load, a config file and --set overrides, the Hugging Face
config.json mapping. Callers import from here:

    from hpctrain.config import Config, load_config
    cfg = load_config("slurm/examples/tiny-cpu.toml", ["parallel.tp=2"])

Imports neither torch nor mpi4py: the login node loads and checks configs without them.
"""
from hpctrain.config.load import MAX_CONFIG_BYTES, SECTIONS, Config, dump_toml, from_dict, load_config, to_dict
from hpctrain.config.sections import (
    MAX_WORLD_SIZE,
    PP_SCHEDULES,
    CheckpointConfig,
    DataConfig,
    JobConfig,
    ModelConfig,
    ParallelConfig,
    TrainConfig,
    default_run_root,
)

__all__ = ["MAX_CONFIG_BYTES", "SECTIONS", "Config", "dump_toml", "from_dict", "load_config", "to_dict",
           "MAX_WORLD_SIZE", "PP_SCHEDULES", "CheckpointConfig", "DataConfig", "JobConfig", "ModelConfig",
           "ParallelConfig", "TrainConfig", "default_run_root"]
