#!/usr/bin/env bash
# Two simulated hosts on this machine, node1 and node2, and a two-node Slurm on
# them, for the multi-node tests (tests/test_multinode.py).
#
#   .ci/hosts.sh start    make the hosts, then start Slurm on them; wait until
#                         both nodes are idle
#   .ci/hosts.sh stop     stop everything started here and remove the hosts
#                         (safe to repeat, and after a failed or killed test)
#   .ci/hosts.sh status   exit 0 when both hosts exist and both nodes take jobs
#   .ci/hosts.sh exec HOST CMD...
#                         run CMD inside HOST (its network, hostname, /etc/hosts)
#   .ci/hosts.sh env      print SLURM_CONF=<file>: the variable sbatch, srun and
#                         squeue need to reach this cluster rather than another
#
# A host is a network namespace (`ip netns`) with an address on a private
# bridge (10.199.77.0/24, which stays inside this machine), loopback up, and
# its own /etc/hosts (ip netns exec bind-mounts /etc/netns/<ns>/hosts over it)
# naming both hosts and the head. The machine's own namespace is the head: it
# holds the bridge (10.199.77.254) and slurmctld; each host runs one slurmd,
# started with its own hostname (unshare --uts), so a job's processes run
# inside the host they were given and reach the other host only over the link.
#
# Separate from the one-node Slurm of .ci/slurm.sh, which may run beside it:
# its own config (SLURM_CONF), ports (6917/6918), munged (own socket and key),
# state, spool and log folders under $ROOT. Processes are found through their
# pid files and the namespaces (`ip netns pids`), never by name.
#
# Root only. `start` exits 3 with one line when it cannot run here (not root, no
# `ip`/`unshare`, namespaces refused, Slurm not installable), so tests skip.
set -euo pipefail

ROOT=${STAGETRAIN_HOSTS_DIR:-/var/lib/stagetrain-hosts}
CONF_DIR=$ROOT/etc
CONF=$CONF_DIR/slurm.conf
HOSTS=(node1 node2)
NET=10.199.77
ADDRS=("$NET.1" "$NET.2")
HEAD_ADDR=$NET.254
BRIDGE=sthosts0
CTLD_PORT=6917
SLURMD_PORT=6918
MUNGE_DIR=$ROOT/munge
MUNGE_SOCKET=$MUNGE_DIR/munge.socket
START_TIMEOUT=${SLURM_START_TIMEOUT:-90}
HERE=$(cd "$(dirname "$0")" && pwd)
HEAD=$(hostname -s)

log() { echo "hosts.sh: $*"; }
die() { echo "hosts.sh: $*" >&2; exit 1; }
skip() { echo "hosts.sh: cannot make the simulated hosts here: $*"; exit 3; }
slurm() { SLURM_CONF=$CONF timeout 15 "$@"; }

alive() { [[ -r /proc/$1/stat ]] && [[ $(awk '{ print $3 }' "/proc/$1/stat" 2>/dev/null) != Z ]]; }

# The pid in a pid file when that process is alive and is the named program.
pid_of() {
    local file=$1 name=$2 pid
    [[ -r $file ]] || return 0
    pid=$(tr -dc '0-9' <"$file")
    if [[ -n $pid ]] && alive "$pid" && [[ $(cat "/proc/$pid/comm" 2>/dev/null) == "$name" ]]; then
        echo "$pid"
    fi
    return 0
}

# --- the hosts -----------------------------------------------------------------

veth() { echo "st-$1"; }   # the head's end of host $1's link (the host's end is eth0)

hosts_file() {
    printf '127.0.0.1 localhost\n%s %s\n' "$HEAD_ADDR" "$HEAD"
    local i
    for i in "${!HOSTS[@]}"; do printf '%s %s\n' "${ADDRS[$i]}" "${HOSTS[$i]}"; done
}

make_hosts() {
    ((EUID == 0)) || skip "it needs root (ip netns, daemons)"
    if ! command -v ip >/dev/null && command -v apt-get >/dev/null; then
        log "installing iproute2 with apt-get"
        DEBIAN_FRONTEND=noninteractive apt-get -y -q install --no-install-recommends iproute2 >/dev/null 2>&1 ||
            { timeout 300 apt-get -q update && DEBIAN_FRONTEND=noninteractive apt-get -y -q install \
                --no-install-recommends iproute2; } >/dev/null 2>&1 || true
    fi
    command -v ip >/dev/null || skip "no ip command (Debian: apt-get install iproute2)"
    command -v nsenter >/dev/null && command -v unshare >/dev/null || skip "no nsenter/unshare (util-linux)"
    if ! ip link show "$BRIDGE" >/dev/null 2>&1; then
        ip link add "$BRIDGE" type bridge 2>/dev/null || skip "ip link add type bridge refused"
        ip addr add "$HEAD_ADDR/24" dev "$BRIDGE"
    fi
    ip link set "$BRIDGE" up
    local i host
    for i in "${!HOSTS[@]}"; do
        host=${HOSTS[$i]}
        if ! ip netns list | grep -qw "^$host"; then
            ip netns add "$host" 2>/dev/null || skip "ip netns add $host refused"
        fi
        mkdir -p "/etc/netns/$host"
        hosts_file >"/etc/netns/$host/hosts"
        if ! ip link show "$(veth "$host")" >/dev/null 2>&1; then
            ip link add "$(veth "$host")" type veth peer name eth0 netns "$host"
            ip -n "$host" addr add "${ADDRS[$i]}/24" dev eth0
        fi
        ip link set "$(veth "$host")" master "$BRIDGE" up
        ip -n "$host" link set lo up
        ip -n "$host" link set eth0 up
    done
    log "hosts ${HOSTS[*]} at ${ADDRS[*]}, head $HEAD at $HEAD_ADDR (bridge $BRIDGE)"
}

