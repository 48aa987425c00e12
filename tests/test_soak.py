"""Most of a minute of hundreds of concurrent clients against a real server on a tiny model whose KV
pool forces preemption (bench/soak.py; longer runs there): nothing fails, leaks, hangs or is half-answered."""

import importlib.util
import sys
from pathlib import Path


def load_soak():
    spec = importlib.util.spec_from_file_location("soak", Path(__file__).parent.parent / "bench" / "soak.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["soak"] = module  # its dataclasses look their module up while they are made
    spec.loader.exec_module(module)
    return module


def test_a_soak_under_150_clients(tiny_dir):
    soak = load_soak()
    report = soak.run_soak(soak.SoakConfig(model=str(tiny_dir("llama")), duration=40, warmup=5, clients=150))
    print(report.table())
    assert report.failures() == []
    assert report.duration_s >= 40
    assert report.requests >= 600 and report.completed >= 200
    assert report.disconnected >= report.requests // 5  # the clients that leave early
    assert report.disconnected_outcomes.get("aborted", 0) > 0
    assert sum(v for k, v in report.rejected.items() if not k.startswith("503")) > 0  # bad requests
    assert report.num_preemptions > 0 and report.blocks_leaked == 0
