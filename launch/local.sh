#!/usr/bin/env bash
# launch/local.sh [--elastic] N [CONFIG.yaml] [key=value ...]
#
# One training job of N processes on this machine, each a "host" of simulated CPU devices
# (8/N each unless SPMD3D_LOCAL_DEVICES says otherwise), talking over localhost with gloo:
# the multi-host code path without a cluster. Every line of output is prefixed by [process].
# Each process's host is named local<slot> ($SPMD3D_HOST), as a cluster's nodes are named.
#
#   launch/local.sh 2 mesh.data=2 mesh.stage=2 train.microbatches=2 run.dir=runs/local
#
# If a process fails, the others are stopped (SIGTERM, then SIGKILL after
# SPMD3D_KILL_GRACE_S = 5 s) and this script exits with the first failure's status.
# Ctrl-C asks every process to stop (jax's preemption notice: they save and exit 0).
# PYTHON picks the interpreter (default: the repository's .venv, else python3).
#
# --elastic: a process killed by a signal is a lost host. The others stop by themselves once
# its heartbeat is missed (dist.heartbeat_timeout_s; SIGKILL after SPMD3D_ELASTIC_WAIT_S =
# 120 s), and the job restarts on the hosts left, as many as `python -m spmd3d.elastic` says
# can keep the layout and the global batch (mesh.data shrinks, the microbatches grow), from
# the last checkpoint. It exits 1 with that command's line when too few are left
# (dist.min_processes) or the restarts are spent (dist.max_restarts); 2 for bad input.
set -u
if ((BASH_VERSINFO[0] * 100 + BASH_VERSINFO[1] < 501)); then
  echo "local.sh needs bash >= 5.1 (wait -n -p), this is $BASH_VERSION" >&2; exit 2
fi

usage="usage: launch/local.sh [--elastic] N [CONFIG.yaml] [key=value ...]"
elastic=0
if [[ ${1:-} == --elastic ]]; then elastic=1; shift; fi
n=${1:-}
[[ $n =~ ^[1-9][0-9]*$ ]] || { echo "$usage (N = number of processes, got '${n}')" >&2; exit 2; }
shift

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
py=${PYTHON:-}
if [[ -z $py ]]; then
  if [[ -x $root/.venv/bin/python ]]; then py=$root/.venv/bin/python; else py=python3; fi
fi
devices=${SPMD3D_LOCAL_DEVICES:-$(( n >= 8 ? 1 : 8 / n ))}
grace=${SPMD3D_KILL_GRACE_S:-5}
wait_lost=${SPMD3D_ELASTIC_WAIT_S:-120}
export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1

# Ctrl-C reaches the whole process group: the prefixers must outlive the processes they
# serve, or those die writing to a closed pipe before they can save.
prefix() { trap '' INT TERM; exec sed -u "s/^/[$1] /"; }

signal_all() {
  for p in "${pids[@]}"; do kill -s "$1" "$p" 2>/dev/null; done
}
trap 'echo "local.sh: interrupted: asking all ${#pids[@]} processes to stop" >&2; signal_all TERM; interrupted=1' INT TERM

# One attempt: the slots in `slots` as processes 0.., with `extra` overrides after the user's.
# Sets `status` (the first failure's, or 0) and `lost` (the slots killed by a signal that this
# script did not send).
attempt() {
  local m=${#slots[@]} port i
  port=${SPMD3D_COORDINATOR_PORT:-$("$py" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')}
  pids=()
  for ((i = 0; i < m; i++)); do
    # the user's key=value come last, so they may override the simulated device count
    SPMD3D_HOST=local${slots[$i]} "$py" -m spmd3d.train mesh.simulated_devices="$devices" \
        dist.coordinator="127.0.0.1:$port" dist.num_processes="$m" dist.process_id="$i" \
        "$@" "${extra[@]}" > >(prefix "$i") 2> >(prefix "$i" >&2) &
    pids+=($!)
  done
  status=0 lost=()
  local killer= finished rc who p still running=("${pids[@]}") ours=()
  while ((${#running[@]} > 0)); do
    finished=
    wait -n -p finished "${running[@]}"
    rc=$?
    [[ -n ${finished:-} ]] || continue  # a trapped signal interrupted the wait
    still=()
    for p in "${running[@]}"; do [[ $p == "$finished" ]] || still+=("$p"); done
    running=("${still[@]}")
    ((rc == 0)) && continue
    for i in "${!pids[@]}"; do [[ ${pids[$i]} == "$finished" ]] && who=$i; done
    echo "local.sh: process $who exited with status $rc" >&2
    # killed by a signal: a lost host; but not SIGABRT (134), jax's abort of the processes left
    # when process 0 and its coordination service die, nor this script's own SIGKILL
    if ((elastic && rc > 128 && rc != 134 && ! interrupted)) &&
        [[ ! " ${ours[*]} " =~ " $finished " ]]; then
      lost+=("${slots[$who]}")
    fi
    if ((status == 0)); then
      status=$rc
      if ((${#running[@]} > 0)); then
        if ((elastic)); then  # the others stop by themselves when they miss its heartbeat
          ours=("${running[@]}")
          (sleep "$wait_lost"; for p in "${ours[@]}"; do kill -s KILL "$p" 2>/dev/null; done) &
        else
          echo "local.sh: stopping the other ${#running[@]}" >&2
          signal_all TERM
          (sleep "$grace"; signal_all KILL) &
        fi
        killer=$!
      fi
    fi
  done
  [[ -n $killer ]] && kill "$killer" 2>/dev/null
  wait  # the output prefixers
}

interrupted=0 restart=0 extra=() slots=() pids=()
for ((i = 0; i < n; i++)); do slots+=("$i"); done
while true; do
  attempt "$@"
  ((status == 0 || ! elastic || interrupted || status == 2 || ${#lost[@]} == 0)) && exit $status
  left=()
  for s in "${slots[@]}"; do [[ " ${lost[*]} " =~ " $s " ]] || left+=("$s"); done
  restart=$((restart + 1))
  echo "local.sh: lost ${lost[*]/#/local}; ${#left[@]} hosts left; restart $restart" >&2
  plan=$("$py" -m spmd3d.elastic mesh.simulated_devices="$devices" "$@" \
      --processes="${#left[@]}" --local-devices="$devices" --of="$n" --restart="$restart") || exit 1
  read -r m rest <<< "$plan"
  read -r -a extra <<< "$rest"
  slots=("${left[@]:0:m}")
  echo "local.sh: restarting on ${#slots[@]} processes with $rest" >&2
done
