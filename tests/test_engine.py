"""The real vLLM engine on the bundled tiny model: batches decode to completion, exactly once."""

from __future__ import annotations

import numpy as np
import pytest

from benchmarks.isolated import IsolatedBatchRunner, common_prefixes
from feather_env.engines.vllm_engine import EngineConfig, build_llm, kv_bytes_per_token
from feather_env.workloads.request import Request
from scheduler_runtime.config import ConfigError, load_mapping
from scheduler_runtime.hardware import online_cores

pytestmark = pytest.mark.engine


def _grouped(groups: int, per_group: int, prefix_len: int, out_len: int, seed: int, tag: str):
    rng = np.random.default_rng(seed)
    reqs = []
    for g in range(groups):
        prefix = rng.integers(3, 8192, prefix_len)
        for i in range(per_group):
            prompt = np.concatenate([prefix, rng.integers(3, 8192, 16)])
            reqs.append(Request(f"{tag}{g}-{i}", prompt, g, out_len + i % 3))
    return reqs


def test_homogeneous_batch_decodes_every_token(isolated_runner: IsolatedBatchRunner):
    reqs = _grouped(1, 12, 1024, 8, seed=1, tag="hom")
    res = isolated_runner.run_batch(reqs)
    assert res.num_requests == 12
    assert res.output_tokens == sum(r.output_len for r in reqs)
    assert res.prompt_tokens == sum(r.prompt_len for r in reqs)
    # warmed prefix: every request finds the 1024-token document in the prefix cache
    assert res.prefix_hit_tokens >= 12 * 1024
    assert res.decode_tokens > 0 and res.decode_seconds > 0 and res.decode_tok_s > 0
    assert max(res.step_batch_sizes) == 12
    assert res.kv_blocks_used > 0


def test_heterogeneous_batch_decodes_every_token(isolated_runner: IsolatedBatchRunner):
    reqs = _grouped(6, 2, 1024, 8, seed=2, tag="het")
    res = isolated_runner.run_batch(reqs)
    assert res.output_tokens == sum(r.output_len for r in reqs)
    assert res.num_requests == 12
    assert res.decode_tokens <= res.output_tokens


def test_batches_are_isolated_and_engine_is_reusable(isolated_runner: IsolatedBatchRunner):
    a = isolated_runner.run_batch(_grouped(2, 3, 256, 4, seed=3, tag="iso"))
    # same ids again: the backend tags each batch, so the engine never sees a reused id
    b = isolated_runner.run_batch(_grouped(2, 3, 256, 4, seed=3, tag="iso"))
    assert a.output_tokens == b.output_tokens == sum(4 + i % 3 for _ in range(2) for i in range(3))
    assert not isolated_runner.llm.llm_engine.has_unfinished_requests()


def test_bad_batches_are_rejected_before_the_engine_sees_them(isolated_runner: IsolatedBatchRunner):
    with pytest.raises(ValueError, match="empty batch"):
        isolated_runner.run_batch([])
    r = Request("dup", np.arange(3, 40), 0, 2)
    with pytest.raises(ValueError, match="duplicate"):
        isolated_runner.run_batch([r, r])
    too_long = Request("long", np.full(isolated_runner.engine_config.max_model_len, 5), 0, 4)
    with pytest.raises(ValueError, match="max_model_len"):
        isolated_runner.run_batch([too_long])
    assert not isolated_runner.llm.llm_engine.has_unfinished_requests()
    ok = isolated_runner.run_batch([Request("after", np.arange(3, 60), 0, 3)])
    assert ok.output_tokens == 3


def test_common_prefixes_per_group():
    a = Request("a", [5, 6, 7, 8], 0, 1)
    b = Request("b", [5, 6, 9], 0, 1)
    c = Request("c", [1, 2, 3], 1, 1)
    assert common_prefixes([a, b, c]) == [[5, 6], [1, 2]]


def test_engine_config_rejects_unknown_keys_and_bad_values(tmp_path):
    with pytest.raises(ConfigError, match="valid keys are"):
        EngineConfig.from_dict({"kv_cache_gb": 2})
    with pytest.raises(ConfigError, match="kv_cache_gib"):
        EngineConfig(kv_cache_gib=0)
    with pytest.raises(ConfigError, match="config.json"):
        EngineConfig(model_dir=str(tmp_path))
    # 4 layers x (K,V) x 4 heads x 64 dims x 2 bytes
    assert kv_bytes_per_token(EngineConfig().model_dir) == 4 * 2 * 4 * 64 * 2


def test_an_engine_that_could_not_start_here_is_refused_before_vllm_is_asked():
    """vLLM itself refused the KV cache with a message about GPU memory utilization (after loading the
    model), and a core this process may not use was a raw OSError from ``sched_setaffinity``."""
    EngineConfig(kv_cache_gib=0.0088, max_model_len=2176).check_startable()  # 17 blocks + the null one
    refused = r"2,048 usable tokens\) cannot hold one request of max_model_len 2,176 tokens, and vLLM"
    with pytest.raises(ConfigError, match=refused + r" would not start: give at least 0.00879 GiB"):
        EngineConfig(kv_cache_gib=0.0087, max_model_len=2176).check_startable()
    assert EngineConfig(kv_cache_gib=1e-5).usable_kv_tokens == 0  # not a negative count of tokens
    with pytest.raises(ConfigError, match=r"max_num_batched_tokens \(32\) must be >= max_num_seqs \(64\)"):
        EngineConfig(max_num_seqs=64, max_num_batched_tokens=32).check_startable()
    beyond = str(max(online_cores()) + 1)
    with pytest.raises(ConfigError, match=rf"cpu_cores '{beyond}': core\(s\) \[{beyond}\] are not among"):
        EngineConfig(cpu_cores=beyond).check_startable()
    with pytest.raises(ConfigError, match="are not among this machine"):  # every engine start asks
        build_llm(EngineConfig(cpu_cores=beyond))


def test_load_mapping_reads_json_or_yaml_and_names_bad_files(tmp_path):
    (tmp_path / "a.json").write_text('{"x": 1}')
    (tmp_path / "a.yaml").write_text("x: 1\n")
    assert load_mapping(tmp_path / "a.json") == load_mapping(tmp_path / "a.yaml") == {"x": 1}
    (tmp_path / "list.json").write_text("[1]")
    (tmp_path / "bad.json").write_text("{bad")
    for name, message in (("list.json", "expected a mapping"), ("bad.json", "malformed JSON"),
                          ("missing.json", "not found"), ("missing.yaml", "not found")):
        with pytest.raises(ConfigError, match=message) as exc:
            load_mapping(tmp_path / name)
        assert name in str(exc.value)
