"""The `hpctrain` command.

    hpctrain submit CONFIG [--set section.key=value ...] [--dry-run] [--wait]
    hpctrain train CONFIG [--set ...] [--run-dir DIR]      # what each rank runs
    hpctrain topo CONFIG [--set ...]                       # the rank map the job will use
    hpctrain bench COLL... [nccl-tests flags]              # collective benchmark; `bench gemm` for matmul
    hpctrain doctor CONFIG [--set ...] [--here]            # screen the nodes: GEMM, links, storage, clocks
    hpctrain data build OUT [INPUTS...] [--tokenizer F]    # token datasets (byte level, or a tokenizer's)
    hpctrain plot RUN_DIR                                  # training curves
    hpctrain diagnose RUN_DIR                              # who stopped where in a hung or failed run
    hpctrain ckpt ls|inspect|verify|export ...             # checkpoints (export --format hf: transformers)

Config and layout errors exit with status 2 and a message naming the value, before anything is submitted. A rank
of `train` that fails ends the whole launch: under MPI with MPI_Abort, else by exiting non-zero (srun's
--kill-on-bad-exit=1, which submit passes, then ends the other tasks).

Signals (hpctrain/job/preempt.py): USR2 and TERM are taken before the imports below (by the console script,
hpctrain/entry.py, or by hpctrain/cli/__main__.py under `python -m hpctrain.cli`). For `train` they are a preemption:
the ranks stop at the next step boundary, the first one if the signal came during start-up, and requeue. Every
other command ends on them, and on SIGINT: exit status 128 + the signal's number, its files cleaned up.
"""
from __future__ import annotations

import functools
import os
import traceback
from pathlib import Path
from typing import Any, Callable

import click

from hpctrain.cli.common import CONFIG_ARG, SET_OPT, user_errors
from hpctrain.cli.data import data_group
from hpctrain.cli.diagnose import diagnose_cmd
from hpctrain.cli.doctor import command as doctor_command
from hpctrain.config import Config, load_config
from hpctrain.job import preempt


def ends_launch_on_error(fn):
    """A failed rank ends every rank of its launch within seconds instead of leaving them in a collective.

    Under MPI the error is printed and the launch aborted (MPI_Abort): exiting normally would run MPI_Finalize,
    which waits forever for a peer that is stopped or stuck. Submitted tasks first leave submitit's error result,
    so `submit --wait` reports the error. Without MPI the exception propagates and the process exits non-zero."""
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except preempt.Ended as e:  # a signal to a command that is not a training job: no traceback
            from hpctrain.hang import ending
            ending.leave_task_error(f"hpctrain: {e}")
            ending.abort_launch(e.code)  # under MPI: the other ranks of the launch end with this one
            raise
        except (Exception, KeyboardInterrupt) as e:
            from hpctrain.hang import ending
            ending.wait_if_ending()  # the hang watchdog is ending the job: its dumps come first
            if not ending.mpi_running():
                raise
            trace = traceback.format_exc()
            click.echo(f"Error: {e.format_message()}" if isinstance(e, click.ClickException) else trace, err=True)
            ending.leave_task_error(trace)
            ending.abort_launch(1)
            raise  # not reached: MPI_Abort ends the process
    return wrapper


def _load(config: str, overrides: tuple[str, ...]) -> Config:
    try:
        return load_config(config, overrides)
    except ValueError as e:
        raise click.UsageError(str(e)) from None


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.pass_context
def main(ctx: click.Context) -> None:
    """hpctrain: Slurm-native distributed training toolkit."""
    # the command is known: a signal is a preemption of `train` (one during the imports stops it before its first
    # step), the end of any other command (one during the imports ends it now)
    flag = preempt.process_flag()
    ends = ctx.invoked_subcommand != "train"
    flag.end_on_signal(ends)
    if ends:  # in-process callers (CliRunner, a submitit task) get their own handlers back afterwards
        ctx.call_on_close(flag.restore)


