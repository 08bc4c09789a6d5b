#!/bin/sh
# Install what tests/simhosts.py needs (sshd, ssh, ssh-keygen, ip) with apt, only when something is missing.
# Usage: install_sshd.sh [EXTRA...]: each extra package whose command of the same name is missing (tcsh, fish)
# is installed too; PACKAGE:COMMAND where they differ (nftables:nft).
#
# Idempotent: a no-op when every tool is there. Installing openssh-server must not start a system-wide sshd, so
# an existing /usr/sbin/policy-rc.d is kept as it is; when there is none, one that denies every service start is
# written for the install and removed afterwards (only that file, only when this script created it).
set -eu

missing=""
command -v sshd >/dev/null 2>&1 || [ -x /usr/sbin/sshd ] || missing="$missing openssh-server"
command -v ssh >/dev/null 2>&1 && command -v ssh-keygen >/dev/null 2>&1 || missing="$missing openssh-client"
command -v ip >/dev/null 2>&1 || [ -x /usr/sbin/ip ] || [ -x /sbin/ip ] || missing="$missing iproute2"
command -v nsenter >/dev/null 2>&1 && command -v unshare >/dev/null 2>&1 || missing="$missing util-linux"
for extra in "$@"; do
    command=${extra#*:}
    command -v "$command" >/dev/null 2>&1 || [ -x "/usr/sbin/$command" ] || missing="$missing ${extra%%:*}"
done

if [ -z "$missing" ]; then
    echo "install_sshd: openssh-server, openssh-client, iproute2${*:+ and }$* already installed"
    exit 0
fi

# One install at a time (parallel test workers may all find the same packages missing): the script runs
# again holding the lock, and finds what another one installed meanwhile.
if command -v flock >/dev/null 2>&1 && [ -z "${INSTALL_SSHD_LOCKED:-}" ]; then
    INSTALL_SSHD_LOCKED=1 exec flock /tmp/clusterrun-install_sshd.lock sh "$0" "$@"
fi

policy=/usr/sbin/policy-rc.d
created_policy=no
if [ ! -e "$policy" ]; then
    printf '#!/bin/sh\n# written by tests/_support/install_sshd.sh for one install\nexit 101\n' >"$policy"
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

echo "install_sshd: installing$missing"
export DEBIAN_FRONTEND=noninteractive
apt-get update -q
# shellcheck disable=SC2086  # $missing is a list of package names
apt-get install -y -q --no-install-recommends $missing
