#!/bin/bash
# Losses of the realistic stack with TE's fused attention held to deterministic algorithms.
source .te-bundle/setup.sh || exit 1
export NVTE_ALLOW_NONDETERMINISTIC_ALGO=0
timeout 200 torchrun --nproc_per_node=1 -m benchmarks.step_time --inits bf16 --quiet --sizes realistic --layers 4 \
  --steps 20 --warmup 3 --recipes Float8CurrentScaling,Float8BlockScaling,DelayedScaling --out $OUT/st_det > $OUT/st_det.log 2>&1
echo "exit=$?" >> $OUT/st_det.log
grep "losses identical\|median step time (ms)" $OUT/st_det/step_time.md | cut -c1-170
