#!/bin/sh
# Install Debian's chromium for the web page's browser tests (Playwright drives it; `playwright install`
# downloads a browser build of its own, which these machines cannot), only when it is missing.
#
# Idempotent: a no-op when /usr/bin/chromium is there. Installing must start no daemon, so an existing
# /usr/sbin/policy-rc.d is kept as it is; when there is none, one that denies every service start is written
# for the install and removed afterwards (only that file, only when this script created it).
set -eu

if [ -x /usr/bin/chromium ]; then
    echo "install_chromium: chromium already installed"
    exit 0
fi

# One install at a time (parallel test workers may all find it missing): the script runs again holding the
# lock, and finds what another one installed meanwhile.
if command -v flock >/dev/null 2>&1 && [ -z "${INSTALL_CHROMIUM_LOCKED:-}" ]; then
    INSTALL_CHROMIUM_LOCKED=1 exec flock /tmp/clusterrun-install_chromium.lock sh "$0" "$@"
fi
if [ -x /usr/bin/chromium ]; then
    exit 0
fi

policy=/usr/sbin/policy-rc.d
created_policy=no
if [ ! -e "$policy" ]; then
    printf '#!/bin/sh\n# written by tests/_support/install_chromium.sh for one install\nexit 101\n' >"$policy"
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

echo "install_chromium: installing chromium"
export DEBIAN_FRONTEND=noninteractive
apt-get update -q
apt-get install -y -q --no-install-recommends chromium fonts-dejavu-core