@main.command()
@CONFIG_ARG
@SET_OPT
@click.option("--dry-run", is_flag=True, help="Validate config and layout, print the sbatch script, submit nothing.")
@click.option("--wait", is_flag=True, help="Follow the job to its end; exit non-zero if it fails.")
@click.option("--no-memory-check", is_flag=True, help="Submit even when the planner predicts the layout does not fit.")
@user_errors
def submit(config: str, overrides: tuple[str, ...], dry_run: bool, wait: bool, no_memory_check: bool) -> None:
    """Submit CONFIG as a job: to Slurm when it is reachable, else run locally."""
    from hpctrain.job import launch
    from hpctrain.parallel import mesh
    from hpctrain.planner import fds

    cfg = _load(config, overrides)
    if dry_run:
        plan = launch.check_layout(cfg, click.echo, strict_data=False)
        launch.predict_fit(cfg, plan, click.echo, memory_check=not no_memory_check)
        launch.check_storage(cfg, plan, click.echo)
        click.echo("\n".join(fds.check(cfg, plan.layout)))
        layout = plan.layout
        if cfg.world_size <= 512:
            rows = mesh.rank_table(layout, plan.node_of_rank)
            click.echo(mesh.format_rank_map(layout, rows))
        else:  # a line per rank with its groups in full: 2048 x 8 ranks at dp=8192 printed 715 MB in 70 s
            click.echo(f"layout {layout}: {cfg.world_size} ranks "
                       f"(`hpctrain topo` prints the rank map)")
        click.echo(f"\n# sbatch script for {cfg.job.nodes} node(s) x {cfg.job.tasks_per_node} task(s); "
                   f"nothing submitted\n")
        click.echo(launch.render_sbatch(cfg, Path(cfg.job.run_root).absolute() / "<run dir>" / "submitit"))
        return
    _submit(cfg, wait, memory_check=not no_memory_check)


class CliTask:
    """The callable each task runs (pickled by submitit): one `hpctrain` command line, in process."""

    def __init__(self, argv: list[str]) -> None:
        self.argv = argv

    def __call__(self) -> Any:
        return main(self.argv, standalone_mode=False)


def train_argv(config_path: Path, run_dir: Path) -> list[str]:
    return ["train", str(config_path), "--run-dir", str(run_dir)]


def _submit(cfg: Config, wait: bool, argv: Callable[[Path, Path], list[str]] = train_argv,
            memory_check: bool = True) -> Path:
    """Submits (train by default, or the given command line) and optionally follows the job."""
    from hpctrain.job import launch

    try:
        run_dir, job, kind = launch.submit(cfg, lambda cfg_path, rdir: CliTask(argv(cfg_path, rdir)), echo=click.echo,
                                           memory_check=memory_check)
    except launch.SubmitError as e:
        raise click.ClickException(str(e)) from None
    click.echo(f"submitted job {job.job_id} ({kind}); run directory {run_dir}")
    if wait:
        try:
            launch.wait(job, run_dir, kind, cfg, echo=click.echo)
        except launch.SubmitError as e:
            raise click.ClickException(str(e)) from None
        click.echo(f"job {job.job_id} finished; summary in {run_dir / 'summary.json'}")
    return run_dir


@main.command()
@CONFIG_ARG
@SET_OPT
@click.option("--run-dir", default=None, type=click.Path(file_okay=False),
              help="Existing run directory (submit passes it); default: a fresh one made by rank 0.")
@ends_launch_on_error
@user_errors
def train(config: str, overrides: tuple[str, ...], run_dir: str | None) -> None:
    """Run one rank of the job (under mpiexec, srun, torchrun, or alone)."""
    from hpctrain.train import trainer as train_mod

    cfg = _load(config, overrides)
    return train_mod.run(cfg, run_dir)


