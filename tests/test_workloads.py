"""Workload layer: loaders checked against the real data files, sampling, arrivals, errors.

The data is found like the toolkit finds it (``$FEATHER_DATA_DIR``, else ``../shared/data``);
a test that needs it fails, with the reason, when it is absent (as in ``conftest.py``).
Expected values are computed here from the raw files independently of the loaders.
"""

from __future__ import annotations

import csv
import json
import math
import re
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from feather_env.workloads import (
    DEFAULT_INSTRUCTION_TEMPLATE,
    ENV_VAR,
    TRACE_FILES,
    ZH_TASKS,
    DataNotFoundError,
    Request,
    Workload,
    WorkloadConfig,
    WorkloadError,
    build_workload,
    load_leval,
    load_longbench,
    load_tokenizer,
    load_trace,
    parse_arrival,
    parse_length_spec,
    read_max_new_tokens,
    read_trace,
    resolve_data_dir,
    synthetic_workload,
)
from feather_env.workloads.cache import CACHE_ENV_VAR
from scheduler_runtime.config import ConfigError

MAX_PROMPT = 16384
LEVAL_TASKS = 15


def _data(subdir: str) -> Path:
    try:
        return resolve_data_dir(None, subdir)
    except DataNotFoundError as exc:
        pytest.fail(str(exc))


# ----------------------------------------------------------------------------- fixtures
@pytest.fixture(scope="session")
def tokenizer():
    return load_tokenizer()


@pytest.fixture(scope="session")
def leval_dir() -> Path:
    return _data("leval")


@pytest.fixture(scope="session")
def leval_raw(leval_dir: Path) -> dict:
    """Independent reading of the raw files: unique documents, their unique questions."""
    docs: dict[str, dict] = {}  # text -> {"task": first task, "questions": {question: answer}}
    per_task: dict[str, int] = {}
    files = sorted(leval_dir.glob("*-tasks/*.jsonl"))
    for path in files:
        for line in path.read_text(encoding="utf-8").splitlines():
            if not line.strip():
                continue
            item = json.loads(line)
            entry = docs.setdefault(item["input"], {"questions": {}})
            for q, a in zip(item["instructions"], item["outputs"], strict=True):
                if q not in entry["questions"]:
                    entry["questions"][q] = a
                    per_task[path.stem] = per_task.get(path.stem, 0) + 1
    return {"files": files, "docs": docs, "per_task": per_task}


@pytest.fixture(scope="session")
def leval(leval_dir: Path, tokenizer) -> Workload:
    # Uses the on-disk token cache ($FEATHER_CACHE_DIR or ~/.cache/feather): only the first
    # run of the suite tokenizes.
    return load_leval(leval_dir, tokenizer)


@pytest.fixture(scope="session")
def longbench_dir() -> Path:
    return _data("longbench")


@pytest.fixture(scope="session")
def traces_dir() -> Path:
    return _data("traces")


def _csv_rows(path: Path) -> list[dict]:
    with path.open(newline="") as fh:
        return list(csv.DictReader(fh))


# ----------------------------------------------------------------------------- L-Eval
def test_leval_every_file_loads_with_independent_counts(leval, leval_raw) -> None:
    assert len(leval_raw["files"]) == LEVAL_TASKS
    expected_total = sum(len(d["questions"]) for d in leval_raw["docs"].values())
    assert len(leval) == expected_total
    assert leval.num_groups == sum(1 for d in leval_raw["docs"].values() if d["questions"])
    by_source: dict[str, int] = {}
    for r in leval:
        by_source[r.source] = by_source.get(r.source, 0) + 1
    assert by_source == {f"leval/{task}": n for task, n in leval_raw["per_task"].items()}
    # gsm100 repeats one 16-shot prompt on 100 lines, each with another question.
    gsm = [r for r in leval if r.source == "leval/gsm100"]
    assert len(gsm) == 100 and len({r.prefix_group for r in gsm}) == 1


