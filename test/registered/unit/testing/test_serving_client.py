"""The serving harness's client (``testing/server/client.py``) never counts an answer without
tokens as a success: SGLang's streamed abort (HTTP 200, ``output_ids: []``, the abort in
``meta_info.finish_reason``; the body below is the one a sharded prefill's router sent when
the decode's PD wait ran out), the same abort in a non-streamed body, an answer with no token
and a stream cut before its finish reason all raise ``RequestFailed``. Runs in both venvs."""

from __future__ import annotations

import http.server
import json
from typing import Dict, List

import pytest

from sglang_cp_hicache.testing.server.client import RequestFailed, check_finished, generate

#: The final chunk a streamed request got through sglang-router after the decode timed out
#: waiting for the prefill's KV (``KVPoll.WaitingForInput``), trimmed of timestamps.
ABORT_CHUNK = {
    "text": "",
    "output_ids": [],
    "meta_info": {
        "id": "a7c7556583e3497389a82ed40211e81f",
        "finish_reason": {
            "type": "abort",
            "message": "Decode transfer failed for request rank=0 ... Request 5671091124522339730 "
            "timed out after 6.0s in KVPoll.WaitingForInput",
            "status_code": 500,
            "err_type": None,
        },
        "prompt_tokens": 296,
        "completion_tokens": 0,
        "cached_tokens": 0,
        "cached_tokens_details": None,
    },
}
LENGTH = {"type": "length", "length": 2}
GOOD = {"output_ids": [7, 8], "meta_info": {"finish_reason": LENGTH, "output_token_logprobs": [[-1.0, 7, None], [-2.0, 8, None]]}}
#: what the fake answers, by the request's first input id: the chunks of a stream, or a body
ANSWERS: Dict[int, List[dict]] = {
    1: [ABORT_CHUNK],
    2: [{"output_ids": [], "meta_info": {"finish_reason": LENGTH}}],
    3: [{"output_ids": [7], "meta_info": {"finish_reason": None}}],  # cut before it finished
    4: [{"output_ids": [7], "meta_info": {"finish_reason": None}}, GOOD],
}


class _Fake(http.server.BaseHTTPRequestHandler):
    def do_POST(self):  # noqa: N802 (http.server's name)
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        chunks = ANSWERS[body["input_ids"][0]]
        self.send_response(200)
        self.end_headers()
        if not body["stream"]:
            self.wfile.write(json.dumps(chunks[-1]).encode())
            return
        for chunk in chunks:
            self.wfile.write(f"data: {json.dumps(chunk)}\n\n".encode())
        if chunks[-1]["meta_info"]["finish_reason"] is not None:
            self.wfile.write(b"data: [DONE]\n\n")

    def log_message(self, *args):
        pass


@pytest.mark.parametrize("stream", [True, False])
def test_an_abort_under_http_200_is_a_failure_with_its_status(fake_http, stream):
    with pytest.raises(RequestFailed) as failed:
        generate(fake_http(_Fake), [1, 5], 8, stream=stream)
    assert failed.value.status == 500
    assert "KVPoll.WaitingForInput" in str(failed.value) and '"output_ids": []' in failed.value.body


@pytest.mark.parametrize("stream", [True, False])
def test_an_answer_without_tokens_is_a_failure(fake_http, stream):
    with pytest.raises(RequestFailed, match="empty success"):
        generate(fake_http(_Fake), [2], 8, stream=stream)


def test_a_stream_cut_before_its_finish_reason_is_a_failure(fake_http):
    with pytest.raises(RequestFailed, match="without a finish reason"):
        generate(fake_http(_Fake), [3], 8)


def test_a_finished_stream_is_a_success(fake_http):
    completion = generate(fake_http(_Fake), [4], 2)
    assert completion.output_ids == (7, 8) and completion.logprobs == (-1.0, -2.0)


def test_zero_tokens_asked_may_answer_none():
    check_finished({"finish_reason": LENGTH}, 0, 0)  # max_new_tokens 0: a prefill-only request
    with pytest.raises(RequestFailed):
        check_finished({"finish_reason": LENGTH}, 0, 1)
