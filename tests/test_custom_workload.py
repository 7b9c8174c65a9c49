"""Your own requests as a workload (``kind: custom``): JSON lines and CSV, text, token ids and chats,
timestamps, time windows, prefix groups from the content, what ``workloads export`` writes read back,
and every malformed row named by file and line before anything is built."""

from __future__ import annotations

import csv
import json
import resource
import time
from pathlib import Path

import numpy as np
import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from feather_env.scenarios import load_scenario
from feather_env.workloads import BOS_ID, Request, Workload, WorkloadError, load_tokenizer
from feather_env.workloads.custom import GROUP_KEY_TOKENS, load_custom, model_info, render_chat
from feather_env.workloads.export import export_jsonl
from scheduler_runtime.config import ConfigError

DATA = Path(__file__).resolve().parent / "data"
SUPPORT = DATA / "support-small.jsonl"


def _write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _scenario(tmp_path: Path, trace: str, **sections) -> Path:
    data = {"workload": {"kind": "custom", "path": trace, "max_prompt_tokens": None},
            "engine": {"kv_cache_gib": 0.02}, **sections}
    path = tmp_path / "mine.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


# ----------------------------------------------------------------------------- reading rows
def test_text_prompts_are_tokenized_as_the_server_does(tmp_path):
    tok = load_tokenizer()
    rows = [{"prompt": "The same system prompt. Question one?", "output_tokens": 5},
            {"prompt": "The same system prompt. Question two?", "max_tokens": 7}]
    w = load_custom(_write_jsonl(tmp_path / "t.jsonl", rows))
    assert [r.output_len for r in w] == [5, 7] and w.arrivals is None
    for row, req in zip(rows, w, strict=True):
        assert req.prompt_token_ids.tolist() == tok.encode(row["prompt"], add_special_tokens=True).ids
        assert req.prompt_token_ids[0] == BOS_ID
    assert w.request_ids == ["t/1", "t/2"] and w[0].meta["line"] == 1


def test_token_ids_are_kept_and_checked_against_the_vocabulary(tmp_path):
    rows = [{"prompt_token_ids": [1, 5, 8191], "output_tokens": 2}]
    w = load_custom(_write_jsonl(tmp_path / "ids.jsonl", rows))
    assert w[0].prompt_token_ids.tolist() == [1, 5, 8191]
    for ids in ([1, 8192], [-1, 4], [1, True], [], "1 2"):
        path = _write_jsonl(tmp_path / "bad.jsonl", [{"prompt_token_ids": [3]  , "output_tokens": 1},
                                                      {"prompt_token_ids": ids, "output_tokens": 1}])
        with pytest.raises(WorkloadError, match=r"bad.jsonl:2: (token id|prompt_token_ids)"):
            load_custom(path)


def test_chats_are_rendered_with_the_models_template_or_plainly(tmp_path):
    info = model_info()
    assert info.chat_template is None  # the bundled model has none
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi?"}]
    text, special = render_chat(messages, info)
    assert text == "system: Be brief.\n\nuser: Hi?\n\nassistant:" and special
    model = tmp_path / "model"
    model.mkdir()
    for name in ("config.json", "tokenizer.json"):
        (model / name).write_bytes((Path(info.model_dir) / name).read_bytes())
    template = ("{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{% endfor %}"
                "{% if add_generation_prompt %}<|assistant|>{% endif %}")
    (model / "tokenizer_config.json").write_text(json.dumps({"chat_template": template, "bos_token": "<s>"}))
    text, special = render_chat(messages, model_info(model))
    assert text == "<s><|system|>Be brief.<|user|>Hi?<|assistant|>" and not special
    w = load_custom(_write_jsonl(tmp_path / "chat.jsonl", [{"messages": messages, "output_tokens": 3}]),
                    model_dir=model)
    assert w[0].prompt_token_ids[0] == BOS_ID and (w[0].prompt_token_ids == BOS_ID).sum() == 1
    (model / "tokenizer_config.json").write_text(json.dumps({"chat_template": "{{ raise_exception('no') }}"}))
    with pytest.raises(WorkloadError, match=r"chat.jsonl:1: the chat template cannot render"):
        load_custom(tmp_path / "chat.jsonl", model_dir=model)


