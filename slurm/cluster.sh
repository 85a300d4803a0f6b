#!/usr/bin/env bash
# Run a real, local Slurm cluster (slurmctld + several slurmd "nodes") on this one host,
# for tests and demos.  Needs root; works without systemd, a tty or stdin.
#
#   bash slurm/cluster.sh up              install (if missing) and start; no-op when already healthy
#   bash slurm/cluster.sh down [--purge]  cancel jobs, stop the daemons we started; --purge wipes the state dir
#   bash slurm/cluster.sh status          report; exit 0 when up and usable, 1 otherwise
#
# Environment:
#   HPCTRAIN_SLURM_DIR      state dir (config, logs, spool, pids)       default /tmp/hpctrain-slurm
#   HPCTRAIN_SLURM_NODES    number of slurmd nodes (n1..nN)             default 3 (a 2-node job can move
#                                                                        off a failed node: the preflight test)
#   HPCTRAIN_SLURM_CPUS     CPUs advertised per node                     default 4
#   HPCTRAIN_SLURM_PORT     slurmctld port; node i listens on PORT+i     default 6817
#   HPCTRAIN_SLURM_TIMEOUT  seconds to wait for each readiness step      default 60
#   HPCTRAIN_SLURM_FORCE    1: set aside a foreign /etc/slurm/slurm.conf (restored by down)
set -euo pipefail

STATE_DIR=$(realpath -m -- "${HPCTRAIN_SLURM_DIR:-/tmp/hpctrain-slurm}")
NODES=${HPCTRAIN_SLURM_NODES:-3}
CPUS=${HPCTRAIN_SLURM_CPUS:-4}
BASE_PORT=${HPCTRAIN_SLURM_PORT:-6817}
TIMEOUT=${HPCTRAIN_SLURM_TIMEOUT:-60}
FORCE=${HPCTRAIN_SLURM_FORCE:-0}

CONF="$STATE_DIR/slurm.conf"
SYS_CONF=/etc/slurm/slurm.conf
SYS_CONF_SAVED=/etc/slurm/slurm.conf.hpctrain-saved
CTLD_PID="$STATE_DIR/slurmctld.pid"
CTLD_LOG="$STATE_DIR/slurmctld.log"
MUNGE_MARK="$STATE_DIR/munged.started-by-us"
MUNGE_PID=/run/munge/munged.pid
PACKAGES=(slurmctld slurmd slurm-client munge)
HOST=$(hostname -s)

# Our own client calls always talk to our cluster, whatever the caller's environment says.
export SLURM_CONF="$CONF"
export DEBIAN_FRONTEND=noninteractive

T0=$(date +%s.%N)
say()  { printf '[slurm] %s\n' "$*"; }
warn() { printf '[slurm] WARNING: %s\n' "$*" >&2; }
elapsed() { awk -v a="$T0" -v b="$(date +%s.%N)" 'BEGIN { printf "%.1f", b - a }'; }

show_log() {  # show_log FILE...
    local f
    for f in "$@"; do
        [[ -f $f ]] || continue
        printf -- '----- last lines of %s -----\n' "$f" >&2
        tail -n 25 -- "$f" >&2 || true
    done
}
all_logs() {
    local i list=("$CTLD_LOG")
    for ((i = 1; i <= NODES; i++)); do list+=("$STATE_DIR/slurmd-n$i.log"); done
    printf '%s\n' "${list[@]}"
}
die() {  # die MESSAGE [LOGFILE...]
    printf '[slurm] ERROR: %s\n' "$1" >&2
    shift
    show_log "$@"
    exit 1
}

validate_settings() {
    [[ $NODES =~ ^[1-9][0-9]*$ ]] || die "HPCTRAIN_SLURM_NODES must be a positive integer (got '$NODES')"
    [[ $CPUS =~ ^[1-9][0-9]*$ ]] || die "HPCTRAIN_SLURM_CPUS must be a positive integer (got '$CPUS')"
    [[ $BASE_PORT =~ ^[1-9][0-9]*$ ]] || die "HPCTRAIN_SLURM_PORT must be a port number (got '$BASE_PORT')"
    [[ $TIMEOUT =~ ^[1-9][0-9]*$ ]] || die "HPCTRAIN_SLURM_TIMEOUT must be a positive integer (got '$TIMEOUT')"
    [[ $STATE_DIR != / ]] || die "HPCTRAIN_SLURM_DIR must not be /"
}

