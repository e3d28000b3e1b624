#!/bin/bash
# one grid job: NAME then the dpzoo train arguments
name=$1; shift
start=$(date +%s)
OMP_NUM_THREADS=2 python3 -m dpzoo train "$@" --data ml-1m --device cuda --quiet --out runs/$name > logs/$name.log 2>&1
echo "$name rc=$? $(( $(date +%s) - start ))s" >> logs/done.txt
