#!/usr/bin/env bash
# Provision this host for crab: apt packages, a CRIU new enough for the running
# kernel, kernel headers for bcc, tracefs, and a running Docker engine.
#
# Idempotent: every step first checks whether its result is already in place
# and returns at once if so, so a second run finishes in seconds.
#
# CRAB_DRY_RUN=1: every step only checks, and says "would ..." for what it
# would change; nothing on the host is changed (`crabctl host setup --dry-run`).
#
# The same script runs from a checkout (`make host`) and from an installed
# package (`crabctl host setup`, which runs its copy in crabd/_data/scripts).
#
# Why each step looks the way it does (details in ../shared/PLATFORM.md and
# docs/host.md):
#  * Debian 12's criu (3.17) fails `criu check` on kernels >= 6.x here, and
#    CRIU 4.1 cannot dump TCP sockets on kernels >= 6.16.  We take CRIU from a
#    newer Debian suite, unpacked into a private prefix with its own glibc and
#    loader, so the system's libc is never upgraded.  A `#!` wrapper named
#    `criu` goes on PATH before /usr/sbin, because runc execs `criu` by name.
#  * The kernel ships no headers and no /lib/modules/$(uname -r).  bcc finds
#    headers only through /lib/modules/$(uname -r)/{build,source}, so we unpack
#    Debian's header packages privately and link them there.
#  * Newer suites are read through a private apt configuration (its own
#    sources, lists and cache) so that the host's apt never sees them.
#  * The host's conntrack table is shrunk to CRAB_CONNTRACK_BUCKETS (32768;
#    "keep" leaves it): CRIU walks all of it twice in every process dump.
set -euo pipefail

CRAB_PREFIX=${CRAB_PREFIX:-/opt/crab}
CRAB_CACHE=${CRAB_CACHE:-/var/cache/crab}
CRAB_LOG_DIR=${CRAB_LOG_DIR:-/var/log/crab}
CRIU_MIN=${CRIU_MIN:-4.2}
CRIU_SUITE=${CRIU_SUITE:-forky}
# The btrfs pool of the runc backend; keep in step with [btrfs] in crabd.toml (docs/btrfs.md).
CRAB_BTRFS_IMAGE=${CRAB_BTRFS_IMAGE:-/var/lib/crab/btrfs.img}
CRAB_BTRFS_MOUNT=${CRAB_BTRFS_MOUNT:-/var/lib/crab/pool}
CRAB_BTRFS_SIZE=${CRAB_BTRFS_SIZE:-16G}
HEADERS_SUITE=${HEADERS_SUITE:-trixie}
CRAB_DRY_RUN=${CRAB_DRY_RUN:-0}
DEBIAN_MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
KEYRING=/usr/share/keyrings/debian-archive-keyring.gpg
# systemd: only for `systemd-analyze` (the unit's tests check it offline; no systemd needs to run).
# btrfs-progs, containernetworking-plugins: the runc backend's snapshot pool and CNI networking (issue 19).
# gcc, libc6-dev: crab-init is compiled (statically) on the host that runs it (crabd/util/resources.py).
# python3-venv: the host-wide install /opt/crab/venv is a venv of Debian's python3 (scripts/install-crab.sh).
APT_PACKAGES=(docker.io debootstrap python3-bpfcc bpfcc-tools busybox-static zstd iproute2 iptables ca-certificates systemd btrfs-progs containernetworking-plugins gcc libc6-dev python3-venv)

log() { printf '[setup-host] %s\n' "$*" >&2; }
die() { printf '[setup-host] ERROR: %s\n' "$*" >&2; exit 1; }
dry_run() { [ "$CRAB_DRY_RUN" = 1 ]; }
# What a step would change under CRAB_DRY_RUN=1 (crabd/host/provision.py collects these lines).
would() { log "would $*"; }

[ "$(id -u)" -eq 0 ] || die "must run as root (crab drives Docker, CRIU and BPF)"
if ! dry_run; then
    mkdir -p "$CRAB_PREFIX" "$CRAB_CACHE" "$CRAB_LOG_DIR"
fi

export DEBIAN_FRONTEND=noninteractive

