#!/usr/bin/env bash
# One-shot GPU check for a lent single-GPU machine (no network), most wanted first:
# environment, bench_gpu.py (ResNet-50 model alone, eager, with training's loader beside it),
# the training worker at ResNet-50 224 with loader pytorch and dali for the v1 and v2 recipes
# (issue 52: its steady img/s against the model alone), the model compiled, DALI's pipeline
# alone, the worker on CUDA/NCCL uninterrupted, then stopped and resumed (compared), and the
# preflight. Every step is bounded by `timeout` and by an overall budget (what does not fit is
# skipped, in that order); every log and a summary go to $OUT.
#
#   bash benchmarks/gpu_check.sh                      # on the GPU machine (wheels in .whl/)
#   GPU_CHECK_DEVICE=cpu GPU_CHECK_PYTHON=.venv/bin/python bash benchmarks/gpu_check.sh  # dry run
#
# Variables: OUT (results; default a temp dir), GPU_CHECK_DEVICE (cuda|cpu), GPU_CHECK_PYTHON,
# GPU_CHECK_BUDGET (seconds for everything: no step starts, or runs, past it; default 480 on
# cuda, 1200 on cpu), GPU_CHECK_TRAIN_COMPILE (1|0), GPU_CHECK_MODEL (training model, default
# resnet18), GPU_CHECK_PRECISION (default bf16 on cuda, fp32 on cpu), GPU_CHECK_SKIP (step names),
# GPU_CHECK_DETERMINISTIC=1 (deterministic: true: the resume compared bitwise).
# $OUT gets 3 files (the device returns at most 8): summary.txt, all_logs.txt (every step's log,
# appended as each ends), logs.tar.gz (the logs, bench JSONs, specs, train metrics, preflight).
set -u
cd "$(dirname "$0")/.."
REPO=$PWD
OUT=${OUT:-$(mktemp -d /tmp/gpu-check-out.XXXX)}
mkdir -p "$OUT"
DEVICE=${GPU_CHECK_DEVICE:-cuda}
PY=${GPU_CHECK_PYTHON:-python3}
BUDGET=${GPU_CHECK_BUDGET:-$([ "$DEVICE" = cuda ] && echo 480 || echo 1200)}
SKIP=" ${GPU_CHECK_SKIP:-} "  # step names to skip (dry runs), e.g. "bench_eager bench_compile"
WORK=$(mktemp -d /tmp/gpu-check-work.XXXX)
LOGS=$WORK/logs  # each step's log; appended to $OUT/all_logs.txt as it ends (8 files come back)
mkdir -p "$LOGS"
SUMMARY=$OUT/summary.txt
: >"$OUT/all_logs.txt"
START=$(date +%s)
: >"$SUMMARY"
export PYTHONUNBUFFERED=1

if [ "$DEVICE" = cuda ]; then
    BACKEND=nccl; PRECISION=bf16; TRAIN_COMPILE=${GPU_CHECK_TRAIN_COMPILE:-1}
    CLASSES=10; PER_CLASS=150; SIDE=64; CROP=56; BATCH=16; EPOCHS=2; STOP=100; TWORKERS=4
    BENCH_COMMON="--steps 10 --repeats 3 --images 1024"
    # the loader's windows: 10 s beside the eager model (the worker's runs below are the loader's
    # figure), 2 s beside the compiled one, 30 s for DALI's pipeline alone
    BENCH_EAGER="$BENCH_COMMON --warmup 5 --seconds 10"
    BENCH_COMPILE="$BENCH_COMMON --warmup 3 --compile --seconds 2"
    BENCH_DALI="$BENCH_COMMON --warmup 5 --repeats 2 --seconds 30"
    T_BENCH=120; T_BENCH_COMPILE=200; T_TRAIN=150; T_PREFLIGHT=150
    W_MODEL=resnet50; W_BATCH=256; W_CROP=224; W_SIDE=256; W_IMAGES=12288; W_HOLDOUT=512
    W_EPOCHS=3; W_WARMUP=6; W_WORKERS=8; T_W=120; T_DATA_W=120
