"""Submission through submitit: the Slurm executor when Slurm answers, else submitit's local executor.

    run_dir, job, kind = submit(cfg, task) # validated config in, a fresh run directory out
    wait(job, run_dir, kind, cfg)          # follows the job, never hangs on one that died

`slurm_parameters(cfg)` is the one mapping from [job] to sbatch options; `render_sbatch` shows the script for
--dry-run without needing Slurm. Heavy modules (torch, submitit) are imported inside functions.
"""
from __future__ import annotations

import dataclasses
import re
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

from hpctrain.config import Config, dump_toml
from hpctrain.job import runs
from hpctrain.parallel import mesh
from hpctrain.parallel.plan import Plan, make_plan


class SubmitError(RuntimeError):
    """Slurm refused the job or it failed; the message says why."""


def _run(cmd: list[str], timeout: float = 15) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)


def slurm_status() -> tuple[bool, str]:
    """(reachable, why): sbatch and srun on PATH and the controller answering sinfo."""
    for tool in ("sbatch", "srun", "sinfo"):
        if shutil.which(tool) is None:
            return False, f"no {tool} on PATH"
    try:
        out = _run(["sinfo", "-h", "-o", "%P"])
    except subprocess.TimeoutExpired:
        return False, "sinfo did not answer within 15 s"
    if out.returncode != 0:
        return False, f"sinfo failed: {(out.stderr or out.stdout).strip()}"
    return True, "sinfo answered"


def choose_executor(cfg: Config) -> tuple[str, str]:
    """('slurm' | 'local', reason)."""
    ok, why = slurm_status()
    if cfg.job.executor == "slurm" and not ok:
        raise ValueError(f"job.executor = 'slurm' but Slurm is not reachable: {why}")
    if cfg.job.executor == "local":
        return "local", "job.executor = 'local'"
    if ok:
        return "slurm", why
    return "local", f"Slurm not reachable ({why})"


def partitions() -> dict[str, dict[str, Any]]:
    """{name: {"nodes": n, "cpus": max CPUs per node, "mem_mb": the least memory of a node (MB, Slurm's
    RealMemory), "default": bool}} from sinfo."""
    out = _run(["sinfo", "-h", "-o", "%P|%D|%c|%m"])
    parts: dict[str, dict[str, Any]] = {}
    for line in out.stdout.splitlines():
        name, nodes, cpus, mem = line.strip().split("|")
        default = name.endswith("*")
        p = parts.setdefault(name.rstrip("*"), {"nodes": 0, "cpus": 0, "mem_mb": None, "default": False})
        p["nodes"] += int(nodes)
        p["cpus"] = max(p["cpus"], int(cpus.rstrip("+")))
        least = int(mem.rstrip("+"))  # "256000+": the group's least, some nodes have more
        p["mem_mb"] = least if p["mem_mb"] is None else min(p["mem_mb"], least)
        p["default"] |= default
    return parts


def check_cluster(cfg: Config, echo=print, host_gib: float = 0.0) -> None:
    """Refuses, before sbatch, what this cluster can never run: a missing partition, too many nodes or CPUs, an
    MPI plugin srun does not have, and with parallel.offload and no job.mem_gb a node whose memory is smaller than
    `host_gib`, the host memory per node the planner predicts for the offloaded states.

    (sbatch accepts such a job and leaves it pending forever.)"""
    parts = partitions()
    name = cfg.job.partition or next((n for n, p in parts.items() if p["default"]), "")
    if name not in parts:
        what = f"job.partition = {cfg.job.partition!r}" if cfg.job.partition else "a default partition"
        raise ValueError(f"{what} does not exist on this cluster; available: {', '.join(sorted(parts)) or '(none)'}")
    part = parts[name]
    if cfg.job.nodes > part["nodes"]:
        raise ValueError(f"job.nodes = {cfg.job.nodes} but partition {name!r} has only {part['nodes']} node(s)")
    cpus = cfg.job.tasks_per_node * cfg.job.cpus_per_task
    if cpus > part["cpus"]:
        raise ValueError(f"job.tasks_per_node * job.cpus_per_task = {cfg.job.tasks_per_node} * "
                         f"{cfg.job.cpus_per_task} = {cpus} CPUs per node, but nodes of partition {name!r} "
                         f"have at most {part['cpus']}")
    if host_gib and not cfg.job.mem_gb and part["mem_mb"] and host_gib > part["mem_mb"] / 1024:
        raise ValueError(f"parallel.offload = {cfg.parallel.offload!r}: {host_gib:.1f} GiB of host memory per node "
                         f"predicted for the offloaded states, but the nodes of partition {name!r} have "
                         f"{part['mem_mb'] / 1024:.1f} GiB (sinfo's RealMemory); spread the model over more nodes, "
                         f"or offload less (parallel.offload = 'optimizer')")
    check_mpi(cfg, echo)