@main.command(context_settings={"show_default": True})
@click.argument("colls", nargs=-1)
@click.option("-b", "--minbytes", default="1K", help="Smallest message (K, M, G suffixes).")
@click.option("-e", "--maxbytes", default="16M", help="Largest message.")
@click.option("-f", "--stepfactor", default=2, type=int, help="Multiply the size by this between steps.")
@click.option("-i", "--stepbytes", default=0, type=int, help="Add this many bytes between steps instead.")
@click.option("-n", "--iters", default=20, type=int, help="Timed iterations per size.")
@click.option("-w", "--warmup", default=5, type=int, help="Untimed iterations before timing.")
@click.option("-c", "--check", default=1, type=click.IntRange(0, 1), help="Check results (#wrong).")
@click.option("-d", "--datatype", default="float", help="Element type; for gemm a comma list.")
@click.option("-o", "--op", default="sum", help="Reduction: sum, prod, min, max, avg.")
@click.option("-r", "--root", default=0, type=int, help="Root for broadcast and reduce (index in the group).")
@click.option("-a", "--average", default=1, type=click.IntRange(0, 3),
              help="Time reported, as nccl-tests: 0 rank 0's, 1 mean over ranks, 2 min, 3 max.")
@click.option("-z", "--blocking", default=0, type=click.IntRange(0, 1),
              help="0: launch the timed calls back to back, one wait at the end (nccl-tests' default); 1: wait and "
                   "pass a barrier after each call.")
@click.option("--group", default="world", help="Communicator: world, tp, dp, pp, cp, intra, inter.")
@click.option("--backend", default="torch", help="torch (the job's gloo/NCCL) or mpi (mpi4py, host buffers).")
@click.option("--algo", default="flat", help="all_reduce algorithm: flat or hier (two-level over nodes).")
@click.option("-J", "--json", "json_path", default=None, help="Also write the JSON lines here.")
@click.option("--plot", "plot_path", default=None, help="Also write the busbw PNG here.")
@click.option("--gemm-size", default=1024, type=int, help="Matrix size of the GEMM probe.")
@click.option("--seed", default=0, type=int)
@click.option("--config", "config", default=None, type=click.Path(dir_okay=False), help="Job config (layout).")
@SET_OPT
@click.option("--run-dir", default=None, type=click.Path(file_okay=False))
@click.option("--submit", "do_submit", is_flag=True, help="Submit as a job (Slurm, else local) with CONFIG's shape.")
@click.option("--wait", is_flag=True, help="With --submit: follow the job and print the table.")
@ends_launch_on_error
@user_errors
def bench(colls, minbytes, maxbytes, stepfactor, stepbytes, iters, warmup, check, datatype, op, root, average,
          blocking, group, backend, algo, json_path, plot_path, gemm_size, seed, config, overrides,
          run_dir, do_submit, wait):
    """nccl-tests-style benchmark of COLLS (all_reduce all_gather reduce_scatter alltoall broadcast reduce
    sendrecv, or all) on the job's own communicators; `hpctrain bench gemm` measures the matmul rate."""
    from hpctrain.bench import sweep

    # a benchmark trains nothing: train.steps=0 also skips the model checks of training
    cfg = _load(config, ("job.name=bench",) * (config is None) + overrides + ("train.steps=0",))
    names = list(colls) or ["all_reduce"]
    if do_submit:
        args = [a for a in _bench_argv(click.get_current_context()) if a not in ("--submit", "--wait")]
        path = _submit(cfg, wait, argv=lambda cfg_path, rdir: ["bench", *args, "--config", str(cfg_path),
                                                                "--run-dir", str(rdir)])
        if wait and (path / "bench.txt").exists():
            from hpctrain.untrusted import read_bytes
            click.echo(read_bytes(path / "bench.txt", 16 << 20).decode("utf-8", "replace"), nl=False)
        return None
    from hpctrain.bench import job as benchjob

    if names == ["gemm"]:
        dtypes = datatype.split(",")
        return benchjob.main(cfg, run_dir, lambda s: benchjob.run_gemm(s, dtypes, gemm_size))
    from hpctrain.bench.colls import COLLS
    from hpctrain.bench.harness import Options

    opts = Options(colls=list(COLLS) if names == ["all"] else names,
                   sizes=sweep.size_sweep(sweep.parse_size(minbytes), sweep.parse_size(maxbytes), stepfactor,
                                          stepbytes),
                   iters=iters, warmup=warmup, check=bool(check), dtype=datatype, op=op, root=root, group=group,
                   backend=backend, algo=algo, seed=seed, average=average, blocking=blocking)
    return benchjob.main(cfg, run_dir, lambda s: benchjob.run_collectives(s, opts, json_path, plot_path))


