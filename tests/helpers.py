"""What the tests share, in one module: the project's own executables and processes, the 1-rank training
reference, and the helpers more than one test file (or a worker script) uses.

Test files of every tier (tests/pure, tests/multiproc, tests/cluster) `import helpers`: tests/conftest.py puts
tests/ on sys.path. The worker scripts in tests/workers/ put it there themselves (they run as scripts). Nothing
of hpctrain is imported at module level (only torch is), so that loading this module, which conftest does for
every test, never depends on the package importing cleanly.
"""
from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
import torch
from torch.distributed.tensor import Replicate, Shard

if TYPE_CHECKING:
    from hpctrain.train.trainer import Trainer

REPO = Path(__file__).resolve().parent.parent
TESTS = REPO / "tests"
WORKERS = TESTS / "workers"
PLUGINS = TESTS / "plugins"  # the test seams (seams.py) and the sitecustomize.py that installs them in a launch
BIN = Path(sys.executable).parent
EXAMPLE = REPO / "slurm" / "examples" / "tiny-cpu.toml"


# --- the project's executables and processes -------------------------------------------------------------------

def tool(name: str) -> str | None:
    """Prefer the virtualenv's executables (its mpiexec belongs to the mpich wheel mpi4py uses)."""
    local = BIN / name
    return str(local) if local.exists() else shutil.which(name)


def env_with_venv() -> dict[str, str]:
    env = dict(os.environ)
    env["PATH"] = f"{BIN}{os.pathsep}{env.get('PATH', '')}"
    env["PYTHONUNBUFFERED"] = "1"
    return env


def seam_env(**seams: str) -> dict[str, str]:
    """Environment for processes a launcher starts with test seams on (SEAM_FAULT=..., SEAM_DOCTOR_SLOW=...; see
    tests/plugins/seams.py): the variables, and tests/plugins first on PYTHONPATH so that every Python process
    started from it (the CLI, its ranks) loads the plugin's sitecustomize.py."""
    path = os.environ.get("PYTHONPATH", "")
    return {"PYTHONPATH": str(PLUGINS) + (os.pathsep + path if path else ""), **seams}


def required(var: str) -> bool:
    """CI sets HPCTRAIN_REQUIRE_MPI=1 and HPCTRAIN_REQUIRE_SLURM=1: a missing tier fails instead of skipping."""
    return os.environ.get(var, "") not in ("", "0")


def hpctrain(*args: str, timeout: float = 300, **kw) -> subprocess.CompletedProcess:
    """Runs the hpctrain CLI in a fresh process, as a user would."""
    return subprocess.run([tool("hpctrain") or "hpctrain", *args], capture_output=True, text=True,
                          timeout=timeout, env=env_with_venv(), stdin=subprocess.DEVNULL, cwd=REPO, **kw)


def run_mpiexec(mpiexec: str, *parts: list[str], timeout: float = 180) -> subprocess.CompletedProcess:
    """mpiexec with MPMD parts joined by ':' (each part may set its own -env)."""
    cmd = [mpiexec]
    for i, part in enumerate(parts):
        cmd += ([":"] if i else []) + part
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env_with_venv(), cwd=REPO,
                          stdin=subprocess.DEVNULL)


