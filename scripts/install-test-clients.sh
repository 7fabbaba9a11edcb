#!/usr/bin/env bash
# Installs the real clients that the server tests drive (issue 23):
#   - the official OpenAI Node SDK, package `openai` pinned below, from the npm registry
#     (npm pack, integrity-checked, unpacked into tests/clients/node_modules/: git-ignored;
#     it has no dependencies, and its optional peer dependencies are not needed);
#   - Debian's `chromium` (headless chat-page test), through apt-get (scripts/install-deps.sh
#     does the apt part: this script calls it with --clients).
# Idempotent and quiet when everything is there. The tests skip (exit 77), not fail, when
# a piece is missing, so a clone without this script still passes `make test`.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

# chromium, curl, python3 (apt). Not fatal: where the distribution has no chromium package
# (Ubuntu ships it as a snap) the chat-page test skips and says so.
scripts/install-deps.sh --clients ||
    echo "install-test-clients: could not install chromium / curl / python3; their tests will skip" >&2

# name version integrity (from `npm view NAME@VERSION dist.integrity`)
pin="openai 6.49.0 sha512-aYCc0C6L864eR6WSYIwQGyXriw/nIyZx0ObvhzOEVuk0zoBDpynjSbrionWI7q65B5H8jJX0DXR9snEzM6bfPg=="
read -r name version integrity <<<"$pin"
dir=tests/clients
dest="$dir/node_modules/$name"
if [[ -f $dest/package.json ]] && grep -q "\"version\": \"$version\"" "$dest/package.json"; then
    exit 0
fi
for tool in node npm tar base64 openssl; do
    command -v "$tool" >/dev/null 2>&1 || { echo "install-test-clients: $tool not found" >&2; exit 1; }
done
mkdir -p "$dir/tarballs" "$dir/node_modules"
tgz="$dir/tarballs/$name-$version.tgz"
if [[ ! -f $tgz ]]; then
    tmp=$(mktemp -d "$dir/tarballs/tmp.XXXXXX")
    if ! (cd "$tmp" && npm pack --silent --ignore-scripts "$name@$version" >/dev/null); then
        rm -rf "$tmp"
        echo "install-test-clients: npm pack $name@$version failed (registry: $(npm config get registry))" >&2
        exit 1
    fi
    mv "$tmp"/*.tgz "$tgz"
    rm -rf "$tmp"
fi
got="sha512-$(openssl dgst -sha512 -binary "$tgz" | base64 -w0)"
if [[ $got != "$integrity" ]]; then
    echo "install-test-clients: $tgz: integrity $got, want $integrity" >&2
    rm -f "$tgz"
    exit 1
fi
rm -rf "$dest"
mkdir -p "$dest"
tar -xzf "$tgz" -C "$dest" --strip-components=1
echo "install-test-clients: $name $version in $dest" >&2
