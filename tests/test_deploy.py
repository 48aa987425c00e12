"""deploy/: the Prometheus rules pass promtool's check and unit tests (each alert fires on synthetic
series and stays quiet on its neighbours'), the tests catch a broken threshold, the Grafana dashboard
parses and its queries are valid PromQL, and every kvserve metric the rules and the dashboard read is
one a running kvserve (with host and Redis tiers) exports."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import time
from pathlib import Path

import httpx
import pytest
import yaml

from redis_server import RedisServer
from server_process import launch_server, stop_server

ROOT = Path(__file__).resolve().parent.parent
RULES = ROOT / "deploy" / "prometheus" / "kvserve-rules.yml"
RULE_TESTS = ROOT / "deploy" / "prometheus" / "kvserve-rules.test.yml"
DASHBOARD = ROOT / "deploy" / "grafana" / "kvserve-dashboard.json"


def promtool(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    binary = shutil.which("promtool")
    assert binary is not None, "promtool is missing: `make setup` installs it (apt-get install prometheus)"
    return subprocess.run([binary, *args], capture_output=True, text=True, timeout=120, cwd=cwd)


def rules() -> list[dict]:
    return [rule for group in yaml.safe_load(RULES.read_text())["groups"] for rule in group["rules"]]


def dashboard_queries() -> list[str]:
    return [target["expr"] for panel in json.loads(DASHBOARD.read_text())["panels"] for target in panel["targets"]]


def test_rules_pass_promtool_check_and_unit_tests():
    check = promtool("check", "rules", str(RULES))
    assert check.returncode == 0 and "SUCCESS" in check.stdout, check.stdout + check.stderr
    tested = promtool("test", "rules", str(RULE_TESTS))
    assert tested.returncode == 0, tested.stdout + tested.stderr


def test_every_alert_fires_and_stays_quiet_in_the_unit_tests():
    alerts = {rule["alert"] for rule in rules() if "alert" in rule}
    cases = yaml.safe_load(RULE_TESTS.read_text())["tests"]
    for name in alerts:
        mine = [c for t in cases for c in t["alert_rule_test"] if c["alertname"] == name]
        firing = [c for c in mine if c["exp_alerts"]]
        assert firing and any(not c["exp_alerts"] for c in mine), f"{name}: needs a case that fires and one that does not"
        series = [s["series"] for t in cases if any(c["alertname"] == name for c in t["alert_rule_test"]) for s in t["input_series"]]
        fired = {json.dumps(e["exp_labels"], sort_keys=True) for c in firing for e in c["exp_alerts"]}
        assert len(series) > len(fired), f"{name}: no series beside the firing ones (nothing shows it stays quiet)"
        assert all(e.get("exp_annotations", {}).get("advice") for c in firing for e in c["exp_alerts"]), f"{name}: no advice"


def test_the_unit_tests_catch_a_broken_threshold(tmp_path):
    broken = RULES.read_text().replace("kvserve:kv_cache_usage_perc > 0.9", "kvserve:kv_cache_usage_perc > 0.99")
    assert broken != RULES.read_text()
    (tmp_path / "kvserve-rules.yml").write_text(broken)
    shutil.copy(RULE_TESTS, tmp_path / "kvserve-rules.test.yml")
    tested = promtool("test", "rules", "kvserve-rules.test.yml", cwd=tmp_path)
    assert tested.returncode != 0 and "KVCacheNearlyFull" in tested.stdout + tested.stderr


def test_dashboard_is_importable_json_and_its_queries_are_promql(tmp_path):
    board = json.loads(DASHBOARD.read_text())
    assert board["uid"] == "kvserve" and board["panels"]
    assert all(panel["targets"] and panel["gridPos"] for panel in board["panels"])
    assert len({panel["id"] for panel in board["panels"]}) == len(board["panels"])
    # promtool parses PromQL in rule files: each query becomes a recording rule ($model_name as a plain regex)
    queries = [q.replace("$model_name", ".*") for q in dashboard_queries()]
    check = {"groups": [{"name": "dashboard", "rules": [{"record": f"dashboard_query_{i}", "expr": q} for i, q in enumerate(queries)]}]}
    (tmp_path / "queries.yml").write_text(yaml.safe_dump(check))
    result = promtool("check", "rules", str(tmp_path / "queries.yml"))
    assert result.returncode == 0, result.stdout + result.stderr


def test_every_metric_read_is_exported_by_a_running_server(tiny_dir):
    recorded = {rule["record"] for rule in rules() if "record" in rule}
    text = " ".join([rule["expr"] for rule in rules()] + dashboard_queries())
    names = set(re.findall(r"kvserve:[a-z0-9_:]+[a-z0-9_]", text)) - recorded
    assert {"kvserve:kv_cache_usage_perc", "kvserve:kv_remote_up", "kvserve:time_to_first_token_seconds_bucket"} <= names
    with RedisServer() as redis:
        proc, url = launch_server(["--model", str(tiny_dir("llama")), "--port", "0", "--dtype", "float32", "--kv-cache-memory", "0.02",
                                   "--kv-offload-host-gib", "0.01", "--kv-remote-url", redis.url])  # fmt: skip
        try:
            httpx.post(url + "/v1/completions", json={"prompt": "hello there", "max_tokens": 4}, timeout=60).raise_for_status()
            assert httpx.post(url + "/v1/completions", json={"prompt": ""}, timeout=60).status_code == 400  # a rejection, counted
            with httpx.stream("POST", url + "/v1/completions", json={"prompt": "hi", "max_tokens": 400, "ignore_eos": True,
                                                                    "stream": True}, timeout=60) as resp:  # fmt: skip
                next(resp.iter_lines())  # then leave: the request is aborted
            deadline = time.monotonic() + 30
            while True:
                exported = httpx.get(url + "/metrics", timeout=30).text
                missing = sorted(n for n in names if not re.search(rf"^{re.escape(n)}[{{ ]", exported, re.M))
                if not missing or time.monotonic() > deadline:
                    break
                time.sleep(0.5)
        finally:
            stop_server(proc)
    assert not missing, f"read by deploy/ but not exported: {missing}"


@pytest.mark.parametrize("path", [RULES, RULE_TESTS], ids=lambda p: p.name)
def test_rule_files_are_plain_yaml(path):
    assert yaml.safe_load(path.read_text())