def _ephemeral_range() -> tuple[int, int]:
    try:
        low, high = map(int, Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
        return low, high
    except (OSError, ValueError):
        return 32768, 60999  # Linux's default


def free_base_port(n: int) -> int:
    """A base port with n free ports above it, one per process group a worker starts in turn. Taken below the
    kernel's ephemeral range: gloo listens on ephemeral ports, and one that landed inside a worker's range
    (seen: a gloo socket of the previous case on base + 2) made the next case's ranks talk to it and hang."""
    import random

    def free(port: int) -> bool:
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
                return True
            except OSError:
                return False
    low, _ = _ephemeral_range()
    top = max(low - n - 1, 10000 + n)
    while True:
        base = random.randrange(10000, top)
        if all(free(base + i) for i in range(n)):
            return base


def spawn_ranks(world: int, cmd: list[str], ranks_per_node: int, run_id: str) -> list[subprocess.Popen]:
    """Starts `world` real processes with torchrun's variables; GROUP_RANK makes nodes of ranks_per_node ranks.
    The worker sets MASTER_PORT itself (one per process group it creates)."""
    procs = []
    for rank in range(world):
        env = env_with_venv() | {
            "RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank % ranks_per_node),
            "LOCAL_WORLD_SIZE": str(ranks_per_node), "GROUP_RANK": str(rank // ranks_per_node),
            "MASTER_ADDR": "127.0.0.1", "TORCHELASTIC_RUN_ID": run_id,
        }
        procs.append(subprocess.Popen(cmd, env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                      text=True))
    return procs


def only_run_dir(root: Path) -> Path:
    dirs = [p for p in root.iterdir() if p.is_dir() and not p.name.startswith(".")]
    assert len(dirs) == 1, f"expected one run directory under {root}, found {dirs}"
    return dirs[0]


def read_summary(root: Path) -> dict:
    return json.loads((only_run_dir(root) / "summary.json").read_text())


def refused(fn, *args, fragments, **kwargs) -> str:
    """fn(*args, **kwargs) raises a ValueError whose message holds every fragment; returns the message."""
    with pytest.raises(ValueError) as info:
        fn(*args, **kwargs)
    msg = str(info.value)
    for fragment in fragments:
        assert fragment in msg, f"{fragment!r} not in {msg!r}"
    return msg


# --- training: the tiny model, and one case trained in one process (one rank) ----------------------------------
# run_case runs in the test process as the 1-rank reference (multiproc/test_train_equivalence.py,
# multiproc/test_grad_scale_mutations.py) and in every rank of workers/train_worker.py.

TINY = ["model.vocab_size=256", "model.dim=64", "model.n_layers=2", "model.n_heads=4", "model.max_seq_len=64",
        "data.source=synthetic", "data.seq_len=32", "train.steps=8", "train.lr=1e-3", "train.warmup_steps=2",
        "train.log_every=100", "train.peak_tflops=1", "train.micro_batch_size=8", "parallel.pp=1",
        "parallel.tp=1", "parallel.dp=-1", "parallel.timeout_s=180"]
# a smaller model still, for the one-process checkpoint tests
SMALL = TINY + ["model.dim=32", "model.n_heads=2", "model.n_layers=1", "data.seq_len=16", "train.micro_batch_size=2"]


def full_weights(model) -> dict[str, torch.Tensor]:
    """Every weight, whole: gathered over dp and tp, and over pipeline stages (each rank holds its own)."""
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    # no cpu_offload: with it only global rank 0 keeps values, and other pipeline stages would come back empty
    sd = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    mine = {k: v.detach().float().cpu().clone() for k, v in sd.items()}
    if not dist.is_initialized():
        return mine
    every: list = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    return {k: v for part in every for k, v in part.items()}


def fsdp_reshard(modules) -> dict[str, bool]:
    """reshard_after_forward of every FSDP module that holds parameters (blocks, roots, pipeline stage roots)."""
    from torch.distributed.fsdp import FSDPModule
    out, seen = {}, set()
    for k, root in enumerate(modules):
        for name, m in root.named_modules():
            if isinstance(m, FSDPModule) and id(m) not in seen:
                seen.add(id(m))
                group = m._get_fsdp_state()._fsdp_param_group
                if group is not None:
                    out[name or f"root{k}"] = group._reshard_after_forward
    return out


@contextlib.contextmanager
def counting_all_gathers(counter: list[int]):
    """Counts FSDP2's parameter all-gathers (it calls dist.all_gather_single)."""
    import torch.distributed as dist
    real = dist.all_gather_single

    def counted(*args, **kwargs):
        counter[0] += 1
        return real(*args, **kwargs)
    dist.all_gather_single = counted
    try:
        yield
    finally:
        dist.all_gather_single = real


def run_case(overrides: list[str], out: Path, inject_inf_step: int = 0) -> dict:
    """Trains one case with the product's own loop (Trainer.fit, checkpoints off) and watches every step through
    fit's on_step; rank 0 saves {"losses", "grad_norms", "skipped", "scales", "weights", "fsdp", "gathers"} to
    `out`. grad_norms: the global pre-clip norm of each step (inf on a step skipped for non-finite gradients);
    gathers: FSDP's all-gathers during the last step. inject_inf_step: the last rank's gradients turn infinite
    in that step."""
    from hpctrain.config import load_config
    from hpctrain.job import session
    from hpctrain.train.metrics import host_values
    from hpctrain.train.trainer import Trainer

    cfg = load_config(None, TINY + ["checkpoint.every_steps=0", "checkpoint.at_end=false"] + overrides
                      + [f"job.run_root={out.parent / (out.stem + '-runs')}"])
    steps = cfg.train.steps
    with session.start(cfg) as s:
        tr = Trainer(cfg, s)
        poison = inject_inf_step and s.rank == s.ident.world_size - 1
        rows, gathers = [], [0]
        counting = contextlib.ExitStack()

        def before(step: int) -> None:  # what runs ahead of `step`
            if poison and step == inject_inf_step:
                _poison_next_gradients(tr)
            if step == steps:
                counting.enter_context(counting_all_gathers(gathers))

        def watch(row: dict) -> None:
            rows.append(host_values(row))
            if row["step"] == steps:
                counting.close()
            before(row["step"] + 1)

        before(1)
        with counting:
            summary = tr.fit(on_step=watch)
        assert [r["step"] for r in rows] == list(range(1, steps + 1)) and summary["losses"] == [
            r["loss"] for r in rows]
        weights = full_weights(tr.model)
        if s.rank == 0:
            torch.save({"losses": summary["losses"], "grad_norms": [float(r["grad_norm"]) for r in rows],
                        "skipped": [bool(r["skipped"]) for r in rows], "scales": [r["loss_scale"] for r in rows],
                        "weights": weights, "fsdp": fsdp_reshard([tr.model, *tr.pm.parts]), "gathers": gathers[0]},
                       out)
    return {"losses": summary["losses"]}


def _poison_next_gradients(tr: Trainer) -> None:
    """Makes one gradient on this rank infinite in the next step (a hook that fires once)."""
    p = tr.params[0]
    state = {"armed": True}

    def hook(grad):
        if state["armed"]:
            state["armed"] = False
            return torch.full_like(grad, float("inf"))
        return grad

    p.register_hook(hook)


# --- layout equivalence: a spawn of workers/train_worker.py, and the comparison with the 1-rank reference -------

LOSS_TOL = 2e-5  # fp32, absolute, per step
WEIGHT_TOL = 2e-4  # fp32, max absolute difference of any weight after 8 AdamW steps at lr 1e-3
BF16_LOSS_TOL = 5e-2  # bf16 compute against the fp32 reference
NORM_RTOL = 1e-5  # fp32, relative, per step, the global pre-clip gradient norm: layouts reach 3e-7
BF16_NORM_RTOL = 1e-2  # bf16 (and fp16) compute against the fp32 reference: 1e-3 seen


def spawn_train_worker(world: int, cases: list[dict], out: Path) -> list[subprocess.Popen]:
    """`world` ranks of workers/train_worker.py on one node, each training every case in turn."""
    cmd = [sys.executable, str(WORKERS / "train_worker.py"), str(out), json.dumps(cases),
           str(free_base_port(len(cases)))]
    return spawn_ranks(world, cmd, ranks_per_node=world, run_id=f"train-{world}")


def compare_losses(got: dict, ref: dict, loss_tol: float) -> None:
    diffs = [abs(a - b) for a, b in zip(got["losses"], ref["losses"])]
    assert len(got["losses"]) == len(ref["losses"]) and max(diffs) <= loss_tol, (got["losses"], ref["losses"])


def norm_errors(got: list[float], ref: list[float]) -> list[float]:
    """Per-step relative error of the pre-clip gradient norm against the reference's."""
    assert len(got) == len(ref), (got, ref)
    return [abs(a - b) / b for a, b in zip(got, ref)]


def compare_runs(got: dict, ref: dict, loss_tol: float, weight_tol: float | None, norm_rtol: float) -> None:
    """A layout's run against the single-process reference: losses, gradient norms, and (weight_tol) weights."""
    compare_losses(got, ref, loss_tol)
    # the check that sees a gradient scale: losses and weights do not (AdamW), unless clipping engages
    worst = max(norm_errors(got["grad_norms"], ref["grad_norms"]))
    assert worst <= norm_rtol, f"grad norm relative error {worst:.3g} > {norm_rtol:g}: {got['grad_norms']} vs " \
                               f"{ref['grad_norms']}"
    assert set(got["weights"]) == set(ref["weights"])
    if weight_tol is not None:
        worst = max((got["weights"][k] - ref["weights"][k]).abs().max().item() for k in ref["weights"])
        assert worst <= weight_tol, f"max weight difference {worst}"


# --- initialisation: what a rank draws -------------------------------------------------------------------------

def counting_tiles(monkeypatch) -> dict[str, int]:
    """Elements drawn per parameter name, from the one place that draws (model.init_tile)."""
    from hpctrain.model import transformer as model

    drawn: dict[str, int] = {}
    real = model.init_tile

    def counted(name, *args):
        tile = real(name, *args)
        drawn[name] = drawn.get(name, 0) + tile.numel()
        return tile
    monkeypatch.setattr(model, "init_tile", counted)
    return drawn


def touched(shape, offset, local_shape) -> int:
    """Elements of the tiles a 2-D (or 1-D) box touches: the most a rank may draw for it."""
    from hpctrain.model.transformer import INIT_TILE

    if len(shape) < 2:
        shape, offset, local_shape = (1, *shape), (0, *offset), (1, *local_shape)
    assert len(shape) == 2
    total = 1
    for size, o, n, t in zip(shape, offset, local_shape, INIT_TILE):
        lo, hi = o // t * t, min(size, math.ceil((o + n) / t) * t)
        total *= hi - lo if n else 0
    return total


# --- checkpoints ---------------------------------------------------------------------------------------------

# name -> (shape, dtype, placement saved, placement loaded): the tensors of workers/hdf5_worker.py
LAYOUTS = {
    "w": ((8, 6), torch.float32, Shard(0), Shard(1)),
    "uneven": ((5, 3), torch.float32, Shard(0), Shard(1)),  # 3+2 rows saved, 2+1 columns loaded
    "bf": ((4, 6), torch.bfloat16, Shard(1), Shard(0)),
    "rep": ((3,), torch.float32, Replicate(), Shard(0)),
}


def reference() -> dict:
    """The full tensors every rank of workers/hdf5_worker.py (and the test process) builds alike."""
    gen = torch.Generator().manual_seed(1234)
    full = {name: torch.randn(shape, generator=gen).to(dtype) for name, (shape, dtype, _, _) in LAYOUTS.items()}
    return {"tensors": full, "step": torch.tensor(5), "meta": {"epoch": 2, "name": "run"}}


def flip_a_byte(ckpt: Path) -> None:
    """Flips one byte inside the data of the token embedding in a checkpoint's first shard."""
    import h5py

    shard = next(ckpt.glob("shard-*.h5"))
    with h5py.File(shard) as f:
        ds = f["model.tok_embeddings.weight"]["0_0"]
        offset = ds.id.get_offset() if ds.chunks is None else ds.id.get_chunk_info(0).byte_offset
    with shard.open("r+b") as fh:
        fh.seek(offset + 100)
        b = fh.read(1)
        fh.seek(offset + 100)
        fh.write(bytes([b[0] ^ 0xFF]))


def stored_datasets(ckpt: Path) -> dict[str, tuple]:
    """Every dataset of a checkpoint's shard files, whatever its dtype (float, uint8 RNG tables and JSON, bf16 bit
    patterns as uint16): "<shard>/<dataset>" -> (numpy dtype, shape, raw bytes, attributes), read with plain h5py."""
    import h5py
    import numpy as np

    out = {}

    def visit(name: str, obj) -> None:
        if isinstance(obj, h5py.Dataset):
            attrs = tuple(sorted((k, str(v)) for k, v in obj.attrs.items()))
            out[f"{shard.name}/{name}"] = (obj.dtype.str, obj.shape, np.asarray(obj[()]).tobytes(), attrs)
    for shard in sorted(ckpt.glob("*.h5")):
        with h5py.File(shard) as f:
            f.visititems(visit)
    return out


def assert_bitwise_equal(a: dict[str, tuple], b: dict[str, tuple]) -> None:
    """Two stored_datasets results: the same dataset names, each with the same dtype, shape, bytes and attributes."""
    assert a, "no datasets: a comparison of nothing would pass"
    assert a.keys() == b.keys(), f"only in one: {sorted(a.keys() ^ b.keys())}"
    differ = [k for k in a if a[k] != b[k]]
    assert not differ, f"{len(differ)} of {len(a)} datasets differ: {differ[:10]}"


def write_lock(root: Path, **fields) -> bytes:
    """A checkpoint directory lock record (hpctrain/checkpoint/lock.py) held by this host and process unless
    fields say otherwise; returns its bytes."""
    from hpctrain.checkpoint.lock import NAME

    rec = {"host": socket.gethostname(), "pid": os.getpid(), "job_id": "", "restart": "0", "cluster": "",
           "started": "2026-01-01T00:00:00+00:00"} | fields
    root.mkdir(parents=True, exist_ok=True)
    data = json.dumps(rec).encode()
    (root / NAME).write_bytes(data)
    return data


def each_case(out: str, cases_json: str, base_port: int, body) -> None:
    """A worker's loop over its cases: each on its own MASTER_PORT (a fresh process group), body(case) run, and
    its error recorded by case name in out/errors-rank<R>.json rather than raised, so the test names the case."""
    errors = {}
    for i, case in enumerate(json.loads(cases_json)):
        os.environ["MASTER_PORT"] = str(base_port + i)
        try:
            body(case)
        except Exception as e:
            errors[case["name"]] = f"{type(e).__name__}: {e}"
    Path(out, f"errors-rank{os.environ['RANK']}.json").write_text(json.dumps(errors))


def spawn_cases(worker: str, out: Path, cases: list[dict], run_id: str, world: int = 4,
                ranks_per_node: int = 4) -> None:
    """Runs tests/workers/<worker> on `world` ranks over `cases` (see each_case) and fails with every case's
    error and the end of every rank's output when any case failed or any rank exited non-zero."""
    cmd = [sys.executable, str(WORKERS / worker), str(out), json.dumps(cases), str(free_base_port(len(cases)))]
    procs = spawn_ranks(world, cmd, ranks_per_node=ranks_per_node, run_id=run_id)
    logs = [p.communicate(timeout=600)[0] for p in procs]
    errors = {}
    for f in out.glob("errors-rank*.json"):
        errors.update(json.loads(f.read_text()))
    assert not errors and all(p.returncode == 0 for p in procs), f"{errors}\n" + "\n".join(x[-3000:] for x in logs)
