#!/usr/bin/env python3
"""Load and fault test of `linmoe serve` (issue 23), stdlib only, loopback only, bounded.

A server on a small trained checkpoint (--max-seqs 16, --max-queue 64), then N requests
(default 2000) from C concurrent clients (default 64): random prompt and generation
lengths, greedy and seeded sampling, streamed and not; 5 % malformed JSON or wrong types
(must get 400 with an error object), 5 % clients that hang up mid-stream, and bursts of
100 extra requests at once beyond the queue limit. Every well-formed request must be
answered with exactly the text it gets alone (computed first, one at a time) or refused
with 429 / 503; the server must stay up. The whole run is done twice; the server's
resident memory (VmRSS) is reported after the references, after the first and after the
second run, and the second run must not grow it by more than --rss-slack-mb (the first
one warms up allocator arenas of the connection threads).

Usage: load_test.py --bin build/linmoe [--train-bin build/linmoe] [--requests N]
                    [--concurrency C] [--json OUT]
Exit 0 = pass, 77 = skipped (no data), 1 = failure.
"""
import argparse
import http.client
import json
import os
import random
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time

ap = argparse.ArgumentParser()
ap.add_argument("--bin", required=True)
ap.add_argument("--train-bin")
ap.add_argument("--ckpt", help="a checkpoint to serve (default: train configs/tiny-train.json)")
ap.add_argument("--requests", type=int, default=2000)
ap.add_argument("--concurrency", type=int, default=64)
ap.add_argument("--templates", type=int, default=40)
ap.add_argument("--rss-slack-mb", type=float, default=4)
ap.add_argument("--json")
args = ap.parse_args()
train_bin = args.train_bin or args.bin
if not (os.path.exists("data/brown/train.txt") and os.path.exists("data/brown/val.txt")):
    print("SKIPPED: no data/brown (scripts/fetch-data.sh)")
    sys.exit(77)

tmp = tempfile.mkdtemp(prefix="linmoe-load.")
server = None


def fail(msg):
    print("FAIL:", msg)
    if server:
        server.kill()
    sys.exit(1)