# --- 1. apt packages ---------------------------------------------------------
ensure_apt_packages() {
    local missing=()
    for p in "${APT_PACKAGES[@]}"; do
        dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'install ok installed' || missing+=("$p")
    done
    if [ ${#missing[@]} -eq 0 ]; then
        log "apt packages: present"
        return
    fi
    if dry_run; then
        would "install apt packages: ${missing[*]}"
        return
    fi
    log "apt packages: installing ${missing[*]}"
    apt-get update -qq
    apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
}

# --- private apt roots for newer suites ----------------------------------------
# apt_private SUITE ARGS... runs apt-get/apt-cache against only SUITE.
apt_root() { printf '%s/apt-%s' "$CRAB_CACHE" "$1"; }
apt_opts() {
    local root; root=$(apt_root "$1")
    printf '%s\n' \
        -o "Dir::Etc::SourceList=$root/sources.list" -o Dir::Etc::SourceParts=/dev/null \
        -o Dir::Etc::Preferences=/dev/null -o Dir::Etc::PreferencesParts=/dev/null \
        -o "Dir::State=$root/state" -o Dir::State::status=/dev/null \
        -o "Dir::Cache=$root/cache" -o APT::Architecture=amd64 -o APT::Architectures=amd64 \
        -o APT::Sandbox::User=root
}
apt_private_init() {
    local suite=$1 root; root=$(apt_root "$suite")
    mkdir -p "$root/state/lists/partial" "$root/cache/archives/partial"
    echo "deb [signed-by=$KEYRING] $DEBIAN_MIRROR $suite main" >"$root/sources.list"
    mapfile -t opts < <(apt_opts "$suite")
    apt-get "${opts[@]}" update -qq
}
apt_private() {
    local suite=$1 tool=$2; shift 2
    mapfile -t opts < <(apt_opts "$suite")
    "$tool" "${opts[@]}" "$@"
}

# --- 2. CRIU ------------------------------------------------------------------
version_ge() { [ "$(printf '%s\n%s\n' "$2" "$1" | sort -V | head -1)" = "$2" ]; }

criu_ok() {  # criu_ok BINARY -> 0 if new enough and `criu check` passes
    local bin=$1 v
    [ -x "$bin" ] || return 1
    v=$("$bin" --version 2>/dev/null | sed -n 's/^Version: //p')
    [ -n "$v" ] && version_ge "$v" "$CRIU_MIN" || return 1
    "$bin" check >/dev/null 2>&1
}

write_criu_wrapper() {
    local wrapper=/usr/local/sbin/criu root=$CRAB_PREFIX/criu
    local want
    # runc execs "criu" from PATH; a wrapper must be a real script with a #!
    # line (a bare exec line gives "exec format error").  The private loader
    # runs criu against the private glibc; LD_LIBRARY_PATH is never exported,
    # so nothing criu spawns inherits the private libraries.
    want="#!/bin/sh
# Generated by crab's scripts/setup-host.sh: CRIU from Debian $CRIU_SUITE in a private prefix.
exec $root/usr/lib/x86_64-linux-gnu/ld-linux-x86-64.so.2 --library-path $root/usr/lib/x86_64-linux-gnu $root/usr/sbin/criu \"\$@\""
    if [ ! -f "$wrapper" ] || [ "$(cat "$wrapper")" != "$want" ]; then
        mkdir -p "$(dirname "$wrapper")"
        printf '%s\n' "$want" >"$wrapper.tmp"
        chmod 0755 "$wrapper.tmp"
        mv -f "$wrapper.tmp" "$wrapper"
    fi
}

ensure_criu() {
    if criu_ok /usr/local/sbin/criu; then
        log "criu: $(/usr/local/sbin/criu --version | head -1) (private prefix) passes criu check"
        return
    fi
    local sys; sys=$(PATH=/usr/sbin:/usr/bin:/sbin:/bin command -v criu || true)
    if [ -n "$sys" ] && criu_ok "$sys"; then
        log "criu: system $sys is new enough and passes criu check"
        return
    fi
    if dry_run; then
        would "provision CRIU >= $CRIU_MIN from Debian $CRIU_SUITE into $CRAB_PREFIX/criu and write /usr/local/sbin/criu"
        return
    fi
    log "criu: provisioning CRIU >= $CRIU_MIN from Debian $CRIU_SUITE into $CRAB_PREFIX/criu"
    apt_private_init "$CRIU_SUITE"
    local pkgs dl=$CRAB_CACHE/debs-criu stage=$CRAB_PREFIX/criu.new
    pkgs=$(apt_private "$CRIU_SUITE" apt-cache depends --recurse --no-recommends --no-suggests \
        --no-conflicts --no-breaks --no-replaces --no-enhances --no-pre-depends criu | grep -v '^ ' | sort -u)
    rm -rf "$dl" "$stage"; mkdir -p "$dl"
    # shellcheck disable=SC2086
    (cd "$dl" && apt_private "$CRIU_SUITE" apt-get download -qq $pkgs)
    for deb in "$dl"/*.deb; do dpkg -x "$deb" "$stage"; done
    rm -rf "$CRAB_PREFIX/criu"; mv "$stage" "$CRAB_PREFIX/criu"
    write_criu_wrapper
    criu_ok /usr/local/sbin/criu || die "provisioned CRIU fails 'criu check'; run /usr/local/sbin/criu check"
    log "criu: $(/usr/local/sbin/criu --version | head -1) ready"
}

# runc hands CRIU /etc/criu/runc.conf on every dump and restore (Docker offers
# no other way to pass CRIU options to `docker start --checkpoint`).
#  * tcp-established: a loopback TCP connection between two processes of a
#    sandbox is dumped and restored (connections to other hosts are rewritten
#    as closed by crabd before a restore);
#  * network-lock skip: CRIU's default lock runs iptables-restore twice per
#    dump (~75 ms each here); crabd freezes the whole sandbox for the dump and
#    closes outside connections at restore, so the lock protects nothing.
CRIU_CONF_LINES=("tcp-established" "network-lock skip")
ensure_criu_config() {
    local conf=/etc/criu/runc.conf marker="# crab: managed by scripts/setup-host.sh" line missing=()
    for line in "${CRIU_CONF_LINES[@]}"; do
        [ -f "$conf" ] && grep -qxF "$line" "$conf" || missing+=("$line")
    done
    if [ ${#missing[@]} -eq 0 ]; then
        log "criu config: $conf is set"
        return
    fi
    if dry_run; then
        would "add ${missing[*]} to $conf"
        return
    fi
    mkdir -p /etc/criu
    if [ -f "$conf" ] && ! grep -qF "$marker" "$conf"; then
        log "criu config: adding ${missing[*]} to the existing $conf"
        { printf '\n%s\n' "$marker"; printf '%s\n' "${missing[@]}"; } >>"$conf"
        return
    fi
    { printf '%s\n' "$marker"; printf '%s\n' "${CRIU_CONF_LINES[@]}"; } >"$conf.tmp"
    mv -f "$conf.tmp" "$conf"
    log "criu config: wrote $conf"
}

# CRIU dumps a sandbox netns's conntrack entries and expectations on every
# process checkpoint, and the kernel answers each dump by walking the host's
# WHOLE conntrack hash table: 20 ms of every freeze at 262144 buckets (this
# kernel's default on any host over 4 GiB), 2 ms at 16384 (docs/processes.md).
# The table is lowered to CRAB_CONNTRACK_BUCKETS (never raised; the kernel's
# entry limit, nf_conntrack_max, stays as it is: chains of 8 when full at 32768)
# and the size kept for the next boot; CRAB_CONNTRACK_BUCKETS=keep leaves it.
CRAB_CONNTRACK_BUCKETS=${CRAB_CONNTRACK_BUCKETS:-32768}
CONNTRACK_SYSCTL=/etc/sysctl.d/60-crab-conntrack.conf
CONNTRACK_MODPROBE=/etc/modprobe.d/crab-conntrack.conf
ensure_conntrack_table() {
    local f=/proc/sys/net/netfilter/nf_conntrack_buckets cur want=$CRAB_CONNTRACK_BUCKETS
    if [ "$want" = keep ]; then
        log "conntrack table: left as the host has it (CRAB_CONNTRACK_BUCKETS=keep)"
        return
    fi
    [[ "$want" =~ ^[1-9][0-9]*$ ]] || die "CRAB_CONNTRACK_BUCKETS must be a number of buckets or 'keep', not '$want'"
    if [ ! -r "$f" ]; then
        log "conntrack table: none on this host (nothing for CRIU to walk)"
        return
    fi
    cur=$(cat "$f")
    if [ "$cur" -le "$want" ]; then
        log "conntrack table: $cur buckets"
        return
    fi
    if dry_run; then
        would "shrink the conntrack table from $cur to $want buckets (and keep that size in $CONNTRACK_SYSCTL)"
        return
    fi
    echo "$want" >"$f" || die "cannot resize the conntrack table ($f); set CRAB_CONNTRACK_BUCKETS=keep to leave it"
    mkdir -p "$(dirname "$CONNTRACK_SYSCTL")" "$(dirname "$CONNTRACK_MODPROBE")"
    printf '# crab: managed by scripts/setup-host.sh (CRIU walks this table twice per process checkpoint)\nnet.netfilter.nf_conntrack_buckets = %s\n' "$want" >"$CONNTRACK_SYSCTL"
    printf '# crab: managed by scripts/setup-host.sh (CRIU walks this table twice per process checkpoint)\noptions nf_conntrack hashsize=%s\n' "$want" >"$CONNTRACK_MODPROBE"
    log "conntrack table: shrunk from $cur to $want buckets, kept in $CONNTRACK_SYSCTL and $CONNTRACK_MODPROBE"
}

# --- 3. kernel headers for bcc ---------------------------------------------------
ensure_kernel_headers() {
    local mod=/lib/modules/$(uname -r)
    if [ -e "$mod/build/include/linux/kconfig.h" ] || [ -e "$mod/build/include/generated/autoconf.h" ]; then
        log "kernel headers: $mod/build present"
        return
    fi
    if dry_run; then
        would "unpack Debian $HEADERS_SUITE kernel headers into $CRAB_PREFIX/kheaders and link them into $mod"
        return
    fi
    log "kernel headers: none for $(uname -r); unpacking Debian $HEADERS_SUITE headers into $CRAB_PREFIX/kheaders"
    apt_private_init "$HEADERS_SUITE"
    local ver dl=$CRAB_CACHE/debs-headers stage=$CRAB_PREFIX/kheaders.new
    ver=$(apt_private "$HEADERS_SUITE" apt-cache depends linux-headers-amd64 \
        | sed -n 's/.*Depends: linux-headers-\(.*\)-amd64$/\1/p' | head -1)
    [ -n "$ver" ] || die "cannot resolve linux-headers-amd64 in Debian $HEADERS_SUITE"
    rm -rf "$dl" "$stage"; mkdir -p "$dl"
    (cd "$dl" && apt_private "$HEADERS_SUITE" apt-get download -qq \
        "linux-headers-$ver-amd64" "linux-headers-$ver-common")
    for deb in "$dl"/*.deb; do dpkg -x "$deb" "$stage"; done
    rm -rf "$CRAB_PREFIX/kheaders"; mv "$stage" "$CRAB_PREFIX/kheaders"
    mkdir -p "$mod"
    # bcc needs both: build/ (the arch headers and generated config) and
    # source/ (the common tree); setting BCC_KERNEL_SOURCE alone is not enough
    # with Debian's split header packages.
    ln -sfn "$CRAB_PREFIX/kheaders/usr/src/linux-headers-$ver-amd64" "$mod/build"
    ln -sfn "$CRAB_PREFIX/kheaders/usr/src/linux-headers-$ver-common" "$mod/source"
    log "kernel headers: linked $ver into $mod"
}

# --- 4. tracefs ---------------------------------------------------------------
ensure_tracefs() {
    if [ -d /sys/kernel/tracing/events ]; then
        log "tracefs: mounted"
        return
    fi
    if dry_run; then
        would "mount tracefs at /sys/kernel/tracing"
        return
    fi
    mount -t tracefs none /sys/kernel/tracing || die "cannot mount tracefs at /sys/kernel/tracing"
    if ! mountpoint -q /sys/kernel/debug; then
        mount -t debugfs none /sys/kernel/debug 2>/dev/null || true
    fi
    log "tracefs: mounted at /sys/kernel/tracing"
}

# --- 5. Docker engine -----------------------------------------------------------
docker_answers() { timeout 10 docker info >/dev/null 2>&1; }

ensure_dockerd() {
    if docker_answers; then
        local exp; exp=$(timeout 10 docker info -f '{{.ExperimentalBuild}}' 2>/dev/null || echo false)
        [ "$exp" = true ] || log "WARNING: the running Docker engine is not in experimental mode; crab needs it for checkpoints (set \"experimental\": true in /etc/docker/daemon.json and restart it)"
        log "dockerd: answering"
        return
    fi
    if dry_run; then
        would "start dockerd --experimental (log: $CRAB_LOG_DIR/dockerd.log)"
        return
    fi
    mkdir -p "$CRAB_LOG_DIR"
    log "dockerd: no engine answers; starting dockerd --experimental (log: $CRAB_LOG_DIR/dockerd.log)"
    # /usr/local/sbin first, so runc (started by containerd under dockerd's
    # environment) finds the CRIU wrapper before any older system criu.
    # Descriptors above 2 are closed first: dockerd outlives this script, and
    # one inherited from the caller (a `flock LOCK make setup` lock, a CI
    # runner's pipe) would stay held for as long as dockerd runs.
    (
        for fd in /proc/self/fd/*; do
            fd=${fd##*/}
            [ "$fd" -gt 2 ] 2>/dev/null && eval "exec $fd>&-"
        done
        PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
            exec setsid nohup dockerd --experimental >>"$CRAB_LOG_DIR/dockerd.log" 2>&1 </dev/null
    ) &
    for _ in $(seq 1 120); do
        docker_answers && { log "dockerd: up"; return; }
        sleep 0.5
    done
    die "dockerd did not answer within 60 s; see $CRAB_LOG_DIR/dockerd.log"
}

