#!/bin/bash
# Step time, paired against stock with a stock-vs-stock control, alone on the GPU.
source .te-bundle/setup.sh || exit 1
R=$OUT
T="torchrun --nproc_per_node=1 -m benchmarks.step_time --inits bf16 --quiet"
timeout 330 $T --sizes realistic --layers 4 --steps 40 --warmup 3 --profile --time-budget 250 \
   --recipes Float8CurrentScaling,Float8BlockScaling,DelayedScaling --out $R/st_real > $R/st_real.log 2>&1
echo "exit=$?" >> $R/st_real.log
timeout 200 $T --sizes leak --steps 40 --warmup 3 --profile --time-budget 150 \
   --recipes Float8CurrentScaling,Float8BlockScaling,DelayedScaling --out $R/st_leak > $R/st_leak.log 2>&1
echo "exit=$?" >> $R/st_leak.log
tail -30 $R/st_real.log; tail -30 $R/st_leak.log; ls $R/st_real $R/st_leak
