#!/usr/bin/env bash
# GPU smoke check of the paths CPU tests cannot reach, on one GPU of a node (no Slurm, no MPI needed):
#   bash tests/device/gpu_smoke.sh              # python3 with a CUDA torch, mpi4py, h5py, click on PATH
#   DEV=cpu PY=.venv/bin/python bash tests/device/gpu_smoke.sh    # the same steps on CPU/gloo, fp32
# 1 hpctrain doctor --here (CUDA device, bf16 GEMM against job.gpu = h100-sxm, storage, environment), 2 the same
# with the node slowed 10x (SEAM_DOCTOR_SLOW: the datasheet rule must fail it, exit 1), 3 training with
# job.preflight (the CUDA-event straggler clock), 4 a rank asleep in step 8's forward (watchdog, NCCL flight
# recorder, diagnose; exit 1), 5 hpctrain bench on the job's backend by nccl-tests' definition (-a 1 -z 0), 6 bench
# --backend mpi in a GPU job (host buffers; said and skipped where no mpiexec or MPI library is there), 7 async saves on
# NCCL with lazy gloo and expandable_segments, then a resume from them, 8 the gradient norm of a rank without
# gradients reduced over a "cpu:gloo,cuda:nccl" group on the parameters' device, 9 CPU offload (all, optimizer)
# against the plain run, and on CUDA a 6B model whose AdamW state does not fit trained with offload = "all"; context
# parallel's CUDA ring needs 2 GPUs and is not here, 10 no host-device sync outside log steps (the first two steps
# set things up). Each step prints its exit status;
# outputs go to $OUT (default /tmp/devout). Steps 2 and 4 run with the test seams of tests/plugins/seams.py (its
# sitecustomize.py on PYTHONPATH reads SEAM_DOCTOR_SLOW and SEAM_FAULT).
# STEPS="9 10" runs only the steps named. All ten may take longer than one device call allows (about 15 starts of
# torch and step 9's 6B model, whose CPU init alone takes ~50 s): run them as two calls, or the steps never run on a
# GPU first (9 and 10). Step 9's 6B model (96 GB of states) exceeds an 80 GB GPU, not an H200's 141 GB: there it
# shows offload training on CUDA, not that it makes the model fit; its pinned host copies take ~100 GiB of host
# memory (torch rounds pinned blocks up to powers of two).
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
SEAM="env PYTHONPATH=$PWD/tests/plugins:$PWD"
BAD=0
expect() {  # expect WHAT WANTED_RC GOT_RC
  if [ "$2" != "$3" ]; then echo "MISMATCH: $1 exited $3, expected $2"; BAD=1; fi
}
PY=$(command -v ${PY:-python3})  # a full path: mpiexec may start ranks with another PATH
OUT=${OUT:-/tmp/devout}; mkdir -p $OUT
ROOT=/tmp/g17runs; rm -rf $ROOT; mkdir -p $ROOT
DEV=${DEV:-cuda}
if [ "$DEV" = cuda ]; then GPU='gpus_per_node = 1
gpu = "h100-sxm"'; BACK=nccl; PREC=bf16; else GPU=''; BACK=gloo; PREC=fp32; fi
nvidia-smi -L 2>/dev/null
$PY -c "import torch,mpi4py,h5py,click;print('torch',torch.__version__,'cuda',torch.cuda.is_available())"
cat > $ROOT/g1.toml <<EOT
[job]
name = "g1"
nodes = 1
tasks_per_node = 1
$GPU
run_root = "$ROOT"
[parallel]
tp = 1
backend = "$BACK"
[model]
vocab_size = 256
dim = 256
n_layers = 2
n_heads = 4
max_seq_len = 128
[train]
steps = 20
micro_batch_size = 4
log_every = 5
precision = "$PREC"
[data]
source = "synthetic"
seq_len = 128
EOT
H="$PY -m hpctrain.cli"
want() { [ -z "${STEPS:-}" ] || [[ " $STEPS " == *" $1 "* ]]; }  # STEPS="9 10": only those steps
if want 1; then
echo "== 1 doctor healthy"; t=$SECONDS
timeout 240 $H doctor $ROOT/g1.toml --here --run-dir $ROOT/doc1 --storage-mb 64 > $OUT/doctor.txt 2>$OUT/doctor.err; rc=$?; echo "rc=$rc in $((SECONDS-t)) s"; expect doctor 0 $rc
cat $OUT/doctor.txt; tail -5 $OUT/doctor.err
fi
if want 2; then
echo "== 2 doctor slowed"; t=$SECONDS
$SEAM SEAM_DOCTOR_SLOW=$(hostname -s) timeout 240 $H doctor $ROOT/g1.toml --here --run-dir $ROOT/doc2 --storage-mb 64 > $OUT/doctor_slow.txt 2>$OUT/doctor_slow.err; rc=$?; echo "rc=$rc in $((SECONDS-t)) s"
[ "$DEV" = cuda ] && expect "slowed doctor (datasheet rule)" 1 $rc
grep -E "FAIL|exclude" $OUT/doctor_slow.txt; tail -3 $OUT/doctor_slow.err
fi
if want 3; then
echo "== 3 train with preflight"; t=$SECONDS
timeout 240 $H train $ROOT/g1.toml --set job.preflight=true --run-dir $ROOT/tr > $OUT/train.txt 2>&1; rc=$?; echo "rc=$rc in $((SECONDS-t)) s"; expect "train with preflight" 0 $rc
grep -E "step +20|preflight|slow|rank_compute" $OUT/train.txt | tail -5; tail -1 $ROOT/tr/metrics.jsonl | cut -c1-400
fi
if want 4; then
echo "== 4 hang"; t=$SECONDS
$SEAM SEAM_FAULT=sleep600:0:forward8 timeout 200 $H train $ROOT/g1.toml --set parallel.hang_timeout_s=8 --run-dir $ROOT/hg > $OUT/hang.txt 2>&1; rc=$?; echo "rc=$rc in $((SECONDS-t)) s"; expect "hung run" 1 $rc
tail -3 $OUT/hang.txt; ls $ROOT/hg/hang
$PY -c "import json,sys;d=json.load(open('$ROOT/hg/hang/rank00000.fr.json'));print({k:(len(v.get('entries',[])) if isinstance(v,dict) else v) for k,v in d.items()})"
$H diagnose $ROOT/hg | tee $OUT/diagnose.txt; rc=${PIPESTATUS[0]}; expect diagnose 1 $rc
grep -q "rank 0 .* busy in forward of step 8" $OUT/diagnose.txt || { echo "MISMATCH: diagnose did not name rank 0 busy in step 8"; BAD=1; }
cp $ROOT/hg/hang/rank00000.fr.json $OUT/ 2>/dev/null
fi
if want 5; then
echo "== 5 bench on the job's backend"; t=$SECONDS
timeout 180 $H bench all_reduce all_gather -b 1M -e 64M -f 4 --config $ROOT/g1.toml --run-dir $ROOT/bn -J $OUT/bench.jsonl > $OUT/bench.txt 2>&1; rc=$?; echo "rc=$rc in $((SECONDS-t)) s"; expect "bench $BACK" 0 $rc
grep -iE "average|blocking|^ +[0-9]" $OUT/bench.txt | head -12
fi
if want 6; then
echo "== 6 bench --backend mpi in a GPU job"; t=$SECONDS
MPIEXEC=$(command -v mpiexec || ls $(dirname $(command -v $PY))/mpiexec 2>/dev/null)
if [ -n "$MPIEXEC" ] && $PY -c "from mpi4py import MPI" 2>/dev/null; then
  # Open MPI refuses root unless told (the device machines run commands as root)
  OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 timeout 180 $MPIEXEC -n 1 $H bench all_reduce -b 1M -e 4M --backend mpi --config $ROOT/g1.toml --run-dir $ROOT/bm > $OUT/bench_mpi.txt 2>&1; rc=$?; echo "rc=$rc in $((SECONDS-t)) s"; expect "bench mpi" 0 $rc
  tail -4 $OUT/bench_mpi.txt
