#!/usr/bin/env bash
# launch/local.sh N [CONFIG.yaml] [key=value ...]
#
# One training job of N processes on this machine, each a "host" of simulated CPU devices
# (8/N each unless SPMD3D_LOCAL_DEVICES says otherwise), talking over localhost with gloo:
# the multi-host code path without a cluster. Every line of output is prefixed by [process].
#
#   launch/local.sh 2 mesh.data=2 mesh.stage=2 train.microbatches=2 run.dir=runs/local
#
# If a process fails, the others are stopped (SIGTERM, then SIGKILL after
# SPMD3D_KILL_GRACE_S = 5 s) and this script exits with the first failure's status.
# Ctrl-C asks every process to stop (jax's preemption notice: they save and exit 0).
# PYTHON picks the interpreter (default: the repository's .venv, else python3).
set -u
if ((BASH_VERSINFO[0] * 100 + BASH_VERSINFO[1] < 501)); then
  echo "local.sh needs bash >= 5.1 (wait -n -p), this is $BASH_VERSION" >&2; exit 2
fi

usage="usage: launch/local.sh N [CONFIG.yaml] [key=value ...]"
n=${1:-}
[[ $n =~ ^[1-9][0-9]*$ ]] || { echo "$usage (N = number of processes, got '${n}')" >&2; exit 2; }
shift

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
py=${PYTHON:-}
if [[ -z $py ]]; then
  if [[ -x $root/.venv/bin/python ]]; then py=$root/.venv/bin/python; else py=python3; fi
fi
devices=${SPMD3D_LOCAL_DEVICES:-$(( n >= 8 ? 1 : 8 / n ))}
port=${SPMD3D_COORDINATOR_PORT:-$("$py" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')}
grace=${SPMD3D_KILL_GRACE_S:-5}
export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1

# Ctrl-C reaches the whole process group: the prefixers must outlive the processes they
# serve, or those die writing to a closed pipe before they can save.
prefix() { trap '' INT TERM; exec sed -u "s/^/[$1] /"; }

pids=()
for ((i = 0; i < n; i++)); do
  # the user's key=value come last, so they may override the simulated device count
  "$py" -m spmd3d.train mesh.simulated_devices="$devices" dist.coordinator="127.0.0.1:$port" \
      dist.num_processes="$n" dist.process_id="$i" "$@" \
      > >(prefix "$i") 2> >(prefix "$i" >&2) &
  pids+=($!)
done

signal_all() {
  for p in "${pids[@]}"; do kill -s "$1" "$p" 2>/dev/null; done
}
trap 'echo "local.sh: interrupted: asking all $n processes to stop" >&2; signal_all TERM' INT TERM

status=0 killer=
running=("${pids[@]}")
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
  if ((status == 0)); then
    status=$rc
    if ((${#running[@]} > 0)); then
      echo "local.sh: stopping the other ${#running[@]}" >&2
      signal_all TERM
      (sleep "$grace"; signal_all KILL) &
      killer=$!
    fi
  fi
done
[[ -n $killer ]] && kill "$killer" 2>/dev/null
wait  # the output prefixers
exit $status
