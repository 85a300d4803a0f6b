#!/usr/bin/env bash
# issue 30's proof on one GPU: hpctrain against a plain PyTorch loop of a Llama-3.1-8B-shaped model in eager,
# compiled, compiled + selective recompute and compiled + float8 modes (benchmarks/gpu_perf.py: the rule, targets
# and what each side is). About 8 minutes on an H100; the results JSON lands in benchmarks/results/ and in $OUT.
#   bash tests/device/gpu_perf.sh                      # python3 with a CUDA torch (torchao for the fp8 mode)
#   LAYERS=8 MODES=eager,compiled bash tests/device/gpu_perf.sh   # LAYERS unset: as many as the planner fits twice
#   PY=.venv/bin/python ARGS=--tiny bash tests/device/gpu_perf.sh   # the script's logic on a CPU, tiny model
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
PY=$(command -v ${PY:-python3}); case $PY in /*) ;; *) PY=$PWD/$PY ;; esac  # the run cds into benchmarks/
OUT=${OUT:-/tmp/devout}; mkdir -p $OUT
nvidia-smi -L 2>/dev/null
$PY -c "import torch;print('torch',torch.__version__,'cuda',torch.version.cuda,torch.cuda.is_available())"
$PY -c "import torchao;print('torchao',torchao.__version__)" 2>/dev/null || echo "no torchao: the fp8 mode is left out"
MODES=${MODES:-eager,compiled,compiled_selective,compiled_fp8}
# fp8 needs torchao and float8 matmuls (compute capability 8.9+: H100, H200, B200); elsewhere the mode is left out
$PY -c "import torch, torchao; assert torch.cuda.get_device_capability() >= (8, 9)" 2>/dev/null \
    || MODES=$(echo $MODES | sed 's/,compiled_fp8//; s/compiled_fp8,//')
t=$SECONDS
(cd benchmarks && timeout -k 20 ${LIMIT_S:-560} $PY gpu_perf.py --layers ${LAYERS:-0} --rounds ${ROUNDS:-6} \
    --modes $MODES ${ARGS:-}) 2>&1 | tee $OUT/gpu_perf.txt
rc=${PIPESTATUS[0]}; echo "gpu_perf rc=$rc in $((SECONDS-t)) s"
cp benchmarks/results/gpu_perf-*.json $OUT/ 2>/dev/null
exit $rc