else echo "skipped: no mpiexec, or mpi4py finds no MPI library, on this machine"; fi
fi
if want 7; then
echo "== 7 async saves, lazy gloo, expandable segments, resume"; t=$SECONDS
PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True timeout 240 $H train $ROOT/g1.toml --set checkpoint.every_steps=5 --set checkpoint.async_save=true --run-dir $ROOT/as > $OUT/async.txt 2>&1; rc=$?; echo "rc=$rc in $((SECONDS-t)) s"; expect "async saves" 0 $rc
PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True timeout 240 $H train $ROOT/g1.toml --set train.steps=25 --set checkpoint.async_save=true --run-dir $ROOT/as > $OUT/resume.txt 2>&1; rc=$?; echo "rc=$rc in $((SECONDS-t)) s"; expect "resume" 0 $rc
grep -iE "resum|nofile|step +2[05]" $OUT/async.txt $OUT/resume.txt | head -8; ls $ROOT/as/checkpoints
grep -qi "resum.*20" $OUT/resume.txt || { echo "MISMATCH: the second run did not say it resumed from step 20"; BAD=1; }
fi
if want 8; then
echo "== 8 gradient norm without gradients on the device"; t=$SECONDS
DEV=$DEV timeout 120 $PY - > $OUT/gradnorm.txt 2>&1 <<'EOP'
import os, torch, torch.distributed as dist
from hpctrain.train.optim import grad_norm
dev = os.environ["DEV"]
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29517")
dist.init_process_group("cpu:gloo,cuda:nccl" if dev == "cuda" else "gloo", rank=0, world_size=1)
pp = dist.new_group([0])
params = [torch.nn.Parameter(torch.ones(4, device=dev))]
n = grad_norm(params, pp_group=pp)
if dev == "cuda": torch.cuda.synchronize()
print("norm", n.item(), "on", n.device)
assert n.device.type == dev and n.item() == 0.0, n
dist.destroy_process_group()
EOP
rc=$?; echo "rc=$rc in $((SECONDS-t)) s"; expect "grad norm without gradients" 0 $rc; cat $OUT/gradnorm.txt | tail -2
fi
if want 9; then
echo "== 9 CPU offload: the same losses as without; a model whose AdamW state does not fit trains with it"; t=$SECONDS
timeout 240 $H train $ROOT/g1.toml --set parallel.zero_stage=3 --set checkpoint.at_end=false --run-dir $ROOT/of0 > $OUT/offload0.txt 2>&1; rc=$?; expect "zero3 without offload" 0 $rc
timeout 240 $H train $ROOT/g1.toml --set parallel.zero_stage=3 --set parallel.offload=all --set checkpoint.at_end=false --run-dir $ROOT/of1 > $OUT/offload1.txt 2>&1; rc=$?; expect "zero3 offload all" 0 $rc
timeout 240 $H train $ROOT/g1.toml --set parallel.offload=optimizer --set checkpoint.at_end=false --run-dir $ROOT/of2 > $OUT/offload2.txt 2>&1; rc=$?; expect "optimizer offload" 0 $rc
$PY - $ROOT/of0 $ROOT/of1 $ROOT/of2 <<'EOP' || BAD=1
import json, sys
runs = [[json.loads(l)["loss"] for l in open(f"{d}/metrics.jsonl") if '"loss"' in l] for d in sys.argv[1:]]
print("losses", [r[-1] for r in runs])
assert all(len(r) == len(runs[0]) > 0 for r in runs) and all(abs(a - b) < 2e-2 for r in runs[1:]
                                                                for a, b in zip(r, runs[0])), runs
