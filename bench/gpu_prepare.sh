#!/usr/bin/env bash
# Prepares .gpu/, what bench/gpu_run.sh needs on a lent GPU machine (which reaches nothing outside it), in this
# checkout: the training and benchmark texts in .gpu/data, and in .gpu/whl the wheels of the packages the GPU image
# lacks, for its Python (3.12), at the versions of this checkout's .venv. `.gpu/` is kept out of git through
# .git/info/exclude; the device tool carries it with carry [".gpu"]. Run it once per checkout, before the GPU call:
#
#   bash bench/gpu_prepare.sh            # then, with the device tool: FAMILIES=0 ... bash bench/gpu_run.sh
#
# DATA (or $ADAPTLM_DATA) is the corpora directory (docs/benchmarks.md, "The corpora"); PY the Python whose versions
# are pinned.
set -euo pipefail
cd "$(dirname "$0")/.."
DATA=${DATA:-${ADAPTLM_DATA:-}}
[ -n "$DATA" ] && [ -d "$DATA" ] || {
    echo "gpu_prepare: set DATA or ADAPTLM_DATA to the corpora directory (docs/benchmarks.md, \"The corpora\")" >&2; exit 2; }
PY=${PY:-.venv/bin/python}
PACKAGES="fastapi starlette uvicorn pydantic pydantic_core pydantic-settings python-dotenv annotated-types
          typing-inspection redis"

grep -qx '/.gpu/' .git/info/exclude 2>/dev/null || echo /.gpu/ >> .git/info/exclude
mkdir -p .gpu/data .gpu/whl
cp "$DATA"/gutenberg/*.txt "$DATA"/tinyshakespeare/input.txt .gpu/data/

pins=()
for p in $PACKAGES; do
    version=$("$PY" -c "import importlib.metadata as m, sys; print(m.version(sys.argv[1]))" "$p") || {
        echo "gpu_prepare: $p is not installed in $PY (run make install first)" >&2; exit 2; }
    pins+=("$p==$version")
done
rm -f .gpu/whl/*.whl
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 -d .gpu/whl "${pins[@]}"
echo "gpu_prepare: $(ls .gpu/data | wc -l) texts in .gpu/data, $(ls .gpu/whl | wc -l) wheels in .gpu/whl" \
     "($(du -sh .gpu | cut -f1)): ${pins[*]}"
