#!/usr/bin/env bash
# Starts and stops a real SLURM cluster on this machine (localhost), for the test
# suite: Debian's slurmctld, slurmd and munged (22.05 on Debian 12, 24.11 on
# Debian 13; installed by scripts/install-deps.sh), run as root without systemd.
#
# Usage (as root): scripts/slurm-cluster.sh start [--nodes 1|2] [--cpus N] [--netns]
#                  scripts/slurm-cluster.sh stop [--keep]
#                  scripts/slurm-cluster.sh status
#                  scripts/slurm-cluster.sh env        # eval "$(scripts/slurm-cluster.sh env)"
#   start    writes a slurm.conf and a MUNGE key, starts munged, slurmctld and one
#            slurmd per node, and waits until sinfo shows every node idle. With a
#            cluster already running (same node count) it only prints the status.
#   --nodes  1 (default): node n1 with this machine's CPUs; 2: nodes n1 and n2,
#            two slurmd on this host (NodeAddr 127.0.0.1, a port each)
#   --cpus   declare N CPUs per node instead of the machine's (SlurmdParameters=
#            config_overrides), e.g. to run more tasks than cores without --overcommit
#   --netns  nodes n0 (and n1) on the nodes of the running scripts/netns-cluster.sh
#            cluster (FULGUR_NETNS_NAME): slurmctld and slurmd n0 on node 0, slurmd n1
#            on node 1, each at its node's address. SLURM's commands then reach the
#            cluster only from a node: scripts/netns-cluster.sh exec 0 srun ...
#   stop     ends every process of this cluster (munged, slurmctld, slurmd, slurmstepd
#            and the jobs' tasks: SIGTERM, then SIGKILL) and removes the state
#            directory; --keep keeps it (logs, slurm.conf). Nothing running: no-op.
#   status   the daemons, sinfo and squeue; exit status 0 if the cluster runs, 3 if not
#   env      prints the exports that point SLURM's commands at this cluster
#
# Everything lives in one directory, $FULGUR_SLURM_DIR (default /tmp/fulgur-slurm):
# slurm.conf, munge/ (key, socket, pid, log of our own munged, run as user munge),
# ctld/ (StateSaveLocation), spool-n1/, log/ (slurmctld.log, slurmd-n1.log,
# jobcomp.log: one line per finished job, with its exit code), run/ (pid files).
# The system's /etc/munge and /etc/slurm are neither read nor changed. Ports are
# picked at start among those free. Every wait has a deadline ($FULGUR_SLURM_TIMEOUT
# seconds, default 30); a failure names the log to read and prints its last lines.
# Unix socket paths are limited to 107 bytes, so keep the directory's path short.
set -euo pipefail

say() { echo "slurm-cluster: $*"; }
die() { echo "slurm-cluster: $*" >&2; exit 2; }

usage() { sed -n '2,30p' "$0" | sed 's/^# \{0,1\}//'; }

cmd="${1:-}"
[ $# -gt 0 ] && shift
nodes=1
cpus=""
keep=0
netns=0
while [ $# -gt 0 ]; do
  case "$cmd:$1" in
    start:--nodes) [ $# -ge 2 ] || die "--nodes needs a value (1 or 2)"; nodes="$2"; shift ;;
    start:--nodes=*) nodes="${1#*=}" ;;
    start:--cpus) [ $# -ge 2 ] || die "--cpus needs a value"; cpus="$2"; shift ;;
    start:--cpus=*) cpus="${1#*=}" ;;
    start:--netns) netns=1 ;;
    stop:--keep) keep=1 ;;
    *:-h|*:--help) usage; exit 0 ;;
    *) die "unknown argument '$1' for '$cmd' (see --help)" ;;
  esac
  shift
done
case "$nodes" in 1|2) ;; *) die "--nodes $nodes: use 1 or 2" ;; esac
case "$cpus" in ''|[1-9]|[1-9][0-9]|[1-9][0-9][0-9]) ;; *) die "--cpus $cpus: use a number from 1 to 999" ;; esac