remove_hosts() {
    local host pids
    for host in "${HOSTS[@]}"; do
        if ip netns list 2>/dev/null | grep -qw "^$host"; then
            # Only what runs inside our namespaces: slurmd, job steps, ranks.
            pids=$(ip netns pids "$host" 2>/dev/null || true)
            # shellcheck disable=SC2086
            [[ -z $pids ]] || kill -KILL $pids 2>/dev/null || true
            ip netns del "$host" || true
        fi
        ip link del "$(veth "$host")" 2>/dev/null || true
        rm -rf "/etc/netns/$host"
    done
    ip link del "$BRIDGE" 2>/dev/null || true
}

# Run a command inside a host: its network, its hostname, its /etc/hosts, and
# this cluster's config as its /etc/slurm (in a mount namespace of its own), so
# srun and scontrol in a job find it without SLURM_CONF, which Snakemake's
# job step removes from the environment of the commands it runs.
# Not `ip netns exec`, which also mounts a sysfs of the namespace over /sys and
# so hides /sys/fs/cgroup, without which slurmd does not start.
in_host() {
    local host=$1
    shift
    ip netns list 2>/dev/null | grep -qw "^$host" || die "host $host does not exist (.ci/hosts.sh start)"
    mkdir -p /etc/slurm   # the mount point of the hosts' Slurm config
    exec_in_host() {
        mount --bind "/etc/netns/$1/hosts" /etc/hosts && mount --bind "$2" /etc/slurm &&
            hostname "$1" && shift 2 && exec "$@"
    }
    nsenter --net="/run/netns/$host" unshare --mount --uts \
        bash -c "$(declare -f exec_in_host); exec_in_host \"\$@\"" in_host "$host" "$CONF_DIR" "$@"
}

# --- Slurm on the hosts ----------------------------------------------------------

start_munge() {
    if [[ -n $(pid_of "$MUNGE_DIR/munged.pid" munged) ]]; then return; fi
    install -d -m 700 "$MUNGE_DIR"
    if [[ ! -s $MUNGE_DIR/munge.key ]]; then
        dd if=/dev/urandom of="$MUNGE_DIR/munge.key" bs=1024 count=1 status=none
    fi
    chmod 400 "$MUNGE_DIR/munge.key"
    munged --force --socket="$MUNGE_SOCKET" --key-file="$MUNGE_DIR/munge.key" \
        --pid-file="$MUNGE_DIR/munged.pid" --log-file="$MUNGE_DIR/munged.log" \
        --seed-file="$MUNGE_DIR/munged.seed"
    for _ in $(seq 20); do
        if timeout 5 munge -S "$MUNGE_SOCKET" -n </dev/null 2>/dev/null |
            timeout 5 unmunge -S "$MUNGE_SOCKET" >/dev/null 2>&1; then return; fi
        sleep 0.5
    done
    tail -n 20 "$MUNGE_DIR/munged.log" >&2 || true
    die "munged does not answer on $MUNGE_SOCKET"
}

