#!/bin/sh
# Install what tests/simhosts.py needs (sshd, ssh, ssh-keygen, ip) with apt, only when something is missing.
# Usage: install_sshd.sh [EXTRA...]: each extra package whose command of the same name is missing (tcsh, fish)
# is installed too; PACKAGE:COMMAND where they differ (nftables:nft).
# A no-op when every tool is there; apt_install.sh installs the rest (starting no sshd).
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

# shellcheck disable=SC2086  # $missing is a list of package names
exec sh "$(dirname "$0")/apt_install.sh" $missing
