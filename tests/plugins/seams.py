"""Test seams, patched into hpctrain from outside it: injected faults, deliberate gradient bugs, a slowed doctor
node, the NCCL path emulated on gloo, a wrong element in the benchmark's check. The product holds none of them
(tests/pure/test_no_seams.py): each patch wraps a product function that exists for its own sake.

In a test process or a worker script, with tests/plugins on sys.path (tests/conftest.py puts it there):

    with seams.gradient_mutation("dp_sum"): ...   # every Trainer built inside has that bug (MUTATIONS)
    with seams.wrong_element(): ...               # the benchmark check's root sees one wrong element
    with seams.doctor_slow("node1:5"): ...        # that node's doctor measures 5x slower
    seams.emulate_nccl()                          # before session.start: NCCL's path, served by gloo, on the CPU

In ranks a launcher starts (the hpctrain CLI, mpiexec, srun, submitit): helpers.launch.seam_env(SEAM_FAULT=...) puts
tests/plugins on PYTHONPATH, where sitecustomize.py calls install_from_env() at interpreter start. Each patch is
applied when its module is first imported, so nothing is imported early and a process that never imports it
is untouched:

    SEAM_FAULT=<action>:<rank>:<point>   that rank acts at `point`. Actions: raise, a signal name (sent to itself:
                                         SIGSTOP stops it as a hung node would), sleep<seconds> (a slow rank).
                                         Points: rendezvous (identity known, before torch.distributed), ready
                                         (mesh checked, before the payload), forward (the heartbeat entering a
                                         training step's forward, every step) or forward<N> (step N's only).
    SEAM_DOCTOR_SLOW=<node>[:factor]     that node's doctor GEMM and storage probes report `factor` (default 10)
                                         times their measured time (rates divided by it). Nothing sleeps: the
                                         verdicts read only the rates, and a sleep would leave the host idle.

Standard library only at module level (sitecustomize imports this in every process started with the plugin).
"""
from __future__ import annotations

import contextlib
import importlib.machinery
import logging
import os
import signal
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

log = logging.getLogger("hpctrain")  # the product's logger: the rank logs show what a seam did

FAULT_ENV = "SEAM_FAULT"
DOCTOR_SLOW_ENV = "SEAM_DOCTOR_SLOW"


# --- patching a module when it is imported --------------------------------------------------------------------

class _AfterImport:
    """A meta path finder that runs patch(module) right after the named module's code ran, before anyone who
    imported it sees it (so a `from m import f` elsewhere gets the patched f)."""

    def __init__(self) -> None:
        self.pending: dict[str, list[Callable[[Any], None]]] = {}

    def find_spec(self, name, path, target=None):
        patches = self.pending.pop(name, None)
        if patches is None:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path, target)
        if spec is None or spec.loader is None:
            return spec
        exec_module = spec.loader.exec_module

        def exec_and_patch(module) -> None:
            exec_module(module)
            for patch in patches:
                patch(module)
        spec.loader.exec_module = exec_and_patch  # this spec's own loader instance
        return spec


_after_import = _AfterImport()


def when_imported(name: str, patch: Callable[[Any], None]) -> None:
    """patch(module) now if `name` is imported already, else right after its import."""
    if name in sys.modules:
        patch(sys.modules[name])
        return
    if _after_import not in sys.meta_path:
        sys.meta_path.insert(0, _after_import)
    _after_import.pending.setdefault(name, []).append(patch)


def _wrap(owner: Any, attr: str, make: Callable[[Callable], Callable]) -> None:
    setattr(owner, attr, make(getattr(owner, attr)))


@contextlib.contextmanager
def _patched(owner: Any, attr: str, make: Callable[[Callable], Callable]) -> Iterator[None]:
    old = getattr(owner, attr)
    setattr(owner, attr, make(old))
    try:
        yield
    finally:
        setattr(owner, attr, old)


# --- faults at three points of a rank's life --------------------------------------------------------------------

_faults_said: set[str] = set()


def inject_fault(spec: str, point: str, rank: int, step: int | None = None) -> None:
    """Acts as `spec` (SEAM_FAULT's form) says when it names this rank and point. The name shows in hang
    reports' stacks (tests/cluster/hang/test_hang.py looks for it)."""
    action, fault_rank, fault_point = spec.split(":")
    if int(fault_rank) != rank or fault_point not in (point, f"{point}{step}"):
        return
    if spec not in _faults_said:  # a slow rank's sleep comes every step: said once
        log.warning("%s: %s on rank %d at %s", FAULT_ENV, action, rank,
                    point if step is None else f"{point} of step {step}")
        _faults_said.add(spec)
    if action == "raise":
        raise RuntimeError(f"{FAULT_ENV}: injected failure on rank {rank} at {point}")
    if action.startswith("sleep"):
        time.sleep(float(action[5:]))
        return
    os.kill(os.getpid(), signal.Signals[action])