def test_csv_rows_read_like_json_lines(tmp_path):
    path = tmp_path / "t.csv"
    with path.open("w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(["prompt", "prompt_token_ids", "output_tokens", "timestamp"])
        w.writerow(["hello there", "", "4", "10.5"])
        w.writerow(["", "[1, 7, 9]", "2", "12"])
    load = load_custom(path)
    assert [r.prompt_token_ids.tolist()[:1] for r in load] == [[BOS_ID], [1]]
    assert [r.arrival_time for r in load] == [0.0, 1.5] and load.arrivals == "trace"  # earliest at 0
    path.write_text("prompt,output_tokens\nhi,3,extra\n")
    with pytest.raises(WorkloadError, match=r"t.csv:2: more fields than the header"):
        load_custom(path)


def test_what_workloads_export_writes_reads_back(tmp_path):
    scenario = load_scenario("leval-kv-pressure", {"episode": {"groups": 3, "max_per_group": 2,
                                                               "arrival": "poisson:2"},
                                                   "workload": {"max_prompt_tokens": 1024}})
    episode = scenario.episode_workload(4)
    summary = export_jsonl(episode, tmp_path / "ep.jsonl")
    back = load_custom(tmp_path / "ep.jsonl")
    assert back.request_ids == episode.request_ids  # its request_id, in its order
    assert [r.output_len for r in back] == [r.output_len for r in episode]
    assert [r.arrival_time for r in back] == pytest.approx([r.arrival_time - episode[0].arrival_time
                                                            for r in episode])
    same = sum(a.prompt_token_ids.tolist() == b.prompt_token_ids.tolist() for a, b in zip(back, episode,
                                                                                          strict=True))
    assert same == summary.exact_prompts and same >= len(episode) // 2
    assert back.num_groups == episode.num_groups  # the documents, found from the text alone


@pytest.mark.parametrize("text, message", [
    ('{"prompt": "a", "output_tokens": 2}\n{"prompt": "b", "output_tokens": 2\n', r":2: malformed JSON line"),
    ('["a list"]\n', r":1: expected a JSON object"),
    ('{"output_tokens": 2}\n', r":1: no prompt: a row needs one of"),
    ('{"prompt": "a", "prompt_token_ids": [1], "output_tokens": 2}\n', r":1: give one of"),
    ('{"prompt": "a"}\n', r":1: no output length"),
    ('{"prompt": "a", "output_tokens": 2.5}\n', r":1: output_tokens must be an integer >= 1"),
    ('{"prompt": "a", "output_tokens": "NaN"}\n', r":1: output_tokens must be an integer >= 1"),
    ('{"prompt": "a", "output_tokens": 2, "max_tokens": 3}\n', r":1: output_tokens and max_tokens differ"),
    ('{"prompt": "", "output_tokens": 2}\n', r":1: prompt must be non-empty text"),
    ('{"messages": [{"content": "x"}], "output_tokens": 2}\n', r":1: messages\[0\] needs a 'role'"),
    ('{"prompt": "a", "output_tokens": 2, "timestamp": -1}\n', r":1: timestamp must be a finite time"),
    ('{"prompt": "a", "output_tokens": 2, "timestamp": Infinity}\n', r":1: timestamp must be a finite time"),
    ('{"prompt": "a", "output_tokens": 2, "timestamp": 1}\n{"prompt": "b", "output_tokens": 2}\n',
     r":2: no timestamp, but line 1 has one"),
    ('{"prompt": "a", "output_tokens": 2, "request_id": "x"}\n{"prompt": "b", "output_tokens": 2, '
     '"request_id": "x"}\n', r":2: request_id 'x' is also on line 1"),
    ("", r"no requests \(the file is empty\)"),
    ("\n\n", r"no requests \(the file is empty\)"),
])
def test_every_malformed_row_is_named_by_file_and_line(tmp_path, text, message):
    path = tmp_path / "t.jsonl"
    path.write_text(text)
    with pytest.raises(WorkloadError, match=message) as info:
        load_custom(path)
    assert str(path) in str(info.value)


def test_non_utf8_and_unknown_formats_are_named(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_bytes(b'{"prompt": "ok", "output_tokens": 2}\n{"prompt": "caf\xe9", "output_tokens": 2}\n')
    with pytest.raises(WorkloadError, match=r"t.jsonl:2: not UTF-8"):
        load_custom(path)
    (tmp_path / "t.txt").write_text("hello")
    with pytest.raises(WorkloadError, match=r"JSON lines .* or CSV"):
        load_custom(tmp_path / "t.txt")


def test_requests_too_long_for_the_model_or_the_kv_cache_are_refused_while_reading(tmp_path):
    path = _write_jsonl(tmp_path / "t.jsonl", [{"prompt_token_ids": [5] * 300, "output_tokens": 10}])
    with pytest.raises(WorkloadError, match=r"t.jsonl:1: 300 prompt \+ 10 output tokens can never fit the "
                                            r"KV cache of 256 tokens"):
        load_custom(path, max_request_tokens=256)
    assert load_custom(path, max_prompt_tokens=200, max_request_tokens=256)[0].prompt_len == 200  # cut
    with pytest.raises(WorkloadError, match=r"prompt of 300 tokens > max_prompt_tokens=200"):
        load_custom(path, max_prompt_tokens=200, overflow="error")
    huge = _write_jsonl(tmp_path / "huge.jsonl", [{"prompt_token_ids": [5] * 70_000, "output_tokens": 1}])
    with pytest.raises(WorkloadError, match=r"huge.jsonl:1: 70000 prompt \+ 1 output tokens exceed the "
                                            r"model's context of 65536"):
        load_custom(huge)


def test_a_line_longer_than_any_request_that_fits_is_refused_before_it_is_read(tmp_path):
    """A 200 MB line: refused after reading a bounded prefix of it (memory stays small)."""
    path = tmp_path / "big.jsonl"
    with path.open("w") as fh:
        fh.write('{"prompt": "')
        chunk = "word " * 200_000
        for _ in range(200):
            fh.write(chunk)
        fh.write('", "output_tokens": 3}\n')
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    t0 = time.perf_counter()
    with pytest.raises(WorkloadError, match=r"big.jsonl:1: line longer than \d+ bytes: no request that long"):
        load_custom(path, max_request_tokens=4096)
    assert time.perf_counter() - t0 < 2.0
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 100_000  # KiB


# ----------------------------------------------------------------------------- groups, windows, reuse
def test_prefix_groups_come_from_the_content(tmp_path):
    """The support trace: one system prompt for all, four articles: four groups, one per article."""
    w = load_custom(SUPPORT)
    by_source: dict[str, set[int]] = {}
    for r in w:
        by_source.setdefault(r.source, set()).add(r.prefix_group)
    assert all(len(g) == 1 for g in by_source.values())  # an article's questions share one group
    assert len({next(iter(g)) for g in by_source.values()}) == len(by_source) == w.num_groups == 4


def _workload(prompts: list[list[int]], times: list[float] | None = None) -> Workload:
    reqs = [Request(f"r{i}", np.array(p), -1, 1, 0.0 if times is None else times[i])
            for i, p in enumerate(prompts)]
    return Workload("w", tuple(reqs), None if times is None else "trace")


@settings(max_examples=60, deadline=None)
@given(st.lists(st.lists(st.integers(3, 6), min_size=1, max_size=40), min_size=1, max_size=12),
       st.integers(1, 8))
def test_cached_prompt_tokens_is_what_a_never_evicting_block_cache_serves(prompts, block):
    """Against a direct count: request i finds the longest run of whole blocks that an earlier prompt
    filled with the same prefix, never its own last token."""
    w = _workload(prompts)
    expected = 0
    for i, p in enumerate(prompts):
        best = 0
        for q in prompts[:i]:
            n = 0
            while (n + 1) * block <= min(len(p) - 1, len(q)) and p[: (n + 1) * block] == q[: (n + 1) * block]:
                n += 1
            best = max(best, n)
        expected += best * block
    assert w.cached_prompt_tokens(block) == expected


@settings(max_examples=60, deadline=None)
@given(st.lists(st.floats(0, 100, allow_nan=False), min_size=1, max_size=30), st.floats(0.5, 50),
       st.integers(0, 2**31 - 1))
def test_a_window_holds_the_requests_of_its_time_span_shifted_to_zero(times, seconds, seed):
    w = _workload([[3, 4]] * len(times), times)
    win = w.window(seconds, seed)
    assert win.fingerprint() == w.window(seconds, seed).fingerprint()  # a pure function of the seed
    ids = {r.request_id for r in win}
    original = {r.request_id: r.arrival_time for r in w}
    start = min(original[i] for i in ids)
    assert min(r.arrival_time for r in win) == 0.0
    assert ids == {i for i, t in original.items() if start <= t < start + seconds}
    assert all(r.arrival_time == pytest.approx(original[r.request_id] - start) for r in win)
    assert len(win) <= w.max_window_requests(seconds)
    assert start + seconds <= max(times) or start == min(times)  # inside the trace, or all of a short one


# ----------------------------------------------------------------------------- in a scenario
def test_a_scenario_reads_its_trace_beside_it_and_keeps_its_timestamps(tmp_path):
    (tmp_path / "traces").mkdir()
    (tmp_path / "traces" / "support.jsonl").write_bytes(SUPPORT.read_bytes())
    sc = load_scenario(_scenario(tmp_path, "traces/support.jsonl"))
    ep = sc.episode_workload(3)
    assert ep.arrivals == "trace" and len(ep) == 24  # no arrival given: the trace's own
    assert [r.arrival_time for r in ep] == sorted(r.arrival_time for r in sc.pool)
    assert ep.fingerprint() == sc.episode_workload(7).fingerprint()  # the whole file, every seed
    windowed = load_scenario(sc, {"episode": {"window_s": 0.3}})
    a, b = windowed.episode_workload(1), windowed.episode_workload(2)
    assert 1 <= len(a) <= windowed.max_episode_requests < 24 and a.arrivals == "trace"
    assert max(r.arrival_time for r in a) < 0.3
    assert {a.fingerprint(), b.fingerprint(), windowed.episode_workload(3).fingerprint()} != {a.fingerprint()}
    burst = load_scenario(sc, {"episode": {"arrival": "burst"}}).episode_workload(0)
    assert {r.arrival_time for r in burst} == {0.0}


def test_a_scenarios_kv_cache_bounds_the_trace_while_it_is_read(tmp_path):
    _write_jsonl(tmp_path / "t.jsonl", [{"prompt_token_ids": [4] * 10, "output_tokens": 2},
                                       {"prompt_token_ids": [4] * 9000, "output_tokens": 2}])
    sc = load_scenario(_scenario(tmp_path, "t.jsonl"))
    with pytest.raises(WorkloadError, match=r"t.jsonl:2: 9000 prompt \+ 2 output tokens can never fit the "
                                            r"KV cache of 4992 tokens \(0.02 GiB, engine.kv_cache_gib of"):
        sc.pool  # noqa: B018
    bad = tmp_path / "w.yaml"
    bad.write_text(yaml.safe_dump({"workload": {"kind": "custom"}}))
    with pytest.raises(ConfigError, match="kind custom reads your requests from a file"):
        load_scenario(bad)
    bad.write_text(yaml.safe_dump({"workload": {"kind": "trace", "path": "t.jsonl"}}))
    with pytest.raises(ConfigError, match=r"unknown kind 'trace'.*kind: custom, path: FILE"):
        load_scenario(bad)
    assert GROUP_KEY_TOKENS >= 16
