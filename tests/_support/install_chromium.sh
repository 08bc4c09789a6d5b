#!/bin/sh
# Install Debian's chromium for the web page's browser tests (Playwright drives it; `playwright install`
# downloads a browser build of its own, which these machines cannot), only when it is missing.
set -eu

if [ -x /usr/bin/chromium ]; then
    echo "install_chromium: chromium already installed"
    exit 0
fi
exec sh "$(dirname "$0")/apt_install.sh" chromium fonts-dejavu-core
