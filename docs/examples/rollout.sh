#!/usr/bin/env bash
# A rollout "engine" in shell (curl + jq): the REST API is language-neutral.
#
#   STALEFLOW_API_URL=http://127.0.0.1:8000 STALEFLOW_TOKEN=sf_... docs/examples/rollout.sh RUN [MAX_SAMPLES]   # RUN: the run's id or name
#
# It registers an instance, then loops: heartbeat (keeps the instance lease, tells the coordinator
# how loaded it is), long-poll for routed work, "generate" a canned response for each sample
# and report it as a finished segment, quoting the attempt and route token the work came with.
# A `pull` command moves it to the new model version (a real engine would load the weights
# from the parameter server first). It stops after MAX_SAMPLES reports (default: never) and
# deregisters on exit, so samples it holds go back to the queue. Docs: docs/api.md.
set -euo pipefail

RUN=${1:?usage: rollout.sh RUN [MAX_SAMPLES]}
MAX_SAMPLES=${2:-0}
API=${STALEFLOW_API_URL:-http://127.0.0.1:8000}
TOKEN=${STALEFLOW_TOKEN:?set STALEFLOW_TOKEN (a rollout token)}
RESPONSE=${RESPONSE:-"[65, 66, 67]"}  # the canned response's token ids

call() {  # METHOD PATH [JSON]: the response body; fails on an HTTP error, printing it
    local out args=(-sS -X "$1" "$API/v1/runs/$RUN$2" -H "Authorization: Bearer $TOKEN" -w '\n%{http_code}')
    if [[ $# -ge 3 ]]; then args+=(-H 'Content-Type: application/json' --data "$3"); fi
    out=$(curl "${args[@]}")
    local code=${out##*$'\n'} body=${out%$'\n'*}
    if [[ $code != 2* ]]; then echo "rollout.sh: $1 $2 -> $code $body" >&2; return 1; fi
    printf '%s' "$body"
}

version=$(call GET "" | jq -r .version)
# capacity: the most requests this instance runs at once and its KV cache in tokens
capacity='{"max_running": 8, "kv_capacity": 4096}'
instance=$(call POST /instances "{\"name\": \"shell-$$\", \"version\": $version, \"lease_seconds\": 30, \"capacity\": $capacity}" | jq -r .instance_id)
echo "registered instance $instance at version $version" >&2
trap 'call DELETE "/instances/$instance" > /dev/null || true' EXIT

reported=0
while [[ $MAX_SAMPLES -eq 0 || $reported -lt $MAX_SAMPLES ]]; do
    call POST "/instances/$instance/heartbeat" \
        "{\"version\": $version, \"snapshot\": {\"throughput\": 100}}" > /dev/null
    polled=$(call POST "/instances/$instance/poll?wait=2")
    # pull: serve the new version from now on (weights would be loaded here)
    target=$(jq -r '[.commands[] | select(.kind == "pull") | .target_version] | max // empty' <<< "$polled")
    if [[ -n $target ]]; then version=$target; fi
    # one finished segment per routed sample, cut to its max_new_tokens, log-probs of -1
    reports=$(jq -c --argjson v "$version" --argjson resp "$RESPONSE" '[.work[] | {
        sample_id, attempt, route_token, version: $v, kind: "finished", finish_reason: "eos",
        tokens: $resp[:.max_new_tokens], logprobs: [$resp[:.max_new_tokens][] | -1.0]}]' <<< "$polled")
    n=$(jq length <<< "$reports")
    if [[ $n -gt 0 ]]; then
        applied=$(call POST "/instances/$instance/segments" "{\"reports\": $reports}" | jq .applied)
        reported=$((reported + applied))
        echo "reported $applied segments (version $version, $reported in all)" >&2
    fi
done
