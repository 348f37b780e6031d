#!/usr/bin/env bash
# The official Python SDKs through the proxy: a venv under target/, pinned anthropic and
# openai from PyPI, the proxy started in front of the mock (--demo), and short programs that
# use the SDKs as a user would. Fails loudly when python3, venv or pip is missing and CI is
# set; otherwise says so and skips.
set -euo pipefail
cd "$(dirname "$0")/../.."

here=proxy/sdk-tests
target="${CARGO_TARGET_DIR:-target}"
venv="$target/sdk-venv"

need() {
    if [ -n "${CI:-}" ]; then
        echo "sdk-tests: $1 is required in CI" >&2
        exit 1
    fi
    echo "sdk-tests: skipped, $1 is not available" >&2
    exit 0
}

command -v python3 >/dev/null || need python3
python3 -c 'import venv, ensurepip' 2>/dev/null || need "python3's venv and ensurepip (apt-get install python3-venv)"

if [ ! -x "$venv/bin/python" ] || ! cmp -s "$here/requirements.txt" "$venv/requirements.txt"; then
    rm -rf "$venv"
    python3 -m venv "$venv" || need "a working python3 -m venv"
    "$venv/bin/python" -m pip install --quiet --disable-pip-version-check -r "$here/requirements.txt" \
        || { echo "sdk-tests: pip install failed" >&2; exit 1; }
    cp "$here/requirements.txt" "$venv/requirements.txt"
fi

cargo build --quiet -p tower-llm-retry-proxy --bin llm-retry-proxy
log="$(mktemp)"
"$target/debug/llm-retry-proxy" --demo --listen 127.0.0.1:0 >"$log" 2>"$log.err" &
pid=$!
trap 'kill "$pid" 2>/dev/null || true; wait "$pid" 2>/dev/null || true; rm -f "$log" "$log.err"' EXIT

for _ in $(seq 100); do
    grep -q '^mock: ' "$log" && break
    kill -0 "$pid" 2>/dev/null || { cat "$log.err" >&2; echo "sdk-tests: the proxy did not start" >&2; exit 1; }
    sleep 0.1
done
PROXY_URL="$(sed -n 's/^llm-retry-proxy (demo) on \(http:[^,]*\),.*/\1/p' "$log")"
MOCK_URL="$(sed -n 's/^mock: //p' "$log")"
[ -n "$PROXY_URL" ] && [ -n "$MOCK_URL" ] || { cat "$log" >&2; echo "sdk-tests: no address printed" >&2; exit 1; }
echo "sdk-tests: proxy $PROXY_URL, mock $MOCK_URL"

status=0
PROXY_URL="$PROXY_URL" MOCK_URL="$MOCK_URL" "$venv/bin/python" "$here/test_sdks.py" || status=$?
if [ "$status" -ne 0 ]; then
    echo "--- proxy log" >&2
    tail -n 50 "$log.err" >&2
fi
exit "$status"