def install_fault(spec: str) -> None:
    """rendezvous: after the identity is known (rendezvous.identify, which session.start calls first); ready:
    after the mesh and its group checks (session._build_mesh); forward: when the heartbeat enters a step's
    forward (the trainer does, per micro-batch, or once for the pipeline schedule), in that step."""
    def identify(orig):
        def identify(*args, **kwargs):
            ident = orig(*args, **kwargs)
            inject_fault(spec, "rendezvous", ident.rank)
            return ident
        return identify

    def build_mesh(orig):
        def _build_mesh(s):
            orig(s)
            inject_fault(spec, "ready", s.rank)
        return _build_mesh

    def enter(orig):
        def enter(self, phase: str, detail: str = "") -> None:
            orig(self, phase, detail)
            if phase == "forward":
                inject_fault(spec, "forward", self.rank, self.step)
        return enter

    when_imported("hpctrain.job.rendezvous", lambda m: _wrap(m, "identify", identify))
    when_imported("hpctrain.job.session", lambda m: _wrap(m, "_build_mesh", build_mesh))
    when_imported("hpctrain.hang.heartbeat", lambda m: _wrap(m.Heartbeat, "enter", enter))


# --- a slowed doctor node ---------------------------------------------------------------------------------------

def slow_factor(spec: str, node: str) -> float:
    """The slowdown SEAM_DOCTOR_SLOW's `spec` gives `node`: 1 when it names another node."""
    name, _, factor = spec.partition(":")
    if not spec or name != node:
        return 1.0
    return float(factor or 10)


def _slowed_measure(spec: str):
    """Wraps doctor.measure.measure: on the named node, its GEMM probe (bench.gemm.measure_gemm) and storage probe
    (hostprobe.storage) report `factor` times their measured time, for the length of that call."""
    def make(orig):
        def measure(s, *args, **kwargs):
            factor = slow_factor(spec, s.ident.node_name)
            if factor <= 1:
                return orig(s, *args, **kwargs)
            from hpctrain import hostprobe
            from hpctrain.bench import gemm

            log.warning("%s: this node measures %g x slower", DOCTOR_SLOW_ENV, factor)

            def slow_gemm(orig_gemm):
                def measure_gemm(*a, **kw):
                    r = orig_gemm(*a, **kw)
                    return r | {"time_s": r["time_s"] * factor, "tflops": r["tflops"] / factor}
                return measure_gemm

            def slow_storage(orig_storage):
                def storage(*a, **kw):
                    r = orig_storage(*a, **kw)
                    if "error" in r:
                        return r
                    return r | {"write_gbps": r["write_gbps"] / factor, "read_gbps": r["read_gbps"] / factor}
                return storage

            with _patched(gemm, "measure_gemm", slow_gemm), _patched(hostprobe, "storage", slow_storage):
                return orig(s, *args, **kwargs)
        return measure
    return make


def install_doctor_slow(spec: str) -> None:
    when_imported("hpctrain.doctor.measure", lambda m: _wrap(m, "measure", _slowed_measure(spec)))


@contextlib.contextmanager
def doctor_slow(spec: str | None) -> Iterator[None]:
    """In-process: the doctor runs inside measure as SEAM_DOCTOR_SLOW=spec says (None or "": unchanged)."""
    if not spec:
        yield
        return
    from hpctrain.doctor import measure
    with _patched(measure, "measure", _slowed_measure(spec)):
        yield


# --- deliberate gradient-scale bugs (tests/multiproc/parallel/test_grad_scale_mutations.py) ---------------------------

# name -> (what the layout needs for the bug to act, the bug)
MUTATIONS = {"dp_sum": ("dp > 1", "the dp reduction sums instead of averaging"),
             "no_accum_div": ("grad_accum > 1 and pp = 1", "the backward loss is not divided by grad_accum"),
             "tp_double": ("tp > 1", "gradients replicated over tp are all-reduced over tp a second time")}


def check_mutation(name: str, dp: int, tp: int, pp: int, grad_accum: int) -> None:
    """Refuses unknown names, and a layout the bug would not touch (a mutation test that mutates nothing would
    pass for the wrong reason)."""
    if name not in MUTATIONS:
        raise ValueError(f"mutation {name!r} is not one of {', '.join(MUTATIONS)}")
    acts = {"dp_sum": dp > 1, "no_accum_div": grad_accum > 1 and pp == 1, "tp_double": tp > 1}[name]
    if not acts:
        raise ValueError(f"mutation {name} needs {MUTATIONS[name][0]}; this layout has pp={pp} dp={dp} tp={tp} "
                         f"grad_accum={grad_accum}")


