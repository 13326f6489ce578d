#!/usr/bin/env bash
# A one-node Slurm cluster on this machine, for tests of the Slurm path
# (sbatch/srun, the Snakemake Slurm executor) on a CI box or a laptop VM.
#
#   .ci/slurm.sh start    install (Debian's slurm-wlm + munge) if needed, write
#                         /etc/slurm/slurm.conf for this host, start munged,
#                         slurmctld and slurmd, wait until the node is idle
#   .ci/slurm.sh stop     stop slurmd, slurmctld and munged (jobs are not cancelled)
#   .ci/slurm.sh status   print sinfo; exit 0 when the node takes jobs
#   .ci/slurm.sh install  only install slurm-wlm and munge where missing (.ci/hosts.sh uses it)
#
# Made for Debian/Ubuntu machines without systemd (containers, VMs): daemons
# are started directly and found again through their pid files. Root only.
# `start` exits 3, with one line saying why, when it cannot run here (not root,
# no apt-get to install Slurm, or the install failed), so tests can skip.
# Everything it waits for has a time limit; SLURM_START_TIMEOUT (seconds,
# default 60) bounds the wait for the node.
set -euo pipefail

CONF_DIR=/etc/slurm
CONF=$CONF_DIR/slurm.conf
LOG_DIR=/var/log/slurm
STATE_DIR=/var/lib/slurm/slurmctld
SPOOL_DIR=/var/lib/slurm/slurmd
CTLD_PID=/run/slurmctld.pid
SLURMD_PID=/run/slurmd.pid
MUNGE_KEY=/etc/munge/munge.key
MUNGE_PID=/run/munge/munged.pid
APT_LOG=/var/log/slurm-ci-apt.log
PARTITION=debug
START_TIMEOUT=${SLURM_START_TIMEOUT:-60}

NODE=$(hostname -s)

log() { echo "slurm.sh: $*"; }
die() { echo "slurm.sh: $*" >&2; exit 1; }
skip() { echo "slurm.sh: cannot start Slurm here: $*"; exit 3; }

# Whether a pid is a live process (not a zombie: a daemon's first fork can
# linger as one here until the container's init reaps it).
alive() { [[ -r /proc/$1/stat ]] && [[ $(awk '{ print $3 }' "/proc/$1/stat" 2>/dev/null) != Z ]]; }

# Whether a process belongs to another Slurm on this machine (.ci/hosts.sh's
# two-node cluster runs its daemons with SLURM_CONF set and munged on a socket
# of its own); this one's never set either.
foreign() {
    tr '\0' '\n' <"/proc/$1/environ" 2>/dev/null | grep -q '^SLURM_CONF=' ||
        tr '\0' ' ' <"/proc/$1/cmdline" 2>/dev/null | grep -q -- '--socket='
}

# Live pids of a daemon: the one in its pid file if that is alive and is the
# named program (a stale file after a crash or a restored snapshot can name a
# reused pid), else every live process with exactly that name that is not
# another Slurm's.
daemon_pids() {
    local file=$1 name=$2 pid
    if [[ -r $file ]]; then
        pid=$(tr -dc '0-9' <"$file")
        if [[ -n $pid ]] && alive "$pid" && [[ $(cat "/proc/$pid/comm" 2>/dev/null) == "$name" ]]; then
            echo "$pid"
            return 0
        fi
    fi
    for pid in $(pgrep -x "$name"); do
        if alive "$pid" && ! foreign "$pid"; then echo "$pid"; fi
    done
}

running() { [[ -n $(daemon_pids "$1" "$2") ]]; }

# State of our node as sinfo reports it ("idle", "mixed", "down*", ...), empty
# when slurmctld does not answer. sinfo retries for a while when slurmctld is
# down, hence the timeout.
node_state() {
    timeout 15 sinfo -h -N -n "$NODE" -o %T 2>/dev/null | head -n1 || true
}

usable() { [[ $(node_state) =~ ^(idle|mixed|allocated|completing)$ ]]; }

install_packages() {
    command -v apt-get >/dev/null || skip "slurmctld is not installed and there is no apt-get"
    log "installing slurm-wlm and munge with apt-get (log: $APT_LOG)"
    # Keep package scripts from starting the daemons (they would need systemd,
    # and this script starts them itself): the policy-rc.d convention. Docker
    # images already ship one that says no; only add ours when none exists.
    local policy=/usr/sbin/policy-rc.d added_policy=0
    if [[ ! -e $policy ]]; then
        printf '#!/bin/sh\nexit 101\n' >"$policy" && chmod 755 "$policy"
        added_policy=1
    fi
    local apt=(apt-get -y -q -o Dpkg::Options::=--force-confdef -o Dpkg::Options::=--force-confold)
    local rc=0
    export DEBIAN_FRONTEND=noninteractive
    # Try the package lists already on the machine first; refresh them only
    # when that fails (missing lists, or a mirror that moved on).
    if ! "${apt[@]}" install --no-install-recommends slurm-wlm munge >"$APT_LOG" 2>&1; then
        { timeout 300 apt-get -q update && "${apt[@]}" install --no-install-recommends slurm-wlm munge; } >>"$APT_LOG" 2>&1 || rc=$?
    fi
    if ((added_policy)); then rm -f "$policy"; fi
    if ((rc != 0)); then
        skip "apt-get install slurm-wlm munge failed (exit $rc; last line: $(tail -n1 "$APT_LOG"))"
    fi
    command -v slurmctld >/dev/null || die "slurmctld still missing after installing slurm-wlm"
}

