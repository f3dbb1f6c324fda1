#!/usr/bin/env bash
# A cluster of "machines" on this one host, for the multi-node tests: each node
# is a network namespace with its own loopback, its own address on a private
# bridge and its own host name (a UTS namespace). The bridge lives in a network
# namespace of its own, attached to none of the host's interfaces, and no
# namespace has a default route: a packet can only go from node to node, never
# off this machine.
#
# Usage (as root): scripts/netns-cluster.sh up N [--rate RATE]
#                  scripts/netns-cluster.sh down
#                  scripts/netns-cluster.sh exec NODE CMD [ARGS...]
#                  scripts/netns-cluster.sh rsh HOST COMMAND...
#                  scripts/netns-cluster.sh addr NODE
#                  scripts/netns-cluster.sh link NODE up|down
#                  scripts/netns-cluster.sh rate NODE RATE|off
#                  scripts/netns-cluster.sh signal NODE SIGNAL
#                  scripts/netns-cluster.sh status
#   up      makes nodes 0..N-1 (N from 1 to 16): node i is host "n<i>" at
#           <subnet>.<10+i>/24. With the same cluster already up, only prints its
#           status; with another N, an error (down first).
#   --rate  limits every node's link, both ways, to RATE (tc tbf: "1gbit",
#           "100mbit", ...)
#   down    kills every process in the nodes (SIGKILL) and removes the namespaces
#           and the state directory. Nothing up: no-op. Always leaves nothing.
#   exec    runs CMD on node NODE (its network, host name, and an /etc/hosts that
#           names every node); the exit status is CMD's.
#   rsh     a remote shell for launchers that start their daemons over ssh (Open
#           MPI's plm_rsh_agent): runs COMMAND (words joined, as ssh does) with sh -c
#           on the node whose host name (n<i>) or address is HOST
#   addr    prints node NODE's address
#   link    takes node NODE's link down (a network partition: its packets are
#           dropped, its sockets stay open) or up again
#   rate    limits node NODE's link to RATE both ways, or removes the limit (off)
#   signal  sends SIGNAL (KILL, STOP, CONT, TERM, ... or a number) to every process
#           running on node NODE: KILL is a lost machine, STOP a frozen one
#   status  the nodes, their addresses, links and limits, and the processes in each;
#           exit status 0 if the cluster is up, 3 if not
#
# Several clusters can exist at once: FULGUR_NETNS_NAME (default "fulgur") names
# one (namespaces <name>-br and <name>-n<i>; state in /run/fulgur-netns/<name>).
# FULGUR_NETNS_SUBNET (default 10.213.0) is the nodes' /24; the addresses exist
# only inside the cluster's namespaces. Every wait has a deadline.
set -euo pipefail

say() { echo "netns-cluster: $*"; }
die() { echo "netns-cluster: $*" >&2; exit 2; }
usage() { sed -n '2,42p' "$0" | sed 's/^# \{0,1\}//'; }

name="${FULGUR_NETNS_NAME:-fulgur}"
subnet="${FULGUR_NETNS_SUBNET:-10.213.0}"
state="/run/fulgur-netns/$name"
bridge_ns="$name-br"

[[ "$name" =~ ^[A-Za-z0-9_.-]{1,40}$ ]] ||
  die "FULGUR_NETNS_NAME=\"$name\": use 1 to 40 letters, digits, '.', '_' or '-'."
[[ "$subnet" =~ ^([0-9]{1,3})\.([0-9]{1,3})\.([0-9]{1,3})$ ]] ||
  die "FULGUR_NETNS_SUBNET=\"$subnet\": give the first three numbers of a /24, e.g. 10.213.0."

node_ns() { echo "$name-n$1"; }
node_addr() { echo "$subnet.$((10 + $1))"; }
nodes_up() { cat "$state/nodes" 2>/dev/null || echo 0; }

need_root() {
  [ "$(id -u)" = 0 ] || die "$1 needs root (network namespaces): run it as root, e.g. with sudo."
  command -v ip >/dev/null || die "ip (iproute2) is missing: run scripts/install-deps.sh."
}

check_node() {  # check_node NODE: a node of the cluster that is up
  local n; n="$(nodes_up)"
  [ "$n" -gt 0 ] || die "no cluster \"$name\" is up: run '$0 up N' first."
  [[ "$1" =~ ^[0-9]+$ ]] && [ "$1" -lt "$n" ] ||
    die "node \"$1\": the cluster \"$name\" has nodes 0 to $((n - 1))."
}

check_rate() {
  [[ "$1" =~ ^[0-9]+(\.[0-9]+)?(bit|kbit|mbit|gbit|tbit|bps|kbps|mbps|gbps)$ ]] ||
    die "rate \"$1\": give a tc rate such as 1gbit, 100mbit or 500kbit."
}

