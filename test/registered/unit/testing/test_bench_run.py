"""The serving benchmark's client side without a server (``testing/server/bench_run.py``,
``bench_workloads.py``): bench_serving's command line and output read back, the request-by-
request comparison and its criterion, the Mooncake-format conversations. Runs in both venvs."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest

from sglang_cp_hicache.testing.server.bench_run import (
    Agreement,
    BenchRequest,
    BenchRun,
    DecodeTally,
    agreement,
    agrees_like_reference,
    bench_argv,
    parse_output,
    run_bounded,
    tolerance,
)
from sglang_cp_hicache.testing.server.bench_workloads import MOONCAKE_BLOCK_TOKENS, Conversations, shared_prefix, warm_up_prompts
from sglang_cp_hicache.testing.server.recorder import FIRST_TOKEN_ID, VOCAB_SIZE


def _run(label, texts, errors=None, lens=None):
    errors = errors or [""] * len(texts)
    lens = lens or [100] * len(texts)
    requests = tuple(BenchRequest(t, e, 0.1, n, {"device": 64}) for t, e, n in zip(texts, errors, lens))
    return BenchRun(label, {}, requests)


def test_bench_serving_is_asked_for_greedy_details_under_its_own_key(tmp_path):
    workload = shared_prefix(groups=2, prompts_per_group=3, system_tokens=128, question_tokens=16, output_tokens=4)
    argv = bench_argv("http://r", Path("/m"), workload, 4, tmp_path / "o.jsonl", "key-1", seed=7)
    assert workload.expected_tokens == 6 * 4
    assert argv[:4] == [sys.executable, "-m", "sglang.bench_serving", "--backend"] and argv[4] == "sglang"
    for flag in ("--cache-report", "--output-details", "--tokenize-prompt"):
        assert flag in argv
    value = lambda flag: argv[argv.index(flag) + 1]  # noqa: E731
    assert value("--tokenizer") == "/m" and value("--max-concurrency") == "4" and value("--seed") == "7"
    assert json.loads(value("--extra-request-body")) == {"extra_key": "key-1"}
    assert workload.requests == 6 and workload.working_set_tokens == 256


def test_output_details_are_read_back_per_request():
    record = {
        "completed": 2, "median_ttft_ms": 12.5, "request_throughput": 1.5, "server_info": {"x": 1},
        "generated_texts": ["ab", ""], "errors": ["", "Bad Gateway: x"], "ttfts": [0.1, 0.0], "input_lens": [70, 80],
        "cached_tokens_details": [{"device": 64, "host": 0, "storage": 128}, None],
    }  # fmt: skip
    run = parse_output("a", json.dumps(record))
    assert run.summary == {"completed": 2, "median_ttft_ms": 12.5, "request_throughput": 1.5}
    assert run.failed == 1 and run.blank == 0  # a failed request is not also a blank one
    assert run.hits() == {"device": 64, "host": 0, "storage": 128}
    assert run.ttfts_s() == [0.1]


def test_every_answer_has_its_tokens_by_the_decodes_count_not_by_the_text():
    """A blank text is a correct answer of tokens the tiny tokenizer decodes to nothing; an
    empty success shows as tokens the decode never generated."""
    blank = BenchRequest("", "", 0.1, 70, {})
    full = BenchRun("a", {}, (blank, blank), decoded=DecodeTally(2, 8), expected_tokens=8)
    assert full.blank == 2 and full.incomplete() is None
    short = BenchRun("a", {}, (blank, blank), decoded=DecodeTally(2, 4), expected_tokens=8)
    assert short.missing_tokens == 4 and "4 of 8 tokens" in short.incomplete()
    unfinished = BenchRun("a", {}, (blank, blank), decoded=DecodeTally(1, 8), expected_tokens=8)
    assert "finished 1 requests" in unfinished.incomplete()
    assert DecodeTally(7, 30).since(DecodeTally(5, 22)) == DecodeTally(2, 8)


def test_agreement_counts_mismatches_and_failures_apart():
    x = _run("x", ["a", "b", "c", "d", ""], errors=["", "", "boom", "", ""])
    y = _run("y", ["a", "B", "c", "d", "e"])
    result = agreement(x, y)
    assert (result.requests, result.mismatched, result.failed) == (5, 2, 1)
    assert result.mismatched_at == (1, 4) and result.mismatch_rate == pytest.approx(0.4)


def test_agreement_refuses_runs_of_different_prompts():
    with pytest.raises(ValueError, match="same prompts"):
        agreement(_run("x", ["a", "b"], lens=[10, 20]), _run("y", ["a", "b"], lens=[10, 21]))


def test_criterion_is_the_references_own_spread_plus_a_tolerance_of_its_sampling_noise():
    spread = Agreement(48, 12, 0)  # 25 %
    allowed = tolerance(Agreement(48, 16, 0), spread)
    assert allowed == pytest.approx(0.05 + 3 * math.sqrt(2 * (28 / 96) * (68 / 96) / 48))
    assert agrees_like_reference(Agreement(48, 16, 0), spread) is None
    assert "mismatch rate" in agrees_like_reference(Agreement(48, 40, 0), spread)
    assert tolerance(Agreement(48, 0, 0), Agreement(48, 0, 0)) == 0.05  # no noise: the floor
    assert "mismatch rate" in agrees_like_reference(Agreement(48, 15, 0), Agreement(48, 0, 0))
    assert "1 failed" in agrees_like_reference(Agreement(20, 0, 0), Agreement(20, 0, 1))


def test_warm_up_prompts_stay_in_the_vocabulary_and_share_full_pages():
    """The benchmark's warm-up once sent ids 3..514 to a 512-id model: the PD decode (and the
    flag's prefill) refuse such ids, upstream's unsharded prefills serve them wrongly."""
    prompts = warm_up_prompts(pages=8, count=3)
    assert len(prompts) == 3
    assert all(FIRST_TOKEN_ID <= t < VOCAB_SIZE for prompt in prompts for t in prompt)
    assert prompts[0][: 8 * 64] == prompts[1][: 8 * 64] == prompts[2][: 8 * 64]
    assert len({tuple(p) for p in prompts}) == 3  # each goes past the shared pages


def test_conversations_extend_each_turn_and_go_turn_by_turn(tmp_path):
    trace = Conversations(conversations=3, turns=2, blocks_per_turn=2, output_tokens=5)
    workload = trace.workload(tmp_path / "t.jsonl")
    records = [json.loads(line) for line in (tmp_path / "t.jsonl").read_text().splitlines()]
    assert workload.requests == len(records) == 6
    assert [r["timestamp"] for r in records] == sorted(r["timestamp"] for r in records)
    first, second = records[:3], records[3:]
    for turn1, turn2 in zip(first, second):
        assert turn2["hash_ids"][: len(turn1["hash_ids"])] == turn1["hash_ids"] and len(turn2["hash_ids"]) == 4
    assert not set(first[0]["hash_ids"]) & set(first[1]["hash_ids"])  # conversations share nothing
    assert workload.working_set_tokens == 3 * 4 * MOONCAKE_BLOCK_TOKENS
    assert "--dataset-path" in workload.dataset_args and "mooncake" in workload.dataset_args


def test_mooncake_block_tokens_are_what_the_tiny_tokenizer_makes_of_bench_servings_block():
    from transformers import AutoTokenizer

    from sglang_cp_hicache.testing.server.tiny_model import ensure_checkpoint

    tokenizer = AutoTokenizer.from_pretrained(ensure_checkpoint())
    block = "12" + " ".join(["hi"] * 128)  # bench_serving's mooncake block for hash id 12
    assert abs(len(tokenizer.encode(block)) - MOONCAKE_BLOCK_TOKENS) <= 2


def test_a_command_past_its_bound_is_killed_with_its_group(tmp_path):
    import subprocess

    marker = tmp_path / "child.pid"
    body = (f"import subprocess, sys, time; p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); "
            f"open({str(marker)!r}, 'w').write(str(p.pid)); time.sleep(60)")  # fmt: skip
    with pytest.raises(subprocess.TimeoutExpired):
        run_bounded([sys.executable, "-c", body], {"PATH": "/usr/bin:/bin"}, tmp_path / "log", timeout_s=3.0)
    assert _gone_within(int(marker.read_text()), 10.0)


def _gone_within(pid: int, seconds: float) -> bool:
    """Gone (or a zombie waiting to be reaped by whoever adopted it) within ``seconds``: a
    SIGKILLed process dies when it next runs, later on a loaded box."""
    import time

    import psutil

    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                return True
        except psutil.NoSuchProcess:
            return True
        time.sleep(0.1)
    return False
