"""A screenshot of /dashboard under load, for the docs: serve a model, run concurrent requests under
three shared license texts (n = 2 each, one license's requests under a cache salt), and capture the
page in headless Chromium while they run: the grid, the prefix tree with its reuse, the salts.

    .venv/bin/python bench/dashboard_screenshot.py --model smollm2-135m-instruct --out docs/images/dashboard.png
"""

from __future__ import annotations

import argparse
import concurrent.futures
import shutil
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from server_process import launch_server, stop_server  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--out", type=Path, default=Path("docs/images/dashboard.png"))
    parser.add_argument("--requests", type=int, default=24)
    parser.add_argument("--kv-cache-memory", default="0.25", help="GiB: small, so the grid fills")
    parser.add_argument("--show-tokens", action="store_true", help="serve with --dashboard-show-tokens (the tree shows text)")
    args = parser.parse_args()
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    serve = ["--model", args.model, "--port", "0", "--kv-cache-memory", args.kv_cache_memory]
    proc, url = launch_server(serve + (["--dashboard-show-tokens"] if args.show_tokens else []), timeout=300)
    options = webdriver.ChromeOptions()
    for flag in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1000,1700"):
        options.add_argument(flag)
    options.binary_location = shutil.which("chromium")
    browser = webdriver.Chrome(service=Service(shutil.which("chromedriver")), options=options)
    licenses = [Path("/usr/share/common-licenses", name).read_text()[:1500] for name in ("GPL-3", "Apache-2.0", "MPL-2.0")]
    bodies = [{"prompt": licenses[i % 3] + f"\n\nQuestion {i}: what does section {i} say?", "max_tokens": 160, "ignore_eos": True,
               "n": 2, "temperature": 1.0, **({"cache_salt": "tenant-b"} if i % 3 == 2 else {})} for i in range(args.requests)]  # fmt: skip
    try:
        browser.get(url + "/dashboard")
        for body in bodies[:3]:  # each license cached once, so the load below reuses it
            httpx.post(url + "/v1/completions", json={**body, "max_tokens": 1, "n": 1}, timeout=600).raise_for_status()
        with concurrent.futures.ThreadPoolExecutor(args.requests) as pool:
            futures = [pool.submit(httpx.post, url + "/v1/completions", json=b, timeout=600) for b in bodies]
            best, best_held = None, -1
            while not all(f.done() for f in futures):
                time.sleep(1.5)
                held = int(browser.execute_script("return (document.body.dataset.numBlocks - document.body.dataset.freeBlocks) || 0"))
                if held > best_held:
                    best, best_held = browser.get_screenshot_as_png(), held
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_bytes(best)
        print(f"wrote {args.out} ({len(best):,} bytes; {best_held} blocks held when taken)")
    finally:
        browser.quit()
        stop_server(proc)


if __name__ == "__main__":
    main()
