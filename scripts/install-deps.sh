#!/usr/bin/env bash
# Installs the Debian/Ubuntu packages that linmoe's build, tests and data scripts need
# (scripts/fetch-data.sh: node, npm, bzip2, xz; `linmoe plot`: gnuplot; multi-process
# training and its tests: libopenmpi-dev, openmpi-bin's mpirun; `linmoe serve`: libmicrohttpd).
# `scripts/install-deps.sh --clients` also installs what the server tests drive (issue 23):
# Debian's chromium (headless chat-page test), curl and python3 (scripts/install-test-clients.sh
# calls it so and adds the pinned OpenAI Node SDK).
# `scripts/install-deps.sh --peer` also installs Debian's python3-torch (CPU PyTorch), used
# only by `linmoe bench model` to time the PyTorch reference step beside linmoe.
# Idempotent: when everything is already installed it prints nothing and changes
# nothing. Runs apt-get directly as root, through sudo otherwise (non-interactive
# sudo when there is no terminal, e.g. in CI).
set -euo pipefail

pkgs=(build-essential cmake pkg-config libopenblas-dev libcjson-dev libpcre2-dev libcmocka-dev
    libmicrohttpd-dev gnuplot-nox bzip2 xz-utils ca-certificates libopenmpi-dev openmpi-bin)
# node + npm run scripts/fetch-data.sh and the tokenizer oracle. Checked by command, not
# by package: a Node.js from elsewhere (e.g. NodeSource's nodejs, which bundles npm and
# conflicts with Debian's npm package) is fine and must not be "fixed".
command -v node >/dev/null 2>&1 || pkgs+=(nodejs)
command -v npm >/dev/null 2>&1 || pkgs+=(npm)
for a in "$@"; do
    case "$a" in
    --peer) pkgs+=(python3-torch python3-numpy) ;;
    --clients)
        pkgs+=(curl)
        command -v chromium >/dev/null 2>&1 || pkgs+=(chromium)
        command -v python3 >/dev/null 2>&1 || pkgs+=(python3)
        ;;
    *) echo "install-deps: unknown option '$a' (known: --peer, --clients)" >&2; exit 2 ;;
    esac
done

if ! command -v dpkg-query >/dev/null 2>&1; then
    echo "install-deps: dpkg-query not found; this script supports Debian/Ubuntu." >&2
    echo "install-deps: install these (or your distribution's equivalents) yourself: ${pkgs[*]}" >&2
    exit 1
fi

missing=()
for p in "${pkgs[@]}"; do
    status=$(dpkg-query -W -f='${db:Status-Abbrev}' "$p" 2>/dev/null || true)
    [[ "$status" == ii* ]] || missing+=("$p")
done
[[ ${#missing[@]} -eq 0 ]] && exit 0

sudo_cmd=()
if [[ $(id -u) -ne 0 ]]; then
    if ! command -v sudo >/dev/null 2>&1; then
        echo "install-deps: missing packages: ${missing[*]}" >&2
        echo "install-deps: not root and sudo is not available; install them as root." >&2
        exit 1
    fi
    if [[ -t 0 ]]; then sudo_cmd=(sudo); else sudo_cmd=(sudo -n); fi
fi

echo "install-deps: installing ${missing[*]}" >&2
apt_env=(env DEBIAN_FRONTEND=noninteractive)
${sudo_cmd[@]+"${sudo_cmd[@]}"} "${apt_env[@]}" apt-get update -qq
${sudo_cmd[@]+"${sudo_cmd[@]}"} "${apt_env[@]}" apt-get install -y -qq --no-install-recommends \
    "${missing[@]}"
