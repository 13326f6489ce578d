#!/usr/bin/env bash
# The one-call GPU check: install the wheelhouse offline, run the whole pipeline on
# config/presets/gpu-check-h200.yaml (NVML detection, the plan for one H200, tokenizer and
# data, DeepSpeed configs, a ~1B Llama pretrained in bf16, consolidation with verification,
# GRPO with generation, consolidation), and write $OUT/report.json: each step's and stage's
# wall time, measured tokens/s, MFU and peak memory next to plan.json's predictions, the
# consolidated models' verification and DeepSpeed's op build time. tools/gpu/README.md says
# how to call it on the GPU machine.
#
#   tools/gpu/check.sh                  # on the GPU machine: one H200; the report goes to $OUT if set
#   tools/gpu/check.sh --simulate-cpu   # here: the same flow in a Python 3.12 venv holding
#                                       # the GPU image's versions, on two CPU ranks
#   ... --resume                        # keep the run folder: Snakemake redoes only the
#                                       # stages that did not finish (a second try, warm)
#
# Every step has a time limit (coreutils timeout, which ends the step's whole process
# group); the GPU run as a whole is held to CHECK_BUDGET_S (default 450 s) so that it ends
# inside 8 minutes whatever hangs. Exit status: 0 if every step passed and both models
# were consolidated and verified.
set -uo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
repo=$(cd "$here/../.." && pwd)
cd "$repo" || exit 1
mode=gpu resume=0
for arg in "$@"; do
  case "$arg" in
    --simulate-cpu) mode=simulate-cpu ;;
    --resume) resume=1 ;;
    *) echo "check.sh: unknown argument $arg (expected --simulate-cpu, --resume)" >&2; exit 2 ;;
  esac
done

if [[ $mode == gpu ]]; then
  preset=config/presets/gpu-check-h200.yaml run=results/gpu-check-h200
  python=${CHECK_PYTHON:-python3}
  site=/tmp/stagetrain-site
  out=${OUT:-$repo/results/gpu-check-h200-out}
  budget=${CHECK_BUDGET_S:-450}  # 7.5 minutes
else
  preset=config/presets/gpu-check-cpu.yaml run=results/gpu-check-cpu
  cache=${CHECK_CACHE:-$repo/.gpukit}
  site=$cache/site
  out=${OUT:-$repo/results/gpu-check-cpu-out}
  budget=${CHECK_BUDGET_S:-3600}
fi
mkdir -p "$out"
: >"$out/steps.tsv"
exec > >(tee "$out/check.log") 2>&1
began=$(date +%s)

# step NAME LIMIT_S COMMAND...: run it under a limit cut to what the budget has left
# (keeping 30 s for the report), record name, exit status, seconds and limit.
step() {
  local name=$1 limit=$2 left rc t0 ms
  shift 2
  left=$((budget - 30 - ($(date +%s) - began)))
  ((left < limit)) && limit=$left
  if ((limit < 5)); then
    echo "== $name: skipped, the ${budget} s budget is spent"
    printf '%s\t%s\t%s\t%s\n' "$name" 124 0 0 >>"$out/steps.tsv"
    return 124
  fi
  echo "== $name (limit ${limit} s): $*"
  t0=$(date +%s%N)
  timeout --kill-after=10 "$limit" "$@"
  rc=$?
  ms=$((($(date +%s%N) - t0) / 1000000))
  printf '%s\t%s\t%d.%03d\t%s\n' "$name" "$rc" $((ms / 1000)) $((ms % 1000)) "$limit" >>"$out/steps.tsv"
  echo "== $name: exit $rc"
  return $rc
}