def parse_mpi_list(text: str) -> list[str]:
    """Plugin names from `srun --mpi=list`: the indented lines, and the versions after 'versions available:'
    (Slurm 22.05: "MPI plugin types are...", "\tpmix", ..., "specific pmix plugin versions available: pmix_v4")."""
    names = set()
    for line in text.splitlines():
        if "versions available:" in line:
            names.update(n for n in re.split(r"[\s,]+", line.split(":", 1)[1]) if n)
        elif line[:1].isspace() and line.strip():
            names.add(line.strip())
    return sorted(names)


def mpi_plugins() -> list[str] | None:
    """The srun MPI plugins of this site, or None when `srun --mpi=list` does not answer with a list."""
    try:
        out = _run(["srun", "--mpi=list"])
    except (OSError, subprocess.TimeoutExpired):
        return None
    plugins = parse_mpi_list(out.stdout) if out.returncode == 0 else []
    return plugins or None


def mpi_plugin_problem(name: str) -> str | None:
    """srun's own error lines when it cannot load plugin `name` on this host, else None. `srun --test-only`
    loads the plugin and runs nothing; here pmix is listed but fails ("can not load PMIx library")."""
    try:
        out = _run(["srun", "--test-only", "-n1", f"--mpi={name}", "true"])
    except (OSError, subprocess.TimeoutExpired):
        return None
    lines = [line.strip() for line in out.stderr.splitlines() if "mpi" in line.lower()]
    return "; ".join(lines) if out.returncode and lines else None


def check_mpi(cfg: Config, echo=print) -> None:
    """Refuses a job.mpi that this site's srun does not list; warns when srun lists it but cannot load it here
    (a login node may lack a library the compute nodes have, so that is no refusal)."""
    name = cfg.job.mpi
    if not name:
        return
    plugins = mpi_plugins()
    if plugins is None:
        echo(f"note: `srun --mpi=list` gave no list here; job.mpi = {name!r} not checked")
        return
    if name not in plugins:
        raise ValueError(f"job.mpi = {name!r} is not an MPI plugin of this site: `srun --mpi=list` offers "
                         f"{', '.join(plugins)}")
    problem = mpi_plugin_problem(name)
    if problem:
        echo(f"warning: job.mpi = {name!r} is listed by `srun --mpi=list` but srun cannot load it on this host "
             f"({problem}); if the compute nodes are the same, every task will fail to start")


# srun options of every GPU job, before job.srun_args (srun takes the last of a repeated option, so a site
# overrides them there):
# --cpu-bind=cores: each task's threads stay on the job.cpus_per_task cores Slurm gave it, instead of wandering
#   over the node (--cpu-bind=none) away from the memory they touched and from their GPU's socket;
# --distribution=block:block: consecutive tasks of a node take their cores from the same socket until it is full,
#   so local ranks 0-3 of 8 sit on the first socket and 4-7 on the second, the order in which common 8-GPU nodes
#   number their GPUs and NICs (bind_device gives local rank i GPU i). Slurm's default (block:cyclic) puts
#   consecutive tasks on alternate sockets: half the ranks would drive a GPU and NIC across the socket link.
#   A task keeps to one socket when job.cpus_per_task x the tasks per socket fills it (the node's cores divided by
#   job.tasks_per_node); `nvidia-smi topo -m` shows each GPU's CPUs.
# Not Slurm's GPU binding (--gpu-bind, --gpus-per-task): where the site constrains devices per task with cgroups, a
# rank cannot open its peers' GPUs and NCCL loses NVLink peer-to-peer within the node.
GPU_SRUN_ARGS = ("--cpu-bind=cores", "--distribution=block:block")
# Shell lines before job.setup in every GPU job: the caching allocator maps memory in growing segments instead of
# fixed blocks, so varying sizes (activations, FSDP's gathers) fragment less near the memory limit. A value in the
# submission's environment (sbatch passes it on) or set by job.setup wins.
GPU_SETUP = ("export PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}",)