try:
    # a small trained checkpoint: --ckpt (the CTest fixture), else tiny-train trained here
    ckpt = args.ckpt
    if not ckpt or not os.path.exists(os.path.join(ckpt, "ckpt", "latest")):
        env = dict(os.environ, LINMOE_BIN=train_bin)
        subprocess.run(["bash", "tests/scripts/server_fixture.sh", tmp], check=True, capture_output=True, env=env)
        ckpt = f"{tmp}/serve-fixture/run"
    server = subprocess.Popen([args.bin, "serve", "--ckpt", ckpt, "--port", "0", "--threads", "2",
                               "--max-seqs", "16", "--max-queue", "64", "--max-len", "1024"],
                              stdout=subprocess.PIPE, stderr=open(f"{tmp}/serve.err", "w"), text=True)
    line = server.stdout.readline()
    m = re.match(r"listening on http://127.0.0.1:(\d+)/", line)
    if not m:
        fail(f"server did not start: {line!r} {open(f'{tmp}/serve.err').read()}")
    port = int(m.group(1))

    def rss_mb():
        for l in open(f"/proc/{server.pid}/status"):
            if l.startswith("VmRSS:"):
                return int(l.split()[1]) / 1024
        return -1

    def conn():
        return http.client.HTTPConnection("127.0.0.1", port, timeout=120)

    def post(body, raw=None):
        c = conn()
        data = raw if raw is not None else json.dumps(body)
        c.request("POST", "/v1/completions", data, {"Content-Type": "application/json"})
        r = c.getresponse()
        out = r.read()
        c.close()
        return r.status, out

    def stream_text(body):
        """status, text of a streamed completion"""
        c = conn()
        c.request("POST", "/v1/completions", json.dumps(dict(body, stream=True)),
                  {"Content-Type": "application/json"})
        r = c.getresponse()
        if r.status != 200:
            r.read()
            c.close()
            return r.status, None
        text, done = "", False
        while True:
            l = r.readline()
            if not l:
                break
            if l.startswith(b"data: "):
                d = l[6:].strip()
                if d == b"[DONE]":
                    done = True
                    break
                o = json.loads(d)
                if "error" in o:
                    return 500, o
                text += o["choices"][0]["text"]
        c.close()
        return (200 if done else 599), text

    words = open("data/brown/val.txt", encoding="utf-8", errors="replace").read().split()[:20000]
    rng = random.Random(23)
    templates = []
    for i in range(args.templates):
        n = rng.randint(1, 120)
        start = rng.randrange(len(words) - n)
        body = {"prompt": " ".join(words[start:start + n]), "max_tokens": rng.randint(1, 48)}
        if i % 2:
            body.update(temperature=0.9, top_p=0.95, seed=rng.randint(0, 1 << 30))
        else:
            body.update(temperature=0)
        templates.append(body)
    # the answers alone, one at a time
    ref = []
    for b in templates:
        st, out = post(b)
        if st != 200:
            fail(f"reference {b}: {st} {out[:200]}")
        ref.append(json.loads(out)["choices"][0]["text"])
    rss0 = rss_mb()

    bad_bodies = ['{"prompt": "x", "max_tokens": 5', '{"prompt": 12}', '{"prompt": "x", "max_tokens": "9"}',
                  '[1, 2, 3]', '{"prompt": "x", "temperature": "warm"}', 'not json at all',
                  '{"prompt": "x", "max_tokens": -3}', '{"prompt": "x", "stop": [1, 2]}']
    plan = []
    for i in range(args.requests):
        u = rng.random()
        kind = "bad" if u < 0.05 else "hangup" if u < 0.10 else "ok"
        plan.append((kind, rng.randrange(len(templates)), rng.random() < 0.5, rng.randrange(len(bad_bodies))))

    lock = threading.Lock()
    stats = {"ok": 0, "busy": 0, "bad_400": 0, "hangup": 0, "burst_ok": 0, "burst_busy": 0}
    errors = []
    nxt = [0]

    def run_one(item, burst=False):
        kind, t, streamed, b = item
        if kind == "bad":
            st, out = post(None, raw=bad_bodies[b])
            ok = st == 400 and "error" in json.loads(out)
            with lock:
                if ok:
                    stats["bad_400"] += 1
                else:
                    errors.append(f"malformed {bad_bodies[b]!r}: {st} {out[:200]}")
            return
        if kind == "hangup":
            s = socket.create_connection(("127.0.0.1", port), timeout=60)
            body = json.dumps(dict(templates[t], stream=True, max_tokens=400, ignore_eos=True)).encode()
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                      b"Content-Length: %d\r\n\r\n" % len(body) + body)
            s.recv(256)
            s.close()
            with lock:
                stats["hangup"] += 1
            return
        st, text = stream_text(templates[t]) if streamed else post(templates[t])
        if st == 200 and not streamed:
            text = json.loads(text)["choices"][0]["text"]
        with lock:
            if st == 200:
                if text != ref[t]:
                    errors.append(f"template {t} ({'stream' if streamed else 'plain'}): {text!r} != alone {ref[t]!r}")
                stats["burst_ok" if burst else "ok"] += 1
            elif st in (429, 503):
                stats["burst_busy" if burst else "busy"] += 1
            else:
                errors.append(f"template {t}: status {st} {str(text)[:200]}")

    def worker():
        while True:
            with lock:
                i = nxt[0]
                nxt[0] += 1
            if i >= len(plan):
                return
            try:
                run_one(plan[i])
            except Exception as e:  # a client error is a failure too
                with lock:
                    errors.append(f"request {i}: {e!r}")
            if i % 500 == 250:  # a burst beyond the queue limit
                bt = [threading.Thread(target=run_one, args=(("ok", rng.randrange(len(templates)), False, 0), True))
                      for _ in range(100)]
                for x in bt:
                    x.start()
                for x in bt:
                    x.join()

    rss_runs, walls = [], []
    for _ in range(2):
        nxt[0] = 0
        t0 = time.time()
        th = [threading.Thread(target=worker) for _ in range(args.concurrency)]
        for x in th:
            x.start()
        for x in th:
            x.join()
        walls.append(time.time() - t0)
        time.sleep(0.3)
        rss_runs.append(rss_mb())
    wall = walls[0]
    # the server is idle again, up, and answers as before
    c = conn()
    for _ in range(200):
        c.request("GET", "/metrics")
        met = c.getresponse().read().decode()
        if re.search(r"^linmoe_running_sequences 0$", met, re.M) and re.search(r"^linmoe_queue_depth 0$", met, re.M):
            break
        time.sleep(0.05)
    else:
        errors.append("the server did not go idle")
    c.close()
    if server.poll() is not None:
        fail(f"the server exited with {server.returncode}: {open(f'{tmp}/serve.err').read()[-2000:]}")
    st, out = post(templates[0])
    if st != 200 or json.loads(out)["choices"][0]["text"] != ref[0]:
        errors.append("after the run the server answers differently")
    rss1 = rss_mb()
    res = dict(requests=args.requests, runs=2, concurrency=args.concurrency, wall_s=[round(w, 2) for w in walls],
               **stats, rss_before_mb=round(rss0, 1), rss_after_run_mb=[round(r, 1) for r in rss_runs],
               rss_end_mb=round(rss1, 1), errors=len(errors))
    print(json.dumps(res))
    if args.json:
        json.dump(res, open(args.json, "w"), indent=1)
    if errors:
        fail(f"{len(errors)} errors, first: " + "; ".join(errors[:5]))
    if stats["burst_busy"] + stats["busy"] == 0:
        fail("no request was refused: the bursts did not exceed the queue")
    if rss_runs[1] - rss_runs[0] > args.rss_slack_mb:
        fail(f"resident memory grew from {rss_runs[0]:.1f} to {rss_runs[1]:.1f} MiB in the second run")
    server.send_signal(15)
    rc = server.wait(timeout=30)
    server = None
    if rc != 0:
        fail(f"the server exited with {rc} on SIGTERM")
    print(f"load: 2 x {args.requests} requests at {args.concurrency}-way concurrency in {walls[0]:.1f} + {walls[1]:.1f} s: "
          f"{stats['ok']} answered as alone, {stats['busy']} refused 429/503, {stats['bad_400']} malformed "
          f"-> 400, {stats['hangup']} hung up mid-stream; bursts: {stats['burst_ok']} answered, "
          f"{stats['burst_busy']} refused; RSS {rss0:.1f} MiB before, {rss_runs[0]:.1f} after run 1, "
          f"{rss_runs[1]:.1f} after run 2; clean exit")
finally:
    if server:
        server.kill()
    shutil.rmtree(tmp, ignore_errors=True)