set_rate() {  # set_rate NODE RATE|off: both directions of the node's link
  local i="$1" rate="$2" ns; ns="$(node_ns "$i")"
  if [ "$rate" = off ]; then
    ip -n "$ns" qdisc del dev eth0 root 2>/dev/null || true
    ip netns exec "$bridge_ns" tc qdisc del dev "n$i" root 2>/dev/null || true
    rm -f "$state/rate-n$i"
    return
  fi
  # A token bucket: RATE on average, bursts of 64 KiB, at most 100 ms queued.
  ip netns exec "$ns" tc qdisc replace dev eth0 root tbf rate "$rate" burst 64kb latency 100ms
  ip netns exec "$bridge_ns" tc qdisc replace dev "n$i" root tbf rate "$rate" burst 64kb latency 100ms
  echo "$rate" >"$state/rate-n$i"
}

do_down() {
  local i ns pids deadline
  [ -d "$state" ] || ip netns list 2>/dev/null | grep -q "^$name-" || return 0
  for ns in $(ip netns list 2>/dev/null | awk '{print $1}' | grep "^$name-" || true); do
    # Every process in the namespace, whatever started it.
    deadline=$((SECONDS + 10))
    while pids="$(ip netns pids "$ns" 2>/dev/null)" && [ -n "$pids" ]; do
      kill -KILL $pids 2>/dev/null || true
      [ $SECONDS -lt $deadline ] || { say "processes $pids in $ns did not end; removing it anyway"; break; }
      sleep 0.1
    done
    ip netns del "$ns" 2>/dev/null || true
  done
  if [ -d "$state" ]; then
    for f in "$state"/uts-n*; do
      [ -e "$f" ] || continue
      umount "$f" 2>/dev/null || umount -l "$f" 2>/dev/null || true
    done
    rm -rf "$state"
  fi
  say "cluster \"$name\" is down"
}

do_status() {
  local n i ns pids
  n="$(nodes_up)"
  if [ "$n" -eq 0 ]; then say "cluster \"$name\" is not up"; return 3; fi
  say "cluster \"$name\": $n node(s) on $subnet.0/24, bridge in namespace $bridge_ns"
  for ((i = 0; i < n; i++)); do
    ns="$(node_ns "$i")"
    pids="$(ip netns pids "$ns" 2>/dev/null | wc -l)"
    echo "  node $i: host n$i, $(node_addr "$i"), namespace $ns, link" \
      "$(ip -n "$bridge_ns" -o link show "n$i" 2>/dev/null | grep -q 'state UP\|,UP' && echo up || echo down)," \
      "rate $(cat "$state/rate-n$i" 2>/dev/null || echo unlimited), $pids process(es)"
  done
}

do_up() {
  local n="$1" rate="$2" i ns
  [[ "$n" =~ ^[0-9]+$ ]] && [ "$n" -ge 1 ] && [ "$n" -le 16 ] ||
    die "up $n: give a node count from 1 to 16."
  [ -z "$rate" ] || check_rate "$rate"
  local have; have="$(nodes_up)"
  if [ "$have" -gt 0 ]; then
    [ "$have" -eq "$n" ] ||
      die "cluster \"$name\" is up with $have node(s), not $n: run '$0 down' first."
    if [ -n "$rate" ]; then for ((i = 0; i < n; i++)); do set_rate "$i" "$rate"; done; fi
    do_status
    return
  fi
  # A half-made cluster from an interrupted up: start clean.
  do_down >/dev/null
  command -v unshare >/dev/null && command -v nsenter >/dev/null ||
    die "unshare/nsenter (util-linux) are missing: run scripts/install-deps.sh."
  mkdir -p "$state"
  trap 'say "up failed; removing what was made"; do_down >/dev/null' ERR
  ip netns add "$bridge_ns"
  ip -n "$bridge_ns" link set lo up
  ip -n "$bridge_ns" link add br0 type bridge
  ip -n "$bridge_ns" link set br0 up
  : >"$state/hosts"
  echo "127.0.0.1 localhost" >>"$state/hosts"
  for ((i = 0; i < n; i++)); do
    echo "$(node_addr "$i") n$i" >>"$state/hosts"
  done
  for ((i = 0; i < n; i++)); do
    ns="$(node_ns "$i")"
    ip netns add "$ns"
    ip -n "$ns" link set lo up
    # The pair is made in the bridge's namespace; one end moves to the node.
    ip -n "$bridge_ns" link add "n$i" type veth peer name eth0 netns "$ns"
    ip -n "$bridge_ns" link set "n$i" master br0
    ip -n "$bridge_ns" link set "n$i" up
    ip -n "$ns" addr add "$(node_addr "$i")/24" dev eth0
    ip -n "$ns" link set eth0 up
    # The node's host name, in a UTS namespace kept by a bind mount.
    touch "$state/uts-n$i"
    unshare --uts="$state/uts-n$i" hostname "n$i"
    [ -z "$rate" ] || set_rate "$i" "$rate"
  done
  echo "$n" >"$state/nodes"
  trap - ERR
  # Links are up when every node reaches node 0 (the bridge learns addresses).
  local deadline=$((SECONDS + 15))
  for ((i = 1; i < n; i++)); do
    until ip netns exec "$(node_ns "$i")" ping -c 1 -W 1 "$(node_addr 0)" >/dev/null 2>&1; do
      if [ $SECONDS -ge $deadline ]; then
        do_down >/dev/null
        die "node $i could not reach node 0 ($(node_addr 0)) within 15 s; the cluster was removed."
      fi
      sleep 0.2
    done
  done
  do_status
}

