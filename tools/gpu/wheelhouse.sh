#!/usr/bin/env bash
# Fill .whl/ with every wheel the GPU check needs beyond the GPU machine's image, for
# CPython 3.12 on manylinux x86_64 (that machine has no network: packages reach it only as
# wheels carried in the working tree). Run here, before a GPU session:
#
#   tools/gpu/wheelhouse.sh [DEST]          # DEST defaults to .whl/ (ignored by git)
#
# The list is tools/gpu/requirements.txt (exact pins). Wheels come from the index for the
# target platform; lines marked "build" have none and are built here with `pip wheel`
# (DeepSpeed needs torch importable while building: PYTHON names an interpreter that has
# it, default .venv/bin/python, else python3). Fails if a built wheel is not pure Python,
# if a name appears twice, if a wheel duplicates a package of the image (tools/gpu/image.txt)
# without an "override" mark, or if the total passes 60 MiB (everything that travels must
# stay under 64 MiB).
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
repo=$(cd "$here/../.." && pwd)
dest=${1:-$repo/.whl}
limit_mib=60
python=${PYTHON:-}
if [[ -z $python ]]; then
  if [[ -x $repo/.venv/bin/python ]]; then python=$repo/.venv/bin/python; else python=python3; fi
fi
if ! "$python" -c "import torch" 2>/dev/null; then
  echo "wheelhouse: $python cannot import torch (needed to build deepspeed); set PYTHON" >&2
  exit 1
fi

platforms=()
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_24_x86_64 \
  manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux_2_12_x86_64 manylinux2010_x86_64 \
  manylinux_2_5_x86_64 manylinux1_x86_64; do
  platforms+=(--platform "$p")
done

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
pins=$work/pins.txt builds=$work/builds.txt
grep -v '^\s*#' "$here/requirements.txt" | grep -v 'build' | sed 's/#.*//; s/[[:space:]]//g' | grep . >"$pins"
grep -v '^\s*#' "$here/requirements.txt" | grep 'build' | sed 's/#.*//; s/[[:space:]]//g' >"$builds"

mkdir -p "$work/whl"
"$python" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
  --implementation cp --abi cp312 --abi abi3 --abi none "${platforms[@]}" \
  -d "$work/whl" -r "$pins"
# Pure-Python packages published only as source: build them here, without isolation, so
# that DeepSpeed's setup.py sees torch. DS_BUILD_OPS=0: ops compile there, at first use.
DS_BUILD_OPS=0 "$python" -m pip wheel -q --no-deps --no-build-isolation -w "$work/whl" -r "$builds"

"$python" - "$work/whl" "$here/image.txt" "$here/requirements.txt" <<'EOF'
"""Check the wheels: one version per name, none of the image's packages unless marked
"override", all installable on CPython 3.12 x86_64 Linux (a built wheel must be pure
Python: py3-none-any)."""
import re
import sys
from pathlib import Path

folder, image, requirements = (Path(a) for a in sys.argv[1:4])


def norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def names(path: Path, marked: str = "") -> set[str]:
    return {
        norm(re.split(r"[=<>\s]", line)[0])
        for line in path.read_text().splitlines()
        if line.strip() and not line.startswith("#") and marked in line
    }


provided = names(image) - names(requirements, "override")
seen: dict[str, str] = {}
bad = []
for wheel in sorted(folder.glob("*.whl")):
    name, version, *_, python, abi, platform = wheel.stem.split("-")
    key = norm(name)
    if key in seen:
        bad.append(f"{key}: two versions ({seen[key]}, {version})")
    seen[key] = version
    if key in provided:
        bad.append(f"{key}: the image has it (tools/gpu/image.txt); drop it from requirements.txt")
    pure = abi == "none" and platform == "any" and "py3" in python
    native = ("cp312" in python or abi == "abi3" or python.startswith("py3")) and all(
        "manylinux" in p and p.endswith("x86_64") for p in platform.split(".")
    )
    if not (pure or native):
        bad.append(f"{wheel.name}: not installable on CPython 3.12 x86_64 Linux")
if bad:
    sys.exit("wheelhouse: " + "; ".join(bad))
EOF

rm -rf "$dest"
mkdir -p "$dest"
mv "$work"/whl/*.whl "$dest"/
bytes=$(du -cb "$dest"/*.whl | tail -1 | cut -f1)
count=$(ls "$dest"/*.whl | wc -l)
mib=$(awk -v b="$bytes" 'BEGIN { printf "%.1f", b / 1048576 }')
echo "wheelhouse: $count wheels, $mib MiB in $dest"
if ((bytes > limit_mib * 1048576)); then
  echo "wheelhouse: $mib MiB is over the $limit_mib MiB limit (the travelling tree holds 64 MiB)" >&2
  exit 1
fi
