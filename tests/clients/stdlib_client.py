#!/usr/bin/env python3
"""A Python standard-library client of `linmoe serve` (tests/scripts/server_clients.sh python):
urllib for plain requests, http.client for a server-sent-event stream, the error object,
/metrics. Usage: stdlib_client.py BASE_URL (http://127.0.0.1:PORT). Exit 0 = pass."""
import http.client
import json
import sys
import urllib.error
import urllib.parse
import urllib.request

base = sys.argv[1].rstrip("/")
u = urllib.parse.urlparse(base)


def post(path, body):
    req = urllib.request.Request(base + path, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        return json.load(r)


def stream(path, body):
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=60)
    conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
    r = conn.getresponse()
    assert r.status == 200, r.status
    assert r.getheader("Content-Type").startswith("text/event-stream")
    events, buf = [], b""
    while True:
        line = r.readline()
        if not line:
            break
        if line.startswith(b"data: "):
            data = line[6:].strip()
            if data == b"[DONE]":
                events.append(None)
                break
            events.append(json.loads(data))
    conn.close()
    assert events and events[-1] is None, "no [DONE]"
    return events[:-1]


c = post("/v1/completions", {"prompt": "It was", "max_tokens": 20, "temperature": 0})
text = c["choices"][0]["text"]
ev = stream("/v1/completions", {"prompt": "It was", "max_tokens": 20, "temperature": 0, "stream": True})
assert "".join(e["choices"][0]["text"] for e in ev) == text
assert ev[-1]["choices"][0]["finish_reason"] in ("stop", "length")
assert ev[-1]["usage"]["completion_tokens"] == c["usage"]["completion_tokens"]

msgs = [{"role": "user", "content": "Hello there"}]
ch = post("/v1/chat/completions", {"messages": msgs, "max_tokens": 16, "temperature": 0})
ev = stream("/v1/chat/completions", {"messages": msgs, "max_tokens": 16, "temperature": 0, "stream": True})
assert ev[0]["choices"][0]["delta"]["role"] == "assistant"
assert "".join(e["choices"][0]["delta"].get("content", "") for e in ev) == ch["choices"][0]["message"]["content"]

lp = post("/v1/completions", {"prompt": "It was", "max_tokens": 4, "temperature": 0, "logprobs": 2, "echo": True})
assert lp["choices"][0]["text"].startswith("It was")
assert all(x <= 0 for x in lp["choices"][0]["logprobs"]["token_logprobs"])

try:
    post("/v1/completions", {"prompt": "x", "temperature": "hot"})
    raise SystemExit("a bad temperature was accepted")
except urllib.error.HTTPError as e:
    assert e.code == 400, e.code
    err = json.load(e)["error"]
    assert err["param"] == "temperature" and err["type"] == "invalid_request_error", err

with urllib.request.urlopen(base + "/metrics", timeout=10) as r:
    metrics = r.read().decode()
n = [l for l in metrics.splitlines() if l.startswith("linmoe_generation_tokens_total ")]
assert n and float(n[0].split()[1]) > 0, metrics
print("python stdlib client: completions and chat, streamed and not, agree; logprobs + echo; "
      "400 error object naming the param; /metrics")
