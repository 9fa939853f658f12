#!/bin/bash
source .te-bundle/setup.sh || exit 1
R=$OUT
P="timeout 470 python3 -m pytest -m gpu -o addopts= -rs --tb=short -q -p no:cacheprovider"
run() { name=$1; shift; ( "$@" > $R/$name.log 2>&1; echo "exit=$?" >> $R/$name.log ) & }
run conf $P tests/gpu/test_conformance.py
run fsdp2a $P tests/gpu/test_conformance_fsdp2.py tests/gpu/test_mode_switches.py
run fsdp2b $P tests/gpu/test_fsdp2.py tests/gpu/test_sharded_params.py
run drawn $P tests/gpu/test_drawn_plans_gpu.py --hypothesis-show-statistics
run rest $P tests/gpu/test_numerics.py tests/gpu/test_faults.py tests/gpu/test_nesting.py tests/gpu/test_conversion.py tests/gpu/test_custom_quantizer.py
wait
timeout 100 torchrun --nproc_per_node=1 -m benchmarks.step_time --inits bf16 --quiet --sizes realistic --layers 4 \
  --steps 20 --warmup 3 --profile --recipes Float8CurrentScaling,Float8BlockScaling --out $R/st_profile > $R/st_profile.log 2>&1
echo "exit=$?" >> $R/st_profile.log
for f in $R/*.log; do echo "== $f"; tail -3 $f; done
grep -h "Python-level calls" $R/st_profile/step_time.md
