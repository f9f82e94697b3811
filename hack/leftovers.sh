#!/usr/bin/env bash
# Whether a local cluster left anything on this machine: processes, its network namespace (and the iptables
# rules in it), mounts, links, cgroups, its directory.
#
#   hack/leftovers.sh [DIR...]   the given cluster directories (default: the demo's and the tests')
#
# Prints what is left and exits 1, or says that nothing is and exits 0. `make down` runs it. Reads only.
set -uo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
(($#)) || set -- "$ROOT/.tally/cluster" "$ROOT/.tally/test-cluster"
left=0
say() { echo "[leftovers] $*" >&2; left=1; }

for given in "$@"; do
  dir=$(realpath -m "$given")
  netns=tally-$(echo "$dir" | sha256sum | cut -c1-8)  # as hack/cluster.sh names it
  [[ ! -e $dir ]] || say "$dir still exists"
  for pid in /proc/[0-9]*; do
    [[ ${pid#/proc/} != "$$" ]] || continue
    cmd=$(tr '\0' ' ' < "$pid/cmdline" 2>/dev/null) || continue
    [[ $cmd == *"$dir/"* || $cmd == *"$dir "* || $cmd == *"/run/netns/$netns"* ]] && say "process ${pid#/proc/}: ${cmd:0:160}"
  done
  if ip netns list 2>/dev/null | grep -qw "$netns"; then
    say "network namespace $netns"
    pids=$(ip netns pids "$netns" 2>/dev/null | tr '\n' ' ')
    [[ -z $pids ]] || say "processes in $netns: $pids"
    rules=$(ip netns exec "$netns" iptables-save 2>/dev/null | grep -c '^-A' || true)
    ((rules == 0)) || say "$rules iptables rules in $netns"
  fi
  mounts=$(grep -F -e "$dir" -e "/run/netns/$netns" /proc/mounts 2>/dev/null | cut -d' ' -f2 | tr '\n' ' ')
  [[ -z $mounts ]] || say "mounts: $mounts"
  for cg in /sys/fs/cgroup/*/"$netns" /sys/fs/cgroup/"$netns"; do
    [[ -d $cg ]] && say "cgroup $cg"
  done
done
for link in tnode0 tpods0; do  # the cluster's bridges live in its namespace, never on this machine's side
  ! ip link show "$link" >/dev/null 2>&1 || say "link $link on this machine"
done
((left)) || echo "[leftovers] nothing left of: $*" >&2
exit "$left"
