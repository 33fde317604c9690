"""NVIDIA's built web client in headless Chromium (Debian's /usr/bin/chromium) against a
server serving it with --static, a fake microphone playing MIC (a 48 kHz WAV, once): presses
Connect, then reads the page's own "Server Audio Stats" each second for SECONDS -> one JSON
line (the last figures, every third reading) and a screenshot.

Run: python bench/clients/nvidia_page.py URL MIC SECONDS SCREENSHOT
"""
import json
import sys
import time

from playwright.sync_api import sync_playwright

url, mic, seconds, shot = sys.argv[1], sys.argv[2], float(sys.argv[3]), sys.argv[4]
with sync_playwright() as p:
    b = p.chromium.launch(executable_path="/usr/bin/chromium", args=[
        "--no-sandbox", "--use-fake-ui-for-media-stream", "--use-fake-device-for-media-stream",
        f"--use-file-for-fake-audio-capture={mic}%noloop",
        "--autoplay-policy=no-user-gesture-required"])
    page = b.new_context(permissions=["microphone"]).new_page()
    logs = []
    page.on("console", lambda m: logs.append(m.text))
    page.goto(url)
    page.click("text=Connect")
    t0 = time.time()
    samples = []
    while time.time() - t0 < seconds:
        time.sleep(1.0)
        try:
            cells = page.eval_on_selector_all("td", "els => els.map(e => e.textContent)")
        except Exception as e:
            cells = [str(e)]
        samples.append((round(time.time() - t0, 1), cells))
    page.screenshot(path=shot, full_page=True)
    b.close()
last = samples[-1][1]
fig = dict(zip(last[0::2], last[1::2]))
print(json.dumps({"figures": fig, "trace": [(t, dict(zip(c[0::2], c[1::2]))) for t, c in samples[::3]],
                  "missed_log_lines": sum("Missed some audio" in l for l in logs)}))
