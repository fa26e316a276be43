#!/usr/bin/env bash
# The GPU checks, as one short script for a machine with a GPU (CI has none): the tests marked
# `gpu` that the visible GPUs allow, then the runs on the GPU that no CPU test covers there:
# a SIGKILLed replica respawned and fed the state by transfer, the reduce overlapped with the
# backward pass (a kill inside it), a script's pipeline stages on the GPU (a kill in a
# backward), a script's replica reducing over
# NCCL (--cross-reduce nccl, not yet run on a GPU), and a --deterministic run with a kill that
# must equal one replica bit for bit. Uses the python3 on the PATH (it must hold a
# CUDA build of torch) and the package from src/ (no install). Logs go to $OUT (default: a
# temporary folder); every check runs, and the exit status is non-zero if any failed.
#
#     bash benchmarks/gpu_check.sh            # DEVICE=cpu runs the same runs on CPU (a dry run)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$(mktemp -d)}
mkdir -p "$OUT"
DEVICE=${DEVICE:-cuda}
PY=${PYTHON:-python3}
export PYTHONPATH=$PWD/src${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 OMP_NUM_THREADS=1
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
FLAGS=(--preset tiny --seq-len 32 --microbatch-size 2 --microbatches 6 --steps 20 --eval-every 0
       --warmup-steps 2 --device "$DEVICE" --balance equal --quiet)
status=0
check() {  # check NAME COMMAND...: run it with its output in $OUT/NAME.log, say how it ended
    local name=$1; shift
    local t0=$SECONDS
    "$@" >"$OUT/$name.log" 2>&1
    local rc=$?
    echo "$name: exit $rc in $((SECONDS - t0)) s"
    [ $rc -eq 0 ] || { status=1; tail -25 "$OUT/$name.log"; }
    return $rc
}
run() { "$PY" -m recover.cli "$@"; }

"$PY" -c 'import torch; print("torch", torch.__version__, "cuda", torch.cuda.is_available(),
    torch.cuda.device_count(), torch.cuda.get_device_name(0) if torch.cuda.is_available() else "")'
run prepare --out "$WORK/data" >"$OUT/prepare.log" 2>&1 || { tail "$OUT/prepare.log"; exit 1; }
DATA=(--data "$WORK/data")

if [ "$DEVICE" = cuda ]; then
    check gpu-tests timeout 300 "$PY" -m pytest -p no:cacheprovider -m gpu -n 0 -q -rs \
        tests/test_multirank.py tests/test_collective.py
fi

# A replica killed mid-step, respawned at once: the joiner gets the state from the live replicas
# (host copies of GPU tensors) and the run stays on the one-replica trajectory.
check respawn-one run train "${FLAGS[@]}" "${DATA[@]}" --replicas 1 --out "$WORK/one"
check respawn run train "${FLAGS[@]}" "${DATA[@]}" --replicas 3 --respawn 0 \
    --fault kill:replica=2,step=4,phase=backward --out "$WORK/respawn"
check respawn-compare run compare "$WORK/one" "$WORK/respawn"
transfers=$(grep -c '"state_transfer"' "$WORK/respawn/metrics.jsonl" 2>/dev/null || echo 0)
echo "respawn: $transfers state_transfer event(s)"
[ "$transfers" -ge 1 ] || status=1

# The reduce overlapped with the last backward pass (never run on a GPU yet): the hooks copy GPU
# gradients into the host buffer of the gloo reduce from autograd's device thread, buckets of
# 32 KiB start during the pass, and a kill inside it is redone on the one-replica trajectory.
check overlap run train "${FLAGS[@]}" "${DATA[@]}" --replicas 3 --reduce-bucket 0.03125 \
    --fault kill:replica=2,step=4,phase=overlap --out "$WORK/overlap"
check overlap-compare run compare "$WORK/one" "$WORK/overlap"
overlapped=$(grep -c '"overlapped":1.0' "$WORK/overlap/metrics.jsonl" 2>/dev/null || echo 0)
echo "overlap: $overlapped step(s) whose reduce started during the backward pass"
[ "$overlapped" -ge 10 ] || status=1

# The script API's NCCL reduce (--cross-reduce nccl), as far as one GPU allows: one replica of
# examples/train_custom.py on the GPU, its epoch's group NCCL's (of one member: built, no reduce).
"$PY" examples/train_custom.py --make-data "$WORK/custom.bin" >/dev/null
if [ "$DEVICE" = cuda ]; then
    check script-nccl run run --replicas 1 --cross-reduce nccl --out "$WORK/script-nccl" -- \
        "$PY" examples/train_custom.py --device cuda --data "$WORK/custom.bin" --steps 10 \
        --out "$WORK/script-nccl/result"
fi

# Pipeline stages through the script API (examples/train_pipeline.py, not yet run on a GPU): the
# one-rank form on the GPU, then 2 replicas of 2 stages that share the one GPU, a rank killed in a
# backward; the compare holds them to the one-rank trajectory. The stages send activations over
# the replica's gloo group: whether gloo sends CUDA tensors point to point is what this finds out
# (NCCL refuses two ranks on one device; on several GPUs each stage has its own).
PIPE=(--data "$WORK/custom.bin" --steps 16 --layers 4 --dim 32 --seq-len 16 --batch 2
      --device "$DEVICE")
check pipe-one run run --replicas 1 --out "$WORK/pipe-one" -- \
    "$PY" examples/train_pipeline.py "${PIPE[@]}" --out "$WORK/pipe-one/result"
check pipe run run --replicas 2 --ranks-per-replica 2 --out "$WORK/pipe" \
    --fault kill:replica=1,rank=1,step=2,phase=backward -- \
    "$PY" examples/train_pipeline.py "${PIPE[@]}" --pp 2 --schedule 1f1b --out "$WORK/pipe/result"
check pipe-compare run compare "$WORK/pipe-one" "$WORK/pipe"

# --deterministic on the GPU: 3 replicas with a kill equal 1 replica, bit for bit.
check det-one run train "${FLAGS[@]}" "${DATA[@]}" --replicas 1 --deterministic --out "$WORK/det1"
check det run train "${FLAGS[@]}" "${DATA[@]}" --replicas 3 --deterministic \
    --fault kill:replica=1,step=3,phase=forward --out "$WORK/det3"
check det-compare run compare --rtol 0 "$WORK/det1" "$WORK/det3"
cp "$WORK"/respawn/metrics.jsonl "$OUT/respawn-metrics.jsonl" 2>/dev/null
# The control plane at 12,500 replicas (issue 15's open target), with COORDINATOR_BENCH=1 on a
# machine of 16 cores: the whole system (replica clients in 8 driver processes, 196 relay
# processes of 64 replicas each: 1,563 node relays of 8 would need more cores than 16), then the
# node agents' beats at 1,564 nodes (docs/multinode.md, "Scale").
if [ "${COORDINATOR_BENCH:-0}" = 1 ]; then
    check coordinator-12500 timeout 480 "$PY" -m recover.cli bench coordinator --replicas 12500 \
        --relays 196 --drivers 8 --steps 4 --no-faults --out "$OUT/coordinator-12500.json"
    check node-beats timeout 120 "$PY" benchmarks/node_beats.py --drivers 4 \
        --json "$OUT/node_beats.json"
fi
echo "logs in $OUT; status $status"
exit $status