def slurm_parameters(cfg: Config) -> dict[str, Any]:
    """[job] -> submitit SlurmExecutor parameters (sbatch option names).

    srun gets, before job.srun_args (which may override them):
    --kill-on-bad-exit=1: a task that dies or exits non-zero ends the others at once, instead of leaving them in a
      collective until parallel.timeout_s;
    --cpus-per-task: srun of Slurm 22.05-23.02 does not inherit it from sbatch and gives each task one CPU. On the
      srun line rather than SRUN_CPUS_PER_TASK in the setup lines: every srun version reads the option (only
      22.05+ read the variable), it shows in the script next to the #SBATCH line it repeats, and it reaches
      this one step only, not other sruns the setup lines may run;
    --mpi=job.mpi (the one place for the plugin, so that check_mpi checks what srun gets);
    and for GPU jobs, GPU_SRUN_ARGS and GPU_SETUP (below)."""
    j = cfg.job
    gpu = j.gpus_per_node > 0
    params: dict[str, Any] = {
        "job_name": j.name, "nodes": j.nodes, "ntasks_per_node": j.tasks_per_node,
        "cpus_per_task": j.cpus_per_task, "time": j.time_min, "signal_delay_s": j.signal_delay_s,
        "srun_args": ["--kill-on-bad-exit=1", f"--cpus-per-task={j.cpus_per_task}",
                      *([f"--mpi={j.mpi}"] if j.mpi else []), *(GPU_SRUN_ARGS if gpu else []), *j.srun_args],
        "setup": [*(GPU_SETUP if gpu else []), *j.setup], "stderr_to_stdout": False,
        # None, not "": submitit writes --wckey=submitit by default and --wckey='' for an empty string
        "wckey": j.wckey or None,
    }
    optional = {"partition": j.partition, "account": j.account, "qos": j.qos, "constraint": j.constraint,
                "gpus_per_node": j.gpus_per_node or None, "exclusive": j.exclusive or None,
                "mem": _sbatch_mem(j.mem_gb, j.exclusive),
                # --requeue: preemption requeues the job itself (sites may default to JobRequeue=0)
                "additional_parameters": {"requeue": True} | j.sbatch_extra_dict()}
    params.update({k: v for k, v in optional.items() if v})
    return params


def _sbatch_mem(mem_gb: float, exclusive: bool) -> str | None:
    """sbatch takes whole units only: 64 -> '64GB', 1.5 -> '1536MB'. 0 -> None (the site default), or '0' on
    exclusive nodes: sites often default to DefMemPerCPU x the CPUs asked for, a fraction of a node that is
    all ours, and --mem=0 means all of each node's memory."""
    if not mem_gb:
        return "0" if exclusive else None
    return f"{int(mem_gb)}GB" if mem_gb == int(mem_gb) else f"{round(mem_gb * 1024)}MB"


def render_sbatch(cfg: Config, folder: str | Path, python: str | None = None) -> str:
    """The sbatch script submitit would write, without Slurm present."""
    from submitit.slurm.slurm import _make_sbatch_string

    command = f"{task_python(python)} -u -m submitit.core._submit {shlex.quote(str(folder))}"
    return _make_sbatch_string(command=command, folder=folder, **slurm_parameters(cfg))