def _bench_argv(ctx: click.Context) -> list[str]:
    """The bench command line again, for the submitted ranks (config and run dir are added by the caller)."""
    argv = list(ctx.params["colls"])
    for param in ctx.command.params:
        value = ctx.params[param.name]
        if param.name in ("colls", "config", "overrides", "run_dir") or value is None:
            continue
        flag = param.opts[-1]
        if param.is_flag:
            argv += [flag] if value else []
        else:
            argv += [flag, str(value)]
    return argv


@main.command()
@CONFIG_ARG
@SET_OPT
@click.option("--gpu", default=None, help="Datasheet hardware profile (a100-40g, a100-80g, h100-sxm, h100-pcie, "
              "h100-96g-500w, h200, b200, mi250x, mi300x); default: job.hw_profile, else job.gpu, else h100-sxm "
              "on a GPU job.")
@click.option("--profile", "profile_file", default=None, type=click.Path(dir_okay=False),
              help="A calibrated profile file (--calibrate's); default: job.hw_profile.")
@click.option("--calibrate", is_flag=True, help="Measure this machine (the GEMM rate, and one-rank training steps "
              "for the efficiency and the host's work) and write a profile to --out, for job.hw_profile; --bench "
              "files add the link bandwidths. Takes a few minutes.")
@click.option("-o", "--out", default="hw-profile.json", show_default=True, type=click.Path(dir_okay=False),
              help="With --calibrate: the profile file to write.")
@click.option("--ranks", type=int, default=None, help="With --calibrate: the ranks that will share this host; they "
              "are measured running at once, tensor parallel on CONFIG's tp (default: CONFIG's ranks for a CPU job, "
              "else 1: one rank with every thread).")
@click.option("--hw", "figures", multiple=True, metavar="KEY=VALUE", help="Replace a figure of the profile "
              "(repeatable): memory_gib, intra_node_gbps, inter_node_gbps, gpus_per_node, peak_<dtype>.")
@click.option("--bench", "bench_files", multiple=True, type=click.Path(exists=True, dir_okay=False),
              help="`hpctrain bench` results (bench.jsonl) of --group intra / inter runs: their link bandwidths.")
@click.option("--storage-gbps", default=5.0, type=float, show_default=True,
              help="Aggregate checkpoint write/read bandwidth the file system gives the job (GB/s).")
@click.option("--node-mtbf-h", default=None, type=float, help="A node's mean time between failures (hours); "
              "default 6000 (Llama 3 report's interruption rate).")
@click.option("--json", "as_json", is_flag=True, help="Print the prediction as JSON (a list with --search).")
@click.option("--search", "do_search", is_flag=True, help="Evaluate every layout of the config's nodes x GPUs per "
              "node for its model and global batch; rank those that fit by predicted throughput.")
