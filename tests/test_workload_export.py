"""``python -m feather_env.workloads export``: an episode, read back by the installed vLLM's CustomDataset.

No engine: vLLM's ``vllm bench serve --dataset-name custom`` loader (``CustomDataset``) reads the
exported file with the bundled tokenizer, exactly as ``vllm bench serve`` would.
"""

from __future__ import annotations

import json
import os

import pytest

from feather_env.engines.vllm_engine import DEFAULT_MODEL_DIR
from feather_env.scenarios import load_scenario
from feather_env.workloads import BOS_ID, load_tokenizer
from feather_env.workloads.__main__ import main as workloads_main
from feather_env.workloads.export import export_jsonl

SCENARIO = "leval-kv-pressure"


@pytest.fixture(scope="module")
def exported(tmp_path_factory, data_dir):
    path = tmp_path_factory.mktemp("export") / "episode.jsonl"
    assert workloads_main(["export", "--scenario", SCENARIO, "--seed", "3", "--out", str(path)]) == 0
    return path, load_scenario(SCENARIO).episode_workload(3)


def test_vllms_custom_dataset_reads_the_export_with_our_lengths(exported):
    from vllm.benchmarks.datasets.datasets import CustomDataset
    from vllm.tokenizers import get_tokenizer

    path, episode = exported
    tokenizer = get_tokenizer(str(DEFAULT_MODEL_DIR))
    dataset = CustomDataset(dataset_path=str(path), disable_shuffle=True)
    samples = dataset.sample(tokenizer, num_requests=len(episode), skip_chat_template=True,
                             no_oversample=True)
    assert len(samples) == len(episode)
    drift = []
    for sample, request in zip(samples, episode, strict=True):
        assert sample.expected_output_len == request.output_len  # from "output_tokens"
        drift.append(abs(sample.prompt_len - request.prompt_len))
    # L-Eval text re-encodes to our ids, up to a token where a cut document meets its question
    assert max(drift) <= 2 and sum(d == 0 for d in drift) >= len(drift) // 2
    assert sum(s.prompt_len for s in samples) == pytest.approx(sum(r.prompt_len for r in episode), rel=1e-3)


def test_questions_on_one_document_still_share_it_as_a_text_prefix(exported):
    path, episode = exported
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert [line["request_id"] for line in lines] == episode.request_ids  # queue order kept
    for group, members in episode.groups().items():
        texts = [line["prompt"] for line in lines if line["prefix_group"] == group]
        assert len(texts) == len(members)
        if len(texts) > 1:
            shared = os.path.commonprefix(texts)
            assert len(shared) > 0.8 * min(len(t) for t in texts), group
    tok = load_tokenizer()
    first = episode[0]
    assert first.prompt_token_ids[0] == BOS_ID and not lines[0]["prompt"].startswith("<s>")
    assert tok.encode(lines[0]["prompt"], add_special_tokens=True).ids[0] == BOS_ID  # the server adds it back


def test_random_token_workloads_report_their_length_drift(tmp_path):
    from feather_env.workloads import synthetic_workload

    workload = synthetic_workload(2, 3, 64, 8, 4, seed=0)
    summary = export_jsonl(workload, tmp_path / "s.jsonl")
    assert summary.requests == 6 and summary.output_tokens == 24
    assert summary.prompt_tokens == sum(r.prompt_len for r in workload)
    assert summary.exact_prompts < 6 and summary.max_length_drift > 0  # random ids are not canonical BPE


def test_export_errors_are_clear(tmp_path, capsys):
    assert workloads_main(["export", "--scenario", "nosuch", "--out", str(tmp_path / "a.jsonl")]) == 2
    assert "unknown scenario 'nosuch'" in capsys.readouterr().err
    assert workloads_main(["export", "--scenario", SCENARIO, "--out", str(tmp_path / "a.json")]) == 2
    assert ".jsonl" in capsys.readouterr().err
    # once raw tracebacks (FileExistsError, IsADirectoryError) after the episode was built
    assert workloads_main(["export", "--scenario", SCENARIO, "--out", "/dev/null/a.jsonl"]) == 2
    assert "--out's folder /dev/null exists and is not a folder" in capsys.readouterr().err
    (tmp_path / "d.jsonl").mkdir()
    assert workloads_main(["export", "--scenario", SCENARIO, "--out", str(tmp_path / "d.jsonl")]) == 2
    assert "is a folder: give the path of a .jsonl file" in capsys.readouterr().err
    assert [p.name for p in tmp_path.iterdir()] == ["d.jsonl"]