EOP
# the host step's stream pipeline (many small buckets: downloads, host AdamW and uploads in flight together) gives
# the weights of one bucket stepped in order: a missed wait shows as different weights
DEV=$DEV timeout 120 $PY - > $OUT/host_adamw.txt 2>&1 <<'EOP'
import os, torch
from hpctrain.train.optim import HostAdamW, param_groups
dev = os.environ["DEV"]
def run(bucket_bytes):
    torch.manual_seed(0)
    m = torch.nn.Sequential(*[torch.nn.Linear(512, 512) for _ in range(8)]).to(dev)
    opt = HostAdamW(param_groups(m, 0.1), pin=dev == "cuda", bucket_bytes=bucket_bytes, lr=1e-3)
    for _ in range(5):
        m(torch.randn(64, 512, device=dev)).square().mean().backward()
        opt.step(); opt.zero_grad()
    return len(opt.buckets), [p.detach().cpu() for p in m.parameters()]
(n1, one), (n2, many) = run(1 << 30), run(300_000)
print("buckets", n1, n2, "equal", all(torch.equal(a, b) for a, b in zip(one, many)))
assert n2 >= 8 and all(torch.equal(a, b) for a, b in zip(one, many))
EOP
rc=$?; expect "host AdamW in buckets" 0 $rc; tail -1 $OUT/host_adamw.txt
if [ "$DEV" = cuda ]; then
  # about 6B parameters: 96 GB of fp32 weights, gradients and AdamW state, more than the GPU; with offload the GPU
  # holds a block's gathered bf16 weights and the activations
  timeout 420 $H train $ROOT/g1.toml --set model.dim=4096 --set model.n_layers=28 --set model.n_heads=32 --set model.vocab_size=32000 --set train.steps=3 --set train.micro_batch_size=1 --set train.ac=full --set parallel.zero_stage=3 --set parallel.offload=all --set checkpoint.at_end=false --run-dir $ROOT/of3 > $OUT/offload_big.txt 2>&1; rc=$?; expect "6B with offload all" 0 $rc
  grep -E "parameters|step +3|memory" $OUT/offload_big.txt | tail -4
