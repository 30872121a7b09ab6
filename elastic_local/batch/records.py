"""Output records in OpenAI's batch output format, one JSON line per request:

    {"id", "custom_id", "response": {"status_code": 200, "request_id", "body": chat.completion |
     text_completion}, "error": null}                  a request that ran
    {"id", "custom_id", "response": null, "error": {"code", "message", "line"}}      one that could not

The body is what the endpoint would have answered: the message's `content` is the answer and
`reasoning_content` the thinking (vLLM's field; a completion choice carries it beside `text`), `usage`
counts thinking in `completion_tokens_details.reasoning_tokens`. `elastic` adds what OpenAI has no field
for: the budgets that ran each phase and how thinking ended. Ids are stable across runs (resume).
"""

from __future__ import annotations

import time

from ..engine.events import Result
from .requests import CHAT, Job, LineError

# the engine's finish reasons in OpenAI's words ("cancelled" rows are never written: a rerun redoes them)
FINISH = {"eos": "stop", "stop": "stop", "answer_limit": "length", "context_limit": "length"}


def response_record(job: Job, r: Result, model: str) -> dict:
    rid = job.key.removeprefix("batch_req_")
    usage = {"prompt_tokens": r.prompt_len, "completion_tokens": len(r.think_ids) + len(r.answer_ids),
             "total_tokens": len(r.ids), "completion_tokens_details": {"reasoning_tokens": len(r.think_ids)}}
    reasoning = r.think_text if r.think_ids else None
    finish = FINISH[r.finish_reason]
    if job.url == CHAT:
        message = {"role": "assistant", "content": r.answer_text, "reasoning_content": reasoning}
        choice = {"index": 0, "message": message, "finish_reason": finish, "logprobs": None}
        kind, prefix = "chat.completion", "chatcmpl-"
    else:
        choice = {"index": 0, "text": r.answer_text, "reasoning_content": reasoning, "finish_reason": finish,
                  "logprobs": None}
        kind, prefix = "text_completion", "cmpl-"
    body = {"id": prefix + rid, "object": kind, "created": int(time.time()), "model": job.model or model,
            "choices": [choice], "usage": usage,
            "elastic": {"think_budgets": r.stats.think_budgets, "answer_budgets": r.stats.answer_budgets,
                        "think_end": r.think_end, "finish_phase": r.finish_phase}}
    return {"id": job.key, "custom_id": job.custom_id,
            "response": {"status_code": 200, "request_id": "req_" + rid, "body": body}, "error": None}


def error_record(e: LineError) -> dict:
    return {"id": e.key, "custom_id": e.custom_id, "response": None,
            "error": {"code": e.code, "message": e.message, "line": e.line}}
