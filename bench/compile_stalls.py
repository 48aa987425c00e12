"""Plain requests beside slow grammars: what one client's hostile constraints cost everybody else.

A server on the default model (SmolLM2-135M-Instruct, a chat template that names the tools) answers
plain requests (completions and chats, 16 tokens, the API's default sampling) one after another,
first alone, then while `--attackers` clients (each from its own loopback address) keep one slow
constraint each in flight: a JSON schema of 2,000 properties (about 15 s to compile, cut at the
10 s --grammar-compile-timeout), or a tool with such parameters. Prints the plain requests' latency
p50/p99 in both phases and the ratio; the target is p99 within 1.5x of the idle case.

    .venv/bin/python bench/compile_stalls.py                  # 10 attackers, 40 plain requests a phase (~3 min)
    .venv/bin/python bench/compile_stalls.py --attackers 4 --requests 20
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).parent.parent / "tests"))

from server_process import launch_server, stop_server  # noqa: E402

# a template that names the tools (not their parameters): a slow tool's prompt stays short, its grammar is slow
TOOLS_TEMPLATE = ("{% if tools %}tools:{% for t in tools %} {{ t.function.name }}{% endfor %}\n{% endif %}{% for m in messages %}"
                  "{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}")  # fmt: skip


def slow_schema(tag: str) -> dict:
    return {"type": "object", "properties": {f"{tag}{i}": {"type": "string"} for i in range(2000)}}


def attack_body(n: int, tag: str) -> tuple[str, dict]:
    """Every other attacker sends a tool whose parameters are slow to compile, the rest a slow schema."""
    if n % 2:
        tool = {"type": "function", "function": {"name": "f", "parameters": slow_schema(tag)}}
        return "/v1/chat/completions", {"messages": [{"role": "user", "content": "call f"}], "tools": [tool], "max_tokens": 8}
    return "/v1/completions", {"prompt": "A record:", "max_tokens": 8, "guided_json": slow_schema(tag)}


def plain_latencies(url: str, count: int) -> list[float]:
    times = []
    with httpx.Client(timeout=300) as client:
        for i in range(count):
            if i % 2:
                path, body = "/v1/chat/completions", {"messages": [{"role": "user", "content": f"Name a colour ({i})."}], "max_tokens": 16}
            else:
                path, body = "/v1/completions", {"prompt": f"The river runs ({i})", "max_tokens": 16}
            start = time.perf_counter()
            response = client.post(url + path, json=body)
            times.append(time.perf_counter() - start)
            assert response.status_code == 200, response.text
    return times


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--attackers", type=int, default=10, help="clients keeping one slow constraint in flight each")
    parser.add_argument("--requests", type=int, default=40, help="plain requests per phase")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        template = Path(tmp) / "tools.jinja"
        template.write_text(TOOLS_TEMPLATE)
        proc, url = launch_server(["--port", "0", "--chat-template", str(template)])
        try:
            plain_latencies(url, 4)  # warm
            idle = plain_latencies(url, args.requests)
            stop = threading.Event()
            answers: dict[int, int] = {}

            def attack(n: int) -> None:
                transport = httpx.HTTPTransport(local_address=f"127.0.0.{n + 2}")
                with httpx.Client(transport=transport, timeout=300) as client:
                    round_ = 0
                    while not stop.is_set():
                        path, body = attack_body(n, f"a{n}r{round_}_")
                        status = client.post(url + path, json=body).status_code
                        answers[status] = answers.get(status, 0) + 1
                        round_ += 1

            threads = [threading.Thread(target=attack, args=(n,), daemon=True) for n in range(args.attackers)]
            for thread in threads:
                thread.start()
            time.sleep(2.0)  # the attackers' compiles queued and running
            attacked = plain_latencies(url, args.requests)
            stop.set()
            for thread in threads:
                thread.join()
        finally:
            stop_server(proc)
    print(f"| phase | plain requests | p50 | p99 |\n|---|---:|---:|---:|")
    for name, times in (("idle", idle), (f"{args.attackers} clients' slow constraints in flight", attacked)):
        print(f"| {name} | {len(times)} | {statistics.median(times) * 1e3:.0f} ms | {percentile(times, 0.99) * 1e3:.0f} ms |")
    print(f"\np99 attacked / idle: {percentile(attacked, 0.99) / percentile(idle, 0.99):.2f}x "
          f"(p50 {statistics.median(attacked) / statistics.median(idle):.2f}x); the attackers' answers by status: {answers}")  # fmt: skip


if __name__ == "__main__":
    main()
