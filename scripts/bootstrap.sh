# Sourced by scripts/test and scripts/run: make .venv and install pdserve into it (idempotent).
#
# - torch: where the system Python already has torch (GPU machines bring their own), the venv
#   sees it (--system-site-packages); otherwise the CPU build torch==2.13.0 is installed first so
#   that the project's torch range installs nothing more.
# - redis-server: the tests start their own on a free port; Debian's package is installed when
#   the binary is missing and we may use apt-get.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${PDSERVE_VENV:-$ROOT/.venv}"
PYTHON="${PYTHON:-python3}"
EXTRAS="${PDSERVE_EXTRAS:-test}"

if [ ! -x "$VENV/bin/python" ]; then
    if "$PYTHON" -c "import torch" >/dev/null 2>&1; then
        echo "bootstrap: creating $VENV (using the system's torch)"
        "$PYTHON" -m venv --system-site-packages "$VENV"
    else
        echo "bootstrap: creating $VENV"
        "$PYTHON" -m venv "$VENV"
    fi
fi
if ! "$VENV/bin/python" -c "import torch" >/dev/null 2>&1; then
    echo "bootstrap: installing torch==2.13.0 (CPU build)"
    "$VENV/bin/python" -m pip install -q "torch==2.13.0"
fi
STAMP="$VENV/.pdserve-installed-$EXTRAS"
if [ ! -f "$STAMP" ] || [ "$ROOT/pyproject.toml" -nt "$STAMP" ]; then
    echo "bootstrap: installing pdserve[$EXTRAS] (editable)"
    "$VENV/bin/python" -m pip install -q -e "$ROOT[$EXTRAS]"
    touch "$STAMP"
fi
if ! command -v redis-server >/dev/null 2>&1; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
        echo "bootstrap: installing Debian's redis-server"
        DEBIAN_FRONTEND=noninteractive apt-get install -y -q redis-server >/dev/null \
            || { apt-get update -q >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -q redis-server >/dev/null; }
    else
        echo "bootstrap: redis-server not found; install it (e.g. apt-get install redis-server)" >&2
    fi
fi
# The dashboard's browser test drives Debian's Chromium (Playwright never downloads a browser here).
if [ "$EXTRAS" = test ] && ! command -v chromium >/dev/null 2>&1 && [ "$(id -u)" = 0 ] \
        && command -v apt-get >/dev/null 2>&1; then
    echo "bootstrap: installing Debian's chromium for the browser test"
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends chromium >/dev/null \
        || { apt-get update -q >/dev/null \
             && DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends chromium >/dev/null; } \
        || echo "bootstrap: chromium could not be installed; the browser test will be skipped" >&2
fi
export PATH="$VENV/bin:$PATH"
