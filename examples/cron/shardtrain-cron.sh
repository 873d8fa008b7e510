#!/usr/bin/env bash
# Runs one shardtrain command from cron: one run at a time per job name, one log file per run,
# and the command's own exit status for cron (and whatever watches it) to see.
#
#   shardtrain-cron.sh [--name NAME] [--log-dir DIR] [--lock FILE] -- COMMAND [ARG ...]
#
#   --name     the job's name: the log files' prefix and the default lock (default: shardtrain)
#   --log-dir  where the per-run logs go (default: $SHARDTRAIN_CRON_LOG_DIR, else
#              ~/.local/state/shardtrain/cron); each run writes NAME-<UTC time>-<pid>.log
#   --lock     the lock file (default: LOG_DIR/NAME.lock); runs sharing it never overlap
#
# e.g.  shardtrain-cron.sh --name nightly -- /opt/shardtrain/.venv/bin/shardtrain run --config conf/run.yaml
#
# Exit status: the command's own (shardtrain: 0 ok, 1 failed and may be retried, 2 fix the
# input), or 75 when an earlier run still holds the lock: this run did nothing, and says so on
# stderr and in its log. 64 means the wrapper itself was called wrongly.
#
# The command's output goes to the run's log only; the wrapper writes to stderr (which cron
# mails) only when the command fails or the run is skipped, naming the log.
#
# The lock is flock(1) on an open file, so it is released by the kernel when the last process
# holding it exits: a killed run leaves no stale lock, and a command that leaves processes
# behind (it should not) keeps the lock until they are gone too.
#
# Stopping a run: TERM, INT or HUP sent to the wrapper is forwarded to the command's process
# group (the command runs in a session of its own, pid and process group in the log's "command
# pid" line); the wrapper then waits for the command to end, writes the end line naming the
# signal, and exits with the command's status: 128+N when the signal ended it (143 for TERM,
# 130 for INT), the command's own when it caught the signal and exited. The lock goes with the
# wrapper, so the next run runs. SIGKILL cannot be forwarded: killing only the wrapper with it
# leaves the command running, and holding the lock, until it ends or is killed too.
# The command's stdin is /dev/null (cron gives it none either).
set -uo pipefail

SKIPPED=75  # EX_TEMPFAIL (sysexits.h): "try again later"; never a shardtrain status
USAGE=64    # EX_USAGE

prog=shardtrain-cron
name=shardtrain
log_dir=${SHARDTRAIN_CRON_LOG_DIR:-$HOME/.local/state/shardtrain/cron}
lock=""

usage() {
  printf '%s: %s\nusage: %s [--name NAME] [--log-dir DIR] [--lock FILE] -- COMMAND [ARG ...]\n' \
    "$prog" "$1" "$(basename "$0")" >&2
  exit "$USAGE"
}

while [ $# -gt 0 ]; do
  case "$1" in
    --name)    [ $# -ge 2 ] || usage "--name needs a value"; name=$2; shift 2 ;;
    --log-dir) [ $# -ge 2 ] || usage "--log-dir needs a value"; log_dir=$2; shift 2 ;;
    --lock)    [ $# -ge 2 ] || usage "--lock needs a value"; lock=$2; shift 2 ;;
    --)        shift; break ;;
    -*)        usage "unknown option $1" ;;
    *)         break ;;
  esac
done
[ $# -gt 0 ] || usage "no command to run"
case "$name" in
  */*|'') usage "--name must be a plain name (it names files), not '$name'" ;;
esac
lock=${lock:-$log_dir/$name.lock}

mkdir -p "$log_dir" || { printf '%s: cannot create the log directory %s\n' "$prog" "$log_dir" >&2; exit "$USAGE"; }
log=$log_dir/$name-$(date -u +%Y%m%dT%H%M%SZ)-$$.log
stamp() { date -u +%Y-%m-%dT%H:%M:%SZ; }
note() { printf '%s %s: %s\n' "$(stamp)" "$prog" "$*" >>"$log"; }

# fd 9 holds the lock for the whole run; the command inherits it (see above).
if ! exec 9>>"$lock"; then
  printf '%s: cannot open the lock file %s\n' "$prog" "$lock" >&2
  exit "$USAGE"
fi
if ! flock --nonblock 9; then
  holder=$(cat "$lock" 2>/dev/null)
  why="skipped: an earlier $name run still holds the lock $lock (${holder:-holder unknown}); this run did nothing"
  note "$why"
  printf '%s: %s; log: %s\n' "$prog" "$why" "$log" >&2
  exit "$SKIPPED"
fi
# Who holds it, for the message a skipped run prints (written only while holding the lock); the
# command's pid is added once it runs: after a SIGKILL of the wrapper, it is the holder.
this_run="pid $$ on $(hostname), started $(stamp)"
printf '%s\n' "$this_run" >"$lock"

# A stop request is passed on to the command rather than ending the wrapper, which would
# orphan the command with the lock and leave the log without its end line.
child=""        # the command's pid (and process group) while it runs
stop_signal=""  # the last signal forwarded to it
woken=""        # set by the trap: the wait below was interrupted, the command has not ended
forward() {
  stop_signal=$1 woken=1
  [ -n "$child" ] || return 0
  # Its pid alone while it has not yet made its own session (the moment after it started).
  kill -s "$1" -- "-$child" 2>/dev/null || kill -s "$1" "$child" 2>/dev/null
}
for sig in TERM INT HUP; do
  trap "forward $sig" "$sig"
done

printf -v command '%q ' "$@"
note "start $name (pid $$): ${command% }"
started=$(date +%s)
# Its own session, so a forwarded signal reaches everything the command started (a Spark JVM,
# ranks) and nothing else. The trap reset matters: a script's background job starts with INT and
# QUIT ignored, and a Python command would keep ignoring a forwarded INT.
( trap - INT QUIT; exec setsid "$@" >>"$log" 2>&1 </dev/null ) &
child=$!
note "command pid $child"
printf '%s, command pid %s\n' "$this_run" "$child" >"$lock"
[ -n "$stop_signal" ] && forward "$stop_signal"  # it came before $child was known
# wait returns early (128+N) when a trapped signal arrives: wait again until the command has
# ended (bash keeps an ended command's status, so a repeated wait returns it).
while :; do
  woken=""
  wait "$child"
  status=$?
  [ -z "$woken" ] && break
done
child=""  # reaped: its pid may be reused, so it is never signalled again

stopped=${stop_signal:+ (SIG$stop_signal forwarded to the command)}
note "end $name: exit status $status after $(( $(date +%s) - started ))s$stopped"
if [ "$status" -ne 0 ]; then
  printf '%s: %s exited with status %s%s; log: %s\n' "$prog" "$name" "$status" "$stopped" "$log" >&2
fi
exit "$status"
