#!/usr/bin/env bash
# The wheels a bare GPU box lacks for benchmarks/device_check.py, downloaded HERE (this machine has PyPI) into .whl/
# at the repository root (ignored by git; carried to the box as an ignored path, 64 MiB at most in all).
#
#     bash benchmarks/device_wheels.sh          # then run, on the box, the command it prints
#
# The box: Python 3.12, torch (CUDA), transformers, Triton and PEFT; no pydantic, no PyYAML, no DeepSpeed, no
# bitsandbytes, no internet. What the check imports of orbitctl needs none of them, except the plan's per-layer
# figure of the graphed_layer step, which loads the Kimi-K2 profile (orbitctl.profile: pydantic + PyYAML). So the
# wheels are exactly pydantic and its dependencies (pydantic-core, annotated-types, typing-inspection,
# typing-extensions) and PyYAML: cp312 manylinux x86_64 builds, --no-deps, at the versions this checkout's .venv
# runs (pydantic pins pydantic-core exactly, so the two must come as a pair). DeepSpeed and bitsandbytes stay out:
# the device check does not import them. Without the wheels the check still runs; it skips the plan comparison.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
DEST="$ROOT/.whl"
LIMIT_MIB=64
PACKAGES=(pydantic pydantic-core annotated-types typing-inspection typing-extensions pyyaml)

PIP=("$ROOT/.venv/bin/python" -m pip)
[ -x "$ROOT/.venv/bin/python" ] || PIP=(python3 -m pip)

# pin each package to the version the checkout's environment runs (tested with orbitctl; pydantic's exact
# pydantic-core pin is then met), or, without an environment, let pip resolve the set for the box's Python
pins=()
if [ -x "$ROOT/.venv/bin/python" ]; then
    mapfile -t pins < <("$ROOT/.venv/bin/python" - "${PACKAGES[@]}" <<'EOF'
import sys
from importlib.metadata import PackageNotFoundError, version
for name in sys.argv[1:]:
    try:
        print(f"{name}=={version(name)}")
    except PackageNotFoundError:
        print(name)
EOF
)
fi

mkdir -p "$DEST"
find "$DEST" -maxdepth 1 -type f -name '*.whl' -delete
rm -rf "$DEST/site"
TARGET=(--only-binary=:all: --python-version 3.12 --implementation cp --abi cp312
        --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64
        --disable-pip-version-check --quiet -d "$DEST")
if [ ${#pins[@]} -eq ${#PACKAGES[@]} ]; then
    "${PIP[@]}" download "${TARGET[@]}" --no-deps "${pins[@]}"
else
    # no environment to read versions from: pip resolves pydantic's own dependencies for the target
    "${PIP[@]}" download "${TARGET[@]}" pydantic pyyaml
fi

echo "wheels in $DEST:"
total=0
for wheel in "$DEST"/*.whl; do
    size=$(stat -c %s "$wheel")
    total=$((total + size))
    printf '  %8.2f MiB  %s\n' "$(awk -v s="$size" 'BEGIN { print s / 1048576 }')" "$(basename "$wheel")"
done
count=$(find "$DEST" -maxdepth 1 -type f -name '*.whl' | wc -l)
for name in "${PACKAGES[@]}"; do  # every package present (wheel names use underscores, any case)
    stem=$(echo "$name" | tr '-' '_')
    if ! find "$DEST" -maxdepth 1 -iname "${stem}-*.whl" | grep -q .; then
        echo "missing a wheel for $name" >&2
        exit 1
    fi
done
printf 'total: %d wheels, %.2f MiB (limit %d MiB for everything carried)\n' "$count" \
    "$(awk -v s="$total" 'BEGIN { print s / 1048576 }')" "$LIMIT_MIB"
if [ "$total" -gt $((LIMIT_MIB * 1024 * 1024)) ]; then
    echo "the wheels exceed $LIMIT_MIB MiB" >&2
    exit 1
fi

cat <<EOF

On the GPU box (carry the ignored path .whl), from the repository root:

  python3 -m pip install --quiet --no-index --find-links .whl --target .whl/site ${PACKAGES[*]}; python3 benchmarks/device_check.py --out \$OUT/dc

(--target: no write into the box's Python, which may be externally managed; device_check.py puts .whl/site on its
path itself. A failed install only skips the plan comparison of the graphed_layer step.)
EOF
