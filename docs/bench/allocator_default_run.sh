#!/usr/bin/env bash
# The default run (resnet, digits, batch 256, 4 sections), 40 steps, three allocator settings interleaved, 2 rounds.
cd /work/bench-alloc
export PYTHONPATH=/work/bench-alloc TF_CPP_MIN_LOG_LEVEL=2
for round in 1 2; do
for setting in onednn0_bfc onednn1_bfc onednn0_nobfc; do
  case $setting in
    onednn0_bfc) envs="TF_ENABLE_ONEDNN_OPTS=0 TF_CPU_ALLOCATOR_USE_BFC=true";;
    onednn1_bfc) envs="TF_ENABLE_ONEDNN_OPTS=1 TF_CPU_ALLOCATOR_USE_BFC=true";;
    onednn0_nobfc) envs="TF_ENABLE_ONEDNN_OPTS=0 TF_CPU_ALLOCATOR_USE_BFC=false";;
  esac
  out=/work/notes/alloc/$setting-$round
  rm -rf $out
  env $envs /work/main/.venv/bin/python -m runner train.steps=40 train.eval_every=0 train.verify_exact=false train.progress=log hydra.run.dir=$out > $out.log 2>&1
  python3 -c "import json;m=json.load(open('$out/metrics.json'));print('$setting', $round, 'median_step_s %.3f' % m['median_step_seconds'], 'step_peak_MiB', None if m['step_peak_bytes'] is None else round(m['step_peak_bytes']/2**20,1), 'median_peak_MiB', None if m['median_step_peak_bytes'] is None else round(m['median_step_peak_bytes']/2**20,1))"
done; done