def hf_tokenizer_sha256(cfg: Config) -> str | None:
    """sha256 of the tokenizer.json of the HF directory train.init_from names, None without one."""
    from hpctrain.config import hf as hfconfig
    directory = hfconfig.hf_dir(cfg.train.init_from)
    path = directory / "tokenizer.json" if directory is not None else None
    if path is None or not path.is_file() or path.is_symlink():
        return None
    import hashlib

    from hpctrain.untrusted import read_bytes
    try:  # as large as the import reads (hf_import), and never through a link
        raw = read_bytes(path, 64 << 20)
    except ValueError as e:
        raise ValueError(f"train.init_from = {cfg.train.init_from!r}: {e}") from None
    return hashlib.sha256(raw).hexdigest()


def check_layout(cfg: Config, echo=print, strict_data: bool = True) -> Plan:
    """The job's plan (layout and topology for nodes x tasks_per_node under block placement; the model and batch
    when it trains) and its data, refused here on the login node. strict_data=False (dry runs) only warns about
    the dataset, which may live on a file system this machine does not see. The data is checked from its records
    alone (sources.check_before_submission): no token id is read here, and a file without a record is named with when
    its ids will be checked (at job start, by one rank)."""
    plan = make_plan(cfg, mesh.block_placement(cfg.job.nodes, cfg.job.tasks_per_node))
    if plan.training:
        for note in plan.notes:
            echo(note)
        from hpctrain.data import sources as data
        try:
            for line in data.check_before_submission(cfg.data, plan.dims.true_vocab_size, cfg.train.eval_every > 0,
                                                     hf_tokenizer_sha256(cfg)):
                echo(line)
        except ValueError as e:
            if strict_data:
                raise
            echo(f"warning: {e} (a submission would be refused)")
    return plan


def predict_fit(cfg: Config, plan: Plan, echo=print, memory_check: bool = True) -> dict | None:
    """Prints the planner's prediction (memory per GPU, checkpoint cost) of a training plan for job.hw_profile (a
    calibration) or job.gpu (a datasheet profile); ValueError when the layout cannot fit and memory_check is on.
    None when nothing is predicted (no training, or no profile: a CPU has no datasheet, only a calibration)."""
    if not plan.training:
        return None
    from hpctrain.planner import ckpt_cost, hardware, report

    try:
        hw = hardware.job_profile(cfg.job.gpu, cfg.job.hw_profile)
    except ValueError as e:
        key = "job.hw_profile" if cfg.job.hw_profile else "job.gpu"
        raise ValueError(f"{key} = {cfg.job.hw_profile or cfg.job.gpu!r}: {e}") from None
    if hw is None:
        echo("planner: " + ("no prediction: " + hardware.NO_DATASHEET if cfg.job.gpus_per_node == 0 else
                            "set job.gpu (e.g. h100-sxm) to check the layout's memory before submission"))
        return None
    out = report.evaluate(cfg, hw, storage_gbps=5.0, node_mtbf_h=ckpt_cost.NODE_MTBF_H, plan=plan)
    echo("planner: " + report.describe(out).replace("\n", "\nplanner: "))
    if not out["host_fits"] and memory_check:
        raise ValueError(f"the offloaded states do not fit the nodes' memory: {out['host_memory_gb_per_node']:.1f} "
                         f"GiB per node predicted, job.mem_gb = {cfg.job.mem_gb:g}; raise job.mem_gb (up to the "
                         f"nodes' memory), spread the model over more nodes, or submit with --no-memory-check")
    if not out["fits"] and memory_check:
        st = out["model_states_gib"]
        raise ValueError(f"the layout does not fit on {hw.name}: {out['memory_gib_per_gpu']:.1f} GiB per GPU predicted "
                         f"of {hw.memory_gib:g} GiB (GiB: parameters {st['params']:.1f}, gradients {st['grads']:.1f}, "
                         f"AdamW {st['optimizer']:.1f}, activations {out['activations_gib']:.1f}, "
                         f"+{out['memory_margin']:.0%}"
                         f"); shard more (parallel.zero_stage, tp, pp), recompute (train.ac), shrink the micro-batch, "
                         f"or submit with --no-memory-check to try anyway")
    return out