start_munge() {
    if running "$MUNGE_PID" munged; then
        log "munged already running"
        return
    fi
    # munged refuses a key (or key directory) readable or writable by others.
    install -d -o munge -g munge -m 700 /etc/munge
    if [[ ! -s $MUNGE_KEY ]]; then
        log "creating $MUNGE_KEY"
        if command -v mungekey >/dev/null; then
            mungekey --create --keyfile="$MUNGE_KEY" --force
        else
            dd if=/dev/urandom of="$MUNGE_KEY" bs=1024 count=1 status=none
        fi
    fi
    chown munge:munge "$MUNGE_KEY"
    chmod 400 "$MUNGE_KEY"
    # /run is a tmpfs on most systems: the socket directory is gone after a reboot.
    install -d -o munge -g munge -m 755 /run/munge
    install -d -o munge -g munge -m 700 /var/lib/munge /var/log/munge
    # A crashed munged leaves its socket behind; --force lets a new one take it over.
    runuser -u munge -- /usr/sbin/munged --force
    for _ in $(seq 20); do
        if timeout 5 munge -n </dev/null 2>/dev/null | timeout 5 unmunge >/dev/null 2>&1; then
            log "munged started"
            return
        fi
        sleep 0.5
    done
    tail -n 20 /var/log/munge/munged.log >&2 || true
    die "munged does not answer (munge -n | unmunge fails)"
}

# slurm.conf for one node: this host, all of its CPUs, 90% of its memory.
render_conf() {
    local cpus mem_mib real_mem def_mem ctld_host node_addr=""
    cpus=$(nproc)
    mem_mib=$(awk '/^MemTotal:/ { print int($2 / 1024) }' /proc/meminfo)
    real_mem=$((mem_mib * 9 / 10))
    # Jobs that give no --mem get this much per CPU. Without it a job without
    # --mem is given the whole node's memory, so two such jobs never run together.
    def_mem=$((real_mem / cpus))
    ctld_host=$NODE
    # Slurm's daemons resolve the node and controller names; where this host's
    # name does not resolve (no /etc/hosts entry) use loopback explicitly.
    if ! getent hosts "$NODE" >/dev/null; then
        ctld_host="$NODE(127.0.0.1)"
        node_addr="NodeAddr=127.0.0.1 "
    fi
    # CR_CPU_Memory, not CR_Core_Memory: a core is the unit of allocation
    # under CR_Core, so on a host whose CPUs are hyperthreads of fewer cores
    # `-n $(nproc)` would not fit. With CR_CPU every CPU nproc counts is one
    # slot, whatever the topology.
    # TaskPlugin=task/none and ProctrackType=proctrack/linuxproc: the cgroup
    # plugins need a cgroup hierarchy delegated by systemd, which these
    # machines do not have; no cgroup.conf is therefore needed.
    cat <<EOF
# Written by .ci/slurm.sh for a one-node test cluster on $NODE.
ClusterName=ci
SlurmctldHost=$ctld_host
SlurmUser=root
AuthType=auth/munge
MpiDefault=none
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
ReturnToService=2
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU_Memory
DefMemPerCPU=$def_mem
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
StateSaveLocation=$STATE_DIR
SlurmdSpoolDir=$SPOOL_DIR
SlurmctldPidFile=$CTLD_PID
SlurmdPidFile=$SLURMD_PID
SlurmctldLogFile=$LOG_DIR/slurmctld.log
SlurmdLogFile=$LOG_DIR/slurmd.log
SlurmctldDebug=info
SlurmdDebug=info
# How long a finished job stays visible to squeue. Snakemake's Slurm executor
# polls job states with squeue when there is no accounting database (sacct
# fails: "Slurm accounting storage is disabled"), every 40 s at first and up to
# every 180 s; it only trusts squeue when MinJobAge >= 120 s.
MinJobAge=600
# No mail on this machine (the default, /bin/mail, is missing: an error per start).
MailProg=/bin/true
NodeName=$NODE ${node_addr}CPUs=$cpus RealMemory=$real_mem State=UNKNOWN
PartitionName=$PARTITION Nodes=$NODE Default=YES MaxTime=INFINITE State=UP
EOF
}

conf_current() { [[ -f $CONF && $(cat "$CONF") == "$(render_conf)" ]]; }

