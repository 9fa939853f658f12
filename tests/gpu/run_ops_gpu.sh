#!/bin/bash
# Issue 28's GPU checks on one GPU, in parallel processes, logs under $OUT
# (one <name>.log each, ending with its exit status), then the benchmark alone
# (its step times must not share the GPU). TE's test files are read from
# $TE_TESTS_DIR (default: shared/te-tests, the folder of TE 2.20.2's
# tests/pytorch files). About 9.5 minutes in all.
source .te-bundle/setup.sh || exit 1
R=$OUT
TE_TESTS=${TE_TESTS_DIR:-shared/te-tests}
P="timeout 400 python3 -m pytest -m gpu -o addopts= -rs --tb=short -q -p no:cacheprovider"
run() { name=$1; shift; ( "$@" > "$R/$name.log" 2>&1; echo "exit=$?" >> "$R/$name.log" ) & }
run numerics_current $P tests/gpu/test_ops_numerics.py -k Float8CurrentScaling
run numerics_block $P tests/gpu/test_ops_numerics.py -k Float8BlockScaling
run numerics_other $P tests/gpu/test_ops_numerics.py -k "DelayedScaling or MXFP8 or NVFP4"
run conformance $P tests/gpu/test_ops_conformance.py
run fsdp2 env TE_WM_OPS_FSDP2_REPORT="$R/ops_fsdp2_report.json" $P tests/gpu/test_ops_fsdp2.py
run te_suite_fusible timeout 400 python3 -m tests.te_suite --tests-dir "$TE_TESTS" --ops --files test_fusible_ops.py \
  --max-minutes 6.4 --timeout 190 --out "$R/te_suite_fusible"
run te_suite_grouped_mlp timeout 400 python3 -m tests.te_suite --tests-dir "$TE_TESTS" --ops --files test_grouped_mlp.py \
  --max-minutes 6.4 --timeout 190 --out "$R/te_suite_grouped_mlp"
wait
timeout 160 torchrun --nproc_per_node=1 -m benchmarks.ops_memory --quiet --time-budget 140 --out "$R/ops_memory" \
  > "$R/ops_memory.log" 2>&1
echo "exit=$?" >> "$R/ops_memory.log"
for f in "$R"/*.log; do echo "== $f"; tail -4 "$f"; done
