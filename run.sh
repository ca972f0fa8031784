#!/usr/bin/env bash
# Launch train_gpt.py on every visible GPU; arguments pass through (e.g. ./run.sh --num_steps=500). A first argument
# naming a trainer runs that one instead: ./run.sh train_optim.py [...] (the optimization track).
# Without a GPU it runs the trainer's tiny preset on the bundled sample, on the CPU, to show the pipeline working, on
# the bundled records' arithmetic (the record path: the same bits on any x86-64 CPU with AVX2, Intel's or AMD's);
# CPU_PATH=native runs the CPU's own kernels instead (faster with AVX-512 or bf16 GEMMs; the losses differ by rounding).
# NPROC=N sets the number of processes (NPROC=2 ./run.sh on a CPU: two gloo ranks): a whole number from 1, at most
# one per GPU (the trainer's own rule, checked here before any process starts) or, on a CPU, one per CPU it may use
# (every rank is a full process with its own torch threads: more ranks than CPUs only share them and slow each step).
# One process runs python directly. Several run under torchrun, whose own report of a failed rank would
# bury the rank's one line: here the launcher stays quiet, so that line is the last one printed, and the
# exit code is the rank's (2: bad input, 130: Ctrl-C, 143: SIGTERM).
set -euo pipefail
cd "$(dirname "$0")"
trainer=train_gpt.py
case "${1:-}" in
    train_gpt.py|train_optim.py) trainer=$1; shift ;;
    *.py) echo "error: $1: run.sh runs train_gpt.py (the default) or train_optim.py (./run.sh train_optim.py ...)" >&2
          exit 2 ;;
esac
if [ -n "${NPROC:-}" ] && ! [[ $NPROC =~ ^[1-9][0-9]*$ ]]; then  # before torch loads: a typo costs no wait
    echo "error: NPROC=$NPROC: give the number of processes, a whole number from 1 (e.g. NPROC=2), or leave it" \
         "unset for one per GPU (one on a CPU)" >&2
    exit 2
fi
# Some images (a distribution's, a container's) have only python3.
python=$(command -v python || command -v python3) || { echo "run.sh: neither python nor python3 is on PATH" >&2; exit 1; }
# Ctrl-C while torch loads: the probe dies of the signal (no KeyboardInterrupt traceback) and run.sh exits 130.
trap 'exit 130' INT
probe=$("$python" -c "import signal; signal.signal(signal.SIGINT, signal.SIG_DFL)
import os, torch
cpus = len(os.sched_getaffinity(0)) if hasattr(os, 'sched_getaffinity') else os.cpu_count()
print(torch.cuda.device_count(), int(torch.cpu._is_avx2_supported()), cpus)")
trap - INT
read -r gpus avx2 cpus <<<"$probe"
nproc=${NPROC:-$((gpus > 0 ? gpus : 1))}
on_cpu=$((gpus == 0))
for a in "$@"; do [ "$a" = "--device=cpu" ] && on_cpu=1; done
if [ "$on_cpu" -eq 1 ]; then most=$cpus unit=CPU; else most=$gpus unit=GPU; fi
if [ ${#nproc} -gt ${#most} ] || [ "$nproc" -gt "$most" ]; then  # lengths first: no overflow on a long number
    echo "error: NPROC=$nproc but $most ${unit}(s) are available: give NPROC=$most or fewer (one process per" \
         "$unit)" >&2
    exit 2
fi
args=("$@")
if [ "$gpus" -eq 0 ]; then
    for a in "$@"; do  # a GPU asked for by name: say so, not that a CPU run starts
        if [ "$a" = "--device=cuda" ]; then
            echo "error: --device=cuda but no CUDA GPU is visible; drop it to run the tiny preset on the CPU" >&2
            exit 2
        fi
    done
    # glibc returns large freed blocks to the OS and page-faults them back every step: keep them.
    export MALLOC_MMAP_THRESHOLD_=${MALLOC_MMAP_THRESHOLD_:-4000000000} MALLOC_TRIM_THRESHOLD_=${MALLOC_TRIM_THRESHOLD_:-4000000000}
    # The tiny preset, the CPU and (the record path) the fp32 GEMM path, unless given (the trainer refuses a flag
    # given twice).
    defaults=(--preset=tiny --device=cpu)
    case "${CPU_PATH:-record}" in
        record)
            if [ "$avx2" -eq 1 ]; then
                # torch and numpy read these as they load: the trainer is too late to set them (train_gpt.py's
                # RECORD_PATH_ENV: torch's kernels at AVX2, GEMMs by OpenBLAS's Haswell kernels on one thread).
                export ATEN_CPU_CAPABILITY=avx2 OPENBLAS_CORETYPE=Haswell OPENBLAS_NUM_THREADS=1
                defaults+=(--cpu_bf16_gemm=fp32)
                how="on the record path (AVX2 kernels, no MKL or oneDNN, fp32 GEMMs; CPU_PATH=native: this CPU's own)"
            else
                how="on this CPU's own kernels: the record path needs an x86-64 CPU with AVX2"
            fi ;;
        native) how="on this CPU's own kernels (CPU_PATH=native)" ;;
        *) echo "error: CPU_PATH=$CPU_PATH: use CPU_PATH=record (the default: the bundled records' arithmetic) or" \
                "CPU_PATH=native (this CPU's own kernels)" >&2
           exit 2 ;;
    esac
    for a in "$@"; do
        case "$a" in
            --preset|--preset=*) defaults=("${defaults[@]/--preset=tiny}") ;;
            --device|--device=*) defaults=("${defaults[@]/--device=cpu}") ;;
            --cpu_bf16_gemm|--cpu_bf16_gemm=*) defaults=("${defaults[@]/--cpu_bf16_gemm=fp32}") ;;
        esac
    done
    added=()
    for d in "${defaults[@]}"; do [ -n "$d" ] && added+=("$d"); done
    echo "run.sh: no CUDA GPU visible; running on the CPU${added[*]:+ with ${added[*]}}, $how" >&2
    args=("${added[@]}" "$@")
fi
if [ "$nproc" -eq 1 ]; then
    exec "$python" "$trainer" "${args[@]}"
fi
exec "$python" - "$nproc" "$trainer" "${args[@]}" <<'PY'
import logging
import sys

from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.run import get_args_parser, run

logging.disable(logging.ERROR)  # torchrun's banners and per-rank reports; a launcher failure still raises
nproc, trainer, args = sys.argv[1], sys.argv[2], sys.argv[3:]
try:
    run(get_args_parser().parse_args(["--standalone", f"--nproc_per_node={nproc}", trainer, *args]))
except ChildFailedError as e:  # a rank exited non-zero, after printing its one line
    code = e.get_first_failure()[1].exitcode
    sys.exit(code if code > 0 else 128 - code)  # a negative code: the rank died of that signal
except SignalException as e:  # Ctrl-C or SIGTERM reached the launcher too; the ranks stopped and said so
    sys.exit(128 + int(e.sigval))
PY
