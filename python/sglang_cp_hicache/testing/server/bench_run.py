"""SGLang's own serving benchmark client, ``python -m sglang.bench_serving --backend sglang``,
run as a subprocess against a router of the serving harness, its results read back.

One :func:`run_bench` is one ``bench_serving`` run: greedy (its default temperature 0,
``ignore_eos``), ``--cache-report`` (cached tokens by tier per request), ``--output-details``
(every request's generated text, error, TTFT, cached tokens), the tokenizer read from the
tiny model's local folder, nothing downloaded (``HF_HUB_OFFLINE``), its caches and temporary
files in the run's folder (``HOME``, ``TMPDIR``). ``extra_key`` is sent with every request
(``--extra-request-body``): SGLang keeps a request's cached pages apart from every other
key's in all tiers, so a rerun of the same prompts under another key starts cold without a
``/flush_cache``.

**Every answer has its tokens.** ``bench_serving`` keeps each answer's text, not its token
ids, and the tiny model's tokenizer decodes 119 of the model's 512 ids to nothing (its BPE
has 393 entries), so a correct greedy answer can be blank text. What decides is the decode
server's own count over the run (:class:`DecodeTally`: finished requests and generated
tokens, ``sglang:num_requests_total`` and ``sglang:generation_tokens_total``): with
``ignore_eos`` every request must finish with all its ``max_new_tokens``, so an empty or
short success shows as missing tokens.

:func:`agreement` compares two runs of the same workload request by request (bench_serving
sends the same prompts in the same order for the same seed); :func:`agrees_like_reference`
is the criterion under concurrency.
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

from sglang_cp_hicache.testing.server.client import TIERS
from sglang_cp_hicache.testing.server.metrics import Metrics

BENCH_TIMEOUT_S = 900.0


@dataclass(frozen=True)
class Workload:
    """A ``bench_serving`` dataset: its name and arguments (the dataset options, the prompt
    count), how many requests it sends, and its logical working set (the distinct prefix
    tokens a cache must hold to serve every reuse from one tier)."""

    name: str
    dataset_args: Tuple[str, ...]
    requests: int
    output_tokens: int  # per request (greedy, ignore_eos: every answer has exactly these)
    working_set_tokens: int = 0

    @property
    def expected_tokens(self) -> int:
        return self.requests * self.output_tokens


@dataclass(frozen=True)
class DecodeTally:
    """What the decode server finished: requests and generated tokens (its own counters,
    which leave out health checks)."""

    requests: int
    tokens: int

    @classmethod
    def read(cls, decode_url: str) -> "DecodeTally":
        metrics = Metrics.fetch(decode_url)
        total = lambda name: int(metrics.total(name))  # noqa: E731
        return cls(total("sglang:num_requests_total"), total("sglang:generation_tokens_total"))

    def since(self, earlier: "DecodeTally") -> "DecodeTally":
        return DecodeTally(self.requests - earlier.requests, self.tokens - earlier.tokens)


@dataclass(frozen=True)
class BenchRequest:
    """One request as ``bench_serving`` saw it."""

    text: str
    error: str
    ttft_s: float
    input_len: int
    cached: Dict[str, int]

    @property
    def ok(self) -> bool:
        return not self.error

    @property
    def blank(self) -> bool:
        """Answered with success and no text (tokens the tokenizer decodes to nothing, or an
        empty answer: :class:`DecodeTally` tells which)."""
        return self.ok and not self.text


@dataclass(frozen=True)
class BenchRun:
    """One ``bench_serving`` run: its summary (request and token throughput, TTFT
    percentiles, cached tokens by tier), every request, and what the decode server finished
    meanwhile against what the workload asks for."""

    label: str
    summary: dict
    requests: Tuple[BenchRequest, ...]
    wall_s: float = 0.0
    decoded: DecodeTally = DecodeTally(0, 0)
    expected_tokens: int = 0

    @property
    def failed(self) -> int:
        return sum(not r.ok for r in self.requests)

    @property
    def blank(self) -> int:
        return sum(r.blank for r in self.requests)

    @property
    def missing_tokens(self) -> int:
        """Output tokens the workload asks for that the decode server did not generate (0
        when every request finished with all of its tokens)."""
        return self.expected_tokens - self.decoded.tokens

    def incomplete(self) -> Optional[str]:
        """None when every request succeeded and the decode finished each with all its
        tokens; else what is missing."""
        if self.failed or self.missing_tokens or self.decoded.requests != len(self.requests):
            return (f"{self.label}: {self.failed} of {len(self.requests)} failed; the decode finished "
                    f"{self.decoded.requests} requests with {self.decoded.tokens} of {self.expected_tokens} tokens")  # fmt: skip
        return None

    def hits(self) -> Dict[str, int]:
        """Cached prompt tokens by tier, summed over the successful requests."""
        return {tier: sum(r.cached.get(tier, 0) for r in self.requests if r.ok) for tier in TIERS}

    def ttfts_s(self) -> List[float]:
        return [r.ttft_s for r in self.requests if r.ok]


def bench_argv(url: str, model: Path, workload: Workload, concurrency: int, output: Path, extra_key: str, seed: int) -> List[str]:
    """The ``bench_serving`` command line of one run."""
    return [
        sys.executable, "-m", "sglang.bench_serving", "--backend", "sglang",
        "--base-url", url, "--model", str(model), "--tokenizer", str(model),
        *workload.dataset_args,
        "--max-concurrency", str(concurrency), "--request-rate", "inf", "--seed", str(seed),
        "--warmup-requests", "0", "--ready-check-timeout-sec", "0",
        "--cache-report", "--output-details", "--output-file", str(output), "--disable-tqdm",
        "--extra-request-body", json.dumps({"extra_key": extra_key}),
    ]  # fmt: skip


def bench_env(folder: Path) -> Dict[str, str]:
    """``bench_serving``'s environment: offline, its caches and temporary files in ``folder``."""
    (folder / "tmp").mkdir(parents=True, exist_ok=True)
    return {
        **os.environ,
        "HOME": str(folder),  # the generated-shared-prefix dataset caches under ~/.cache
        "TMPDIR": str(folder / "tmp"),
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "PYTHONUNBUFFERED": "1",
    }


