#!/usr/bin/env bash
# Install crab from this checkout for every user of the host (`make install`, part of `make setup`):
#   $CRAB_VENV       a venv of the system's Python with crab installed non-editable (default /opt/crab/venv),
#   $CRAB_BIN_DIR    crabctl and crabd linked there (default /usr/local/bin), on everyone's PATH.
#
# Why not the checkout's .venv: its interpreter is pyenv's, under root's 0700 home, and the package is an
# editable install pointing into the checkout, so a member of group crab gets "Permission denied" before
# crabctl even starts.  Here the interpreter is /usr/bin/python3 (Debian's, like the python3-bpfcc that the
# inspector links in) and every file is world-readable; systemd/crabd.service runs $CRAB_VENV/bin/crabd.
#
# Idempotent and fast on a second run: the venv records a fingerprint (sha256 of the content of every file
# that goes into the package, the extras and the interpreter's version); when it matches, nothing is built.
# The wheel is built by the checkout's venv (which has setuptools and grpcio-tools: no download) from a copy
# of the files git tracks or would track, so an old build/ or a generated file never leaks into it.
set -euo pipefail
umask 022  # everything installed must be readable by every member of group crab

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
CRAB_VENV=${CRAB_VENV:-/opt/crab/venv}
CRAB_BIN_DIR=${CRAB_BIN_DIR:-/usr/local/bin}
CRAB_SYS_PYTHON=${CRAB_SYS_PYTHON:-/usr/bin/python3}
CRAB_INSTALL_EXTRAS=${CRAB_INSTALL_EXTRAS:-remote}
BUILD_PYTHON=${BUILD_PYTHON:-$ROOT/.venv/bin/python}
STAMP=$CRAB_VENV/.crab-fingerprint
# What a build puts into the package (setup.py, MANIFEST.in, crabd/util/resources.py SHIPPED).
PACKAGE_PATHS=(crabd ebpf envs scripts systemd pyproject.toml setup.py MANIFEST.in README.md)

log() { printf '[install] %s\n' "$*" >&2; }
die() { printf '[install] ERROR: %s\n' "$*" >&2; exit 1; }

[ "$(id -u)" -eq 0 ] || die "must run as root (it writes $CRAB_VENV and $CRAB_BIN_DIR)"
[ -x "$CRAB_SYS_PYTHON" ] || die "no $CRAB_SYS_PYTHON (Debian's python3; set CRAB_SYS_PYTHON to another interpreter outside any private home)"

# The package's files: tracked, or new and not ignored (generated gRPC code and crab-init are ignored).
package_files() {
    if git -C "$ROOT" rev-parse --is-inside-work-tree >/dev/null 2>&1; then
        git -C "$ROOT" ls-files -z --cached --others --exclude-standard -- "${PACKAGE_PATHS[@]}" \
            | while IFS= read -r -d '' f; do [ -f "$ROOT/$f" ] && printf '%s\0' "$f"; done
    else
        (cd "$ROOT" && find "${PACKAGE_PATHS[@]}" -type f -not -path '*/__pycache__/*' -not -name '*.py[co]' \
            -not -name '*_pb2*.py*' -not -name crab-init -print0 2>/dev/null)
    fi
}

fingerprint() {
    {
        (cd "$ROOT" && package_files | LC_ALL=C sort -z | xargs -0 -r sha256sum)
        echo "extras=$CRAB_INSTALL_EXTRAS"
        "$CRAB_SYS_PYTHON" -V
    } | sha256sum | cut -d' ' -f1
}

link_commands() {
    mkdir -p "$CRAB_BIN_DIR"
    local cmd
    for cmd in crabctl crabd; do
        if [ "$(readlink "$CRAB_BIN_DIR/$cmd" 2>/dev/null)" != "$CRAB_VENV/bin/$cmd" ]; then
            ln -sfn "$CRAB_VENV/bin/$cmd" "$CRAB_BIN_DIR/$cmd"
            log "linked $CRAB_BIN_DIR/$cmd -> $CRAB_VENV/bin/$cmd"
        fi
    done
}

# crab-init (the sandboxes' PID 1) ships as C source; the install's crabd looks for its binary in
# /opt/crab/lib, which crabd.service keeps read-only (ProtectSystem=strict): compile it now, as root.
build_init() {
    (cd / && "$CRAB_VENV/bin/python" -c 'from crabd.runtime import initbin; initbin.is_built() or print(initbin.build())') \
        | while read -r built; do log "compiled $built"; done
}

want=$(fingerprint)
if [ -x "$CRAB_VENV/bin/crabd" ] && [ "$(cat "$STAMP" 2>/dev/null)" = "$want" ]; then
    build_init
    link_commands
    log "crab in $CRAB_VENV is current (crabctl, crabd in $CRAB_BIN_DIR)"
    exit 0
fi

[ -x "$BUILD_PYTHON" ] || die "no $BUILD_PYTHON to build the wheel with (run \`make venv\` first)"
work=$(mktemp -d /tmp/crab-install.XXXXXX)
trap 'rm -rf "$work"' EXIT
mkdir -p "$work/src"
(cd "$ROOT" && package_files | tar --null -T - -cf -) | tar -xf - -C "$work/src"
log "building the wheel"
"$BUILD_PYTHON" -m pip wheel -q --disable-pip-version-check --no-deps --no-build-isolation \
    -w "$work/dist" "$work/src" >/dev/null
wheel=$(ls "$work"/dist/crabd-*.whl)

if [ ! -x "$CRAB_VENV/bin/python" ]; then
    log "creating $CRAB_VENV ($("$CRAB_SYS_PYTHON" -V))"
    mkdir -p "$(dirname "$CRAB_VENV")"
    "$CRAB_SYS_PYTHON" -m venv "$CRAB_VENV"
fi
pip=("$CRAB_VENV/bin/python" -m pip install -q --disable-pip-version-check)
extras=${CRAB_INSTALL_EXTRAS:+[$CRAB_INSTALL_EXTRAS]}
# Dependencies first (pip keeps those already at their pinned version), then crab itself over whatever
# copy was there: its version does not change with its source, so only --force-reinstall replaces it.
"${pip[@]}" "$wheel$extras"
"${pip[@]}" --force-reinstall --no-deps "$wheel"
# bcc (the eBPF inspector) is Debian's python3-bpfcc, built for this same system Python; linked in
# rather than adding all of dist-packages to sys.path (as in the checkout's venv, see the Makefile).
site=$("$CRAB_VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
if [ -d /usr/lib/python3/dist-packages/bcc ]; then ln -sfn /usr/lib/python3/dist-packages/bcc "$site/bcc"; fi
build_init
echo "$want" >"$STAMP"
link_commands
version=$("$CRAB_VENV/bin/python" -c 'from importlib.metadata import version; print(version("crabd"))')
log "crab $version installed in $CRAB_VENV (crabctl, crabd in $CRAB_BIN_DIR)"