# --- 6. the crab group (who may use crabd's socket) --------------------------------
ensure_group() {
    if getent group crab >/dev/null; then
        log "group crab: present"
        return
    fi
    if dry_run; then
        would "create the system group crab"
        return
    fi
    # systemd-sysusers does this from systemd/crab.sysusers on a packaged install.
    groupadd --system crab
    log "group crab: created"
}

# --- 7. the btrfs pool (runc backend: one subvolume per sandbox, snapshots as checkpoints) ---
btrfs_pool_report() {
    log "btrfs pool: $CRAB_BTRFS_MOUNT ($1); $(df -h --output=avail "$CRAB_BTRFS_MOUNT" | tail -1 | tr -d ' ') free of $(df -h --output=size "$CRAB_BTRFS_MOUNT" | tail -1 | tr -d ' ')"
}
ensure_btrfs_pool() {
    if [ "$(findmnt -n -o FSTYPE --mountpoint "$CRAB_BTRFS_MOUNT" 2>/dev/null)" = btrfs ]; then
        btrfs_pool_report "mounted"
        return
    fi
    mountpoint -q "$CRAB_BTRFS_MOUNT" && die "$CRAB_BTRFS_MOUNT is a mount point, but not of btrfs; unmount it or set CRAB_BTRFS_MOUNT"
    if dry_run; then
        if [ -f "$CRAB_BTRFS_IMAGE" ]; then
            would "mount the btrfs pool $CRAB_BTRFS_IMAGE at $CRAB_BTRFS_MOUNT"
        else
            would "make the btrfs pool $CRAB_BTRFS_IMAGE ($CRAB_BTRFS_SIZE, sparse) and mount it at $CRAB_BTRFS_MOUNT"
        fi
        return
    fi
    mkdir -p "$(dirname "$CRAB_BTRFS_IMAGE")" "$CRAB_BTRFS_MOUNT"
    if [ ! -f "$CRAB_BTRFS_IMAGE" ]; then
        # Sparse: the file takes only what the pool holds.  Made under a temporary
        # name so that an interrupted run never leaves a half-formatted image.
        truncate -s "$CRAB_BTRFS_SIZE" "$CRAB_BTRFS_IMAGE.tmp"
        mkfs.btrfs -q -L crab-pool "$CRAB_BTRFS_IMAGE.tmp" >/dev/null
        mv -f "$CRAB_BTRFS_IMAGE.tmp" "$CRAB_BTRFS_IMAGE"
        log "btrfs pool: made $CRAB_BTRFS_IMAGE ($CRAB_BTRFS_SIZE, sparse)"
    fi
    mount -o loop "$CRAB_BTRFS_IMAGE" "$CRAB_BTRFS_MOUNT" || die "cannot mount $CRAB_BTRFS_IMAGE at $CRAB_BTRFS_MOUNT"
    btrfs_pool_report "mounted now"
}

ensure_apt_packages
ensure_group
ensure_criu
ensure_criu_config
ensure_conntrack_table
ensure_kernel_headers
ensure_tracefs
ensure_dockerd
ensure_btrfs_pool
if dry_run; then
    log "dry run: nothing was changed"
else
    log "host ready"
fi
