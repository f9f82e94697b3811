"""The model-server protocol's gauges on the API port (`--model-server-metrics`), as a gateway's endpoint
picker reads them from an SGLang pod: under load on the real CPU engine, `sglang:num_queue_reqs` counts the
requests waiting in Tally's admission queue (without them a pod full of waiting requests looks idle to the
picker), the running count and the KV fraction are the engine's, the cache's shape is there, and nothing
of Tally's own series or of any tenant is on that port."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families
from runtime_harness import free_port, runtime_process, until

MODEL = "smollm2-135m-instruct"
CONTEXT = 2048


def gauges(url: str) -> dict[str, tuple[str, dict[str, str], float]]:
    response = httpx.get(f"{url}/metrics", timeout=5)
    assert response.status_code == 200, response.text
    return {sample.name: (family.type, sample.labels, sample.value)
            for family in text_string_to_metric_families(response.text) for sample in family.samples}


def test_the_pickers_gauges_count_tallys_queue_under_load_and_nothing_else_is_on_the_api_port(tmp_path: Path) -> None:
    metrics_port = free_port()
    with runtime_process(tmp_path / "runtime.log", "--metrics-port", str(metrics_port), "--model-server-metrics",
                         "--max-concurrent-generations", "1", "--context-length", str(CONTEXT)) as (_, url):
        idle = gauges(url)
        assert set(idle) == {"sglang:num_queue_reqs", "sglang:num_running_reqs", "sglang:token_usage",
                             "sglang:cache_config_info"}
        assert all(kind == "gauge" for kind, _, _ in idle.values())
        assert idle["sglang:num_queue_reqs"][2] == idle["sglang:num_running_reqs"][2] == 0
        assert idle["sglang:token_usage"][2] == 0.0
        _, info, one = idle["sglang:cache_config_info"]
        assert one == 1 and info["page_size"] == "1" and info["num_pages"] == str(CONTEXT)  # one slot of CONTEXT

        clients = [httpx.Client(timeout=120) for _ in range(3)]
        loads: list[Any] = []

        def stream(client: httpx.Client, i: int) -> None:
            try:
                with client.stream("POST", f"{url}/v1/completions", json={
                        "model": MODEL, "prompt": f"Story {i}:", "max_tokens": 400, "ignore_eos": True,
                        "stream": True}) as response:
                    for _ in response.iter_raw():
                        pass
            except (httpx.HTTPError, RuntimeError):  # closed under it: how the test ends the load
                pass

        threads = [threading.Thread(target=stream, args=(c, i), daemon=True) for i, c in enumerate(clients)]
        for thread in threads:
            thread.start()

        def busy() -> bool:
            now = gauges(url)
            loads.append(now)
            return now["sglang:num_running_reqs"][2] == 1 and now["sglang:num_queue_reqs"][2] == 2

        assert until(busy, 60, interval=0.1), loads[-1:]
        assert until(lambda: 0 < gauges(url)["sglang:token_usage"][2] <= 1, 30, interval=0.1)
        page = httpx.get(f"{url}/metrics").text
        assert "tally_" not in page and "tenant" not in page
        own = httpx.get(f"http://127.0.0.1:{metrics_port}/metrics").text
        assert "tally_queued_requests 2.0" in own and "sglang:num_queue_reqs" not in own
        for client in clients:  # the clients leave: the streams end and the gauges fall back
            client.close()
        assert until(lambda: gauges(url)["sglang:num_running_reqs"][2] == 0
                     and gauges(url)["sglang:num_queue_reqs"][2] == 0, 60, interval=0.1)
        assert gauges(url)["sglang:token_usage"][2] == 0.0


def test_without_the_flag_the_api_port_has_no_metrics_and_the_flag_needs_a_metrics_port(tmp_path: Path) -> None:
    with runtime_process(tmp_path / "plain.log", "--metrics-port", str(free_port())) as (_, url):
        assert httpx.get(f"{url}/metrics").status_code == 404
    done = subprocess.run([sys.executable, "-m", "tally_runtime", "serve", "--model-server-metrics"],
                          capture_output=True, text=True, timeout=60, env={**os.environ})
    assert done.returncode == 2 and "--model-server-metrics needs --metrics-port" in done.stderr
