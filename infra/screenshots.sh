#!/usr/bin/env bash
# Screenshots of a run in a real headless browser (Debian's chromium: apt-get install chromium):
# its HTML report and its flow run in the Prefect UI. Needs `make up` and a finished run.
#   infra/screenshots.sh RUN_NAME [RUN_ROOT] [OUT_DIR]
set -euo pipefail
run=${1:?usage: infra/screenshots.sh RUN_NAME [RUN_ROOT] [OUT_DIR]}
root=${2:-runs}
out=${3:-docs}
prefect_api=${PREFECT_API_URL:-http://127.0.0.1:${RLFLOW_PREFECT_PORT:-4200}/api}
chromium=$(command -v chromium || command -v chromium-browser || true)
[ -n "$chromium" ] || { echo "no chromium: apt-get install chromium" >&2; exit 2; }
report="$(cd "$root/$run" && pwd)/report.html"
[ -f "$report" ] || { echo "no $report: run the flow to the end first" >&2; exit 2; }
flow_run_id=$(.venv/bin/python - "$prefect_api" "$run" <<'PY'
import sys
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterName
from prefect.settings import PREFECT_API_URL, temporary_settings
with temporary_settings(updates={PREFECT_API_URL: sys.argv[1]}), get_client(sync_client=True) as client:
    runs = client.read_flow_runs(flow_run_filter=FlowRunFilter(name=FlowRunFilterName(any_=[sys.argv[2]])))
    done = sorted((r for r in runs if r.state_name == "Completed"), key=lambda r: r.created)
    print(done[-1].id if done else "")
PY
)
[ -n "$flow_run_id" ] || { echo "no completed flow run named $run at $prefect_api" >&2; exit 2; }
profile=$(mktemp -d)
trap 'rm -rf "$profile"' EXIT
# The flags keep Chromium off the network this machine does not have (it retries endlessly otherwise).
shoot() {  # url file width height
  "$chromium" --headless --no-sandbox --disable-gpu --disable-quic --no-first-run --hide-scrollbars \
    --disable-background-networking --disable-component-update --disable-sync --user-data-dir="$profile" \
    --window-size="$3,$4" --virtual-time-budget=15000 --screenshot="$2" "$1" 2>/dev/null
  echo "$2"
}
mkdir -p "$out"
shoot "file://$report" "$out/report.png" 1400 1500
shoot "${prefect_api%/api}/runs/flow-run/$flow_run_id" "$out/prefect-ui.png" 1400 900
# 128 colours: a third of the size, for committing under docs/.
.venv/bin/python -c "
import sys
from PIL import Image
for name in sys.argv[1:]:
    Image.open(name).convert('RGB').quantize(colors=128).save(name, optimize=True)
" "$out/report.png" "$out/prefect-ui.png"