# Nothing of a job or cluster this runs in (an outer SLURM job, an earlier eval of
# 'env') reaches the daemons, nor makes this script's own processes look like tasks.
while read -r v; do unset "$v"; done < <(compgen -e | grep -E '^SLURMD?_' || true)

dir="${FULGUR_SLURM_DIR:-/tmp/fulgur-slurm}"
case "$dir" in /*) ;; *) dir="$PWD/$dir" ;; esac
dir="$(realpath -m "$dir")"
[ "$dir" != / ] || die "FULGUR_SLURM_DIR must not be /"
timeout_s="${FULGUR_SLURM_TIMEOUT:-30}"
conf="$dir/slurm.conf"
marker="$dir/.fulgur-slurm"   # says the directory is ours: stop/start may remove it
node_names=(n1)
[ "$nodes" = 2 ] && node_names=(n1 n2)
netns_script="$(dirname "$(realpath "$0")")/netns-cluster.sh"
# In a netns cluster the nodes are named after its hosts (n0, n1), and what runs
# on node i runs in its namespaces.
if [ -e "$dir/.netns" ] || [ "$netns" = 1 ]; then
  node_names=(n0)
  [ "$nodes" = 2 ] && node_names=(n0 n1)
fi
# The words that run a command on node I: nothing here, or netns-cluster.sh exec I.
on_node=()
set_on_node() {
  on_node=()
  if [ "$netns" = 1 ] || [ -e "$dir/.netns" ]; then on_node=(bash "$netns_script" exec "$1"); fi
}

now() { echo "${EPOCHREALTIME/[.,]/}"; }  # microseconds
elapsed() { local us=$(( $(now) - $1 )); printf '%d.%02d s' $((us / 1000000)) $((us % 1000000 / 10000)); }

# The last lines of a log, for an error message.
log_tail() {
  local f="$1"
  if [ -s "$f" ]; then
    echo "---- last lines of $f:"
    tail -n "${2:-15}" "$f" | sed 's/^/  /'
  else
    echo "---- $f: missing or empty"
  fi
}

# fail MESSAGE LOG...: prints the message and the logs' tails, ends what was
# started (keeping the directory for the logs) and exits 1.
fail() {
  local msg="$1"; shift
  {
    echo "slurm-cluster: $msg"
    for f in "$@"; do log_tail "$f"; done
    echo "slurm-cluster: stopping what was started; logs kept in $dir/log and $dir/munge"
  } >&2
  kill_cluster >/dev/null 2>&1 || true
  exit 1
}

# ---- Processes of this cluster.
# A pid file's process, if it still runs as the expected program.
pid_of() {
  local file="$1" comm="$2" pid
  [ -r "$file" ] || return 1
  read -r pid <"$file" 2>/dev/null || return 1
  [[ "$pid" =~ ^[0-9]+$ ]] || return 1
  [ "$(cat "/proc/$pid/comm" 2>/dev/null)" = "$comm" ] || return 1
  ! grep -q '^State:[[:space:]]*Z' "/proc/$pid/status" 2>/dev/null || return 1  # a zombie: ended
  echo "$pid"
}

daemon_pidfile() {
  case "$1" in
    munged) echo "$dir/munge/munged.pid" ;;
    slurmctld) echo "$dir/run/slurmctld.pid" ;;
    slurmd-*) echo "$dir/run/${1}.pid" ;;
  esac
}

# The node names of the cluster written in slurm.conf (the running one's).
conf_nodes() {
  sed -n 's/^NodeName=\([^ ]*\) .*/\1/p' "$conf" 2>/dev/null
}