def mutate_reduced_grads(name: str, params, dp: int, tp_group) -> None:
    """After the real reductions: dp_sum turns the dp average into the sum (a DDP/FSDP divide factor of 1);
    tp_double sums the gradients that tensor parallel replicates (norm weights; those not sharded over tp) over tp
    again, as a redundant all-reduce of already complete gradients would."""
    import torch
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    def sharded_over_tp(t) -> bool:
        if not isinstance(t, DTensor):
            return False  # plain tensors are whole on every tp rank
        names = t.device_mesh.mesh_dim_names or ()
        return "tp" in names and t.placements[names.index("tp")].is_shard()

    with torch.no_grad():
        for p in params:
            if p.grad is None:
                continue
            local = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
            if name == "dp_sum":
                local.mul_(dp)
            elif not sharded_over_tp(p.grad):
                dist.all_reduce(local, group=tp_group)


@contextlib.contextmanager
def gradient_mutation(name: str | None) -> Iterator[None]:
    """Every Trainer built inside has bug `name` (None: unchanged). The bug goes through the trainer's loss scaler,
    which sits at both places a bug needs: scale_loss (the backward loss: no_accum_div scales it back up by
    grad_accum, so the backward sees the undivided mean) and unscale_and_check (called first after the
    gradients are reduced: dp_sum and tp_double change them there)."""
    if not name:
        yield
        return
    from hpctrain.train.trainer import Trainer

    def make(orig_init):
        def __init__(self, *args, **kwargs) -> None:
            orig_init(self, *args, **kwargs)
            layout, accum, scaler = self.s.mesh.layout, self.cfg.train.grad_accum, self.scaler
            check_mutation(name, layout.dp, layout.tp, layout.pp, accum)
            log.warning("mutation %s: %s (a deliberate bug, for tests only)", name, MUTATIONS[name][1])
            if name == "no_accum_div":
                scale_loss = scaler.scale_loss
                scaler.scale_loss = lambda loss: scale_loss(loss * accum)
                return
            unscale_and_check, tp_group = scaler.unscale_and_check, self.s.mesh.group("tp")

            def mutated_unscale_and_check(params, device):
                mutate_reduced_grads(name, params, layout.dp, tp_group)
                return unscale_and_check(params, device)
            scaler.unscale_and_check = mutated_unscale_and_check
        return __init__

    with _patched(Trainer, "__init__", make):
        yield


# --- the benchmark's check, proven able to fail --------------------------------------------------------------

@contextlib.contextmanager
def wrong_element() -> Iterator[None]:
    """The group's root (which checks every collective, reduce too) finds its first received element set to the
    sentinel before the check: never a result, in any type (+1 could round away in bf16)."""
    from hpctrain.bench import harness

    def make(orig):
        def check_recv(coll, inputs, ctx, T, recv, chunk):
            if ctx.idx == ctx.root:
                recv.view(-1)[0] = harness.sentinel(recv.dtype)
            return orig(coll, inputs, ctx, T, recv, chunk)
        return check_recv

    with _patched(harness, "check_recv", make):
        yield


# --- NCCL's code path on a CPU-only torch (tests/multiproc/job/test_device_collectives.py) --------------------------

def emulated_device_backend(config: str) -> str:
    """The backend string with every NCCL entry served by gloo instead, each for the same device types only:
    "nccl" -> "cuda:gloo", a group that refuses host tensors with NCCL's own error on a CPU-only torch."""
    from torch.distributed import Backend
    from torch.distributed.distributed_c10d import BackendConfig

    pairs = BackendConfig(Backend(config)).get_device_backend_map()
    return ",".join(f"{dev}:{'gloo' if name == 'nccl' else name}" for dev, name in pairs.items())


def emulate_nccl() -> None:
    """For the rest of this process: rendezvous.init_distributed takes the NCCL path (choose_backend says "nccl"),
    the rank on the CPU (bind_device), and the process group it asks for is made with NCCL's entries served by
    gloo and without device_id (NCCL's eager connect to a bound GPU, which a CPU cannot be). The backend string
    is translated where it reaches torch, so a test may still replace rendezvous.backend_config."""
    import torch
    import torch.distributed as dist

    from hpctrain.job import rendezvous

    rendezvous.choose_backend = lambda backend: "nccl"
    rendezvous.bind_device = lambda ident, backend: torch.device("cpu")
    init_process_group = dist.init_process_group

    def emulated_init_process_group(backend=None, *args, device_id=None, **kwargs):
        return init_process_group(emulated_device_backend(backend), *args, **kwargs)
    dist.init_process_group = emulated_init_process_group


# --- from the environment (sitecustomize.py) -------------------------------------------------------------------

def install_from_env(env=os.environ) -> None:
    if env.get(FAULT_ENV):
        install_fault(env[FAULT_ENV])
    if env.get(DOCTOR_SLOW_ENV):
        install_doctor_slow(env[DOCTOR_SLOW_ENV])