def check_storage(cfg: Config, plan: Plan, echo=print) -> None:
    """Warns (the nodes may mount what the login node does not, so never refuses) when job.run_root or
    checkpoint.dir lies on NFS, and when the directory checkpoints go to has room (free space, Lustre quota) for
    fewer than checkpoint.keep + 1 of this plan's checkpoints."""
    import os

    from hpctrain import hostprobe

    table, home, scratch = hostprobe.mount_table(), os.environ.get("HOME", ""), os.environ.get("SCRATCH", "")
    places = {"job.run_root": Path(cfg.job.run_root).absolute()}
    if cfg.checkpoint.dir:
        places["checkpoint.dir"] = Path(cfg.checkpoint.dir).absolute()
    for key, path in places.items():
        if note := hostprobe.nfs_warning(key, path, table, home, scratch):
            echo(note)
    if not plan.training:
        return
    from hpctrain.planner import ckpt_cost

    key, path = list(places.items())[-1]  # where checkpoints go: checkpoint.dir, else the run directory
    there = hostprobe.probe_dir(str(path), path)
    try:
        free = shutil.disk_usage(there).free
    except OSError:
        return
    size = ckpt_cost.checkpoint_bytes(plan.dims, cfg.world_size)
    if note := hostprobe.room_warning(key, path, size, cfg.checkpoint.keep, free, hostprobe.quota_left(there)):
        echo(note)


def task_python(python: str | None = None) -> str:
    """The python command submitit starts each task with: hpctrain.entry's task runner, which takes USR2 and TERM
    before submitit is imported (a preemption while a task starts is kept, not fatal), then runs submitit's."""
    return f"{python or shlex.quote(sys.executable)} -u -m hpctrain.entry"


def make_executor(kind: str, cfg: Config, folder: Path):
    import submitit
    if kind == "slurm":
        ex = submitit.SlurmExecutor(folder=folder, python=task_python())
        ex.update_parameters(**slurm_parameters(cfg))
        return ex
    # The local executor has one node: every rank of every requested node runs on this host.
    ex = submitit.LocalExecutor(folder=folder, python=task_python())
    ex.update_parameters(tasks_per_node=cfg.world_size, nodes=1, timeout_min=cfg.job.time_min)
    return ex


def absolute_paths(cfg: Config) -> Config:
    """The config with its data files and HF directory named absolutely: ranks may start in another directory."""
    def absolute(path: str) -> str:
        return str(Path(path).absolute()) if path else path
    d, t = cfg.data, cfg.train
    data_cfg = dataclasses.replace(d, path=absolute(d.path), paths=[absolute(p) for p in d.paths],
                                   val_path=absolute(d.val_path))
    init_from = "hf:" + absolute(t.init_from[3:]) if t.init_from.startswith("hf:") else t.init_from
    return dataclasses.replace(cfg, data=data_cfg, train=dataclasses.replace(t, init_from=init_from))