else  # CPU dry run: the same code paths at tiny sizes
    BACKEND=gloo; PRECISION=fp32; TRAIN_COMPILE=${GPU_CHECK_TRAIN_COMPILE:-0}
    CLASSES=4; PER_CLASS=12; SIDE=32; CROP=24; BATCH=4; EPOCHS=2; STOP=5; TWORKERS=1
    BENCH_EAGER="--quick --warmup 1"; BENCH_COMPILE="--quick --warmup 1 --compile"
    BENCH_DALI="$BENCH_EAGER --seconds 2"  # a window, as on the GPU: its pass spans epochs
    T_BENCH=120; T_BENCH_COMPILE=300; T_TRAIN=150; T_PREFLIGHT=150
    W_MODEL=resnet18; W_BATCH=4; W_CROP=32; W_SIDE=36; W_IMAGES=96; W_HOLDOUT=8
    W_EPOCHS=2; W_WARMUP=2; W_WORKERS=1; T_W=150; T_DATA_W=60
fi
MODEL=${GPU_CHECK_MODEL:-resnet18}
PRECISION=${GPU_CHECK_PRECISION:-$PRECISION}  # the CPU dry run: fp32 (bf16 is emulated, slow)

# keep FILE: append FILE to $OUT/all_logs.txt under a header
keep() { { echo; echo "######## $(basename "$1")"; cat "$1"; } >>"$OUT/all_logs.txt" 2>&1; }
say() { echo "$*" | tee -a "$SUMMARY"; }
section() { echo; echo "==================== $* ($(($(date +%s) - START)) s elapsed)"; }
# left SECONDS: the budget not yet spent
left() { echo $((BUDGET - ($(date +%s) - START))); }
# run_step NAME LIMIT CMD...: CMD under timeout min(LIMIT, budget left), log $LOGS/NAME.log;
# returns CMD's code (124: timed out; 200: skipped, too little budget left).
run_step() {
    local name=$1 limit=$2 rest code t0
    shift 2
    case "$SKIP" in *" $name "*) say "$name: SKIPPED (GPU_CHECK_SKIP)"; return 200 ;; esac
    rest=$(left)
    [ "$rest" -lt "$limit" ] && limit=$rest
    if [ "$limit" -lt 20 ]; then
        say "$name: SKIPPED (budget: ${rest}s left)"
        return 200
    fi
    echo "\$ $* (timeout ${limit}s)" | tee "$LOGS/$name.log"
    t0=$(date +%s)
    set -o pipefail
    timeout -k 10 "$limit" "$@" 2>&1 | tee -a "$LOGS/$name.log"
    code=$?
    set +o pipefail
    echo "[$name: exit $code after $(($(date +%s) - t0)) s]" | tee -a "$LOGS/$name.log"
    [ "$code" = 124 ] && say "$name: TIMED OUT after ${limit}s"
    keep "$LOGS/$name.log"
    return "$code"
}
# A background sampler of the GPU's memory.used (MiB, every 0.5 s) while a step runs.
gpu_sampler_start() {
    SAMPLER_PID=""
    [ "$DEVICE" = cuda ] || return 0
    nvidia-smi --query-gpu=memory.used,utilization.gpu --format=csv,noheader,nounits -lms 500 \
        >"$WORK/$1.smi" 2>/dev/null &
    SAMPLER_PID=$!
}
gpu_sampler_stop() {  # prints "peak MiB, mean util % over busy samples"
    [ -n "${SAMPLER_PID:-}" ] || { echo "n/a (no GPU)"; return 0; }
    kill "$SAMPLER_PID" 2>/dev/null; wait "$SAMPLER_PID" 2>/dev/null
    awk -F', ' '{ if ($1>m) m=$1; if ($2>0) {u+=$2; n++} }
        END { printf "peak memory.used %d MiB (nvidia-smi, incl. CUDA context), mean util %.0f%% over %d busy samples", m, (n? u/n: 0), n }' \
        "$WORK/$1.smi"
}

say "gpu_check $(date -u '+%Y-%m-%d %H:%M:%S UTC'), device $DEVICE, budget ${BUDGET}s, commit $(git -C "$REPO" rev-parse --short HEAD 2>/dev/null || echo '?')$(git -C "$REPO" diff --quiet 2>/dev/null || echo ' (+ uncommitted changes)')"