fi
fi
if want 10; then
echo "== 10 no host-device sync outside log steps (torch.cuda.set_sync_debug_mode)"; t=$SECONDS
DEV=$DEV ROOT=$ROOT timeout 240 $PY - > $OUT/syncs.txt 2>&1 <<'EOP'
import os, warnings, torch
from hpctrain.config import load_config
from hpctrain.job import session
from hpctrain.train.trainer import Trainer
cuda = os.environ["DEV"] == "cuda"
cfg = load_config(os.environ["ROOT"] + "/g1.toml", ["train.steps=12", "train.log_every=4", "checkpoint.at_end=false",
                                                    f"job.run_root={os.environ['ROOT']}/sy"])
with session.start(cfg) as s:
    tr = Trainer(cfg, s)
    step, seen = tr.train_step, {}
    def watched(*a, **k):  # from this step's start to the next one's: the whole iteration of fit()'s loop
        n = tr.step + 1
        if cuda:
            torch.cuda.set_sync_debug_mode(0 if tr.log_step(n) or n <= 2 else "warn")
        seen[n] = len(caught)
        return step(*a, **k)
    tr.train_step = watched
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        tr.fit()
    if cuda:
        torch.cuda.set_sync_debug_mode(0)
syncs = [m for m in caught if "synchroniz" in str(m.message)]
print("warnings per step", {n: c for n, c in seen.items()}, "syncs", len(syncs))
for m in syncs[:5]:
    print(m.filename, m.lineno, m.message)
assert not syncs, "the step synchronised with the device outside log steps"
EOP
rc=$?; echo "rc=$rc in $((SECONDS-t)) s"; expect "no syncs outside log steps" 0 $rc; tail -6 $OUT/syncs.txt
fi
echo "rc=$BAD after $((SECONDS-t)) s"
[ $BAD = 0 ] && echo "gpu_smoke: every step as expected" || echo "gpu_smoke: MISMATCH above"
exit $BAD
