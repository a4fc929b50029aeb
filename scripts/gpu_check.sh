#!/usr/bin/env bash
# The GPU paths in one command, on a CUDA machine, in about 20 minutes: the GPU tests, three
# minutes of the Multi30k recipe in bf16 with its throughput, the attention benchmark for
# every backend in bf16 and fp16, the training-step benchmark, long-context decoding, and
# short runs of the long-context LM and MQAR; one markdown report.
#
#   scripts/gpu_check.sh [REPORT]        # default outputs/gpu_check.md
#
# Run it from a checkout with the project's virtualenv active (or PYTHON=/path/to/python).
# Raw Multi30k: $MULTIHEAD_DATA_DIR, else shared/data/multi30k in the checkout, else
# ../shared/data/multi30k beside it. Logs and run files go to outputs/gpu_check/<time>/.
# Exit status: 0 when every section passed, 1 when one failed or there is no CUDA device,
# 2 for bad arguments.
set -uo pipefail

if [ $# -gt 1 ]; then
    echo "usage: scripts/gpu_check.sh [REPORT.md]  (got $# arguments: $*)" >&2
    exit 2
fi
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$repo" || exit 1
report=${1:-outputs/gpu_check.md}
python=${PYTHON:-python}
# This checkout's code and tests, whatever the virtualenv has installed; nothing goes online.
export PYTHONPATH="$repo/src:$repo${PYTHONPATH:+:$PYTHONPATH}"
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 WANDB_MODE=offline

# Three minutes of the recipe: the learning-rate cooldown must fit inside them.
recipe=(experiment=multi30k_en_de trainer=gpu trainer.max_time=00:00:03:00 module.scheduler.cooldown_minutes=1 logger=csv summary.limit=256)

# ---------------------------------------------------------------- what is here
if ! device=$("$python" -c 'import torch; assert torch.cuda.is_available(); print(torch.cuda.get_device_name(0))' 2>/dev/null); then
    torch_version=$("$python" -c 'import torch; print(torch.__version__)' 2>&1 | tail -n 1)
    echo "gpu_check: no CUDA device (torch: $torch_version, python: $python); run it on a machine with an NVIDIA GPU and a CUDA build of torch" >&2
    exit 1
fi
data=${MULTIHEAD_DATA_DIR:-}
if [ -z "$data" ]; then
    for candidate in shared/data/multi30k ../shared/data/multi30k; do
        if [ -f "$candidate/train.en.gz" ]; then data=$candidate; break; fi
    done
fi
if [ -z "$data" ] || [ ! -f "$data/train.en.gz" ]; then
    echo "gpu_check: raw Multi30k not found (MULTIHEAD_DATA_DIR='${MULTIHEAD_DATA_DIR:-}', shared/data/multi30k, ../shared/data/multi30k); expected a directory with train.en.gz" >&2
    exit 1
fi
data=$(cd "$data" && pwd)
export MULTIHEAD_DATA_DIR=$data  # the tests look here too

work=outputs/gpu_check/$(date +%Y-%m-%d_%H-%M-%S)
mkdir -p "$work" "$(dirname "$report")"
body=$work/sections.md
: > "$body"
rows=()
failed=0

# section TITLE LIMIT_S COMMAND...: run COMMAND (killed after LIMIT_S seconds), keep its output
# in the report, and record pass or fail.
section() {
    local title=$1 limit=$2
    shift 2
    local n=$((${#rows[@]} + 1))
    local log=$work/section$n.log start=$SECONDS rc verdict
    echo "gpu_check: [$n] $title (at most $limit s)" >&2
    timeout "$limit" "$@" > "$log" 2>&1
    rc=$?
    verdict=PASS
    if [ $rc -ne 0 ]; then
        verdict="FAIL (exit $rc)"
        [ $rc -eq 124 ] && verdict="FAIL (stopped after $limit s)"
        failed=1
    fi
    rows+=("| $n | $title | $verdict | $((SECONDS - start)) |")
    {
        echo "## $n. $title"
        echo
        echo "$verdict in $((SECONDS - start)) s. Command:"
        echo
        echo '```bash'
        printf '%q ' "$@"
        echo
        echo '```'
        echo
        echo '```text'
        tail -n 200 "$log"
        echo '```'
        echo
    } >> "$body"
    echo "gpu_check: [$n] $verdict" >&2
}

# The recipe run's figures, from its summary.json and the hyperparameters Lightning logged.
cat > "$work/recipe_summary.py" <<'EOF'
import json, sys
from pathlib import Path

import torch
import yaml

run = Path(sys.argv[1])
summary = json.loads((run / "summary.json").read_text())
precision = yaml.safe_load((run / "csv" / "hparams.yaml").read_text())["precision"]
expected = "bf16-mixed" if torch.cuda.is_bf16_supported(including_emulation=False) else "16-mixed"
print(f"precision: {precision} (auto on this GPU should be {expected})")
for key in (
    "perf/train_tgt_tokens_per_s",
    "perf/train_tokens_per_s",
    "perf/peak_memory_mb",
    "decode/greedy_sentences_per_s",
    "decode/beam5_sentences_per_s",
    "val/bleu",
    "test/bleu",
    "test/ckpt",
):
    print(f"{key}: {summary.get(key, 'MISSING')}")
missing = [k for k in ("perf/train_tgt_tokens_per_s", "test/bleu") if k not in summary]
if precision != expected or missing:
    sys.exit(f"wrong precision or missing figures: {precision}, {missing}")
EOF

# ---------------------------------------------------------------- the checks
section "GPU tests (pytest -m gpu)" 240 \
    "$python" -m pytest -q -rs -m gpu tests
section "Trainer presets on this GPU (gpu, ddp, fsdp)" 60 \
    "$python" -m pytest -q -rs tests/training/test_configs.py -k "trainer_options or gpu_variant"
section "Three minutes of the Multi30k recipe (precision auto)" 330 \
    "$python" scripts/train.py "${recipe[@]}" "data.local_dir=$data" \
    "paths.cache_dir=$work/cache" "hydra.run.dir=$work/recipe"
section "Recipe throughput and scores (summary.json)" 30 \
    "$python" "$work/recipe_summary.py" "$work/recipe"
for dtype in bf16 fp16; do
    section "Attention benchmark, every backend, $dtype" 120 \
        "$python" scripts/benchmark_attention.py --device cuda --dtype "$dtype" \
        --csv "$work/attention_$dtype.csv"
done
# The Hydra overrides come first: --precisions takes every word after it.
section "Training-step benchmark (32-true, bf16-mixed, 16-mixed)" 90 \
    "$python" scripts/benchmark_training.py experiment=multi30k_en_de \
    "data.local_dir=$data" "paths.cache_dir=$work/cache" \
    --device cuda --precisions 32-true bf16-mixed 16-mixed

# Long-context decoding (issue 64's benchmark) on CUDA in bf16: the designs at 4k and 16k,
# batches 1 and 8, HF's sdpa on StaticCache/DynamicCache beside ours, with the roofline.
section "Long-context decoding, bf16 (MHA, GQA, MQA, MLA)" 300 \
    "$python" scripts/benchmark_long_context.py --device cuda --dtypes bf16 \
    --settings 4096x1 4096x8 16384x1 16384x8 --steps 5 --rounds 2 --prefill 1024 \
    --json "$work/long_context.json"

# The long-context comparison's experiments, short, in the GPU's mixed precision: the LM on
# the Python corpus (context 2,048) and the recall probe. The corpus is built by pip download
# on first use: on a GPU machine that reaches no registry, carry outputs/cache (where a run on
# this checkout built it) with the checkout.
section "Decoder-only LM at long context, 100 steps (precision auto)" 300 \
    "$python" scripts/train.py experiment=lm_long trainer=gpu trainer.precision=auto \
    trainer.max_steps=100 trainer.val_check_interval=50 logger=csv \
    "hydra.run.dir=$work/lm_long"
section "MQAR, 200 steps (precision auto)" 180 \
    "$python" scripts/train.py experiment=mqar trainer=gpu trainer.precision=auto \
    trainer.max_steps=200 trainer.val_check_interval=100 logger=csv \
    "hydra.run.dir=$work/mqar"

# ---------------------------------------------------------------- the report
{
    echo "# GPU check"
    echo
    echo "- date: $(date -u '+%Y-%m-%d %H:%M UTC'), commit $(git rev-parse --short HEAD 2>/dev/null || echo unknown)"
    echo "- device: $device"
    smi=$(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null | paste -sd ';' -)
    echo "- nvidia-smi: ${smi:-unavailable}"
    echo "- $("$python" -c 'import lightning, torch; print(f"torch {torch.__version__} (CUDA {torch.version.cuda}), lightning {lightning.__version__}")')"
    echo "- data: $data; logs and runs: $work"
    echo
    echo "| # | section | result | seconds |"
    echo "|---|---|---|---|"
    printf '%s\n' "${rows[@]}"
    echo
    cat "$body"
} > "$report"
echo "gpu_check: report written to $report" >&2
if [ $failed -ne 0 ]; then
    echo "gpu_check: some sections failed (see $report)" >&2
    exit 1
fi