render_conf() {
    local cpus mem_mib real_mem host i
    cpus=$(nproc)
    mem_mib=$(awk '/^MemTotal:/ { print int($2 / 1024) }' /proc/meminfo)
    # The hosts share this machine's memory: each is given 90% of half of it.
    real_mem=$((mem_mib * 9 / 10 / ${#HOSTS[@]}))
    # Every host declares all of the machine's CPUs (they are simulated: both run
    # on the same cores), so a plan detected on one fits each.
    cat <<EOF
# Written by .ci/hosts.sh: a two-node test cluster on simulated hosts.
ClusterName=hosts
SlurmctldHost=$HEAD($HEAD_ADDR)
SlurmctldPort=$CTLD_PORT
SlurmdPort=$SLURMD_PORT
SlurmUser=root
AuthType=auth/munge
AuthInfo=socket=$MUNGE_SOCKET
MpiDefault=none
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
ReturnToService=2
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU_Memory
DefMemPerCPU=$((real_mem / cpus))
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
StateSaveLocation=$ROOT/slurmctld/state
SlurmctldPidFile=$ROOT/slurmctld/slurmctld.pid
SlurmctldLogFile=$ROOT/slurmctld/slurmctld.log
# One spool, pid and log file per host (%n: the node's name).
SlurmdSpoolDir=$ROOT/%n/spool
SlurmdPidFile=$ROOT/%n/slurmd.pid
SlurmdLogFile=$ROOT/%n/slurmd.log
SlurmctldDebug=info
SlurmdDebug=info
# Snakemake's Slurm executor trusts squeue only with MinJobAge >= 120 s (see .ci/slurm.sh).
MinJobAge=600
# A job's processes get SIGTERM, then SIGKILL this many seconds later (default 30).
KillWait=5
MailProg=/bin/true
EOF
    for i in "${!HOSTS[@]}"; do
        host=${HOSTS[$i]}
        echo "NodeName=$host NodeAddr=${ADDRS[$i]} NodeHostname=$host CPUs=$cpus RealMemory=$real_mem State=UNKNOWN"
    done
    echo "PartitionName=debug Nodes=$(IFS=,; echo "${HOSTS[*]}") Default=YES MaxTime=INFINITE State=UP"
}

start_slurm() {
    bash "$HERE/slurm.sh" install || exit $?   # exit 3 (cannot install) passes through
    start_munge
    local clear="" host
    mkdir -p "$ROOT/slurmctld/state" "$CONF_DIR"
    if [[ ! -f $CONF || $(cat "$CONF") != "$(render_conf)" ]]; then
        render_conf >"$CONF"
        clear=-c
        stop_slurm_daemons
    fi
    if [[ -z $(pid_of "$ROOT/slurmctld/slurmctld.pid" slurmctld) ]]; then
        SLURM_CONF=$CONF slurmctld $clear
    fi
    for host in "${HOSTS[@]}"; do
        mkdir -p "$ROOT/$host/spool"
        if [[ -z $(pid_of "$ROOT/$host/slurmd.pid" slurmd) ]]; then
            SLURM_CONF=$CONF in_host "$host" slurmd -N "$host"
        fi
    done
    wait_for_nodes
}

node_states() { slurm sinfo -h -N -o '%N %T' 2>/dev/null || true; }

wait_for_nodes() {
    local deadline=$((SECONDS + START_TIMEOUT)) states resumed=0
    while ((SECONDS < deadline)); do
        states=$(node_states)
        if [[ $(grep -cE ' (idle|mixed|allocated)$' <<<"$states") == "${#HOSTS[@]}" ]]; then
            log "Slurm: $(tr '\n' ' ' <<<"$states")(SLURM_CONF=$CONF)"
            return 0
        fi
        if ((resumed == 0)) && grep -qE ' (down|drain|fail)' <<<"$states"; then
            slurm scontrol update NodeName="$(IFS=,; echo "${HOSTS[*]}")" State=RESUME 2>/dev/null || true
            resumed=1
        fi
        sleep 1
    done
    echo "hosts.sh: Slurm nodes not idle after ${START_TIMEOUT}s: $(tr '\n' ' ' <<<"$states")" >&2
    local f
    for f in "$ROOT/slurmctld/slurmctld.log" "$ROOT"/node*/slurmd.log "$MUNGE_DIR/munged.log"; do
        [[ -f $f ]] && { echo "--- last lines of $f" >&2; tail -n 15 "$f" >&2; }
    done
    exit 1
}

stop_pid() {
    local pid=$1
    kill "$pid" 2>/dev/null || true
    for _ in $(seq 20); do alive "$pid" || return 0; sleep 0.5; done
    kill -KILL "$pid" 2>/dev/null || true
}

stop_slurm_daemons() {
    local host pid
    for host in "${HOSTS[@]}"; do
        pid=$(pid_of "$ROOT/$host/slurmd.pid" slurmd)
        [[ -z $pid ]] || stop_pid "$pid"
    done
    pid=$(pid_of "$ROOT/slurmctld/slurmctld.pid" slurmctld)
    [[ -z $pid ]] || stop_pid "$pid"
}

cmd_start() {
    make_hosts
    start_slurm
}

cmd_stop() {
    stop_slurm_daemons
    remove_hosts
    local pid
    pid=$(pid_of "$MUNGE_DIR/munged.pid" munged)
    [[ -z $pid ]] || stop_pid "$pid"
    # Job state of this run goes too: the next start begins from nothing.
    rm -rf "$ROOT/slurmctld/state" "$ROOT"/node*/spool
    log "stopped; hosts removed"
}

cmd_status() {
    local host
    for host in "${HOSTS[@]}"; do
        ip netns list 2>/dev/null | grep -qw "^$host" || { echo "hosts.sh: host $host does not exist"; return 1; }
    done
    [[ -f $CONF ]] || { echo "hosts.sh: no $CONF"; return 1; }
    local states
    states=$(node_states)
    echo "$states"
    [[ $(grep -cE ' (idle|mixed|allocated|completing)$' <<<"$states") == "${#HOSTS[@]}" ]]
}

# The whole command line is read before any of it runs (a function), so an edit
# to this file while it runs (a test's `exec` lasts minutes) cannot change it.
main() {
  case ${1:-} in
    start) cmd_start ;;
    stop) cmd_stop ;;
    status) cmd_status ;;
    env) echo "SLURM_CONF=$CONF" ;;
    exec) shift; in_host "$@" ;;
    *) echo "usage: $0 start|stop|status|env|exec HOST CMD..." >&2; exit 2 ;;
  esac
}
main "$@"; exit