# Every process of this cluster: the daemons (by a command line naming this
# directory, or SLURM_CONF=our conf in their environment: slurmscriptd, 22.05's
# slurmstepd; or a file open in this directory: slurmstepd), and the jobs' tasks
# (SLURM_CONF=our conf and a SLURM_JOB_ID in their environment, which slurmstepd
# sets). Not this script, nor its ancestors.
cluster_pids() {
  local pid how comm self_chain=" $$ " q=$$
  while [ "$q" -gt 1 ] 2>/dev/null; do
    q="$(awk '/^PPid:/ {print $2}' "/proc/$q/status" 2>/dev/null || echo 0)"
    self_chain+="$q "
  done
  # A few greps over /proc (exit status 2: a process ended while grep read it;
  # zombies, ended, have neither command line nor environment nor files).
  {
    { grep -laF -- "$dir/" /proc/[0-9]*/cmdline 2>/dev/null || true; } | sed 's|^/proc/\([0-9]*\)/.*|\1 cmdline|'
    { grep -lzxF -- "SLURM_CONF=$conf" /proc/[0-9]*/environ 2>/dev/null || true; } | sed 's|^/proc/\([0-9]*\)/.*|\1 environ|'
    # SLURM 24.11's slurmstepd has neither (an empty environment): it holds the
    # slurmd log in this directory open, and works in it.
    { grep -lx slurmstepd /proc/[0-9]*/comm 2>/dev/null || true; } | sed 's|^/proc/\([0-9]*\)/.*|\1|' |
      while read -r pid; do
        for f in "/proc/$pid/cwd" "/proc/$pid"/fd/*; do
          case "$(readlink "$f" 2>/dev/null)" in "$dir"/*) echo "$pid files"; break ;; esac
        done
      done
  } | while read -r pid how; do
    case "$self_chain" in *" $pid "*) continue ;; esac
    read -r comm 2>/dev/null <"/proc/$pid/comm" || continue
    case "$comm" in
      munged|slurmctld|slurmscriptd|slurmd|slurmstepd) echo "$pid" ;;
      *) if [ "$how" = environ ] && grep -qzE '^SLURM_JOB_ID=' "/proc/$pid/environ" 2>/dev/null; then
           echo "$pid"
         fi ;;
    esac
  done | sort -un || true
}

# Sends SIGTERM to the given processes, waits up to $2 s for them to end, then
# SIGKILL; new ones found by $1 (a function listing pids) meanwhile get the same.
terminate() {
  local lister="$1" grace="$2" t0 pids
  t0=$(now)
  pids="$($lister)"
  [ -n "$pids" ] || return 0
  # shellcheck disable=SC2086
  kill -TERM $pids 2>/dev/null || true
  while [ $(( $(now) - t0 )) -lt $(( grace * 1000000 )) ]; do
    pids="$($lister)"
    [ -n "$pids" ] || return 0
    # shellcheck disable=SC2086
    kill -TERM $pids 2>/dev/null || true
    sleep 0.2
  done
  t0=$(now)
  while [ $(( $(now) - t0 )) -lt 5000000 ]; do
    pids="$($lister)"
    [ -n "$pids" ] || return 0
    # shellcheck disable=SC2086
    kill -KILL $pids 2>/dev/null || true
    sleep 0.2
  done
  pids="$($lister)"
  [ -z "$pids" ] || { echo "slurm-cluster: still running after SIGKILL: $pids" >&2; return 1; }
}

slurm_pids() {
  local p comm
  cluster_pids | while read -r p; do
    read -r comm 2>/dev/null <"/proc/$p/comm" || continue
    [ "$comm" = munged ] || echo "$p"
  done || true
}
munge_pids() { cluster_pids; }

# Ends the whole cluster: SLURM's processes first (jobs get KillWait-like grace),
# then munged (which they need to talk while shutting down).
kill_cluster() {
  terminate slurm_pids 6 && terminate munge_pids 3
}

# Which daemons run: prints "name pid" for each running, returns 0 if all do.
daemons_state() {
  local all=0 n pid names=(munged slurmctld)
  for n in $(conf_nodes); do names+=("slurmd-$n"); done
  for n in "${names[@]}"; do
    if pid="$(pid_of "$(daemon_pidfile "$n")" "${n%%-*}")"; then
      echo "$n $pid"
    else
      echo "$n -"
      all=1
    fi
  done
  [ -f "$conf" ] || all=1
  return $all
}

cluster_running() { daemons_state >/dev/null 2>&1; }

slurm_cmd() { set_on_node 0; SLURM_CONF="$conf" timeout 10 "${on_node[@]}" "$@"; }

print_status() {
  say "directory $dir"
  { daemons_state || true; } | while read -r n pid; do
    if [ "$pid" = - ]; then echo "  $n: not running"; else echo "  $n: pid $pid"; fi
  done
  if pid_of "$dir/run/slurmctld.pid" slurmctld >/dev/null; then
    slurm_cmd sinfo -N -o '%N %T %c %O %E' 2>&1 | sed 's/^/  /' || true
    slurm_cmd squeue -o '%i %j %T %M %R' 2>&1 | sed 's/^/  /' || true
  fi
}

# ---- Free TCP ports: none bound on this machine (IPv4 or IPv6), below the
# ephemeral range (where outgoing connections would take them).
used_ports() {
  local _ local_address _rest
  cat /proc/net/tcp /proc/net/tcp6 2>/dev/null |
    while read -r _ local_address _rest; do
      case "$local_address" in *:????) echo $(( 16#${local_address##*:} )) ;; esac
    done | sort -un
}
pick_ports() {
  local count="$1" low=20000 high eph used picked=() p tries=0
  eph="$(awk '{print $1}' /proc/sys/net/ipv4/ip_local_port_range 2>/dev/null || echo 32768)"
  high=$(( eph - 1 ))
  [ "$high" -gt $(( low + 1000 )) ] || { low=10000; high=19999; }
  used=" $(used_ports | tr '\n' ' ') "
  while [ ${#picked[@]} -lt "$count" ]; do
    tries=$((tries + 1))
    [ $tries -lt 10000 ] || die "found no free TCP port in $low-$high"
    p=$(( low + (RANDOM * 32768 + RANDOM) % (high - low + 1) ))
    case "$used" in *" $p "*) continue ;; esac
    used+="$p "
    picked+=("$p")
  done
  echo "${picked[*]}"
}

slurm_major() { slurmctld -V 2>/dev/null | sed -n 's/^slurm[^ ]* \([0-9]*\)\..*/\1/p'; }

write_conf() {
  local ctld_port="$1"; shift
  local node_ports=("$@") host major i n topo
  host="$(uname -n)"; host="${host%%.*}"  # slurmctld runs only where SlurmctldHost is its short name
  major="$(slurm_major)"
  [ -n "$major" ] || die "cannot read SLURM's version from 'slurmctld -V'"
  if [ -n "$cpus" ]; then
    topo="CPUs=$cpus"
  else
    # This machine's topology, as slurmd itself reports it (so that it registers).
    topo="$(slurmd -C 2>/dev/null | head -1 | tr ' ' '\n' |
            grep -E '^(CPUs|Boards|SocketsPerBoard|CoresPerSocket|ThreadsPerCore)=' | tr '\n' ' ')"
    topo="${topo% }"
    [ -n "$topo" ] || topo="CPUs=$(nproc)"
  fi
  {
    echo "# Written by fulgur scripts/slurm-cluster.sh for SLURM $(slurmctld -V | cut -d' ' -f2): a test cluster on localhost."
    echo "ClusterName=fulgur"
    if [ "$netns" = 1 ]; then
      echo "SlurmctldHost=n0($(bash "$netns_script" addr 0))"
    else
      echo "SlurmctldHost=$host(127.0.0.1)"
    fi
    echo "SlurmctldPort=$ctld_port"
    echo "SlurmdPort=${node_ports[0]}"
    echo "SlurmUser=root"
    echo "SlurmdUser=root"
    echo "AuthType=auth/munge"
    echo "CredType=cred/munge"
    echo "# Our own munged's socket; cred_expire=5 (the minimum): a requeued job may start"
    echo "# again 5 s after it ended instead of 120 s."
    echo "AuthInfo=cred_expire=5,socket=$dir/munge/munge.socket.2"
    echo "StateSaveLocation=$dir/ctld"
    echo "SlurmdSpoolDir=$dir/spool-%n"
    echo "SlurmctldPidFile=$dir/run/slurmctld.pid"
    echo "SlurmdPidFile=$dir/run/slurmd-%n.pid"
    echo "SlurmctldLogFile=$dir/log/slurmctld.log"
    echo "SlurmdLogFile=$dir/log/slurmd-%n.log"
    echo "SlurmctldDebug=info"
    echo "SlurmdDebug=info"
    echo "PlugStackConfig=$dir/plugstack.conf"
    echo "MailProg=/bin/true"
    echo "ProctrackType=proctrack/linuxproc"
    echo "SelectType=select/cons_tres"
    echo "SelectTypeParameters=CR_Core"
    echo "SchedulerType=sched/backfill"
    echo "SchedulerParameters=sched_interval=1,bf_interval=1"
    echo "JobCompType=jobcomp/filetxt"
    echo "JobCompLoc=$dir/log/jobcomp.log"
    if [ "$major" -lt 23 ]; then
      echo "TaskPlugin=task/none"
      echo "AccountingStorageType=accounting_storage/none"
      echo "JobAcctGatherType=jobacct_gather/none"
      echo "MpiDefault=none"
    else
      echo "# SLURM $major ships no 'none' plugins (22.05 did); unset means none for"
      echo "# TaskPlugin, AccountingStorageType, JobAcctGatherType, MpiDefault."
    fi
    echo "KillWait=5"
    echo "ReturnToService=2"
    echo "JobRequeue=1"
    echo "MinJobAge=600"
    echo "InactiveLimit=0"
    [ -z "$cpus" ] || echo "SlurmdParameters=config_overrides"
    for i in "${!node_names[@]}"; do
      n="${node_names[$i]}"
      if [ "$netns" = 1 ]; then
        echo "NodeName=$n NodeAddr=$(bash "$netns_script" addr "$i") NodeHostname=$n Port=${node_ports[$i]} $topo State=UNKNOWN"
      else
        echo "NodeName=$n NodeAddr=127.0.0.1 NodeHostname=$host Port=${node_ports[$i]} $topo State=UNKNOWN"
      fi
    done
    echo "PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP"
  } >"$conf"
  : >"$dir/plugstack.conf"
  # Read from slurm.conf's directory. SLURM 24.11's slurmd initializes a cgroup
  # plugin even with proctrack/linuxproc, and fails where /sys/fs/cgroup is not
  # mounted (a chroot, a container); 22.05's has no 'disabled' and needs none.
  if [ "$major" -ge 23 ]; then
    echo "CgroupPlugin=disabled" >"$dir/cgroup.conf"
  fi
}

# Runs a daemon in a new session with no file descriptor of ours but the given
# stdin, stdout and stderr (an inherited pipe would keep a test runner waiting, an
# inherited lock would keep the next start waiting). The daemons fork themselves.
spawn() {
  (
    for fd in /proc/"$BASHPID"/fd/*; do
      fd="${fd##*/}"
      [ "$fd" -gt 2 ] 2>/dev/null && eval "exec $fd>&-"
    done
    cd "$dir" && exec setsid "$@"
  )
}

