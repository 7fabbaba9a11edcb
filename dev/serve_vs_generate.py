#!/usr/bin/env python3
"""dev/: issue 23's correctness acceptance on a real checkpoint: 50 prompts (5 families with a
shared 150-byte prefix, so the prefix cache hits) served by `linmoe serve` to 16 clients at once,
half greedy and half sampled with a seed, each compared byte for byte with `linmoe generate`
run alone with the same seed. (tests/test_server.c does the same on random weights in CI.)
Usage: dev/serve_vs_generate.py BIN CKPT [SERVE_ARGS...] (e.g. --threads 1 --decode-threads 2)"""
import codecs, json, re, subprocess, sys, threading, urllib.request

# the server's output text (docs/serving.md "Output text"): every byte that is not part of
# valid UTF-8, and every NUL, becomes one U+FFFD (Python's "replace" gives one per run)
codecs.register_error("per_byte", lambda e: ("\ufffd" * (e.end - e.start), e.end))

bin_, ckpt = sys.argv[1], sys.argv[2]
srv = subprocess.Popen([bin_, "serve", "--ckpt", ckpt, "--port", "0"] + sys.argv[3:], stdout=subprocess.PIPE,
                       stderr=subprocess.DEVNULL, text=True)
port = int(re.match(r"listening on http://127.0.0.1:(\d+)/", srv.stdout.readline()).group(1))
fam = ["The committee said that the city", "In the beginning of the year, the",
       "Mr. Smith went to Washington and", "A new study of the river shows",
       "She asked whether the old house"]
prompts, reqs = [], []
for i in range(50):
    p = ""
    while len(p) < 150:
        p += fam[i % 5] + " "
    p = p[:150] + "".join(chr(ord("a") + (k * 7 + i) % 26) for k in range((i * 37) % 61))
    prompts.append(p)
    r = {"prompt": p, "max_tokens": 32, "temperature": 0}
    if i % 2:
        r.update(temperature=0.9, top_p=0.95, top_k=40, seed=1000 + i)
    reqs.append(r)
served = [None] * 50
def client(t):
    for i in range(t, 50, 16):
        q = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", json.dumps(reqs[i]).encode(),
                                   {"Content-Type": "application/json"})
        served[i] = json.load(urllib.request.urlopen(q))["choices"][0]["text"]
th = [threading.Thread(target=client, args=(t,)) for t in range(16)]
[t.start() for t in th]
[t.join() for t in th]
met = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics").read().decode()
hits = re.search(r"^linmoe_prefix_cache_hit_tokens_total (\S+)", met, re.M).group(1)
srv.terminate(); srv.wait()
same = 0
for i, r in enumerate(reqs):
    a = [bin_, "generate", "--ckpt", ckpt, "--prompt", prompts[i], "--max-new", "32",
         "--temperature", str(r["temperature"]), "--top-p", str(r.get("top_p", 1)),
         "--top-k", str(r.get("top_k", 0)), "--seed", str(r.get("seed", 1))]
    out = subprocess.run(a, capture_output=True).stdout
    g = out[len(prompts[i].encode()):-1].decode("utf-8", errors="per_byte").replace("\0", "\ufffd")
    if g == served[i]:
        same += 1
    else:
        print(f"prompt {i}: served {served[i]!r} generate {g!r}")
print(f"{same} of 50 served completions (16 clients, prefix cache on, {hits} prompt tokens restored) "
      f"identical to `linmoe generate` alone")
