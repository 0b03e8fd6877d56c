#!/usr/bin/env bash
# Creates the virtual environment DIR (default .venv) with a Python that current JAX supports.
#
# JAX 0.11 and newer need Python >= 3.12; on Python 3.11 pip resolves jaxgpt's pins to JAX 0.10.2,
# which works but is not what the suite is tested on first. So: the first of python3.12,
# python3.13 (on PATH, or pyenv's installed versions) that runs, else python3 (>= 3.11).
# An existing DIR is kept as it is.
set -euo pipefail
dir=${1:-.venv}
if [[ -x "$dir/bin/python" ]]; then exit 0; fi
pyenv_root=$(pyenv root 2>/dev/null || echo "$HOME/.pyenv")
candidates=()
for minor in 12 13; do
    candidates+=("python3.$minor")
    for p in "$pyenv_root"/versions/3."$minor".*/bin/python3; do [[ -x $p ]] && candidates+=("$p"); done
done
candidates+=(python3)
for py in "${candidates[@]}"; do
    if "$py" -c 'import sys; sys.exit(sys.version_info < (3, 11))' >/dev/null 2>&1; then
        echo "venv: $dir with $("$py" -c 'import sys; print("Python", sys.version.split()[0])') ($py)"
        exec "$py" -m venv "$dir"
    fi
done
echo "error: jaxgpt needs Python >= 3.11 (3.12 or newer for current JAX); none found" >&2
exit 1