# wait_for SECONDS COMMAND [DAEMON...]: retries COMMAND every 0.1 s until it
# succeeds (0); 1 after SECONDS; 2 as soon as one of the DAEMONs (started since
# $spawned_at) has ended, its name then in $ended.
spawned_at=0
ended=""
wait_for() {
  local limit="$1" test="$2" t0 d f; shift 2
  t0=$(now)
  until "$test" >/dev/null 2>&1; do
    for d in "$@"; do
      f="$(daemon_pidfile "$d")"
      if [ -e "$f" ]; then
        pid_of "$f" "${d%%-*}" >/dev/null || { ended="$d"; return 2; }
      elif [ $(( $(now) - spawned_at )) -gt 5000000 ]; then
        ended="$d"; return 2  # no pid file 5 s after it was started: it ended at once
      fi
    done
    [ $(( $(now) - t0 )) -lt $(( limit * 1000000 )) ] || return 1
    sleep 0.1
  done
}

# The message for wait_for's status $1: what was awaited ($2).
wait_failure() {
  if [ "$1" = 2 ]; then echo "$ended ended while starting (waiting until $2)"; else echo "$2: not after $timeout_s s"; fi
}

munge_works() {
  munge -n -S "$dir/munge/munge.socket.2" | unmunge -S "$dir/munge/munge.socket.2"
}
ctld_up() { slurm_cmd scontrol ping | grep -q 'is UP'; }
nodes_idle() {
  local states
  states="$(slurm_cmd sinfo -h -N -o '%N %T' | sort -u)"
  [ "$(echo "$states" | grep -c ' idle$')" -eq "${#node_names[@]}" ]
}