section "0. wheels (.whl) -> /tmp/site"
if ls .whl/*.whl >/dev/null 2>&1; then
    if timeout -k 5 120 "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl >"$LOGS/wheels.log" 2>&1; then
        say "wheels: installed $(ls .whl | tr '\n' ' ')"
        export PYTHONPATH=/tmp/site:$REPO/src:$REPO
    else
        say "wheels: install FAILED (see wheels.log); using what $PY has"
        export PYTHONPATH=$REPO/src:$REPO
    fi
    cat "$LOGS/wheels.log"; keep "$LOGS/wheels.log"
else
    say "wheels: none in .whl/"
    export PYTHONPATH=$REPO/src:$REPO
fi

section "1. environment"
run_step env 60 bash -c "nvidia-smi -L; nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv; uname -r; nproc; free -g | head -2
\"$PY\" - <<'EOF'
import importlib, platform, sys
import torch
print('python', platform.python_version(), sys.executable)
print('torch', torch.__version__, 'cuda', torch.version.cuda, 'available', torch.cuda.is_available())
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    print('device', torch.cuda.get_device_name(), f'{p.total_memory / 2**30:.1f} GiB', p.multi_processor_count, 'SMs')
    print('nccl', torch.cuda.nccl.version())
for name in ('torchvision', 'timm', 'numpy', 'pandas', 'simplejpeg', 'yaml', 'tqdm', 'tabulate', 'sklearn', 'scipy', 'PIL', 'tensorboard', 'pynvml', 'jsonschema', 'triton'):
    try:
        m = importlib.import_module(name)
        print(f'{name:12s}', getattr(m, '__version__', '?'), getattr(m, '__file__', ''))
    except Exception as e:
        print(f'{name:12s} MISSING ({type(e).__name__}: {e})')
EOF"
ENV_OK=$?
grep -E "^(python|torch|device|nccl) " "$LOGS/env.log" | tee -a "$SUMMARY"
grep -E '^[a-zA-Z_]+ +MISSING \(' "$LOGS/env.log" | sed 's/^/import: /' | tee -a "$SUMMARY"
CUDA_OK=0
if [ "$DEVICE" = cuda ]; then
    grep -q "available True" "$LOGS/env.log" && CUDA_OK=1
    [ "$CUDA_OK" = 1 ] || say "CUDA NOT AVAILABLE: the GPU steps below are skipped"
fi
JPEG_OK=0
grep -q "^simplejpeg .*MISSING" "$LOGS/env.log" || JPEG_OK=1
[ "$ENV_OK" = 0 ] || say "env step exit $ENV_OK"
gpu_ready() { [ "$DEVICE" = cpu ] || [ "$CUDA_OK" = 1 ]; }

# make_spec KIND RUN_NAME DIR [extra settings JSON [DATA]]: a job spec as
# tests/workflow_helpers.py make_job/run_settings build it (no Snakemake), written to
# DIR/spec.json; DATA (default $WORK) holds split/ and prepared/; a "recipe" in the extra
# settings is its preset's settings, the rest of the extra replacing them
make_spec() {
    timeout -k 5 60 "$PY" - "$1" "$2" "$3" "${4:-"{}"}" "${5:-$WORK}" <<EOF
import json, sys
from pathlib import Path
from imagenet_ddp.jobs.spec import write_spec
from imagenet_ddp.settings.presets import preset
from tests.workflow_helpers import make_job, run_settings

kind, name, folder, data = sys.argv[1], sys.argv[2], Path(sys.argv[3]), Path(sys.argv[5])
extra = json.loads(sys.argv[4])
recipe = preset(extra.pop("recipe")) if "recipe" in extra else {}
settings = {
    "run": name, "model": "$MODEL", "epochs": $EPOCHS, "batch_size": $BATCH, "lr": 0.05,
    "lr_scaling": "none", "crop_size": $CROP, "eval_resize": $SIDE, "workers": $TWORKERS,
    "seed": 0, "device": "$DEVICE", "backend": "$BACKEND", "precision": "$PRECISION",
    "channels_last": True, "compile": bool($TRAIN_COMPILE), "log_interval": 20,
    "throughput_warmup_steps": 5, "warmup_epochs": 0.5,
    "deterministic": bool(${GPU_CHECK_DETERMINISTIC:-0}), **recipe, **extra,
}
folder.mkdir(parents=True, exist_ok=True)
paths = dict(split_dir=data / "split", checkpoint_root=folder / "ckpt", prepared_train=data / "prepared")
if kind == "train":
    job = make_job("train", run_settings(**settings), run_dir=folder / "out", **paths)
else:
    job = make_job("preflight", run_settings(**settings), out=folder / "preflight.json",
                   scratch_dir=str(folder / "scratch"), **paths)
print(write_spec(folder / "spec.json", job))
EOF
}
# train_run NAME DIR [worker args]: one rank under torchrun, as tests/test_resume.py starts it,
# on $TRAIN_DATA (default $WORK/prepared)
train_run() {
    local name=$1 dir=$2
    shift 2
    gpu_sampler_start "$name"
    run_step "$name" "$T_TRAIN" "$PY" -m torch.distributed.run --standalone --nproc-per-node=1 \
        -m imagenet_ddp.training.worker --spec "$dir/spec.json" --train-data "${TRAIN_DATA:-$WORK/prepared}" "$@"
    local code=$?
    say "$name: exit $code; $(gpu_sampler_stop "$name")"
    # torchrun's ChildFailedError after the expected stop (exit 75) is left out
    grep -hiE "diverg|Error:|error\b" "$LOGS/$name.log" | grep -vE "ChildFailedError|errors.html" | head -3 | sed "s/^/$name: /" | tee -a "$SUMMARY"
    return $code
}

section "2a. bench_gpu.py: ResNet-50 synthetic (eager) + training's loader (v1 recipe, 30 s windows)"
# bench_gpu times training's loader after the model in every call: it needs simplejpeg.
if gpu_ready && [ "$JPEG_OK" = 1 ]; then
    run_step bench_eager "$T_BENCH" "$PY" benchmarks/bench_gpu.py $BENCH_EAGER \
        --json "$LOGS/bench_eager.json"
    grep -E "bench_gpu:|img/s|resnet|loader" "$LOGS/bench_eager.log" | head -8 | sed 's/^/bench eager: /' >>"$SUMMARY"
else
    say "bench_eager: SKIPPED (no CUDA or no simplejpeg)"
fi

section "2w. the training worker at $W_MODEL $W_CROP: loader pytorch and dali, v1 and v2 recipes"
# Issue 52's proof: the product's own worker (one rank, torchrun), eager, as bench_eager's model
# alone above; $W_WORKERS loader workers (pytorch: DataLoader workers; dali: its threads and
# draw processes) on realistic JPEGs (bench_gpu.make_prepared, 1,000 classes, short side
# $W_SIDE). Its steady img/s (each epoch past its first $W_WARMUP steps; the median of its
# epochs) against the model alone: the target with dali is >= 0.95.
W_OK=0
if gpu_ready && [ "$JPEG_OK" = 1 ]; then
    run_step data_w "$T_DATA_W" "$PY" - "$WORK/w" "$W_IMAGES" "$W_HOLDOUT" "$W_SIDE" <<'EOF' && W_OK=1
import sys, time
from pathlib import Path
import pandas as pd
sys.path.insert(0, "benchmarks")
from bench_gpu import make_prepared

root, images, holdout, side = Path(sys.argv[1]), *map(int, sys.argv[2:5])
t0 = time.time()
make_prepared(root, images, side)
(root / "split").mkdir(parents=True)
ids = list(range(images))  # labels i % 1000 (make_prepared); the holdout: the last ids
pd.DataFrame({"sample_id": ids[:-holdout]}).to_csv(root / "split/train.csv", index=False)
pd.DataFrame({"sample_id": ids[-holdout:]}).to_csv(root / "split/holdout.csv", index=False)
print(f"data_w: {images - holdout} train / {holdout} holdout realistic JPEGs at short side {side}, {time.time() - t0:.1f} s")
EOF
    grep "^data_w:" "$LOGS/data_w.log" | tee -a "$SUMMARY"
else
    say "data_w: SKIPPED (no CUDA or no simplejpeg)"
fi
W_LOADERS=pytorch
if "$PY" -c "import nvidia.dali" 2>/dev/null; then W_LOADERS="dali pytorch"; else say "worker dali: SKIPPED (no nvidia.dali)"; fi
if [ "$W_OK" = 1 ]; then
    for recipe in torchvision-resnet50-v1 torchvision-resnet50-v2; do
        for loader in $W_LOADERS; do
            name="w_${recipe#torchvision-resnet50-}_$loader"
            extra="{\"recipe\": \"$recipe\", \"model\": \"$W_MODEL\", \"batch_size\": $W_BATCH,
                \"crop_size\": $W_CROP, \"eval_resize\": $W_SIDE, \"eval_crop_size\": $W_CROP,
                \"workers\": $W_WORKERS, \"epochs\": $W_EPOCHS, \"loader\": \"$loader\",
                \"compile\": false, \"throughput_warmup_steps\": $W_WARMUP, \"log_interval\": 10}"
            if make_spec train "$name" "$WORK/$name" "$extra" "$WORK/w" >"$LOGS/spec_$name.log" 2>&1; then
                TRAIN_DATA=$WORK/w/prepared T_TRAIN=$T_W train_run "$name" "$WORK/$name"
                cp "$WORK/$name/out/train_metrics.json" "$LOGS/train_metrics_$name.json" 2>/dev/null
            else
                say "$name: spec FAILED"; cat "$LOGS/spec_$name.log"; keep "$LOGS/spec_$name.log"
            fi
        done
    done
    timeout -k 5 60 "$PY" - "$LOGS" <<'EOF' 2>&1 | tee "$LOGS/worker_compare.log" | tee -a "$SUMMARY"
import json, sys
from pathlib import Path

logs = Path(sys.argv[1])
bench = logs / "bench_eager.json"
alone = json.loads(bench.read_text())["rows"][0]["ours"] if bench.exists() else None
print(f"model alone (bench_eager): {alone:,.0f} img/s" if alone else "model alone: not measured")
for path in sorted(logs.glob("train_metrics_w_*.json")):
    m = json.loads(path.read_text())
    steady, epoch = m.get("steady_images_per_s"), m.get("images_per_s")
    c = m["config"]  # what the run trained with, not its name
    ratio = f"{steady / alone:.2f}x the model alone" if steady and alone else "no ratio"
    print(f"{path.stem[len('train_metrics_'):]} ({c['model']}, {c['recipe']}, loader {c['loader']}, "
          f"crop {c['crop_size']}, batch {c['batch_size']}, workers {c['workers']}, {c['precision']}): "
          f"steady {steady or 0:,.0f} img/s, {ratio}; end to end {epoch or 0:,.0f} img/s "
          "(start-up included; evaluation excluded from both)")
EOF
    keep "$LOGS/worker_compare.log"
fi

section "2b. bench_gpu.py: ResNet-50 synthetic with --compile"
if gpu_ready && [ "$JPEG_OK" = 1 ]; then
    run_step bench_compile "$T_BENCH_COMPILE" "$PY" benchmarks/bench_gpu.py $BENCH_COMPILE \
        --json "$LOGS/bench_compile.json"
    grep -E "bench_gpu:|img/s|resnet|loader" "$LOGS/bench_compile.log" | head -8 | sed 's/^/bench compile: /' >>"$SUMMARY"
else
    say "bench_compile: SKIPPED (no CUDA or no simplejpeg)"
fi

section "2c. bench_gpu.py --loader dali: training's DALI pipeline (v1; v2's TrivialAugmentWide)"
# The same code as the preflight's loader figure of a loader: dali run (DaliLoader, mixed decode).
if gpu_ready && "$PY" -c "import nvidia.dali" 2>/dev/null; then
    for recipe in none torchvision-resnet50-v2; do
        run_step "bench_dali_$recipe" "$T_BENCH" "$PY" benchmarks/bench_gpu.py $BENCH_DALI \
            --loader dali --recipe "$recipe" --json "$LOGS/bench_dali_$recipe.json"
        grep -E "training.s loader" "$LOGS/bench_dali_$recipe.log" | head -1 | sed "s/^/bench dali $recipe: /" >>"$SUMMARY"
    done
else
    say "bench_dali: SKIPPED (no CUDA or no nvidia.dali)"
fi

section "3. training worker: demo data, uninterrupted run, stopped + resumed run"
DATA_OK=1
if [ "$JPEG_OK" = 1 ] && gpu_ready; then
    run_step data 120 "$PY" - "$WORK" "$CLASSES" "$PER_CLASS" "$SIDE" <<'EOF' || DATA_OK=0
import sys, time
from pathlib import Path
from imagenet_ddp.data.archives import build_index
from imagenet_ddp.data.demo import make_demo_dataset
from imagenet_ddp.data.prepare import prepare_split
from imagenet_ddp.data.split import stratified_split
from imagenet_ddp.io import write_csv_atomic

work, classes, per_class, side = Path(sys.argv[1]), *map(int, sys.argv[2:5])
t0 = time.time()
make_demo_dataset(work / "ILSVRC2012", num_classes=classes, train_per_class=per_class,
                  val_per_class=2, image_size=side, seed=0)
cls, train, val = build_index(work / "ILSVRC2012")
prepare_split(work / "ILSVRC2012", train, work / "prepared", which="train", short_side=side,
              num_classes=len(cls), shard_samples=256, quality=90, workers=4, on_corrupt="fail")
part, holdout = stratified_split(train, 0.1, seed=0)
(work / "split").mkdir()
write_csv_atomic(work / "split" / "train.csv", part)
write_csv_atomic(work / "split" / "holdout.csv", holdout)
print(f"demo: {classes} classes x {per_class} at {side} px, {len(part)} train / {len(holdout)} holdout, {time.time() - t0:.1f} s")
EOF
    grep "^demo:" "$LOGS/data.log" | tee -a "$SUMMARY"
else
    DATA_OK=0; say "data: SKIPPED (no CUDA or no simplejpeg)"
fi

TRAIN_OK=0
if [ "$DATA_OK" = 1 ]; then
    say "train settings: $MODEL, batch $BATCH, lr 0.05 (0.5 epoch warm-up), crop $CROP, $EPOCHS epochs, $PRECISION, channels_last, compile $TRAIN_COMPILE, $DEVICE/$BACKEND, workers $TWORKERS, 1 rank"
    make_spec train gpucheck "$WORK/full" '{}' >"$LOGS/spec.log" 2>&1 \
        && make_spec train gpucheck "$WORK/resumed" '{}' >>"$LOGS/spec.log" 2>&1 \
        && cp "$WORK/full/spec.json" "$LOGS/train_spec.json" && TRAIN_OK=1
    keep "$LOGS/spec.log"
    [ "$TRAIN_OK" = 1 ] || { say "spec: FAILED"; cat "$LOGS/spec.log"; }
fi
if [ "$TRAIN_OK" = 1 ]; then
    train_run train_full "$WORK/full" || TRAIN_OK=0
    STOP_CODE=-1
    if [ "$TRAIN_OK" = 1 ]; then
        train_run train_stop "$WORK/resumed" --stop-after-steps "$STOP"
        STOP_CODE=$?
        # the rank exits 75 (stopped, checkpointed); torchrun reports any non-zero exit as 1
        say "train_stop: --stop-after-steps $STOP, exit $STOP_CODE (non-zero expected); $(grep -ho 'interrupted at.*' "$LOGS/train_stop.log" | head -1)"
    fi
    if [ "$STOP_CODE" != 0 ] && grep -q "interrupted at" "$LOGS/train_stop.log" 2>/dev/null; then
        train_run train_resume "$WORK/resumed"
        say "train_resume: $(grep -ho 'resuming from.*' "$LOGS/train_resume.log" | head -1)"
    fi
    section "3b. training results"
    timeout -k 5 60 "$PY" - "$WORK/full/out" "$WORK/resumed/out" <<'EOF' 2>&1 | tee "$LOGS/train_compare.log" | tee -a "$SUMMARY"
import json, sys
from pathlib import Path
import torch
from imagenet_ddp.training.model import read_model_file

def figures(out):
    m = json.loads((out / "train_metrics.json").read_text())
    rows = [f"{out.parent.name}: img/s {m['images_per_s']:.1f}, steady img/s {m['steady_images_per_s']:.1f}"
            f" (global batch {m['global_batch']}: steady steps/s {m['steady_images_per_s'] / m['global_batch']:.2f})"]
    for e in m["epochs"]:
        keep = {k: v for k, v in e.items() if isinstance(v, (int, float)) and any(
            s in k for s in ("epoch", "step", "images_per_s", "loss", "acc", "seconds"))}
        rows.append("  " + ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in keep.items()))
    return rows

def weights(out):
    s = read_model_file(out / "model.pt")
    return {**s["model"], **{f"ema.{k}": v for k, v in (s.get("ema") or {}).items()}}

full, resumed = map(Path, sys.argv[1:3])
for out in (full, resumed):
    if (out / "train_metrics.json").exists():
        print("\n".join(figures(out)))
    else:
        print(f"{out.parent.name}: no train_metrics.json")
if (full / "model.pt").exists() and (resumed / "model.pt").exists():
    a, b = weights(full), weights(resumed)
    same_keys = a.keys() == b.keys()
    diff = {k: (a[k].float() - b[k].float()).abs().max().item() for k in a if k in b and a[k].is_floating_point()}
    bitwise = same_keys and all(torch.equal(a[k], b[k]) for k in a)
    worst = max(diff, key=diff.get) if diff else None
    scale = max(a[k].float().abs().max().item() for k in diff) if diff else 0
    print(f"resume vs uninterrupted: bitwise equal {bitwise}; same keys {same_keys}; "
          f"tensors differing {sum(v > 0 for v in diff.values())}/{len(diff)}; "
          f"max |diff| {diff.get(worst, 0):.3g} at {worst} (largest |value| of those tensors {scale:.3g})")
else:
    print("resume vs uninterrupted: not compared (a model.pt is missing)")
EOF
    keep "$LOGS/train_compare.log"
    for d in full resumed; do
        cp "$WORK/$d/out/train_metrics.json" "$LOGS/train_metrics_$d.json" 2>/dev/null
        cp "$WORK/$d/out/history.csv" "$LOGS/history_$d.csv" 2>/dev/null
    done
else
    say "training: SKIPPED (data or spec failed)"
fi

section "4. preflight (imagenet_ddp.cli preflight, local launcher)"
if [ "$DATA_OK" = 1 ]; then
    CPUS=$(nproc); [ "$CPUS" -gt 16 ] && CPUS=16
    GPUS=$([ "$DEVICE" = cuda ] && echo 1 || echo 0)
    if make_spec preflight gpucheck "$WORK/preflight" \
        "{\"nodes\": 1, \"tasks_per_node\": 1, \"cpus_per_task\": $CPUS, \"gpus_per_node\": $GPUS, \"workers\": $((CPUS - 1))}" \
        >"$LOGS/preflight_spec.log" 2>&1; then
        gpu_sampler_start preflight
        run_step preflight "$T_PREFLIGHT" "$PY" -m imagenet_ddp.cli preflight --job "$WORK/preflight/spec.json"
        code=$?
        say "preflight: exit $code; $(gpu_sampler_stop preflight)"
        [ -f "$LOGS/preflight.log" ] && sed -n '/rank(s) on/,/problems:/p; /passed in/p' "$LOGS/preflight.log" | head -14 | tee -a "$SUMMARY"
        for f in "$WORK"/preflight/preflight*.json; do [ -f "$f" ] && cp "$f" "$LOGS/"; done
    else
        say "preflight: SKIPPED (spec failed)"; cat "$LOGS/preflight_spec.log"; keep "$LOGS/preflight_spec.log"
    fi
else
    say "preflight: SKIPPED (no data)"
fi

section "summary ($OUT/summary.txt)"
say "total $(($(date +%s) - START)) s"
cat "$SUMMARY"
tar -czf "$OUT/logs.tar.gz" -C "$WORK" logs
rm -rf "$WORK"
ls -la "$OUT"
