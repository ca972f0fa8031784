#!/usr/bin/env bash
# Launch train_gpt.py on every visible GPU; arguments pass through (e.g. ./run.sh --num_steps=500).
# Without a GPU it runs the tiny preset on the bundled sample, on the CPU, to show the pipeline working.
set -euo pipefail
cd "$(dirname "$0")"
gpus=$(python -c "import torch; print(torch.cuda.device_count())")
if [ "$gpus" -eq 0 ]; then
    echo "run.sh: no CUDA GPU visible; running --preset=tiny on the CPU with data/sample/" >&2
    # glibc returns large freed blocks to the OS and page-faults them back every step: keep them.
    export MALLOC_MMAP_THRESHOLD_=${MALLOC_MMAP_THRESHOLD_:-4000000000} MALLOC_TRIM_THRESHOLD_=${MALLOC_TRIM_THRESHOLD_:-4000000000}
    exec torchrun --standalone --nproc_per_node=1 train_gpt.py --preset=tiny --device=cpu "$@"
fi
exec torchrun --standalone --nproc_per_node="$gpus" train_gpt.py "$@"