start() {
  local t0 ports
  t0=$(now)
  if cluster_running; then
    local running_nodes
    running_nodes="$(conf_nodes | wc -l)"
    if [ "$running_nodes" != "$nodes" ]; then
      die "a cluster with $running_nodes node(s) already runs in $dir; stop it first to start one with $nodes"
    fi
    say "already running"
    print_status
    return 0
  fi
  for b in munged munge unmunge slurmctld slurmd sinfo scontrol runuser; do
    command -v "$b" >/dev/null || die "'$b' is missing: run scripts/install-deps.sh (Debian's slurmctld slurmd slurm-client munge)"
  done
  getent passwd munge >/dev/null || die "no user 'munge' (Debian's munge package makes it): run scripts/install-deps.sh"
  # Something left of an earlier cluster in this directory (a daemon died): end it.
  if [ -e "$marker" ]; then
    if [ -n "$(cluster_pids)" ]; then
      say "a daemon of the earlier cluster in $dir has ended: stopping the rest, starting anew"
    fi
    kill_cluster || die "could not end the processes of the earlier cluster in $dir"
    rm -rf "$dir"
  elif [ -e "$dir" ] && [ -n "$(ls -A "$dir" 2>/dev/null)" ]; then
    die "$dir exists, is not empty and was not made by this script; set FULGUR_SLURM_DIR to another path"
  fi
  # Unix sockets: munged's, and slurmstepd's <spool>/<node>_<job>.<step> (107 bytes at most).
  local longest="$dir/spool-n1/n1_4294967294.4294967294"
  [ ${#longest} -le 107 ] ||
    die "FULGUR_SLURM_DIR='$dir' is too long for unix sockets (${#longest} > 107 bytes with slurmstepd's); use a shorter path"

  if [ "$netns" = 1 ]; then
    bash "$netns_script" addr $((nodes - 1)) >/dev/null 2>&1 ||
      die "--netns: no netns cluster \"${FULGUR_NETNS_NAME:-fulgur}\" with $nodes node(s) is up: run 'scripts/netns-cluster.sh up $nodes' first"
  fi
  mkdir -p "$dir"/{ctld,run,log,munge}
  for n in "${node_names[@]}"; do mkdir -p "$dir/spool-$n"; done
  touch "$marker"
  [ "$netns" = 0 ] || touch "$dir/.netns"
  chmod 0755 "$dir" "$dir/log"
  chmod 0700 "$dir/munge" "$dir/ctld"

  # munged runs as user munge: every directory above ours must let it pass.
  if ! runuser -u munge -- test -x "$dir"; then
    fail "user munge cannot reach $dir: a directory above it is not searchable by others (one made by mkdtemp has mode 0700; munged wants it searchable by all). chmod go+x it, or set FULGUR_SLURM_DIR elsewhere"
  fi
  # munged, as user munge, with a key of its own.
  dd if=/dev/urandom of="$dir/munge/munge.key" bs=1024 count=1 status=none
  chown -R munge:munge "$dir/munge"
  chmod 0400 "$dir/munge/munge.key"
  chmod 0755 "$dir/munge"  # clients (root, and the jobs) reach the socket
  spawned_at=$(now)
  spawn runuser -u munge -- munged \
    --socket="$dir/munge/munge.socket.2" --key-file="$dir/munge/munge.key" \
    --pid-file="$dir/munge/munged.pid" --log-file="$dir/munge/munged.log" \
    --seed-file="$dir/munge/munged.seed" \
    </dev/null >>"$dir/munge/munged.out" 2>&1 ||
    fail "munged did not start (exit status $?)" "$dir/munge/munged.out" "$dir/munge/munged.log"
  wait_for "$timeout_s" munge_works munged ||
    fail "$(wait_failure $? "munged answers on $dir/munge/munge.socket.2")" \
      "$dir/munge/munged.log" "$dir/munge/munged.out"

  read -r -a ports <<<"$(pick_ports $((1 + ${#node_names[@]})))"
  write_conf "${ports[@]}"
  export SLURM_CONF="$conf"

  # slurmctld (-i: no state to recover; the directory is new).
  spawned_at=$(now)
  set_on_node 0
  spawn "${on_node[@]}" slurmctld -i -f "$conf" </dev/null >>"$dir/log/slurmctld.out" 2>&1 ||
    fail "slurmctld did not start (exit status $?)" "$dir/log/slurmctld.out" "$dir/log/slurmctld.log"
  wait_for "$timeout_s" ctld_up slurmctld ||
    fail "$(wait_failure $? "slurmctld is up (scontrol ping)")" "$dir/log/slurmctld.log" "$dir/log/slurmctld.out"

  local daemons=(slurmctld) logs=("$dir/log/slurmctld.log")
  spawned_at=$(now)
  for i in "${!node_names[@]}"; do
    n="${node_names[$i]}"
    set_on_node "$i"
    spawn "${on_node[@]}" slurmd -N "$n" -f "$conf" </dev/null >>"$dir/log/slurmd-$n.out" 2>&1 ||
      fail "slurmd -N $n did not start (exit status $?)" "$dir/log/slurmd-$n.out" "$dir/log/slurmd-$n.log"
    daemons+=("slurmd-$n")
    logs+=("$dir/log/slurmd-$n.log" "$dir/log/slurmd-$n.out")
  done
  local status=0
  wait_for "$timeout_s" nodes_idle "${daemons[@]}" || status=$?
  if [ "$status" != 0 ]; then
    echo "slurm-cluster: sinfo now:" >&2
    slurm_cmd sinfo -N -o '%N %T %E' >&2 || true
    local shown=() f
    for f in "${logs[@]}"; do [ ! -s "$f" ] || shown+=("$f"); done
    fail "$(wait_failure "$status" "sinfo shows the node(s) ${node_names[*]} idle")" "${shown[@]}"
  fi
  say "started in $(elapsed "$t0"): ${#node_names[@]} node(s), slurmctld port ${ports[0]}, slurmd port(s) ${ports[*]:1}; SLURM $(slurmctld -V | cut -d' ' -f2)"
  say "use it with: eval \"\$($0 env)\""
}

stop() {
  local t0 pids
  t0=$(now)
  pids="$(cluster_pids)"
  if [ -z "$pids" ]; then
    if [ "$keep" = 0 ] && [ -e "$marker" ]; then rm -rf "$dir"; fi
    say "nothing runs in $dir"
    return 0
  fi
  kill_cluster || die "processes of the cluster in $dir survived SIGKILL"
  if [ "$keep" = 0 ]; then
    if [ -e "$marker" ]; then rm -rf "$dir"; fi
    say "stopped in $(elapsed "$t0"); $dir removed"
  else
    say "stopped in $(elapsed "$t0"); $dir kept"
  fi
}

[ -n "$cmd" ] || { usage >&2; exit 2; }
case "$cmd" in
  -h|--help|help) usage; exit 0 ;;
  env)
    printf 'export SLURM_CONF=%q\n' "$conf"
    printf 'export FULGUR_SLURM_DIR=%q\n' "$dir"
    exit 0 ;;
  status)
    if cluster_running; then print_status; exit 0; fi
    say "not running in $dir"
    if [ -f "$conf" ]; then print_status; fi
    exit 3 ;;
  start|stop) ;;
  *) die "unknown command '$cmd' (known: start, stop, status, env, --help)" ;;
esac

[ "$(id -u)" -eq 0 ] || die "needs root (munged runs as user munge, slurmd as root)"
command -v flock >/dev/null || die "flock (util-linux) is missing"
# One start or stop at a time for a directory: the lock is its parent directory.
mkdir -p "$(dirname "$dir")"
exec 8<"$(dirname "$dir")"
flock -w "$timeout_s" 8 || die "another slurm-cluster.sh holds the lock on $(dirname "$dir") for over $timeout_s s"
"$cmd"
