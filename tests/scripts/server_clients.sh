#!/usr/bin/env bash
# Real clients against `linmoe serve` (issue 23 acceptance), one mode per CTest entry:
#   node      the official OpenAI Node SDK (tests/clients/openai_sdk.mjs; pinned `openai`
#             installed by scripts/install-test-clients.sh)
#   python    a Python standard-library client (tests/clients/stdlib_client.py)
#   curl      the curl examples of README.md's serving section, as written (only the port
#             8080 is replaced by the test's free port)
#   chromium  the chat page (GET /) in headless Chromium: a message is sent, the streamed
#             answer appears and equals the server's chat completion for the same request;
#             a screenshot is saved to OUT_DIR/chat_page.png
# Usage: server_clients.sh MODE OUT_DIR   (from the source root; LINMOE_BIN = the CLI)
# Exit 77 (CTest: skipped) when the mode's client or the data is not installed.
set -euo pipefail
mode=$1
out_dir=${2:-build}
bin=${LINMOE_BIN:?LINMOE_BIN is not set (run through ctest)}
skip() { echo "SKIPPED: $*"; exit 77; }

case "$mode" in
node)
    command -v node >/dev/null || skip "node is not installed"
    [[ -f tests/clients/node_modules/openai/package.json ]] ||
        skip "the OpenAI Node SDK is not installed (scripts/install-test-clients.sh)"
    major=$(node -p 'process.versions.node.split(".")[0]')
    ((major >= 18)) || skip "node $major is older than the SDK supports (18)"
    ;;
python) command -v python3 >/dev/null || skip "python3 is not installed" ;;
curl) command -v curl >/dev/null || skip "curl is not installed" ;;
chromium) command -v chromium >/dev/null || skip "chromium is not installed (scripts/install-test-clients.sh)" ;;
*) echo "unknown mode $mode" >&2; exit 2 ;;
esac
[[ -f data/brown/train.txt && -f data/brown/val.txt ]] || skip "no data/brown (scripts/fetch-data.sh)"

tmp=$(mktemp -d /tmp/linmoe-clients.XXXXXX)
pid=
cleanup() {
    [[ -n $pid ]] && kill "$pid" 2>/dev/null && wait "$pid" 2>/dev/null
    rm -rf "$tmp"
}
trap cleanup EXIT

# The small trained checkpoint of the CTest fixture (tests/scripts/server_fixture.sh),
# trained here when the fixture did not run (the script run by hand).
ckpt=$out_dir/serve-fixture/run
if [[ ! -f $ckpt/ckpt/latest ]]; then
    bash tests/scripts/server_fixture.sh "$tmp" >/dev/null
    ckpt=$tmp/serve-fixture/run
fi

# the files exist before the server starts: the redirections below happen in the background
# child, which a loaded machine may not have run yet when the loop first reads serve.out
: >"$tmp/serve.out"
: >"$tmp/serve.err"
"$bin" serve --ckpt "$ckpt" --port 0 --threads 1 >"$tmp/serve.out" 2>"$tmp/serve.err" &
pid=$!
port=
for _ in $(seq 200); do
    port=$(sed -n 's|^listening on http://127.0.0.1:\([0-9]*\)/$|\1|p' "$tmp/serve.out")
    [[ -n $port ]] && break
    kill -0 "$pid" 2>/dev/null || { cat "$tmp/serve.err"; exit 1; }
    sleep 0.05
done
[[ -n $port ]] || { echo "the server did not start"; cat "$tmp/serve.err"; exit 1; }
base=http://127.0.0.1:$port

case "$mode" in
node) node tests/clients/openai_sdk.mjs "$base/v1" ;;
python) python3 tests/clients/stdlib_client.py "$base" ;;
curl)
    # the block between the markers in README.md; each command starts with `curl`
    awk '/<!-- serve-curl:begin -->/{on=1; next} /<!-- serve-curl:end -->/{on=0} on' README.md |
        awk '/^curl / {c=1} c {print} c && !/\\$/ {c=0}' >"$tmp/cmds"
    n=0
    cmd=
    while IFS= read -r line; do
        cmd+="${line%\\} "
        [[ $line == *\\ ]] && continue
        n=$((n + 1))
        out=$(bash -c "${cmd//localhost:8080/localhost:$port}" 2>>"$tmp/curl.err")
        case "$out" in
        *'"choices"'* | *'data: [DONE]'* | *linmoe_requests_total* | *'"status":"ok"'* | *'"object":"list"'*) ;;
        *) echo "README curl example $n failed:"; echo "$cmd"; echo "output: $out"; exit 1 ;;
        esac
        if [[ $out == *'"error"'* ]]; then echo "README curl example $n: $out"; exit 1; fi
        cmd=
    done <"$tmp/cmds"
    ((n >= 4)) || { echo "only $n curl examples found in README.md"; exit 1; }
    echo "README: $n curl examples ran as written and answered"
    ;;
chromium)
    q="Hello there"
    want=$(curl -s "$base/v1/chat/completions" -H 'Content-Type: application/json' \
        -d "{\"messages\":[{\"role\":\"user\",\"content\":\"$q\"}],\"max_tokens\":24,\"temperature\":0}" |
        python3 -c 'import json,sys; print(json.load(sys.stdin)["choices"][0]["message"]["content"], end="")')
    url="$base/?q=Hello%20there&temperature=0&max_tokens=24"
    mkdir -p "$out_dir"
    rm -f "$out_dir/chat_page.png"
    # the page in headless Chromium, driven over the DevTools protocol (stdlib Python)
    timeout 120 python3 tests/clients/chat_page_cdp.py "$url" "$out_dir/chat_page.png" "$tmp/chrome" \
        >"$tmp/msgs.json"
    python3 - "$tmp/msgs.json" "$want" <<'PY'
import json, sys
msgs, want = json.load(open(sys.argv[1])), sys.argv[2]
assert len(msgs) == 2, f"want a user and an assistant message, got {msgs}"
u, a = msgs
assert "user" in u["cls"] and u["text"] == "Hello there", u
assert "assistant" in a["cls"] and a["state"] == "done", a
assert a["text"] == want, f"page shows {a['text']!r}, the API answers {want!r}"
assert a["text"].strip(), "empty answer"
print(f"chat page: sent 'Hello there', the streamed answer {a['text']!r} appeared and equals the API's")
PY
    [[ -s $out_dir/chat_page.png ]] || { echo "no screenshot"; exit 1; }
    echo "screenshot: $out_dir/chat_page.png ($(stat -c %s "$out_dir/chat_page.png") bytes)"
    ;;
esac