if [[ ! -d .whl ]] || ! ls .whl/*.whl >/dev/null 2>&1; then
  echo "check.sh: no wheels in .whl/; run tools/gpu/wheelhouse.sh first" >&2
  exit 1
fi

if [[ $mode == simulate-cpu ]]; then
  # A venv that stands in for the GPU image: its pinned versions, from PyPI, built once and
  # rebuilt when tools/gpu/image.txt changes. Everything after it comes from .whl/ alone.
  venv=$cache/venv-sim
  stamp=$(sha256sum tools/gpu/image.txt | cut -c1-16)
  if [[ ! -f $venv/.image-$stamp ]]; then
    rm -rf "$venv"
    step image_venv 1800 bash -c "${CHECK_PYTHON312:-python3.12} -m venv '$venv' && \
      '$venv/bin/pip' install -q -r <(grep -v '^#' tools/gpu/image.txt | grep .) && touch '$venv/.image-$stamp'" || exit 1
  fi
  python=$venv/bin/python
fi

rm -rf "$site" "$repo/.snakemake/locks"
# DeepSpeed's JIT-built ops (the CPU shared-memory op; any CUDA op) in a folder of the check's
# own, kept between simulations. A build killed by a time limit leaves its lock file, which
# would make the next build wait forever: no other process uses this folder, so drop them.
if [[ $mode == gpu ]]; then
  export TORCH_EXTENSIONS_DIR=/tmp/stagetrain-torch-extensions
else
  export TORCH_EXTENSIONS_DIR=$cache/torch_extensions
fi
mkdir -p "$TORCH_EXTENSIONS_DIR" && find "$TORCH_EXTENSIONS_DIR" -name lock -type f -delete
((resume)) || rm -rf "$run"
# pip_resolve: pip, pointed at the wheelhouse alone, finds everything the carried packages
# require among the wheels and the image's packages (nothing fetched, nothing installed).
# Fatal here (the image's stand-in must be complete); there only recorded, as the run may
# still work with what the image has.
step pip_resolve 120 "$python" -m pip install -q --dry-run --no-index --find-links .whl \
  -r tools/gpu/requirements.txt || [[ $mode == gpu ]] || exit 1
step install 180 "$python" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
  --upgrade --target "$site" .whl/*.whl || exit 1
export PYTHONPATH=$repo/src:$site PATH=$site/bin:$PATH PYTHONUNBUFFERED=1
step pip_check 60 "$python" -m pip check  # recorded, not fatal: a mismatch the run survives is news

step versions 120 "$python" - "$out/versions.json" <<'EOF'
import json, platform, subprocess, sys, time
from importlib.metadata import version
t0 = time.monotonic()
import torch, deepspeed  # noqa: E401  (import time is part of what is measured)
names = ("torch", "deepspeed", "transformers", "huggingface_hub", "tokenizers", "safetensors",
         "accelerate", "snakemake", "jsonschema", "nvidia-ml-py", "numpy", "tensorboard")
found = {}
for name in names:
    try:
        found[name] = version(name)
    except Exception as err:  # noqa: BLE001  recorded: a missing package is a finding
        found[name] = f"missing ({type(err).__name__})"
info = {"python": platform.python_version(), "packages": found, "import_torch_deepspeed_s": round(time.monotonic() - t0, 1),
        "cuda": torch.version.cuda, "cuda_available": torch.cuda.is_available(),
        "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "stagetrain": __import__("stagetrain").__file__}
try:
    info["nvidia_smi"] = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version,clocks.max.sm",
        "--format=csv,noheader"], capture_output=True, text=True, timeout=30).stdout.strip()
except (OSError, subprocess.SubprocessError) as err:
    info["nvidia_smi"] = f"unavailable ({type(err).__name__})"
json.dump(info, open(sys.argv[1], "w"), indent=1)
print(json.dumps(info))
EOF
step ds_report 60 "$python" -m deepspeed.env_report

if [[ $mode == simulate-cpu ]]; then
  # The hub client on the image's huggingface_hub (1.x: httpx, where 2.x has httpx2) against
  # the tests' local hub server; the GPU run itself reads nothing from a hub. pytest is not
  # in the image: it comes from PyPI into the cache, beside the venv.
  tests=$cache/test-site
  # pyarrow and zstandard too: dependencies the wheelhouse leaves out (pyarrow is 40 MB; both
  # are imported only to read a parquet or .zst file, which the GPU run does not), and the
  # tests' data-file helper writes both.
  [[ -d $tests/pytest && -d $tests/pyarrow && -d $tests/zstandard ]] ||
    "$python" -m pip install -q --no-deps --target "$tests" \
      pytest==9.2.0 pluggy==1.7.0 iniconfig==2.3.1 pyarrow==26.0.1 zstandard==0.25.0
  PYTHONPATH=$PYTHONPATH:$tests step hub_tests 300 "$python" -m pytest -q -x -p no:cacheprovider -o addopts= \
    tests/test_table.py tests/test_corpus.py -k hub
fi

snakemake=("$python" -m snakemake all --cores all --configfile "$preset")  # target first: --configfile takes several
pipeline_limit=360
[[ $mode == simulate-cpu ]] && pipeline_limit=1500
step pipeline "$pipeline_limit" "${snakemake[@]}"

# GRPO's step under ZeRO-0 and ZeRO-3 on the run's own job spec (benchmarks/grpo_step.py):
# each phase's seconds and the bare loop beside it. Under ZeRO-3 a rollout gathers the policy
# once, not once per decoded token; this is where that is measured on a GPU.
for zero in 0 3; do
  step "grpo_step_zero$zero" 120 bash -c "'$python' -m benchmarks.grpo_step --spec '$run/checkpoints/grpo/job.json' \
    --steps 3 --warmup 1 --zero $zero >'$out/grpo_step_zero$zero.txt'"
done

# The pipeline's AdamW is torch's (torch_adam), so on GPUs it JIT-builds no op; time one build
# (DeepSpeed's fused Adam, with the image's nvcc and ninja) for when that changes. Last, as
# the check can best do without it. Not in the simulation: the CPU variant of that op takes
# two cores three minutes and more (run there once by hand, 2026-11-30: 185 s).
[[ $mode == gpu ]] && step op_build 150 "$python" - "$out/op_build.json" <<'EOF'
import json, os, sys, time
import torch
from deepspeed.accelerator import get_accelerator
# DeepSpeed 0.19.8 cannot sort an arch list with suffixed entries ("9.0a": int("0a") fails,
# seen on the H200 image, 2026-12-04): build for the device's own capability instead.
image_arch = os.environ.get("TORCH_CUDA_ARCH_LIST")
os.environ["TORCH_CUDA_ARCH_LIST"] = "%d.%d" % torch.cuda.get_device_capability()
builder = get_accelerator().create_op_builder("FusedAdamBuilder")
t0 = time.monotonic()
builder.load(verbose=False)
result = {"op": builder.name, "accelerator": get_accelerator()._name, "build_and_load_s": round(time.monotonic() - t0, 1),
          "arch_list": os.environ["TORCH_CUDA_ARCH_LIST"], "image_arch_list": image_arch}
json.dump(result, open(sys.argv[1], "w"))
print(result)
EOF

# Logs and small artifacts, in one archive (a handful of files to copy off the GPU machine).
budget=$((budget + 30))  # the 30 s kept for the report are now the report's
tar -czf "$out/artifacts.tar.gz" --exclude='*.bin' --exclude='*.safetensors' --exclude='*.pt' \
  --exclude='tokenizer' --exclude='checkpoints' --exclude='tensorboard' "$run" 2>/dev/null
for log in pretrain grpo; do
  [[ -f $run/logs/$log.log ]] && cp "$run/logs/$log.log" "$out/$log.log"
done
step report 30 "$python" tools/gpu/report.py --run "$run" --check-dir "$out" --mode "$mode" \
  --out "$out/report.json"
status=$?
echo "check.sh: $mode, $(($(date +%s) - began)) s in all; report: $out/report.json"
exit $status
