#!/bin/bash
# issue 17's GPU grid: the jobs of jobs.txt, P at a time, until DEADLINE seconds; then the results into $OUT
P=${P:-12}; DEADLINE=${DEADLINE:-540}
export DPZOO_DATA=$PWD/.gpudata PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1 PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
mkdir -p runs logs; : > logs/done.txt
( sleep 60; nvidia-smi --query-gpu=utilization.gpu,memory.used --format=csv > logs/smi.txt ) &
timeout $DEADLINE xargs -P $P -L 1 bash .gpudata/run_one.sh < .gpudata/jobs.txt
echo "grid stopped after $SECONDS s"
cat logs/done.txt; cat logs/smi.txt
tar czf $OUT/seqrec_runs.tgz runs/*/metrics.json runs/*/metrics.csv logs 2>/dev/null
ls -la $OUT
