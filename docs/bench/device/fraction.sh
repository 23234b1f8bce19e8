#!/bin/bash
# 0.30 and 0.25 of whole's peak as the device, sections=auto with no budget: step time against whole's
#   bash docs/bench/device/fraction.sh            (OUT=folder; EXTRA="overrides" for both runs)
#   ONEDNN=1 bash docs/bench/device/fraction.sh   (every run with oneDNN's kernels: the runner leaves them off under a
#                                                  limit, as they crash the process where an allocation fails)
cd "$(dirname "$0")/../../.."
export TF_CPP_MIN_LOG_LEVEL=2
R="${EXTRA:-} model=resnet data=synthetic data.image_shape=[28,28,1] data.train_size=16384 batch=2048 train.steps=8 train.verify_exact=false train.eval_every=0 train.save_model=false train.checkpoint_every=0 train.progress=log"
O=${OUT:-outputs/bench/device/fraction}
rm -rf $O; mkdir -p $O
# oneDNN off unless ONEDNN=1, as the emulated device runs (sectionflow turns it off where the allocator has a limit)
export TF_ENABLE_ONEDNN_OPTS=${ONEDNN:-0}
.venv/bin/python -m runner $R engine=whole hydra.run.dir=$O/whole > $O/whole.txt 2>&1
PEAK=$(python3 -c "import json; print(json.load(open('$O/whole/metrics.json'))['step_peak_bytes'])")
for F in 0.30 0.25; do
  MIB=$(python3 -c "print(int($PEAK*$F/2**20))")
  TF_CPU_BFC_MEM_LIMIT_IN_MB=$MIB .venv/bin/python -m runner $R sections=auto train.plan_cache=null hydra.run.dir=$O/auto_$F > $O/auto_$F.txt 2>&1
  echo "fraction $F device $MIB MiB rc=$?"  # 139: a segmentation fault (oneDNN on)
done
.venv/bin/python -m runner $R engine=whole hydra.run.dir=$O/whole_again > $O/whole_again.txt 2>&1
python3 - <<PY
import json
for name in ["whole", "auto_0.30", "auto_0.25", "whole_again"]:
    try:
        m = json.load(open("$O/" + name + "/metrics.json"))
        print(name, m["batch"], round(m["step_peak_bytes"]/2**20,1), "MiB", round(m["median_step_seconds"],3), "s", m["num_sections"], m.get("memory_budget_bytes"))
    except Exception as e:
        print(name, "failed", e)
PY