@user_errors
def plan(config: str, overrides: tuple[str, ...], gpu: str | None, profile_file: str | None, calibrate: bool,
         out: str, ranks: int | None, figures: tuple[str, ...], bench_files: tuple[str, ...], storage_gbps: float,
         node_mtbf_h: float | None, as_json: bool, do_search: bool) -> None:
    """Predict what CONFIG's layout costs per GPU (memory, step time, throughput, MFU) and what its checkpoints
    cost, before any GPU time is spent; --search ranks every layout instead; --calibrate measures this machine."""
    import json

    from hpctrain.planner import ckpt_cost, hardware, report, search

    if calibrate:
        from hpctrain.train import calibrate as calibration
        job = _load(config, overrides)
        cpu_job = job.job.gpus_per_node == 0
        if ranks is None:
            ranks = job.job.nodes * job.job.tasks_per_node if cpu_job else 1
            cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
            if ranks > max(4 * cores, 8):  # a job of many hosts: its ranks do not all share this one
                raise click.UsageError(
                    f"{config} runs {ranks} ranks (job.nodes = {job.job.nodes} x job.tasks_per_node = "
                    f"{job.job.tasks_per_node}), too many to start on this host's {cores} cores: calibrate with "
                    f"--ranks N, the ranks that will share one host (job.tasks_per_node where nodes are hosts)")
        tp = job.parallel.tp if ranks > 1 else 1
        try:
            links = {k: v for f in bench_files for k, v in
                     hardware.bandwidths_from_bench(f, world_is_one_node=True).items()}
            hw = calibration.calibrate(links, echo=lambda line: click.echo(line, err=True), ranks=ranks, tp=tp)
        except ValueError as e:
            raise click.UsageError(str(e)) from None
        hardware.save_profile(hw, out)
        click.echo(json.dumps(hardware.profile_json(hw), indent=1) if as_json else
                   f"wrote {out}: {hw.source}; use it with job.hw_profile = {str(Path(out).absolute())!r}")
        return
    cfg = _load(config, overrides)
    name = gpu or ("" if profile_file or cfg.job.hw_profile else cfg.job.gpu) or (
        hardware.CPU if cfg.job.gpus_per_node == 0 else "h100-sxm")
    mtbf = node_mtbf_h or ckpt_cost.NODE_MTBF_H
    try:
        links = {k: v for f in bench_files for k, v in hardware.bandwidths_from_bench(f).items()}
        given = links | hardware.parse_figures(figures)  # --hw wins over --bench
        calibrated = None if gpu else profile_file or cfg.job.hw_profile
        hw = hardware.load_profile(calibrated, given) if calibrated else hardware.profile(name, given)
        out = report.evaluate(cfg, hw, storage_gbps, mtbf)
        if do_search:
            fit, why = search.search(cfg, hw, storage_gbps, mtbf, out["global_batch"])
    except ValueError as e:
        raise click.UsageError(str(e)) from None
    if do_search:
        click.echo(json.dumps(fit, indent=1) if as_json else search.describe(fit, why))
    else:
        click.echo(json.dumps(out, indent=1) if as_json else report.describe(out))


@main.command()
@click.argument("run_dir", type=click.Path(exists=True, file_okay=False))
@click.option("-o", "--out", default=None, type=click.Path(dir_okay=False),
              help="PNG path (default RUN_DIR/training.png)")
@user_errors
def plot(run_dir: str, out: str | None) -> None:
    """Draw loss, learning rate and throughput curves of a training run to PNG."""
    from hpctrain.train.plot import plot_training

    click.echo(plot_training(Path(run_dir), Path(out) if out else None))


@main.group(name="ckpt")
def ckpt_group() -> None:
    """Checkpoints: list, inspect, verify, export (reads the files; no process group)."""


CKPT_ARG = click.argument("ckpt", type=click.Path(exists=True, file_okay=False))


@ckpt_group.command(name="ls")
@click.argument("path", type=click.Path(exists=True, file_okay=False))
@user_errors
def ckpt_ls(path: str) -> None:
    """List a run's checkpoints, newest last.

    PATH is a run directory or its checkpoints directory."""
    from hpctrain.checkpoint import listing

    click.echo(listing.format_listing(*listing.list_checkpoints(Path(path))))


@ckpt_group.command(name="inspect")
@CKPT_ARG
@click.option("--json", "as_json", is_flag=True, help="Print everything as one JSON object.")
@user_errors
def ckpt_inspect(ckpt: str, as_json: bool) -> None:
    """Show a checkpoint's tensors and provenance.

    Tensors, totals, layout, provenance and train state of CKPT: a step directory, or a run directory for its
    newest committed checkpoint."""
    import json

    from hpctrain.checkpoint import inspection

    try:
        info = inspection.describe(inspection.resolve(Path(ckpt)))
    except inspection.CheckpointCorrupt as e:
        raise click.ClickException(str(e)) from None
    click.echo(json.dumps(info, indent=1) if as_json else inspection.format_description(info))


