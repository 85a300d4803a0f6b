"""One rank of tests/multiproc/job/test_open_files.py: a short training job through session.start (Slurm's variables,
file rendezvous), started by the test under a low soft RLIMIT_NOFILE. At the end, after a barrier, the rank counts
its own descriptors from /proc/self/fd (TCP sockets split into established and listening by /proc/self/net/tcp*)
and writes OUT/rank<r>.json with the counts, its limits and the layout.

    python tests/workers/open_files_worker.py OUT [section.key=value ...]
"""
from __future__ import annotations

import json
import os
import resource
import sys
from pathlib import Path

TINY = ["model.vocab_size=256", "model.dim=32", "model.n_layers=2", "model.n_heads=4", "model.max_seq_len=32",
        "data.source=synthetic", "data.seq_len=16", "train.lr=1e-3", "train.warmup_steps=1", "train.log_every=100",
        "train.peak_tflops=1", "train.micro_batch_size=2", "train.steps=2", "parallel.timeout_s=60",
        "parallel.connect_timeout_s=30", "job.nodes=1", "job.tasks_per_node=4"]


def tcp_states() -> dict[str, str]:
    """socket inode -> "established" | "listening" | "other", for the TCP sockets of this network namespace."""
    states = {}
    for table in ("/proc/self/net/tcp", "/proc/self/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            f = line.split()
            states[f[9]] = {"01": "established", "0A": "listening"}.get(f[3], "other")
    return states


def count_fds() -> dict[str, int]:
    """This process's descriptors by kind: tcp_established, tcp_listening, tcp_other, socket (unix, ...), other."""
    states = tcp_states()
    counts = {"tcp_established": 0, "tcp_listening": 0, "tcp_other": 0, "socket": 0, "other": 0}
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:  # the descriptor listdir itself used
            continue
        if target.startswith("socket:["):
            state = states.get(target[8:-1])
            counts[f"tcp_{state}" if state else "socket"] += 1
        else:
            counts["other"] += 1
    counts["total"] = sum(counts.values())
    return counts


def main(out: Path, overrides: list[str]) -> None:
    import torch.distributed as dist

    from hpctrain.config import load_config
    from hpctrain.job import session
    from hpctrain.train.trainer import Trainer

    rank = int(os.environ["SLURM_PROCID"])
    result: dict = {"soft_at_start": resource.getrlimit(resource.RLIMIT_NOFILE)[0]}
    cfg = load_config(None, TINY + [f"job.run_root={out / 'runs'}"] + overrides)
    with session.start(cfg) as s:
        Trainer(s.cfg, s).fit()
        dist.barrier()  # every rank past its last collective: no connection half made
        result.update(counts=count_fds(), limits=list(resource.getrlimit(resource.RLIMIT_NOFILE)),
                      layout=s.summary["layout"], run_dir=str(s.run_dir), lazy=os.environ.get("TORCH_GLOO_LAZY_INIT"))
        dist.barrier()  # nobody tears down while a peer still counts
    (out / f"rank{rank}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2:])