def test_leval_questions_share_their_document_prefix(leval, leval_raw, tokenizer) -> None:
    prefixes: dict[bytes, int] = {}
    for group, members in leval.groups().items():
        keep = members[0].meta["document_tokens"]
        shared = members[0].prompt_token_ids[: 1 + keep]
        assert shared[0] == 1  # <s>
        for r in members:
            assert r.meta["document_tokens"] == keep
            np.testing.assert_array_equal(r.prompt_token_ids[: 1 + keep], shared)
        assert prefixes.setdefault(shared.tobytes(), group) == group, "two groups, one document"
    # The shared prefix is the document's own tokens, and the question comes last.
    doc_text, entry = next(iter(leval_raw["docs"].items()))
    first = leval[0]
    doc_ids = tokenizer.encode(doc_text, add_special_tokens=False).ids
    keep = first.meta["document_tokens"]
    assert first.prompt_token_ids[1 : 1 + keep].tolist() == doc_ids[:keep]
    question = next(iter(entry["questions"]))
    tail = tokenizer.encode(
        DEFAULT_INSTRUCTION_TEMPLATE.format(instruction=question), add_special_tokens=False
    ).ids
    assert first.prompt_token_ids[-len(tail) :].tolist() == tail


def test_leval_truncation_bound_and_error(leval, leval_dir, tokenizer) -> None:
    assert max(r.prompt_len for r in leval) <= MAX_PROMPT
    truncated = [r for r in leval if r.meta["truncated"]]
    assert truncated, "L-Eval has documents longer than 16K tokens"
    for group in {r.prefix_group for r in truncated}:
        members = leval.groups()[group]
        # The document is cut just enough for the longest question to fit exactly.
        assert max(r.prompt_len for r in members) == MAX_PROMPT
    small = load_leval(leval_dir, tokenizer, tasks=["tpo", "news_summ"], max_prompt_tokens=2048)
    assert max(r.prompt_len for r in small) <= 2048
    with pytest.raises(
        WorkloadError, match=r"leval/legal_contract_qa/d\d+/q\d+.*max_prompt_tokens"
    ):
        load_leval(leval_dir, tokenizer, tasks=["legal_contract_qa"], overflow="error")
    with pytest.raises(WorkloadError, match="unknown L-Eval task"):
        load_leval(leval_dir, tokenizer, tasks=["no_such_task"])
    with pytest.raises(WorkloadError, match="not a valid format string"):
        load_leval(leval_dir, tokenizer, tasks="tpo", instruction_template="{instruction} {x}")


def test_leval_output_lengths_and_caps(leval, leval_raw, leval_dir, tokenizer) -> None:
    assert all(1 <= r.output_len <= 512 for r in leval)
    summaries = [r for r in leval if r.source == "leval/news_summ"]
    for r in summaries:
        assert r.output_len == min(512, max(1, r.meta["answer_tokens"]))
    long_answers = [r for r in leval if r.meta["answer_tokens"] > 512]
    assert long_answers and all(r.output_len == 512 for r in long_answers)
    capped = load_leval(leval_dir, tokenizer, tasks=["news_summ"], max_output_tokens=16)
    assert {r.output_len for r in capped} == {16}
    # output="max": every request generates exactly the cap, short answers included
    fixed = load_leval(leval_dir, tokenizer, tasks=["tpo"], max_output_tokens=96, output="max")
    assert {r.output_len for r in fixed} == {96}
    assert min(r.meta["answer_tokens"] for r in fixed) < 96
    with pytest.raises(WorkloadError, match="output must be one of"):
        load_leval(leval_dir, tokenizer, tasks=["tpo"], output="longest")
    with pytest.raises(WorkloadError, match="needs max_output_tokens"):
        load_leval(leval_dir, tokenizer, tasks=["tpo"], max_output_tokens=None, output="max")
    # answer_tokens is the reference answer's own token count
    doc_text, entry = next(iter(leval_raw["docs"].items()))
    question, answer = next(iter(entry["questions"].items()))
    assert leval[0].meta["answer_tokens"] == len(
        tokenizer.encode(answer, add_special_tokens=False).ids
    )


