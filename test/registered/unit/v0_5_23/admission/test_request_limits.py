"""``v0_5_23.admission``: what a server under the flag refuses with HTTP 400 that upstream
admits (token ids outside the vocabulary, ``top_logprobs_num`` above it and
``logprob_start_len`` below -1 with ``return_logprob``: each killed or silently corrupted a
server of SGLang's own PD cluster; ``text`` with ``input_ids``: the text dropped silently).

The limits alone (fast), then the hooks on SGLang's real ``TokenizerManager``: one fresh
interpreter with the CPU server runtime builds a manager from the serving harness's own
prefill launch with the flag and one without, and runs the real ``_validate_one_request``
on real ``GenerateReqInput``s (flag off: upstream's answer, unchanged)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from sglang_cp_hicache.testing.server.runtime import RUNTIME_ENV
from sglang_cp_hicache.v0_5_23.admission.request_limits import UNDER_FLAG, RequestLimits

VOCAB = 512


@pytest.mark.parametrize(
    "ids, fields, refused",
    [
        ([5, 6, 7], {}, None),
        ([0, 511], {}, None),  # both ends of the vocabulary
        ([5, -1, 7], {}, "input_ids[1] = -1 is outside the vocabulary [0, 512)"),
        ([5, 512], {}, "input_ids[1] = 512"),
        ([5], {"text_and_ids": True}, "text and input_ids are both given"),
        ([5], {"return_logprob": True, "top_logprobs_num": VOCAB}, None),
        ([5], {"return_logprob": True, "top_logprobs_num": VOCAB + 1}, "top_logprobs_num 513 exceeds"),
        ([5], {"return_logprob": False, "top_logprobs_num": 10**6}, None),  # never read
        ([5], {"return_logprob": True, "logprob_start_len": -1}, None),
        ([5], {"return_logprob": True, "logprob_start_len": 0}, None),
        ([5], {"return_logprob": True, "logprob_start_len": -5}, "logprob_start_len -5 is negative"),
        ([5], {"return_logprob": False, "logprob_start_len": -5}, None),  # ignored upstream
        (None, {}, None),  # input_embeds: no ids to check
    ],
)
def test_limits_name_what_they_refuse(ids, fields, refused):
    problem = RequestLimits(VOCAB, UNDER_FLAG).problem(ids, **fields)
    if refused is None:
        assert problem is None
    else:
        assert problem is not None and refused in problem


# ----------------------------------------------------------- the real TokenizerManager
PROBE = r"""
import json, sys
from sglang_cp_hicache.testing.server.runtime import install_server_runtime
install_server_runtime()
import sglang.srt.plugins as plugins
plugins._plugins_loaded = False
plugins.load_plugins()
from sglang.srt.managers.io_struct import GenerateReqInput
from sglang.srt.managers.tokenizer_manager import TokenizerManager
from sglang.srt.runtime_context import publish, restore_context, snapshot_context
from sglang.srt.server_args import PortArgs, prepare_server_args
from sglang_cp_hicache.testing.server.launch import (
    Endpoint, PrefillSpec, decode_argv, line_launch, prefill_argv, server_argv,
)
from sglang_cp_hicache.testing.server.tiny_model import ensure_checkpoint

line, model, endpoint = line_launch(), ensure_checkpoint(), Endpoint(30000, 30001)
launches = {
    "on": prefill_argv(line, model, endpoint, PrefillSpec("p", sharded=True)),
    "off": prefill_argv(line, model, endpoint, PrefillSpec("p", sharded=False)),
    "decode": decode_argv(line, model, endpoint),
    "plain": server_argv(model, endpoint, 1, line.model_args(decode=True)),
}
results = {}
for role, argv in launches.items():
    # a second manager in one process would register the same Prometheus series
    argv = [a for a in argv[argv.index("sglang.launch_server") + 1:] if a != "--enable-metrics"]
    before = snapshot_context()
    record = prepare_server_args(argv)
    publish(record, role="tokenizer")
    manager = TokenizerManager(record, PortArgs.init_new(record), start_pd_bootstrap_service=False)
    for name, fields in json.loads(sys.argv[1]).items():
        obj = GenerateReqInput(sampling_params={"max_new_tokens": 4}, **fields)
        obj.normalize_batch_and_arguments()
        try:
            manager._validate_one_request(obj, list(fields.get("input_ids") or [5, 6, 7]))
            results[f"{role}:{name}"] = None
        except ValueError as error:
            results[f"{role}:{name}"] = str(error)
    restore_context(before)
print("RESULT " + json.dumps(results))
"""
CASES = {
    "served": {"input_ids": [5, 6, 7]},
    "negative id": {"input_ids": [5, -1, 7]},
    "id = vocab": {"input_ids": [5, VOCAB, 7]},
    "top_logprobs_num over the vocab": {"input_ids": [5, 6], "return_logprob": True, "top_logprobs_num": 10**6},
    "logprob_start_len -5": {"input_ids": [5, 6], "return_logprob": True, "logprob_start_len": -5},
    "logprob_start_len 0": {"input_ids": [5, 6], "return_logprob": True, "logprob_start_len": 0, "top_logprobs_num": 3},
    "text and ids": {"input_ids": [5, 6], "text": "hello"},
}
REFUSED = {
    "negative id": "input_ids[1] = -1 is outside the vocabulary [0, 512)",
    "id = vocab": "input_ids[1] = 512 is outside the vocabulary",
    "top_logprobs_num over the vocab": "top_logprobs_num 1000000 exceeds the vocabulary size 512",
    "logprob_start_len -5": "logprob_start_len -5 is negative",
    "text and ids": "text and input_ids are both given",
}


@pytest.fixture(scope="module")
def validated(tmp_path_factory):
    """Every case through the real managers' ``_validate_one_request``: error or None."""
    tmp = tmp_path_factory.mktemp("tokenizer-manager")
    env = {**os.environ, RUNTIME_ENV: "0", "TMPDIR": str(tmp)}  # its ZMQ sockets stay there
    out = subprocess.run(
        [sys.executable, "-c", PROBE, json.dumps(CASES)], env=env, capture_output=True, text=True, timeout=300
    )
    lines = [line for line in out.stdout.splitlines() if line.startswith("RESULT ")]
    assert out.returncode == 0 and lines, out.stderr[-3000:]
    return json.loads(lines[-1][len("RESULT "):])


@pytest.mark.parametrize("case", sorted(CASES))
def test_the_flag_refuses_on_the_real_tokenizer_manager(validated, case):
    refusal = validated[f"on:{case}"]
    if case in REFUSED:
        assert refusal is not None and REFUSED[case] in refusal
        assert "--enable-nsa-prefill-cp-shared-kv" in refusal
    else:
        assert refusal is None


@pytest.mark.parametrize("case", sorted(CASES))
def test_the_pd_decode_refuses_what_the_flags_prefill_refuses(validated, case):
    """The decode runs without the flag; sglang-router answers with its response."""
    refusal = validated[f"decode:{case}"]
    if case in REFUSED:
        assert refusal is not None and REFUSED[case] in refusal
        assert "PD decode" in refusal and "--enable-nsa-prefill-cp-shared-kv" in refusal
    else:
        assert refusal is None


@pytest.mark.parametrize("role", ["off", "plain"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_without_flag_or_decode_role_validation_is_upstreams(validated, role, case):
    """A prefill without the flag, a plain server (no PD): upstream admits every one."""
    assert validated[f"{role}:{case}"] is None
