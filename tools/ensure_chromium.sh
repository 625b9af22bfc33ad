#!/usr/bin/env bash
# Make sure a Chromium for the browser test (tests/test_browser.py) is present.
#
# Installs Debian's `chromium` package with apt when it is missing, but only when
# running in CI (CI=true) or when asked explicitly (`tools/ensure_chromium.sh --install`
# or ENSURE_CHROMIUM=1). Otherwise it only reports. Idempotent and quiet: prints one
# line, and apt's output only when apt fails.
#
# Playwright's own browser download does not work on the course machines; the test
# drives this system Chromium through the Python `playwright` package instead.
set -euo pipefail

want_install=0
if [[ "${CI:-}" == "true" || "${ENSURE_CHROMIUM:-}" == "1" || "${1:-}" == "--install" ]]; then
    want_install=1
fi

find_chromium() {
    if [[ -n "${CHROMIUM:-}" && -x "${CHROMIUM}" ]]; then
        echo "${CHROMIUM}"
        return 0
    fi
    local c
    for c in /usr/bin/chromium /usr/bin/chromium-browser; do
        if [[ -x "$c" ]]; then
            echo "$c"
            return 0
        fi
    done
    return 1
}

if path="$(find_chromium)"; then
    echo "ensure_chromium: found ${path}"
    exit 0
fi

if [[ "$want_install" != 1 ]]; then
    echo "ensure_chromium: no Chromium found; run 'tools/ensure_chromium.sh --install'" \
         "(apt-get install chromium) or set CHROMIUM=/path/to/chromium" >&2
    exit 0
fi

if ! command -v apt-get >/dev/null 2>&1; then
    echo "ensure_chromium: apt-get not available; install Chromium by hand and set CHROMIUM" >&2
    exit 1
fi

SUDO=""
if [[ "$(id -u)" != 0 ]]; then
    SUDO="sudo"
fi

log="$(mktemp -t ensure_chromium.XXXXXX.log)"
export DEBIAN_FRONTEND=noninteractive
if ! { $SUDO apt-get update -qq && \
       $SUDO apt-get install -y -qq --no-install-recommends chromium fonts-dejavu-core; } \
       >"$log" 2>&1; then
    echo "ensure_chromium: apt-get install chromium failed:" >&2
    tail -n 30 "$log" >&2
    rm -f "$log"
    exit 1
fi
rm -f "$log"

if path="$(find_chromium)"; then
    echo "ensure_chromium: installed ${path} ($("$path" --version 2>/dev/null || echo '?'))"
    exit 0
fi
echo "ensure_chromium: apt-get finished but no chromium binary was found" >&2
exit 1