def submit(cfg: Config, task: Callable[[Path, Path], Callable[[], Any]], echo=print,
           memory_check: bool = True) -> tuple[Path, Any, str]:
    """Validates, makes a fresh run directory, submits. On failure nothing is left behind. task(config_path,
    run_dir) is the picklable callable every task of the job runs (hpctrain.cli.main.CliTask: one command line)."""
    plan = check_layout(cfg, echo)
    predicted = predict_fit(cfg, plan, echo, memory_check)
    check_storage(cfg, plan, echo)
    from hpctrain.planner import fds
    fds.check(cfg, plan.layout)  # a layout past the compute nodes' open-files limit is refused, as the dry run does
    kind, why = choose_executor(cfg)
    if kind == "slurm":
        check_cluster(cfg, echo, (predicted or {}).get("host_memory_gb_per_node", 0.0) if memory_check else 0.0)
    echo(f"executor: {kind} ({why})")
    if kind == "local" and cfg.job.nodes > 1:
        echo(f"local executor: {cfg.job.nodes} nodes x {cfg.job.tasks_per_node} tasks run as {cfg.world_size} "
             f"processes on this host")
    cfg = absolute_paths(cfg)
    run_dir = runs.new_run_dir(cfg.job.run_root, cfg.job.name)
    try:
        config_path = run_dir / "config.toml"
        config_path.write_text(dump_toml(cfg))
        executor = make_executor(kind, cfg, run_dir / "submitit")
        job = executor.submit(task(config_path, run_dir))
    except Exception as e:
        shutil.rmtree(run_dir, ignore_errors=True)
        msg = str(e).strip()
        raise SubmitError(f"submission failed, nothing was submitted: {msg}") from None
    runs.write_json(run_dir / "job.json", {"executor": kind, "job_id": str(job.job_id),
                                           "submitted": time.strftime("%Y-%m-%dT%H:%M:%S"),
                                           "world_size": cfg.world_size})
    return run_dir, job, kind


def queue_state(job_id: str) -> str | None:
    """The job's state (with the pending reason) from squeue, or None once it has left the queue."""
    out = _run(["squeue", "-h", "-j", str(job_id), "-o", "%T %r"])
    state = out.stdout.strip()
    if out.returncode != 0 and "Invalid job id" not in out.stderr:
        return f"UNKNOWN (squeue: {out.stderr.strip()})"  # controller busy: keep polling
    if not state:
        return None
    return state.removesuffix(" None")  # "PENDING Resources", "RUNNING"


def _follow_log(path: Path, pos: int, echo) -> int:
    """Echoes new lines of rank 0's log; returns the new read position."""
    if not path.exists():
        return pos
    with path.open() as f:
        f.seek(pos)
        for line in f:
            echo("  | " + line.rstrip())
        return f.tell()


def wait(job: Any, run_dir: Path, kind: str, cfg: Config, echo=print, poll_s: float = 2.0) -> Any:
    """Follows the job to its end, echoing state changes and rank 0's log; raises SubmitError on failure.

    Without Slurm accounting submitit cannot tell a dead job's state and job.result() would wait forever, so
    we watch squeue: once the job has left the queue its results must appear within job.wait_timeout_s.
    """
    log_path = runs.rank_log_path(run_dir, 0)
    pos, last, t0 = 0, None, time.time()
    while True:
        state = queue_state(job.job_id) if kind == "slurm" else ("RUNNING" if not job.done() else None)
        if state != last:
            echo(f"[{time.time() - t0:6.1f} s] job {job.job_id}: {state or 'left the queue'}")
            last = state
        pos = _follow_log(log_path, pos, echo)
        if state is None:
            break
        time.sleep(poll_s)
    deadline = time.time() + cfg.job.wait_timeout_s
    while not _has_results(job) and _task_error(job) is None and time.time() < deadline:
        time.sleep(0.5)
    pos = _follow_log(log_path, pos, echo)
    error = _task_error(job)  # a rank that aborted the launch left the only result there will be
    if error is not None:
        raise SubmitError(f"job {job.job_id} failed: {error.strip()[-3000:]}")
    if not _has_results(job):
        raise SubmitError(f"job {job.job_id} left the queue without a result within {cfg.job.wait_timeout_s} s "
                          f"(killed or crashed?); see {run_dir / 'submitit'} and {log_path.parent}")
    try:
        return job.results()
    except Exception as e:
        raise SubmitError(f"job {job.job_id} failed: {str(e).strip()[-3000:]}") from None


def _has_results(job: Any) -> bool:
    """submitit writes one result pickle per task when the task ends, failed or not."""
    return all(job.task(t).paths.result_pickle.exists() for t in range(job.num_tasks))


def _task_error(job: Any) -> str | None:
    """The error of the first task whose result is a failure, among the results already written."""
    for t in range(job.num_tasks):
        task = job.task(t)
        if task.paths.result_pickle.exists():
            try:
                task.results()
            except Exception as e:
                return str(e)
    return None