@ckpt_group.command(name="verify")
@CKPT_ARG
@click.option("--full", "mode", flag_value="full", default=True, help="Check the crc32 of every dataset (default).")
@click.option("--sampled", "mode", flag_value="sampled", help="Only the datasets a sampled load checks.")
@user_errors
def ckpt_verify(ckpt: str, mode: str) -> None:
    """Check a checkpoint's files and checksums.

    The COMMITTED marker, file sizes and every dataset's size and crc32 against index.json; prints each problem
    and exits 1 if there is any."""
    from hpctrain.checkpoint import inspection

    path = inspection.resolve(Path(ckpt))
    verdict = inspection.verify(path, mode)
    click.echo(inspection.format_verdict(path, verdict))
    if verdict.problems:
        raise click.exceptions.Exit(1)


@ckpt_group.command(name="export")
@CKPT_ARG
@click.option("--to", "--format", "fmt", required=True, type=click.Choice(["safetensors", "hf"]),
              help="safetensors: one file under hpctrain's names; hf: a Hugging Face LlamaForCausalLM directory.")
@click.option("-o", "--out", default=None, type=click.Path(),
              help="Output file, or directory for hf (default: ./<step directory>.safetensors or ./<step>-hf).")
@click.option("--dtype", type=click.Choice(["fp32", "bf16", "fp16"]), help="hf: the weights' dtype (default: saved).")
@click.option("--max-shard-gb", type=float, default=5.0, show_default=True,
              help="hf: above this many GB of weights, several files and model.safetensors.index.json.")
@user_errors
def ckpt_export(ckpt: str, fmt: str, out: str | None, dtype: str | None, max_shard_gb: float) -> None:
    """Write the model for inference, from any layout it was saved in.

    safetensors: CKPT's model tensors without the "model." prefix, in their saved dtypes, in one file. hf: a
    directory transformers loads as LlamaForCausalLM, streamed tensor by tensor; a non-empty --out is refused."""
    from hpctrain.checkpoint import inspection
    from hpctrain.hf import export as hf

    path = inspection.resolve(Path(ckpt))
    if fmt == "safetensors" and dtype is not None:
        raise click.UsageError(f"--dtype {dtype} applies to --format hf only")
    if not max_shard_gb > 0:
        raise click.UsageError(f"--max-shard-gb {max_shard_gb} must be positive")
    try:
        if fmt == "hf":
            return click.echo(hf.format_export(hf.export_hf(path, Path(out or f"{path.name}-hf"), dtype,
                                                            int(max_shard_gb * 1e9)), path))
        done = inspection.export_safetensors(path, Path(out or f"{path.name}.{fmt}"))
    except inspection.CheckpointCorrupt as e:
        raise click.ClickException(str(e)) from None
    click.echo(f"{done['path']}: {done['num_tensors']} tensors, {done['params'] / 1e6:.2f}M parameters, "
               f"{inspection.human_bytes(done['bytes'])} from {path}")


@main.command()
@CONFIG_ARG
@SET_OPT
@user_errors
def topo(config: str, overrides: tuple[str, ...]) -> None:
    """Print the rank map of CONFIG's layout on its nodes x tasks_per_node (block placement)."""
    from hpctrain.job import launch
    from hpctrain.parallel import mesh

    cfg = _load(config, overrides)
    plan = launch.check_layout(cfg)
    click.echo(mesh.format_rank_map(plan.layout, mesh.rank_table(plan.layout, plan.node_of_rank)))


main.add_command(data_group)
main.add_command(diagnose_cmd)
main.add_command(doctor_command(ends_launch_on_error, _submit))
