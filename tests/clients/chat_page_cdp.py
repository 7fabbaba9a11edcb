#!/usr/bin/env python3
"""Drive the chat page (GET /) in headless Chromium over the DevTools protocol on a pipe
(--remote-debugging-pipe: JSON messages separated by NUL on fds 3 and 4; stdlib only):
open URL, wait until the assistant message is done (or failed), print the page's messages
as JSON, save a screenshot. Usage: chat_page_cdp.py URL SCREENSHOT.png PROFILE_DIR"""
import base64
import json
import os
import subprocess
import sys
import time

url, shot, profile = sys.argv[1], sys.argv[2], sys.argv[3]
to_chrome_r, to_chrome_w = os.pipe()
from_chrome_r, from_chrome_w = os.pipe()


def child_fds():
    os.dup2(to_chrome_r, 3)
    os.dup2(from_chrome_w, 4)


proc = subprocess.Popen(
    ["chromium", "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
     "--no-first-run", "--remote-debugging-pipe", f"--user-data-dir={profile}",
     "--window-size=1000,720", "about:blank"],
    preexec_fn=child_fds, pass_fds=(3, 4), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
os.close(to_chrome_r)
os.close(from_chrome_w)
wr, rd = os.fdopen(to_chrome_w, "wb", buffering=0), os.fdopen(from_chrome_r, "rb", buffering=0)
buf, next_id = b"", 0


def call(method, params=None, session=None, timeout=60):
    global buf, next_id
    next_id += 1
    msg = {"id": next_id, "method": method, "params": params or {}}
    if session:
        msg["sessionId"] = session
    wr.write(json.dumps(msg).encode() + b"\0")
    end = time.time() + timeout
    while time.time() < end:
        while b"\0" in buf:
            raw, buf = buf.split(b"\0", 1)
            m = json.loads(raw)
            if m.get("id") == next_id:
                if "error" in m:
                    raise RuntimeError(f"{method}: {m['error']}")
                return m["result"]
        chunk = rd.read(65536)
        if not chunk:
            raise RuntimeError("chromium closed the pipe")
        buf += chunk
    raise TimeoutError(method)


try:
    target = call("Target.createTarget", {"url": "about:blank"})["targetId"]
    sess = call("Target.attachToTarget", {"targetId": target, "flatten": True})["sessionId"]
    call("Page.enable", session=sess)
    call("Page.navigate", {"url": url}, session=sess)
    probe = ("JSON.stringify([...document.querySelectorAll('.msg')].map(d => "
             "({cls: d.className, state: d.dataset.state || null, "
             "text: d.querySelector('.text').textContent})))")
    msgs, end = [], time.time() + 60
    while time.time() < end:
        r = call("Runtime.evaluate", {"expression": probe, "returnByValue": True}, session=sess)
        msgs = json.loads(r["result"].get("value") or "[]")
        if len(msgs) >= 2 and msgs[-1]["state"] in ("done", "error"):
            break
        time.sleep(0.1)
    png = call("Page.captureScreenshot", {"format": "png"}, session=sess)["data"]
    with open(shot, "wb") as f:
        f.write(base64.b64decode(png))
    print(json.dumps(msgs))
finally:
    try:
        call("Browser.close", timeout=5)
    except Exception:
        pass
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()
