#!/usr/bin/env bash
# Checks the asv dashboard end to end: benchmarks two commits of this repository, publishes
# the HTML, checks that a tracked KV metric has results for both commits, and renders the
# page in headless Chromium to a screenshot (look at it).
#
#   benchmarks/check_dashboard.sh [OUT_DIR]     (default OUT_DIR: .asv/dashboard-check)
#
# Each commit's own code is measured: its tree is exported (git archive) with today's asv
# benchmark module and suite files copied in, and imported from there (the benchmark folder's
# parent comes first on asv's path), in the current Python environment. Results go to
# OUT_DIR, never to the project's .asv/. asv's page loads jQuery, flot and Bootstrap from
# CDNs; the check serves the same libraries from npm packages instead, so it needs no
# internet (only the npm registry). Prints SKIP and exits 0 when asv, Chromium or npm is
# absent, so it can run anywhere.
set -euo pipefail
cd "$(dirname "$0")/.."
repo=$(pwd)
here="$repo/benchmarks"
out=$(realpath -m "${1:-.asv/dashboard-check}")
python=${PYTHON:-python3}
metric="asv_bench.KVMetrics.track_kv_waste_pct"

if ! "$python" -c "import asv" 2>/dev/null; then
  echo "SKIP: asv is not installed for $python"; exit 0
fi
chromium=$(command -v chromium || command -v chromium-browser || command -v google-chrome || true)
if [[ -z "$chromium" ]]; then
  echo "SKIP: no Chromium (Debian: apt-get install chromium)"; exit 0
fi
if ! command -v npm >/dev/null; then
  echo "SKIP: npm is needed to serve the dashboard's JavaScript libraries locally"; exit 0
fi
commits=$(git rev-list --max-count=2 HEAD | tac)
if [[ $(wc -w <<<"$commits") -lt 2 ]]; then
  echo "SKIP: the repository has fewer than two commits"; exit 0
fi

rm -rf "$out" && mkdir -p "$out"
server_pid=""
cleanup() { if [[ -n "$server_pid" ]]; then kill "$server_pid" 2>/dev/null || true; fi; }
trap cleanup EXIT

"$python" -m asv machine --yes >/dev/null
for commit in $commits; do
  src="$out/src-${commit:0:8}"
  mkdir -p "$src"
  git archive "$commit" | tar -x -C "$src"
  # Today's benchmark definitions, the commit's code under test.
  cp benchmarks/__init__.py benchmarks/asv_bench.py "$src/benchmarks/"
  cp benchmarks/suites/quick-*.toml "$src/benchmarks/suites/"
  "$python" "$here/dashboard_tools.py" layout "$src"
  (cd "$src" && "$python" -c "import kvbench.engines.factory as m, sys; sys.exit(not m.__file__.startswith('$src'))") \
    || { echo "FAIL: the export of $commit does not import as kvbench"; exit 1; }
  "$python" "$here/dashboard_tools.py" config "$repo" "$src" "$out" > "$out/asv.conf.json"
  "$python" -m asv run --config "$out/asv.conf.json" -E "existing:$python" \
    --set-commit-hash "$commit" --bench KVMetrics --quick --show-stderr
done
"$python" -m asv publish --config "$out/asv.conf.json"
"$python" "$here/dashboard_tools.py" commits "$out/html" "$metric"
"$python" "$here/dashboard_tools.py" vendor "$out/html" "$out/npm"

port=$("$python" -c "import socket; s = socket.socket(); s.bind(('127.0.0.1', 0)); print(s.getsockname()[1])")
"$python" -m http.server "$port" --bind 127.0.0.1 --directory "$out/html" >/dev/null 2>&1 &
server_pid=$!
sleep 1
browse() {
  "$chromium" --headless --no-sandbox --disable-gpu --disable-quic --no-first-run \
    --disable-background-networking --disable-component-update --disable-sync \
    --user-data-dir="$(mktemp -d)" --window-size=1400,900 --virtual-time-budget=20000 \
    "$@" "http://127.0.0.1:$port/#$metric" 2>/dev/null
}
browse --screenshot="$out/dashboard.png"
browse --dump-dom > "$out/dashboard.html"
[[ -s "$out/dashboard.png" ]] || { echo "FAIL: Chromium wrote no screenshot"; exit 1; }
# flot draws the graph on this canvas; asv shows its "swallow" page when scripts fail.
if grep -q "continental origin of swallow" "$out/dashboard.html" \
   || ! grep -q 'class="flot-base"' "$out/dashboard.html"; then
  echo "FAIL: the dashboard did not draw the graph (see $out/dashboard.png)"; exit 1
fi
echo "OK: graph drawn; screenshot $out/dashboard.png"
