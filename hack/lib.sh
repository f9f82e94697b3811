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

# ---- pid files that know whom they name
#
# A pid file holds "PID START BOOT": the process's start time (clock ticks since boot, /proc/PID/stat
# field 22) and the boot's id. A PID is reused once its process is gone (and after a reboot every PID
# is new), so nothing is ever signalled on the strength of a number alone: `live_pid` answers only while
# the recorded process itself is still running.

proc_start() { # proc_start <pid>: its start time, or nothing
  local stat
  stat=$(cat "/proc/$1/stat" 2>/dev/null) || return 1
  stat=${stat##*) }  # the command may hold spaces and parentheses: fields start after the last ") "
  read -r -a fields <<<"$stat"
  echo "${fields[19]}"  # field 22 of the whole line
}

boot_id() { cat /proc/sys/kernel/random/boot_id; }

record_pid() { # record_pid <file> <pid> [extra words]
  local start
  start=$(proc_start "$2") || return 1
  echo "$2 $start $(boot_id)${3:+ $3}" > "$1"
}

live_pid() { # live_pid <file>: the recorded PID if that very process still runs; nothing otherwise
  local pid start boot rest
  [[ -f $1 ]] || return 1
  read -r pid start boot rest < "$1" || true
  [[ $pid =~ ^[0-9]+$ && -n $start && $boot == "$(boot_id)" ]] || return 1
  [[ $(proc_start "$pid" 2>/dev/null) == "$start" ]] || return 1
  echo "$pid"
}

recorded() { # recorded <file> <word index from 3>: an extra word of the record
  local words
  read -r -a words < "$1" || true
  echo "${words[$2]:-}"
}