def run_bounded(argv: Sequence[str], env: Dict[str, str], log: Path, timeout_s: float) -> int:
    """Run ``argv`` in its own process group, output to ``log``; past ``timeout_s`` (or on any
    interruption) the group is killed and the error raised (``subprocess.TimeoutExpired``).
    Its exit status."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "ab") as out:
        process = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                   env=env, start_new_session=True)  # fmt: skip
        try:
            return process.wait(timeout=timeout_s)
        except BaseException:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
            raise
        finally:
            try:
                os.killpg(process.pid, signal.SIGKILL)  # anything it left in its group
            except ProcessLookupError:
                pass


def parse_output(label: str, line: str) -> BenchRun:
    """A ``bench_serving`` ``--output-details`` JSONL record as a :class:`BenchRun`."""
    record = json.loads(line)
    texts, errors = record["generated_texts"], record["errors"]
    details = record.get("cached_tokens_details") or [None] * len(texts)
    requests = tuple(
        BenchRequest(
            text=text,
            error=error or "",
            ttft_s=float(ttft),
            input_len=int(input_len),
            cached={tier: int((detail or {}).get(tier) or 0) for tier in TIERS},
        )
        for text, error, ttft, input_len, detail in zip(texts, errors, record["ttfts"], record["input_lens"], details)
    )
    summary = {k: v for k, v in record.items() if not isinstance(v, list) and k != "server_info"}
    return BenchRun(label, summary, requests)


@dataclass(frozen=True)
class BenchTarget:
    """Where one run goes: a router, and the decode server behind it (its tally)."""

    router_url: str
    decode_url: str


def run_bench(
    target: BenchTarget, model: Path, workload: Workload, concurrency: int, folder: Path, label: str,
    extra_key: str, seed: int = 1, timeout_s: float = BENCH_TIMEOUT_S,
) -> BenchRun:  # fmt: skip
    """One ``bench_serving`` run through ``target``'s router (nothing else may use its decode
    meanwhile: the tally is the decode's); its log and output in ``folder``. Raises
    RuntimeError naming the log when it exits non-zero or writes nothing."""
    output = folder / f"{label}.jsonl"
    log = folder / f"{label}.log"
    output.unlink(missing_ok=True)
    argv = bench_argv(target.router_url, model, workload, concurrency, output, extra_key, seed)
    before, started = DecodeTally.read(target.decode_url), time.monotonic()
    status = run_bounded(argv, bench_env(folder), log, timeout_s)
    wall_s = time.monotonic() - started
    lines = output.read_text().splitlines() if output.exists() else []
    if status != 0 or not lines:
        tail = "\n".join(log.read_text(errors="replace").splitlines()[-15:])
        raise RuntimeError(f"bench_serving {label} exited {status} (log {log}):\n{tail}")
    run = parse_output(label, lines[-1])
    decoded = DecodeTally.read(target.decode_url).since(before)
    return BenchRun(run.label, run.summary, run.requests, wall_s, decoded, workload.expected_tokens)


@dataclass(frozen=True)
class Agreement:
    """Two runs of one workload compared request by request (greedy outputs)."""

    requests: int
    mismatched: int
    failed: int  # failed on either side
    mismatched_at: Tuple[int, ...] = field(default=())

    @property
    def mismatch_rate(self) -> float:
        return self.mismatched / self.requests if self.requests else 0.0

    def as_dict(self) -> dict:
        return {**self.__dict__, "mismatch_rate": round(self.mismatch_rate, 4)}


def agreement(x: BenchRun, y: BenchRun) -> Agreement:
    """``x`` and ``y`` request by request, by their greedy output texts; a request failed on
    either side counts there, not as a mismatch. Raises ValueError when the runs did not send
    the same workload (counts or prompt lengths differ)."""
    if len(x.requests) != len(y.requests) or [r.input_len for r in x.requests] != [r.input_len for r in y.requests]:
        raise ValueError(f"{x.label} and {y.label} did not send the same prompts")
    failed = 0
    mismatched: List[int] = []
    for i, (a, b) in enumerate(zip(x.requests, y.requests)):
        if not (a.ok and b.ok):
            failed += 1
        elif a.text != b.text:
            mismatched.append(i)
    return Agreement(len(x.requests), len(mismatched), failed, tuple(mismatched))


#: The criterion's tolerance: a floor plus this many standard errors of the difference of two
#: mismatch rates at their pooled rate (a sample of n requests at rate p varies by
#: sqrt(p (1 - p) / n): 0.07 at p 0.3 and n 48, so a fixed few per cent would fail a correct
#: server about one run in three).
TOLERANCE_FLOOR = 0.05
TOLERANCE_STANDARD_ERRORS = 3.0


def tolerance(sharded: Agreement, reference_rerun: Agreement) -> float:
    """The allowed excess of the sharded-vs-reference mismatch rate over the reference's own:
    :data:`TOLERANCE_FLOOR` + :data:`TOLERANCE_STANDARD_ERRORS` standard errors."""
    n = min(sharded.requests, reference_rerun.requests)
    if n == 0:
        return TOLERANCE_FLOOR
    pooled = (sharded.mismatched + reference_rerun.mismatched) / (sharded.requests + reference_rerun.requests)
    return TOLERANCE_FLOOR + TOLERANCE_STANDARD_ERRORS * math.sqrt(2 * pooled * (1 - pooled) / n)


def agrees_like_reference(sharded: Agreement, reference_rerun: Agreement) -> Optional[str]:
    """The concurrency criterion on the greedy outputs: no failed request in either
    comparison, and the sharded-vs-reference mismatch rate at most the reference's own
    run-to-run rate plus :func:`tolerance` (every answer's tokens: :meth:`BenchRun.incomplete`).
    None when it holds, else what broke it."""
    problems = []
    for name, result in (("sharded vs reference", sharded), ("reference vs its rerun", reference_rerun)):
        if result.failed:
            problems.append(f"{name}: {result.failed} failed of {result.requests}")
    allowed = tolerance(sharded, reference_rerun)
    if sharded.mismatch_rate > reference_rerun.mismatch_rate + allowed:
        problems.append(
            f"mismatch rate sharded vs reference {sharded.mismatch_rate:.3f} > reference vs its rerun "
            f"{reference_rerun.mismatch_rate:.3f} + tolerance {allowed:.3f}"
        )
    return "; ".join(problems) or None


__all__ = [
    "Agreement",
    "BenchRequest",
    "BenchRun",
    "BenchTarget",
    "DecodeTally",
    "TOLERANCE_FLOOR",
    "TOLERANCE_STANDARD_ERRORS",
    "Workload",
    "agreement",
    "agrees_like_reference",
    "bench_argv",
    "parse_output",
    "run_bench",
    "tolerance",
]
