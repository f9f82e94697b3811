# Shared by the cluster scripts (sourced): each defines log() and die(), and LOGS, before sourcing this.

# wait_for <seconds> <description> <command...>: poll with a deadline, never a fixed sleep
wait_for() {
  local seconds=$1 what=$2; shift 2
  local deadline=$((SECONDS + seconds))
  until "$@" >/dev/null 2>&1; do
    ((SECONDS < deadline)) || die "timed out after ${seconds}s waiting for $what (logs: $LOGS)"
    sleep 0.2
  done
}