do_exec() {
  local i="$1"; shift
  check_node "$i"
  [ $# -gt 0 ] || die "exec $i: give a command to run on node $i."
  # The node's network and host name, and a mount namespace of the command's own
  # in which /etc/hosts names the nodes (the host's is untouched). Not through
  # ip netns exec, which also mounts a sysfs over /sys and so hides the cgroup
  # file systems that slurmd needs.
  exec nsenter --net="/run/netns/$(node_ns "$i")" --uts="$state/uts-n$i" -- \
    unshare --mount --propagation private \
    sh -c 'mount --bind "$0" /etc/hosts && exec "$@"' "$state/hosts" "$@"
}

do_rsh() {
  local host="$1" n i; shift
  n="$(nodes_up)"
  [ "$n" -gt 0 ] || die "no cluster \"$name\" is up: run '$0 up N' first."
  for ((i = 0; i < n; i++)); do
    if [ "$host" = "n$i" ] || [ "$host" = "$(node_addr "$i")" ]; then
      [ $# -gt 0 ] || die "rsh $host: give a command."
      do_exec "$i" sh -c "$*"
    fi
  done
  die "rsh: host \"$host\" is not a node of the cluster \"$name\" (n0 to n$((n - 1)), or their addresses)."
}

cmd="${1:-}"
[ $# -gt 0 ] && shift
case "$cmd" in
  up)
    need_root up
    [ $# -ge 1 ] || die "up: give a node count, e.g. '$0 up 2'."
    count="$1"; shift
    rate=""
    while [ $# -gt 0 ]; do
      case "$1" in
        --rate) [ $# -ge 2 ] || die "--rate needs a value, e.g. 1gbit"; rate="$2"; shift ;;
        --rate=*) rate="${1#*=}" ;;
        *) die "up: unknown argument \"$1\" (known: --rate RATE)" ;;
      esac
      shift
    done
    do_up "$count" "$rate" ;;
  down) need_root down; do_down ;;
  exec) need_root exec; [ $# -ge 1 ] || die "exec: give a node and a command."; do_exec "$@" ;;
  rsh) need_root rsh; [ $# -ge 1 ] || die "rsh: give a host and a command."; do_rsh "$@" ;;
  addr) [ $# -eq 1 ] || die "addr: give one node."; check_node "$1"; node_addr "$1" ;;
  link)
    need_root link
    [ $# -eq 2 ] || die "link: give a node and up or down."
    check_node "$1"
    case "$2" in
      up|down) ip -n "$bridge_ns" link set "n$1" "$2" ;;
      *) die "link $1 $2: give up or down." ;;
    esac ;;
  rate)
    need_root rate
    [ $# -eq 2 ] || die "rate: give a node and a rate (or off)."
    check_node "$1"
    [ "$2" = off ] || check_rate "$2"
    set_rate "$1" "$2" ;;
  signal)
    need_root signal
    [ $# -eq 2 ] || die "signal: give a node and a signal (KILL, STOP, CONT, ...)."
    check_node "$1"
    sig="${2#SIG}"
    { [[ "$sig" =~ ^[0-9]+$ ]] || kill -l "$sig" >/dev/null 2>&1; } ||
      die "signal $1 $2: not a signal (kill -l lists them: KILL, STOP, CONT, TERM, ...)."
    # Every process whose network is the node's (ip netns pids).
    pids="$(ip netns pids "$(node_ns "$1")" 2>/dev/null | tr '\n' ' ')"
    [ -z "$pids" ] || kill -s "$sig" $pids 2>/dev/null || true
    say "signal $sig sent to node $1: $(echo $pids | wc -w) process(es)" ;;
  status) do_status ;;
  -h|--help|help) usage ;;
  "") usage; exit 2 ;;
  *) die "unknown command \"$cmd\" (up, down, exec, rsh, addr, link, rate, signal, status)" ;;
esac
