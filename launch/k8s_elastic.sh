#!/usr/bin/env bash
# Elastic training on Kubernetes (docs/elastic.md):
#   launch/k8s_elastic.sh PODS CONFIG [key=value ...]
#
# A Kubernetes Job's size is fixed in its spec, so going on with fewer hosts is a new Job. This
# supervisor runs where kubectl may create Jobs and read Pods and Nodes (a workstation, or a
# small pod with such a service account). It renders launch/k8s.yaml for PODS pods
# (completions, parallelism, JAX_NUM_PROCESSES, the training arguments), with the Job's own
# retries off, applies it and watches its pods:
#   - every pod succeeded: done, exit 0; a pod exits 2 (bad input): exit 2, nothing restarted;
#   - a pod failed (its node lost: the others stop within dist.heartbeat_timeout_s), or one is
#     still Pending after SPMD3D_PENDING_S (no node can take it): the Job is deleted, the Ready
#     schedulable nodes with SPMD3D_GPUS allocatable GPUs counted (label selector
#     SPMD3D_NODES), `python -m spmd3d.elastic` asked how many of them the layout can use with
#     the same global batch, and the Job applied again at that size. It resumes from the last
#     checkpoint, so /runs must be shared storage. Nodes that are back count at the next
#     restart: the job grows again.
# It stops with spmd3d.elastic's line (exit 1) when too few nodes are left or the restarts
# (dist.max_restarts) are spent. The nodes are assumed to be the job's alone (a selector on a
# dedicated node pool): their allocatable GPUs are counted, not what other pods hold.
#
# Environment: KUBECTL (kubectl), SPMD3D_JOB_SPEC (launch/k8s.yaml), SPMD3D_JOB_NAME (spmd3d,
# the spec's Job), SPMD3D_GPUS (8 a pod), SPMD3D_NODES (all nodes), SPMD3D_POLL_S (10),
# SPMD3D_PENDING_S (300), PYTHON (.venv/bin/python if there is one, else python3).
set -uo pipefail
cd "$(dirname "$0")/.."
kubectl=${KUBECTL:-kubectl}
python=${PYTHON:-python3}
[[ -x .venv/bin/python && -z ${PYTHON:-} ]] && python=.venv/bin/python
spec=${SPMD3D_JOB_SPEC:-launch/k8s.yaml} name=${SPMD3D_JOB_NAME:-spmd3d}
gpus=${SPMD3D_GPUS:-8} poll=${SPMD3D_POLL_S:-10} pending_limit=${SPMD3D_PENDING_S:-300}
full=${1:-}
[[ $full =~ ^[1-9][0-9]*$ ]] || {
  echo "usage: launch/k8s_elastic.sh PODS CONFIG [key=value ...] (PODS = number of pods, got '$full')" >&2
  exit 2
}
shift

render() {  # render PODS ARG...: the Job spec for PODS pods running `spmd3d.train ARG...`
  local pods=$1 args
  shift
  args=$("$python" -c 'import json, sys; print(json.dumps(sys.argv[1:]))' "$@")
  awk -v pods="$pods" -v args="$args" '
    /^  completions:/ { print "  completions: " pods; next }
    /^  parallelism:/ { print "  parallelism: " pods; next }
    /^  backoffLimitPerIndex:/ { print "  backoffLimitPerIndex: 0"; next }
    /^ *args:/ { sub(/args:.*/, "args: " args); print; next }
    procs { sub(/value:.*/, "value: \"" pods "\""); procs = 0 }
    /- name: JAX_NUM_PROCESSES/ { procs = 1 }
    { print }' "$spec"
}

watch_pods() {  # watch_pods PODS -> 0: all succeeded, 2: bad input, 1: lost or unschedulable
  local pods=$1 waited=0 counts ok failed bad pending
  while sleep "$poll"; do
    waited=$((waited + poll))
    counts=$("$kubectl" get pods -l "job-name=$name" -o jsonpath='{range .items[*]}{.status.phase} {.status.containerStatuses[0].state.terminated.exitCode}{"\n"}{end}' |
        awk '$1 == "Succeeded" {ok++} $1 == "Failed" {failed++; if ($2 == 2) bad++}
             $1 == "Pending" {pending++} END {print ok + 0, failed + 0, bad + 0, pending + 0}') ||
        continue
    read -r ok failed bad pending <<< "$counts"
    ((bad)) && return 2
    ((failed)) && return 1
    ((ok == pods)) && return 0
    ((pending && waited >= pending_limit)) && return 1
  done
}

ready_nodes() {  # how many nodes could take a pod now
  "$kubectl" get nodes ${SPMD3D_NODES:+-l "$SPMD3D_NODES"} -o jsonpath='{range .items[*]}{.metadata.name} {.status.conditions[?(@.type=="Ready")].status} {.status.allocatable.nvidia\.com/gpu} {.spec.unschedulable}{"\n"}{end}' |
      awk -v g="$gpus" '$2 == "True" && $3 >= g && $4 != "true" {n++} END {print n + 0}'
}

pods=$full extra=() restart=0
while true; do
  # foreground: returns once the old Job's pods are gone, so two Jobs never write the run
  "$kubectl" delete job "$name" --ignore-not-found --cascade=foreground --wait=true \
      >/dev/null || exit 1
  render "$pods" "$@" "${extra[@]}" | "$kubectl" apply -f - >/dev/null || exit 1
  echo "k8s_elastic.sh: job $name on $pods pods${extra[*]:+ with ${extra[*]}}" >&2
  watch_pods "$pods"
  status=$?
  ((status == 0)) && { echo "k8s_elastic.sh: job $name finished" >&2; exit 0; }
  ((status == 2)) && { echo "k8s_elastic.sh: a pod exited 2 (bad input): stopped" >&2; exit 2; }
  live=$(ready_nodes)
  restart=$((restart + 1))
  echo "k8s_elastic.sh: a pod failed or found no node; $live of $full nodes ready; restart $restart" >&2
  ((live)) || { echo "k8s_elastic.sh: cannot go on: no node is ready" >&2; exit 1; }
  plan=$("$python" -m spmd3d.elastic "$@" --processes="$((live < full ? live : full))" \
      --local-devices="$gpus" --of="$full" --restart="$restart") || exit 1
  read -r pods rest <<< "$plan"
  read -r -a extra <<< "$rest"
done