write_conf() {
    mkdir -p "$CONF_DIR" "$LOG_DIR" "$STATE_DIR" "$SPOOL_DIR"
    # Saved state (jobs, node records) from a different configuration, e.g. a
    # machine image taken under another hostname, can keep slurmctld from
    # starting or leave a phantom node; start from a clean state when the
    # configuration changed, and recover it otherwise.
    CLEAR_STATE=""
    if ! conf_current; then
        if [[ -f $CONF ]]; then log "$CONF changed; slurmctld starts from a clean state"; fi
        render_conf >"$CONF"
        CLEAR_STATE=-c
    fi
    log "$(grep '^NodeName=' "$CONF")"
}

start_daemons() {
    # Daemons still running with an older configuration: restart them.
    if [[ -n $CLEAR_STATE ]]; then
        if running "$SLURMD_PID" slurmd; then stop_daemon "$SLURMD_PID" slurmd; fi
        if running "$CTLD_PID" slurmctld; then stop_daemon "$CTLD_PID" slurmctld; fi
    fi
    if running "$CTLD_PID" slurmctld; then
        log "slurmctld already running"
    else
        slurmctld $CLEAR_STATE
    fi
    if running "$SLURMD_PID" slurmd; then
        log "slurmd already running"
    else
        slurmd
    fi
}

wait_for_node() {
    local deadline=$((SECONDS + START_TIMEOUT)) state resumed=0
    while ((SECONDS < deadline)); do
        state=$(node_state)
        case $state in
            # ("completing" is left alone: it passes once slurmd has
            # registered and cleaned up after jobs of a killed run.)
            idle|mixed|allocated)
                log "node $NODE is $state"
                return 0 ;;
            down*|drain*|fail*)
                # A node left DOWN or DRAINED by an earlier run (killed slurmd,
                # configuration change) does not always come back by itself.
                if ((resumed == 0)); then
                    log "node $NODE is $state; resuming it"
                    timeout 15 scontrol update NodeName="$NODE" State=RESUME || true
                    resumed=1
                fi ;;
        esac
        sleep 1
    done
    echo "slurm.sh: node $NODE is not idle after ${START_TIMEOUT}s (state: '${state:-no answer}')" >&2
    timeout 15 sinfo -N -l >&2 || true
    timeout 15 scontrol show node "$NODE" >&2 || true
    local f
    for f in "$LOG_DIR/slurmctld.log" "$LOG_DIR/slurmd.log" /var/log/munge/munged.log; do
        [[ -f $f ]] && { echo "--- last lines of $f" >&2; tail -n 25 "$f" >&2; }
    done
    exit 1
}

cmd_start() {
    ((EUID == 0)) || skip "it needs root (daemons, /etc/slurm, apt-get)"
    if command -v slurmctld >/dev/null && command -v slurmd >/dev/null && command -v munged >/dev/null &&
        running "$CTLD_PID" slurmctld && running "$SLURMD_PID" slurmd && conf_current && usable; then
        log "already running; node $NODE is $(node_state)"
        return 0
    fi
    if ! command -v slurmctld >/dev/null || ! command -v slurmd >/dev/null || ! command -v munged >/dev/null; then
        install_packages
    fi
    start_munge
    write_conf
    start_daemons
    wait_for_node
}

# Stop a daemon (found through its pid file, else by exact name), wait up to
# 15 s for it to exit, then kill it.
stop_daemon() {
    local file=$1 name=$2 pids pid left
    pids=$(daemon_pids "$file" "$name")
    if [[ -z $pids ]]; then
        log "$name not running"
        rm -f "$file"
        return 0
    fi
    # shellcheck disable=SC2086  # $pids is a list
    kill $pids 2>/dev/null || true
    for _ in $(seq 30); do
        left=""
        for pid in $pids; do if alive "$pid"; then left+=" $pid"; fi; done
        [[ -z $left ]] && break
        sleep 0.5
    done
    if [[ -n $left ]]; then
        log "$name did not stop in 15 s; killing it"
        # shellcheck disable=SC2086
        kill -KILL $left 2>/dev/null || true
    fi
    rm -f "$file"
    log "$name stopped"
}

cmd_stop() {
    stop_daemon "$SLURMD_PID" slurmd
    stop_daemon "$CTLD_PID" slurmctld
    stop_daemon "$MUNGE_PID" munged
    return 0
}

cmd_status() {
    command -v sinfo >/dev/null || { echo "slurm.sh: Slurm is not installed"; return 1; }
    timeout 15 sinfo || true
    if usable; then
        return 0
    fi
    echo "slurm.sh: node $NODE is not usable (state: '$(node_state)')"
    return 1
}

case ${1:-} in
    start) cmd_start ;;
    stop) cmd_stop ;;
    status) cmd_status ;;
    install)
        ((EUID == 0)) || skip "it needs root (apt-get)"
        if ! command -v slurmctld >/dev/null || ! command -v slurmd >/dev/null || ! command -v munged >/dev/null; then
            install_packages
        fi ;;
    *) echo "usage: $0 start|stop|status|install" >&2; exit 2 ;;
esac
