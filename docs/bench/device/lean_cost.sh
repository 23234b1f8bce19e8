#!/bin/bash
# What lean gradients cost in time with one section (no re-run): the notebook ResNet at batch 2048 on an emulated
# device with room for either (4000 MiB; oneDNN off, as the runner sets it under a limit), lean and plain in turn.
#   bash docs/bench/device/lean_cost.sh        (OUT=folder; ROUNDS=3; each run its own process, one at a time)
cd "$(dirname "$0")/../../.."
export TF_CPP_MIN_LOG_LEVEL=2 TF_CPU_BFC_MEM_LIMIT_IN_MB=${MIB:-4000}
R="model=resnet data=synthetic data.image_shape=[28,28,1] data.train_size=16384 batch=2048 train.steps=6 train.verify_exact=false train.eval_every=0 train.save_model=false train.checkpoint_every=0 train.progress=log sections=1"
O=${OUT:-outputs/bench/device/lean_cost}
rm -rf $O; mkdir -p $O
for ROUND in $(seq ${ROUNDS:-3}); do
  for LEAN in false true recompute; do
    N=lean_${LEAN}_$ROUND
    .venv/bin/python -m runner $R engine.lean=$LEAN hydra.run.dir=$O/$N > $O/$N.txt 2>&1
    python3 -c "import json; m=json.load(open('$O/$N/metrics.json')); print('$N', round(m['median_step_seconds'],3), 's', round(m['step_peak_bytes']/2**20,1), 'MiB')"
  done
done