def test_leval_reuse_factor_is_high(leval) -> None:
    stats = leval.describe()
    assert stats["requests"] == len(leval) and stats["groups"] == leval.num_groups
    assert stats["prompt_tokens_max"] <= MAX_PROMPT
    assert 4.0 < stats["reuse_factor"] < 7.0  # docs/design.md: ~5.7x prompt-token reuse


def test_leval_cache_is_used_and_rebuilt_when_corrupt(
    tmp_path: Path, monkeypatch, leval_dir, tokenizer
) -> None:
    monkeypatch.setenv(CACHE_ENV_VAR, str(tmp_path / "cache"))
    cold = load_leval(leval_dir, tokenizer, tasks=["tpo"])
    entries = list((tmp_path / "cache" / "leval").glob("tpo-*.npz"))
    assert len(entries) == 1
    import feather_env.workloads.leval as leval_module

    def no_tokenizing(*args, **kwargs):
        raise AssertionError("a warm load tokenized again instead of reading the cache")

    with monkeypatch.context() as m:
        m.setattr(leval_module, "encode_batch_ids", no_tokenizing)
        warm = load_leval(leval_dir, tokenizer, tasks=["tpo"])
    assert warm.fingerprint() == cold.fingerprint()
    entries[0].write_bytes(b"not an npz file")
    rebuilt = load_leval(leval_dir, tokenizer, tasks=["tpo"])
    assert rebuilt.fingerprint() == cold.fingerprint()
    with np.load(entries[0]) as rewritten:  # rewritten as a valid archive
        assert "doc_tok" in rewritten.files
    # truncated archive
    data = entries[0].read_bytes()
    entries[0].write_bytes(data[: len(data) // 2])
    assert load_leval(leval_dir, tokenizer, tasks=["tpo"]).fingerprint() == cold.fingerprint()


def test_leval_malformed_line_names_file_and_line(tmp_path: Path, tokenizer) -> None:
    task_dir = tmp_path / "leval" / "Closed-ended-tasks"
    task_dir.mkdir(parents=True)
    good = {"input": "A document.", "instructions": ["Q?"], "outputs": ["A"], "evaluation": "exam"}
    bad_file = task_dir / "broken.jsonl"
    bad_file.write_text(json.dumps(good) + "\n" + '{"input": "x", "instructions": [\n')
    with pytest.raises(WorkloadError, match=re.escape(f"{bad_file}:2: malformed JSON")):
        load_leval(tmp_path, tokenizer, cache=False)
    bad_file.write_text(json.dumps({**good, "outputs": []}) + "\n")
    with pytest.raises(
        WorkloadError, match=re.escape(f"{bad_file}:1: 1 instructions but 0 outputs")
    ):
        load_leval(tmp_path, tokenizer, cache=False)
    bad_file.write_text(json.dumps({**good, "instructions": [], "outputs": []}) + "\n")
    with pytest.raises(WorkloadError, match="produced no requests"):
        load_leval(tmp_path, tokenizer, cache=False)


# ----------------------------------------------------------------------------- LongBench
def test_longbench_counts_lengths_and_caps(longbench_dir: Path) -> None:
    max_new = json.loads((longbench_dir / "config" / "dataset2maxlen.json").read_text())
    assert read_max_new_tokens(longbench_dir) == max_new
    raw = {
        p.stem: [json.loads(line) for line in p.read_text().splitlines() if line.strip()]
        for p in sorted((longbench_dir / "lengths").glob("*.jsonl"))
    }
    assert len(raw) == 21 and sum(map(len, raw.values())) == 4750
    w = load_longbench(longbench_dir, max_prompt_tokens=None, output="max")
    assert len(w) == 4750 and w.num_groups == 4750
    for r in w:
        task = r.meta["task"]
        i = int(r.request_id.rsplit("/", 1)[1])
        factor = 1.0 if task in ZH_TASKS else 1.3
        assert r.prompt_len == max(1, round(raw[task][i]["length"] * factor))
        assert r.output_len == max_new[task]
        assert r.prompt_token_ids.min() >= 3 and r.prompt_token_ids.max() < 8192
    counts = {}
    for r in w:
        counts[r.meta["task"]] = counts.get(r.meta["task"], 0) + 1
    assert counts == {task: len(items) for task, items in raw.items()}


def test_longbench_answer_lengths_factor_and_truncation(longbench_dir: Path, tokenizer) -> None:
    max_new = read_max_new_tokens(longbench_dir)
    items = [
        json.loads(x) for x in (longbench_dir / "lengths" / "qasper.jsonl").read_text().splitlines()
    ]
    w = load_longbench(longbench_dir, tasks="qasper", tokens_per_word=2.0, max_prompt_tokens=None)
    for r, item in zip(w, items, strict=True):
        assert r.prompt_len == round(item["length"] * 2.0)
        words = len(item["answers"][0].split())
        assert r.output_len == min(max_new["qasper"], max(1, math.ceil(words * 2.0)))
    with_tok = load_longbench(longbench_dir, tasks="gov_report", tokenizer=tokenizer)
    assert all(1 <= r.output_len <= max_new["gov_report"] for r in with_tok)
    assert (
        max(r.output_len for r in with_tok) == max_new["gov_report"]
    )  # some summaries hit the cap
    capped = load_longbench(
        longbench_dir, tasks=["narrativeqa", "dureader"], max_prompt_tokens=4096
    )
    assert max(r.prompt_len for r in capped) == 4096
    with pytest.raises(WorkloadError, match=r"longbench/narrativeqa/\d+ .*max_prompt_tokens=4096"):
        load_longbench(longbench_dir, tasks="narrativeqa", max_prompt_tokens=4096, overflow="error")
    with pytest.raises(WorkloadError, match="unknown LongBench task"):
        load_longbench(longbench_dir, tasks="nope")


def test_longbench_grouping_shares_prefixes(longbench_dir: Path) -> None:
    w = load_longbench(longbench_dir, tasks="qmsum", group_size=4, question_tokens=16, seed=1)
    groups = w.groups()
    assert len(groups) == math.ceil(200 / 4)
    contexts = set()
    for members in groups.values():
        ids = [int(r.request_id.rsplit("/", 1)[1]) for r in members]
        assert ids == list(range(ids[0], ids[0] + len(members)))  # consecutive items
        n = members[0].meta["context_tokens"]
        assert all(r.prompt_len == n + 16 for r in members)
        for r in members[1:]:
            np.testing.assert_array_equal(r.prompt_token_ids[:n], members[0].prompt_token_ids[:n])
        assert len({r.prompt_token_ids[n:].tobytes() for r in members}) == len(members)
        contexts.add(members[0].prompt_token_ids[:2].tobytes())
    assert len(contexts) == len(groups)  # groups differ from the first tokens on
    assert w.describe()["reuse_factor"] > 3.0


# ----------------------------------------------------------------------------- traces
def test_splitwise_trace_counts_lengths_and_arrivals(traces_dir: Path) -> None:
    path = traces_dir / TRACE_FILES["splitwise"]
    rows = _csv_rows(path)
    w = load_trace(path)
    assert len(w) == len(rows) and w.arrivals == "trace"
    prefill = np.array([int(r["num_prefill_tokens"]) for r in rows])
    np.testing.assert_array_equal([r.prompt_len for r in w], np.minimum(prefill, MAX_PROMPT))
    np.testing.assert_array_equal(
        [r.output_len for r in w], [int(r["num_decode_tokens"]) for r in rows]
    )
    np.testing.assert_allclose([r.arrival_time for r in w], [float(r["arrived_at"]) for r in rows])
    # no shared prefixes: every request's first two tokens are its own
    assert w.num_groups == len(w)
    assert len({r.prompt_token_ids[:2].tobytes() for r in w if r.prompt_len >= 2}) == sum(
        1 for r in w if r.prompt_len >= 2
    )
    kept = w.sample(500, seed=0).with_arrivals("trace")
    times = [r.arrival_time for r in kept]
    assert times == sorted(times)
    assert all(r.arrival_time == w[r.request_id].arrival_time for r in kept)


@pytest.mark.parametrize("kind", ["sharegpt", "arxiv"])
def test_length_only_traces(traces_dir: Path, kind: str) -> None:
    path = traces_dir / TRACE_FILES[kind]
    rows = _csv_rows(path)
    assert read_trace(path).prefill.size == len(rows)
    w = load_trace(path, limit=300, max_output_tokens=256)
    assert len(w) == 300 and w.arrivals is None
    for r, row in zip(w, rows, strict=False):
        assert r.prompt_len == min(int(row["num_prefill_tokens"]), MAX_PROMPT)
        assert r.output_len == min(int(row["num_decode_tokens"]), 256)
    with pytest.raises(WorkloadError, match="no timestamps"):
        w.with_arrivals("trace")


def test_trace_bad_input(tmp_path: Path) -> None:
    bad = tmp_path / "bad.csv"
    bad.write_text("num_prefill_tokens,decode\n10,5\n")
    with pytest.raises(
        WorkloadError, match=re.escape(f"{bad}: missing column(s) ['num_decode_tokens']")
    ):
        load_trace(bad)
    bad.write_text("num_prefill_tokens,num_decode_tokens\n10,5\n12,abc\n")
    with pytest.raises(WorkloadError, match=re.escape(f"{bad}:3: num_decode_tokens is 'abc'")):
        load_trace(bad)
    bad.write_text("num_prefill_tokens,num_decode_tokens\n")
    with pytest.raises(WorkloadError, match="no rows"):
        load_trace(bad)
    bad.write_text("num_prefill_tokens,num_decode_tokens\n20000,5\n")
    with pytest.raises(WorkloadError, match=r"bad/0 .*20000 prompt tokens"):
        load_trace(bad, overflow="error")
    missing = tmp_path / "nope.csv"
    with pytest.raises(DataNotFoundError, match=re.escape(str(missing))):
        load_trace(missing)


# ----------------------------------------------------------------------------- determinism
@pytest.mark.parametrize(
    "cfg",
    [
        {"kind": "leval", "num_groups": 4, "arrival": "poisson:1.5"},
        {"kind": "longbench", "tasks": ["hotpotqa", "lsht"], "num_requests": 50},
        {"kind": "splitwise", "num_requests": 200},
        {"kind": "synthetic", "num_groups": 3, "per_group": "uniform:2:5", "prefix_len": 300},
    ],
)
def test_same_seed_same_workload_other_seed_other_sample(cfg: dict) -> None:
    subdir = {"leval": "leval", "longbench": "longbench", "splitwise": "traces"}.get(cfg["kind"])
    if subdir:
        _data(subdir)
    a, b = build_workload({**cfg, "seed": 7}), build_workload({**cfg, "seed": 7})
    assert a.request_ids == b.request_ids and a.fingerprint() == b.fingerprint()
    c = build_workload({**cfg, "seed": 8})
    assert a.fingerprint() != c.fingerprint()
    if cfg["kind"] != "synthetic":
        assert set(a.request_ids) != set(c.request_ids)


def test_arrival_processes() -> None:
    w = synthetic_workload(4, 5, 50, 5, 8, seed=0)
    burst = w.with_arrivals("burst")
    assert burst.arrivals == "burst" and {r.arrival_time for r in burst} == {0.0}
    assert burst.request_ids == w.request_ids  # ties keep the queue order
    p = w.with_arrivals(parse_arrival("poisson:4"), seed=3)
    times = np.array([r.arrival_time for r in p])
    assert p.arrivals == "poisson:4" and np.all(np.diff(times) >= 0) and times[0] > 0
    assert p.fingerprint() == w.with_arrivals("poisson:4", seed=3).fingerprint()
    assert p.fingerprint() != w.with_arrivals("poisson:4", seed=4).fingerprint()
    many = synthetic_workload(100, 10, 1, 1, 1).with_arrivals("poisson:4", seed=1)
    assert 3.6 < len(many) / many[-1].arrival_time < 4.4  # 1000 arrivals at 4 requests/s
    with pytest.raises(WorkloadError, match="no timestamps"):
        w.with_arrivals("trace")
    for spec in ("poisson", "poisson:-1", "poisson:abc", "uniform:3", "bursty", 3):
        with pytest.raises(ConfigError, match="poisson:RATE"):
            parse_arrival(spec)  # type: ignore[arg-type]


def test_length_specs() -> None:
    rng = np.random.default_rng(0)
    assert parse_length_spec(7).sample(rng, 3).tolist() == [7, 7, 7]
    assert parse_length_spec("7").sample(rng, 2).tolist() == [7, 7]
    u = parse_length_spec("uniform:3:5").sample(rng, 500)
    assert set(u.tolist()) == {3, 4, 5}
    c = parse_length_spec("choice:10, 20,30").sample(rng, 300)
    assert set(c.tolist()) == {10, 20, 30}
    ln = parse_length_spec("lognormal:200:0.5").sample(rng, 20000)
    assert 190 < ln.mean() < 210 and ln.min() >= 1
    for bad, why in [
        ("uniform:5:3", "LO=5 > HI=3"),
        ("uniform:1", "LO:HI"),
        ("lognormal:-1:1", "MEAN > 0"),
        ("choice:", "at least one"),
        ("zipf:1", "unknown distribution"),
        ("abc", "not a number"),
        ("2.5", "non-negative integer"),
        (-3, ">= 0"),
    ]:
        with pytest.raises(ConfigError, match=why) as info:
            parse_length_spec(bad, name="prefix_len")
        assert "prefix_len" in str(info.value) and "uniform:LO:HI" in str(info.value)


def test_synthetic_workload_shape_and_caps() -> None:
    w = synthetic_workload(3, "choice:2,4", "uniform:100:200", 10, "lognormal:50:1", seed=5)
    for members in w.groups().values():
        n = members[0].meta["prefix_tokens"]
        assert 100 <= n <= 200 and len(members) in (2, 4)
        assert all(r.prompt_len == n + 10 for r in members)
        for r in members:
            np.testing.assert_array_equal(r.prompt_token_ids[:n], members[0].prompt_token_ids[:n])
    capped = synthetic_workload(
        2, 3, 500, 20, 900, seed=0, max_prompt_tokens=100, max_output_tokens=64
    )
    assert {r.prompt_len for r in capped} == {100} and {r.output_len for r in capped} == {64}
    with pytest.raises(WorkloadError, match="max_prompt_tokens=100"):
        synthetic_workload(2, 3, 500, 20, 9, max_prompt_tokens=100, overflow="error")


# ----------------------------------------------------------------------------- errors
def test_data_dir_resolution(tmp_path: Path, monkeypatch) -> None:
    (tmp_path / "root" / "traces").mkdir(parents=True)
    (tmp_path / "env" / "traces").mkdir(parents=True)
    monkeypatch.setenv(ENV_VAR, str(tmp_path / "env"))
    assert resolve_data_dir(tmp_path / "root", "traces") == tmp_path / "root" / "traces"
    assert resolve_data_dir(None, "traces") == tmp_path / "env" / "traces"
    # pointing at the subfolder itself works too
    assert resolve_data_dir(tmp_path / "root" / "traces", "traces") == tmp_path / "root" / "traces"
    with pytest.raises(DataNotFoundError) as info:
        resolve_data_dir(None, "leval")
    msg = str(info.value)
    assert str(tmp_path / "env" / "leval") in msg and ENV_VAR in msg and "OpenLMLab/LEval" in msg
    assert isinstance(info.value, FileNotFoundError)
    monkeypatch.setenv(ENV_VAR, str(tmp_path / "nowhere"))
    with pytest.raises(
        DataNotFoundError, match=re.escape(str(tmp_path / "nowhere")) + ".*THUDM/LongBench"
    ):
        load_longbench()
    with pytest.raises(DataNotFoundError, match="vidur"):
        build_workload({"kind": "sharegpt"})
    monkeypatch.delenv(ENV_VAR)
    with pytest.raises(DataNotFoundError, match=re.escape(str(tmp_path / "explicit"))):
        load_leval(tmp_path / "explicit")


def test_longbench_malformed_line(tmp_path: Path) -> None:
    (tmp_path / "lengths").mkdir()
    (tmp_path / "config").mkdir()
    (tmp_path / "config" / "dataset2maxlen.json").write_text('{"qasper": 128}')
    f = tmp_path / "lengths" / "qasper.jsonl"
    f.write_text('{"length": 10, "answers": ["yes"]}\n{"length": "ten", "answers": ["no"]}\n')
    with pytest.raises(
        WorkloadError, match=re.escape(f"{f}:2: `length` must be a positive integer")
    ):
        load_longbench(tmp_path)
    f.write_text('{"length": 10, "answers": ["yes"]}\nnot json\n')
    with pytest.raises(WorkloadError, match=re.escape(f"{f}:2: malformed JSON")):
        load_longbench(tmp_path)
    f.write_text("")
    with pytest.raises(WorkloadError, match="no items"):
        load_longbench(tmp_path)


def _req(rid: str, group: int = 0, n: int = 4) -> Request:
    return Request(rid, np.arange(3, 3 + n), group, 1)


def test_workload_invariants() -> None:
    with pytest.raises(WorkloadError, match="'empty' is empty"):
        Workload("empty", ())
    with pytest.raises(WorkloadError, match="duplicate request id 'a'"):
        Workload("dup", (_req("a"), _req("b"), _req("a")))
    w = Workload("w", (_req("a"), _req("b", 1)))
    assert w["b"].prefix_group == 1 and "a" in w and len(w) == 2
    with pytest.raises(WorkloadError, match="cannot sample 3 requests from 2"):
        w.sample(3, seed=0)
    with pytest.raises(WorkloadError, match="cannot sample 0 prefix groups"):
        w.sample_groups(0, seed=0)
    with pytest.raises(AttributeError):
        w.name = "other"  # type: ignore[misc]


def test_config_errors() -> None:
    with pytest.raises(
        ConfigError, match=r"unknown key\(s\) \['max_prompt_token'\].*'max_prompt_tokens'"
    ):
        WorkloadConfig.from_mapping({"kind": "leval", "max_prompt_token": 100})
    with pytest.raises(ConfigError, match=r"unknown key.*valid keys are \[.*'arrival'"):
        build_workload({"kind": "synthetic", "arrivals": "burst"})
    with pytest.raises(ConfigError, match="unknown kind 'lval'"):
        WorkloadConfig(kind="lval")
    with pytest.raises(ConfigError, match="poisson:RATE"):
        WorkloadConfig.from_mapping({"arrival": "poisson:fast"})
    with pytest.raises(ConfigError, match="workload.prefix_len"):
        WorkloadConfig.from_mapping({"kind": "synthetic", "prefix_len": "uniform:9:1"})
    cfg = WorkloadConfig.from_mapping(
        {"kind": "longbench", "tasks": ["qasper"], "tokens_per_word": 2}
    )
    assert cfg.tasks == ("qasper",) and cfg.tokens_per_word == 2.0


# ----------------------------------------------------------------------------- properties
@st.composite
def _workloads(draw) -> Workload:
    sizes = draw(st.lists(st.integers(1, 6), min_size=1, max_size=8))
    reqs = [_req(f"g{g}/r{j}", g, 1 + j) for g, n in enumerate(sizes) for j in range(n)]
    order = draw(st.permutations(range(len(reqs))))
    return Workload("prop", tuple(reqs[i] for i in order))


@settings(max_examples=60, deadline=None)
@given(w=_workloads(), data=st.data(), seed=st.integers(0, 2**32 - 1))
def test_sample_is_a_deterministic_subset(w: Workload, data, seed: int) -> None:
    n = data.draw(st.integers(1, len(w)))
    s = w.sample(n, seed)
    assert len(s) == n == len(set(s.request_ids))
    assert set(s.request_ids) <= set(w.request_ids)
    assert all(r is w[r.request_id] for r in s)
    assert s.request_ids == w.sample(n, seed).request_ids
    ordered = w.sample(n, seed, shuffle=False).request_ids
    assert ordered == [rid for rid in w.request_ids if rid in set(ordered)]


@settings(max_examples=60, deadline=None)
@given(w=_workloads(), data=st.data(), seed=st.integers(0, 2**32 - 1))
def test_sample_groups_keeps_groups_whole(w: Workload, data, seed: int) -> None:
    k = data.draw(st.integers(1, w.num_groups))
    cap = data.draw(st.one_of(st.none(), st.integers(1, 6)))
    s = w.sample_groups(k, seed, max_per_group=cap)
    assert s.num_groups == k and len(set(s.request_ids)) == len(s)
    assert set(s.request_ids) <= set(w.request_ids)
    full = w.groups()
    for g, members in s.groups().items():
        assert len(members) == (len(full[g]) if cap is None else min(cap, len(full[g])))
        assert {r.request_id for r in members} <= {r.request_id for r in full[g]}
    assert s.fingerprint() == w.sample_groups(k, seed, max_per_group=cap).fingerprint()
    grouped = w.sample_groups(k, seed, max_per_group=cap, shuffle=False)
    runs = [r.prefix_group for r in grouped]
    assert runs == sorted(runs, key=lambda g: runs.index(g))  # members stay together


# ---------------------------------------------------------------------------- text encoding


def test_files_that_are_not_utf8_are_workload_errors_naming_them(tmp_path: Path) -> None:
    """A non-UTF-8 file once raised a raw UnicodeDecodeError in every reader."""
    from feather_env.workloads.longbench import read_lengths, read_max_new_tokens
    from feather_env.workloads.traces import read_trace

    latin1 = "caf\u00e9".encode("latin-1")
    lengths = tmp_path / "lengths" / "qasper.jsonl"
    lengths.parent.mkdir()
    lengths.write_bytes(b'{"length": 10, "answers": ["a"]}\n{"length": 12, "answers": ["' + latin1 + b'"]}\n')
    with pytest.raises(WorkloadError, match=rf"{re.escape(str(lengths))}:2: not UTF-8 text"):
        read_lengths(lengths)
    config = tmp_path / "config" / "dataset2maxlen.json"
    config.parent.mkdir()
    config.write_bytes(b'{"qasper": 128, "' + latin1 + b'": 3}')
    with pytest.raises(WorkloadError, match=rf"{re.escape(str(config))}: not UTF-8 text"):
        read_max_new_tokens(tmp_path)
    trace = tmp_path / "trace.csv"
    trace.write_bytes(b"num_prefill_tokens,num_decode_tokens\n10,5\n" + latin1 + b",3\n")
    with pytest.raises(WorkloadError, match=rf"{re.escape(str(trace))}: not UTF-8 text"):
        read_trace(trace)