need_root() {
    [[ $(id -u) -eq 0 ]] || die "must run as root (it starts munged, slurmctld and slurmd)"
}

# Serialise concurrent up/down calls.  The lock lives next to the state dir so --purge can remove the dir.
take_lock() {
    mkdir -p -- "$(dirname -- "$STATE_DIR")"
    exec 9>"$STATE_DIR.lock"
    flock -w 300 9 || die "could not take the lock $STATE_DIR.lock within 300 s"
}

# ---------------------------------------------------------------- processes

# pid_alive PIDFILE NAME: true when the pid file names a live process whose command name is NAME.
pid_alive() {
    local pid comm
    [[ -s $1 ]] || return 1
    pid=$(tr -dc '0-9' <"$1")
    [[ -n $pid ]] || return 1
    [[ -r /proc/$pid/comm ]] || return 1
    comm=$(cat "/proc/$pid/comm" 2>/dev/null) || return 1
    [[ $comm == "$2" ]]
}
pid_of() { tr -dc '0-9' <"$1"; }

# stop_pids NAME PIDFILE...: SIGTERM every live NAME process named by the pid files, wait up to 20 s
# for all of them together, then SIGKILL what is left.
stop_pids() {
    local name=$1 f pid i left
    shift
    local pids=()
    for f in "$@"; do
        if pid_alive "$f" "$name"; then
            pid=$(pid_of "$f")
            pids+=("$pid")
            kill -TERM "$pid" 2>/dev/null || true
        fi
    done
    for ((i = 0; i < 200 && ${#pids[@]} > 0; i++)); do
        left=()
        for pid in "${pids[@]}"; do [[ -d /proc/$pid ]] && left+=("$pid"); done
        ((${#left[@]} == 0)) && break
        sleep 0.1
    done
    for pid in "${pids[@]}"; do
        if [[ -d /proc/$pid ]]; then
            warn "$name (pid $pid) ignored SIGTERM for 20 s; sending SIGKILL"
            kill -KILL "$pid" 2>/dev/null || true
            for ((i = 0; i < 50; i++)); do
                [[ -d /proc/$pid ]] || break
                sleep 0.1
            done
        fi
    done
    rm -f -- "$@"
    ((${#pids[@]} == 0)) || say "stopped $name (pid ${pids[*]})"
}

# Start a daemon detached from our session, stdio and lock fd, so callers that capture our output
# (CI pipes) are not held open by it and killing our process group does not kill it.
launch() {  # launch LOGFILE CMD...
    local log=$1
    shift
    setsid -w "$@" </dev/null >>"$log" 2>&1 9>&- || return 1
}

# ---------------------------------------------------------------- packages

pkg_installed() {
    [[ $(dpkg-query -W -f='${Status}' "$1" 2>/dev/null || true) == "install ok installed" ]]
}

ensure_packages() {
    local p missing=()
    for p in "${PACKAGES[@]}"; do
        pkg_installed "$p" || missing+=("$p")
    done
    ((${#missing[@]} == 0)) && return 0
    command -v apt-get >/dev/null || die "missing packages (${missing[*]}) and no apt-get to install them"
    say "installing ${missing[*]} (apt-get)"
    local apt_log="$STATE_DIR/apt.log"
    # Refresh the package lists first when they are missing or do not know our packages.
    if [[ -z $(apt-cache policy "${missing[0]}" 2>/dev/null | awk '/Candidate:/ && $2 != "(none)" { print $2 }') ]]; then
        apt-get update </dev/null >>"$apt_log" 2>&1 || die "apt-get update failed" "$apt_log"
    fi
    if ! apt-get install -y --no-install-recommends "${missing[@]}" </dev/null >>"$apt_log" 2>&1; then
        say "apt-get install failed; refreshing package lists and retrying"
        apt-get update </dev/null >>"$apt_log" 2>&1 || die "apt-get update failed" "$apt_log"
        apt-get install -y --no-install-recommends "${missing[@]}" </dev/null >>"$apt_log" 2>&1 ||
            die "apt-get install ${missing[*]} failed" "$apt_log"
    fi
    say "installed ${missing[*]} ($(elapsed) s)"
}

# ---------------------------------------------------------------- munge

munge_ok() {
    command -v munge >/dev/null && command -v unmunge >/dev/null || return 1
    munge -n </dev/null 2>/dev/null | unmunge >/dev/null 2>&1
}

ensure_munge() {
    if munge_ok; then
        return 0
    fi
    if [[ ! -s /etc/munge/munge.key ]]; then
        say "creating /etc/munge/munge.key"
        install -d -o munge -g munge -m 0700 /etc/munge
        if command -v mungekey >/dev/null; then
            runuser -u munge -- mungekey --create --keyfile=/etc/munge/munge.key </dev/null
        else
            dd if=/dev/urandom of=/etc/munge/munge.key bs=1024 count=1 status=none
        fi
        chown munge:munge /etc/munge/munge.key
        chmod 0400 /etc/munge/munge.key
    fi
    install -d -o munge -g munge -m 0755 /run/munge
    install -d -o munge -g munge -m 0700 /var/log/munge /var/lib/munge
    # A stale pid file or socket from an unclean stop makes munged refuse to start.
    if [[ -e $MUNGE_PID ]] && ! pid_alive "$MUNGE_PID" munged; then
        rm -f -- "$MUNGE_PID" /run/munge/munge.socket.2 /run/munge/munge.socket.2.lock
    fi
    say "starting munged"
    launch "$STATE_DIR/munged.out" runuser -u munge -- /usr/sbin/munged ||
        die "munged failed to start" "$STATE_DIR/munged.out" /var/log/munge/munged.log
    local i
    for ((i = 0; i < 50; i++)); do
        munge_ok && break
        sleep 0.2
    done
    munge_ok || die "munged started but 'munge -n | unmunge' fails" "$STATE_DIR/munged.out" /var/log/munge/munged.log
    : >"$MUNGE_MARK"
}

# ---------------------------------------------------------------- configuration

real_memory_mb() {  # per node: 90 % of this host's memory, split between the nodes
    local kb
    kb=$(awk '/^MemTotal:/ { print $2 }' /proc/meminfo)
    local mb=$((kb / 1024 * 9 / 10 / NODES))
    ((mb < 100)) && mb=100
    echo "$mb"
}

# Node topology.  Advertising the CPUs as 2-way hyperthreaded cores (with CR_Core, Slurm hands out
# whole cores) makes `srun -N2 -n4` put 2 tasks on each node (ranks 0-1 on n1, 2-3 on n2); with
# single-thread cores Slurm would fill n1 first (3+1).  Cost: a 1-task job holds a whole core (2 CPUs).
node_topology() {
    if ((CPUS % 2 == 0)); then
        echo "Sockets=1 CoresPerSocket=$((CPUS / 2)) ThreadsPerCore=2"
    else
        echo "Sockets=1 CoresPerSocket=$CPUS ThreadsPerCore=1"
    fi
}

write_config() {  # write_config FILE
    local mem i topo
    mem=$(real_memory_mb)
    topo=$(node_topology)
    {
        cat <<EOF
# Generated by hpctrain slurm/cluster.sh -- edits are overwritten by the next 'up'.
ClusterName=hpctrain-local
SlurmctldHost=$HOST(127.0.0.1)
SlurmctldPort=$BASE_PORT
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=cred_expire=10

StateSaveLocation=$STATE_DIR/ctld
SlurmctldPidFile=$CTLD_PID
SlurmctldLogFile=$CTLD_LOG
SlurmctldDebug=info
SlurmdSpoolDir=$STATE_DIR/spool/%n
SlurmdPidFile=$STATE_DIR/slurmd-%n.pid
SlurmdLogFile=$STATE_DIR/slurmd-%n.log
SlurmdDebug=info
TmpFS=$STATE_DIR/tmp/%n
SlurmdParameters=config_overrides

ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
MpiDefault=none
SwitchType=switch/none
LaunchType=launch/slurm

AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none

SchedulerType=sched/backfill
SchedulerParameters=bf_interval=1,sched_interval=2
ReturnToService=2
JobRequeue=1
KillWait=5
# A step's tasks ending slowly after SIGKILL on a loaded host (their files flushed to a busy disk: CI-34 saw ~65 s)
# drained the node "Kill task failed" at the default 60 s, and every later 2-node test lost it.
UnkillableStepTimeout=180
InactiveLimit=0
MinJobAge=300
SlurmdTimeout=60
MailProg=/bin/true

EOF
        for ((i = 1; i <= NODES; i++)); do
            printf 'NodeName=n%d NodeHostname=%s NodeAddr=127.0.0.1 Port=%d CPUs=%d %s RealMemory=%d State=UNKNOWN\n' \
                "$i" "$HOST" $((BASE_PORT + i)) "$CPUS" "$topo" "$mem"
        done
        printf 'PartitionName=debug Nodes=n[1-%d] Default=YES MaxTime=UNLIMITED State=UP\n' "$NODES"
    } >"$1"
}

make_dirs() {
    local i
    mkdir -p -- "$STATE_DIR/ctld"
    for ((i = 1; i <= NODES; i++)); do
        mkdir -p -- "$STATE_DIR/spool/n$i" "$STATE_DIR/tmp/n$i"
    done
    chmod 0755 "$STATE_DIR"
    chmod 1777 "$STATE_DIR"/tmp/n*
}

# /etc/slurm/slurm.conf -> our config, so client commands work from any shell without SLURM_CONF.
link_points_to_us() {
    [[ -L $SYS_CONF ]] || return 1
    local t
    t=$(readlink -- "$SYS_CONF")
    [[ $t == "$STATE_DIR"/* ]]
}

sys_conf_foreign() { [[ -e $SYS_CONF || -L $SYS_CONF ]] && ! link_points_to_us; }

# Refuse early (before starting anything) when another slurm.conf is in the way.
check_sys_conf() {
    sys_conf_foreign || return 0
    if [[ $FORCE != 1 ]]; then
        die "$SYS_CONF already exists and is not ours: $(ls -l -- "$SYS_CONF" | cut -c1-200)
  Refusing to replace it. Set HPCTRAIN_SLURM_FORCE=1 to move it aside to $SYS_CONF_SAVED
  (put back by 'down'), or remove it yourself."
    fi
    if [[ -e $SYS_CONF_SAVED || -L $SYS_CONF_SAVED ]]; then
        die "$SYS_CONF_SAVED already exists; sort out $SYS_CONF by hand first"
    fi
}

ensure_link() {
    if link_points_to_us && [[ $(readlink -- "$SYS_CONF") == "$CONF" ]]; then
        return 0
    fi
    mkdir -p /etc/slurm
    if sys_conf_foreign; then
        check_sys_conf
        say "HPCTRAIN_SLURM_FORCE=1: moving $SYS_CONF aside to $SYS_CONF_SAVED"
        mv -- "$SYS_CONF" "$SYS_CONF_SAVED"
    fi
    ln -sfn -- "$CONF" "$SYS_CONF"
    say "linked $SYS_CONF -> $CONF"
}

remove_link() {
    if link_points_to_us; then
        rm -f -- "$SYS_CONF"
        say "removed $SYS_CONF symlink"
        if [[ -e $SYS_CONF_SAVED || -L $SYS_CONF_SAVED ]]; then
            mv -- "$SYS_CONF_SAVED" "$SYS_CONF"
            say "restored the earlier $SYS_CONF"
        fi
    fi
}

# ---------------------------------------------------------------- health

ctld_running() { pid_alive "$CTLD_PID" slurmctld; }
slurmd_running() { pid_alive "$STATE_DIR/slurmd-$1.pid" slurmd; }
ctld_up() { scontrol ping 2>/dev/null </dev/null | grep -q 'is UP'; }

node_states() {  # "name state" lines, one per node
    sinfo -h -N -o '%N %T' </dev/null 2>/dev/null | sort -u
}

# Every node in a usable state (idle, mixed, allocated, completing or planned).
nodes_usable() {
    local states
    states=$(node_states) || return 1
    [[ -n $states ]] || return 1
    [[ $(wc -l <<<"$states") -ge $NODES ]] || return 1
    ! awk '$2 !~ /^(idle|mixed|allocated|completing|planned)$/ { bad = 1 } END { exit !bad }' <<<"$states"
}

all_running() {
    local i
    munge_ok && ctld_running || return 1
    for ((i = 1; i <= NODES; i++)); do slurmd_running "n$i" || return 1; done
}

healthy() { all_running && ctld_up && nodes_usable; }

# ---------------------------------------------------------------- up

start_ctld() {
    if ! ctld_running; then
        rm -f -- "$CTLD_PID"
        say "starting slurmctld (port $BASE_PORT)"
        launch "$STATE_DIR/slurmctld.out" /usr/sbin/slurmctld -f "$CONF" ||
            die "slurmctld failed to start" "$STATE_DIR/slurmctld.out" "$CTLD_LOG"
    fi
    local deadline=$((SECONDS + TIMEOUT)) started=$SECONDS
    # Our slurmctld must be alive too: a ping could be answered by some other slurmctld on the port.
    until ctld_running && ctld_up; do
        if ! ctld_running && ((SECONDS - started >= 5)); then
            die "slurmctld exited (port $BASE_PORT in use?)" "$STATE_DIR/slurmctld.out" "$CTLD_LOG"
        fi
        ((SECONDS < deadline)) || die "slurmctld not answering 'scontrol ping' after ${TIMEOUT} s" \
            "$STATE_DIR/slurmctld.out" "$CTLD_LOG"
        sleep 0.3
    done
}

start_slurmds() {
    local i n
    for ((i = 1; i <= NODES; i++)); do
        n=n$i
        slurmd_running "$n" && continue
        rm -f -- "$STATE_DIR/slurmd-$n.pid"
        say "starting slurmd $n (port $((BASE_PORT + i)))"
        launch "$STATE_DIR/slurmd-$n.out" /usr/sbin/slurmd -f "$CONF" -N "$n" ||
            die "slurmd $n failed to start" "$STATE_DIR/slurmd-$n.out" "$STATE_DIR/slurmd-$n.log"
    done
}

wait_nodes() {
    local deadline=$((SECONDS + TIMEOUT)) last_resume=-100 states bad i logs
    while :; do
        states=$(node_states || true)
        if nodes_usable; then
            return 0
        fi
        for ((i = 1; i <= NODES; i++)); do
            slurmd_running "n$i" || die "slurmd n$i exited" "$STATE_DIR/slurmd-n$i.out" "$STATE_DIR/slurmd-n$i.log"
        done
        # Nodes left down/drained by an earlier run: put them back in service (not too often).
        bad=$(awk '$2 ~ /^(down|drain|drained|draining|fail)/ && $2 !~ /\*$/ { print $1 }' <<<"$states" | paste -sd, -)
        if [[ -n $bad ]] && ((SECONDS - last_resume >= 3)); then
            say "resuming $bad"
            scontrol update nodename="$bad" state=resume </dev/null >/dev/null 2>&1 || true
            last_resume=$SECONDS
        fi
        if ((SECONDS >= deadline)); then
            printf '%s\n' "$states" >&2
            mapfile -t logs < <(all_logs)
            die "nodes not idle after ${TIMEOUT} s" "${logs[@]}"
        fi
        sleep 0.5
    done
}

cmd_up() {
    need_root
    validate_settings
    take_lock
    check_sys_conf
    mkdir -p -- "$STATE_DIR"
    ensure_packages
    ensure_munge

    local new="$STATE_DIR/slurm.conf.new" changed=0
    write_config "$new"
    if [[ -f $CONF ]] && cmp -s "$new" "$CONF"; then
        rm -f -- "$new"
    else
        changed=1
    fi

    if ((changed == 0)) && healthy && link_points_to_us; then
        say "already up ($(elapsed) s): $NODES nodes, config $CONF"
        sinfo </dev/null
        return 0
    fi

    if ((changed)); then
        if [[ -f $CONF ]] && { ctld_running || any_slurmd_running; }; then
            # Node layouts may differ, so running jobs would not survive the restart cleanly.
            say "configuration changed: cancelling jobs and restarting the Slurm daemons"
            cancel_jobs
            stop_daemons
        fi
        mv -f -- "$new" "$CONF"
    fi
    make_dirs
    ensure_link
    start_ctld
    start_slurmds
    wait_nodes
    say "up in $(elapsed) s: $NODES nodes x $CPUS CPUs, partition debug; config $CONF"
    sinfo </dev/null
}

# ---------------------------------------------------------------- down

any_slurmd_running() {
    local f n
    for f in "$STATE_DIR"/slurmd-*.pid; do
        [[ -e $f ]] || continue
        n=${f##*/slurmd-}
        n=${n%.pid}
        slurmd_running "$n" && return 0
    done
    return 1
}

cancel_jobs() {
    ctld_running && ctld_up || return 0
    local jobs i
    jobs=$(squeue -h -o %A </dev/null 2>/dev/null | paste -sd' ' -) || return 0
    [[ -n $jobs ]] || return 0
    say "cancelling jobs: $jobs"
    # shellcheck disable=SC2086
    scancel $jobs </dev/null >/dev/null 2>&1 || true
    for ((i = 0; i < 100; i++)); do
        [[ -z $(squeue -h -t all -o '%A %T' </dev/null 2>/dev/null |
            awk '$2 ~ /^(PENDING|RUNNING|COMPLETING|CONFIGURING|SUSPENDED|REQUEUED|REQUEUE_HOLD|RESIZING|SIGNALING|STAGE_OUT|STOPPED)$/') ]] && break
        sleep 0.2
    done
}

# Job step daemons (slurmstepd) that still hold sockets in our spool dirs once slurmd is gone.
leftover_stepds() {
    local inodes pid fd
    inodes=$(awk -v d="$STATE_DIR/spool/" 'index($8, d) == 1 { print $7 }' /proc/net/unix 2>/dev/null | sort -u)
    [[ -n $inodes ]] || return 0
    for pid in /proc/[0-9]*; do
        pid=${pid#/proc/}
        [[ $(cat "/proc/$pid/comm" 2>/dev/null || true) == slurmstepd ]] || continue
        for fd in /proc/"$pid"/fd/*; do
            [[ $(readlink "$fd" 2>/dev/null || true) =~ ^socket:\[([0-9]+)\]$ ]] || continue
            if grep -qx "${BASH_REMATCH[1]}" <<<"$inodes"; then
                echo "$pid"
                break
            fi
        done
    done
}

stop_daemons() {
    local pids
    stop_pids slurmd "$STATE_DIR"/slurmd-*.pid
    stop_pids slurmctld "$CTLD_PID"
    pids=$(leftover_stepds | paste -sd' ' -)
    if [[ -n $pids ]]; then
        warn "terminating leftover slurmstepd: $pids"
        # shellcheck disable=SC2086
        kill -TERM $pids 2>/dev/null || true
        sleep 1
        # shellcheck disable=SC2086
        kill -KILL $pids 2>/dev/null || true
    fi
}

cmd_down() {
    local purge=0 a
    for a in "$@"; do
        case $a in
            --purge) purge=1 ;;
            *) die "unknown option for down: $a" ;;
        esac
    done
    need_root
    validate_settings
    take_lock
    if [[ -d $STATE_DIR ]]; then
        if ctld_running || any_slurmd_running; then
            cancel_jobs
            stop_daemons
        else
            rm -f -- "$CTLD_PID" "$STATE_DIR"/slurmd-*.pid
        fi
        if [[ -e $MUNGE_MARK ]]; then
            stop_pids munged "$MUNGE_PID"
            rm -f -- "$MUNGE_MARK"
        fi
    fi
    remove_link
    if ((purge)) && [[ -d $STATE_DIR ]]; then
        rm -rf -- "$STATE_DIR"
        rm -f -- "$STATE_DIR.lock"
        say "purged $STATE_DIR"
    fi
    say "down ($(elapsed) s)"
}

# ---------------------------------------------------------------- status

cmd_status() {
    local ok=0 i yes=running no="not running"
    validate_settings
    if munge_ok; then say "munged:      $yes"; else say "munged:      $no"; ok=1; fi
    if ctld_running; then
        say "slurmctld:   $yes (pid $(pid_of "$CTLD_PID"))"
    else
        say "slurmctld:   $no"; ok=1
    fi
    for ((i = 1; i <= NODES; i++)); do
        if slurmd_running "n$i"; then
            say "slurmd n$i:   $yes (pid $(pid_of "$STATE_DIR/slurmd-n$i.pid"))"
        else
            say "slurmd n$i:   $no"; ok=1
        fi
    done
    if link_points_to_us; then say "$SYS_CONF -> $(readlink -- "$SYS_CONF")"; else say "$SYS_CONF: not linked to $CONF"; fi
    if [[ -f $CONF ]] && ctld_running && ctld_up; then
        sinfo </dev/null || ok=1
        nodes_usable || { say "nodes not all idle/mixed/allocated"; ok=1; }
    else
        ok=1
    fi
    if ((ok == 0)); then say "status: up"; else say "status: not up"; fi
    return "$ok"
}

usage() {  # the header comment above
    awk 'NR == 1 { next } /^#/ { sub(/^# ?/, ""); print; next } { exit }' "$0"
}

case ${1:-} in
    up) shift; (($# == 0)) || die "up takes no options"; cmd_up ;;
    down) shift; cmd_down "$@" ;;
    status) shift; cmd_status ;;
    -h | --help | help) usage ;;
    *) usage >&2; exit 2 ;;
esac
