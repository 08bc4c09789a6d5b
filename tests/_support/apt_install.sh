#!/bin/sh
# apt-get install PACKAGE... for the tests, one install at a time, starting no daemon.
#
# An existing /usr/sbin/policy-rc.d is kept as it is; when there is none, one that denies every service
# start is written for the install and removed afterwards (only that file, only when this script created it).
set -eu

[ "$#" -gt 0 ] || exit 0

# Parallel test workers may all find the same packages missing: the script runs again holding the lock
# (apt-get installs nothing another one installed meanwhile).
if command -v flock >/dev/null 2>&1 && [ -z "${APT_INSTALL_LOCKED:-}" ]; then
    APT_INSTALL_LOCKED=1 exec flock /tmp/clusterrun-apt_install.lock sh "$0" "$@"
fi

policy=/usr/sbin/policy-rc.d
created_policy=no
if [ ! -e "$policy" ]; then
    printf '#!/bin/sh\n# written by tests/_support/apt_install.sh for one install\nexit 101\n' >"$policy"
    chmod 0755 "$policy"
    created_policy=yes
fi
cleanup() {
    if [ "$created_policy" = yes ]; then
        rm -f "$policy"
    fi
}
trap cleanup EXIT
trap 'exit 130' INT TERM

echo "apt_install: installing $*"
export DEBIAN_FRONTEND=noninteractive
apt-get update -q
apt-get install -y -q --no-install-recommends "$@"
