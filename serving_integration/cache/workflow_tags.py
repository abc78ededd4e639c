"""The workflow metadata a request carries to the PBKV plugin: one wire format, written by the
benchmark client (and any orchestrator) and read inside the SGLang scheduler.

Three carriers, all of which leave the radix tree's prefix sharing intact (docs/serving.md;
`extra_key` / `cache_salt` would namespace the tree and must never carry a workflow id):

    sampling_params.custom_params = {"pbkv": {"workflow_id": "w1", "agent": "coder", "step": 3,
                                               "workflow_end": false, "task": "..."}}
    kv_hints = {"protocol_version": "1", "message_id": "<rid>",
                "actions": [{"action_id": "pbkv", "action_type": "pbkv.workflow",
                             "action_version": "1", "payload": {... same fields ...}}]}

    rid = "pbkv1." + urlsafe base64 (unpadded) of the payload's JSON + "." + anything unique

`custom_params` works from any client; `kv_hints` is SGLang's orchestrator envelope (it reaches
`Req.kv_hints`, which mem_cache ignores in 0.5.23); the request id is for requests that pass
through sglang-router 0.3.2, which rebuilds a /generate body from its own typed request and drops
`custom_params` and `kv_hints` but keeps `rid` (docs/cluster.md). The kv_hints action wins over
custom_params, which wins over the request id.
`workflow_end: true` retires the workflow's cache when the request finishes. A real orchestrator
knows a workflow is over only after its last call returned, so the benchmark client sends the end
as its own tiny request after the last call (`end_signal: true`, with `workflow_end: true`): the
plugin retires the workflow and records nothing else of that request (it is no agent call).
`task` (the workflow's task text) is read once, for the predictor's text signal.
`return_hidden: true` asks a plugin that captures hidden states (`hidden_state`) to send the
request's hidden state at its last prefill token back, as `meta_info.pbkv_hidden` = [vector]
(the benchmark client's --save-trace stores it in the collected trace).
"""

from __future__ import annotations

import base64
import binascii
import json
from dataclasses import dataclass
from typing import Any

CUSTOM_PARAMS_KEY = "pbkv"
HINT_ACTION_TYPE = "pbkv.workflow"
HINT_ACTION_VERSION = "1"
RID_PREFIX = "pbkv1."
HIDDEN_RESPONSE_KEY = "pbkv_hidden"  # meta_info key of a hidden state sent back (`return_hidden`)
MAX_ID_CHARS = 256  # longer ids are rejected as bad metadata rather than stored
MAX_TASK_CHARS = 4096


@dataclass(frozen=True)
class WorkflowTag:
    workflow_id: str
    agent: str
    step: int | None = None
    workflow_end: bool = False
    task: str = ""
    end_signal: bool = False  # the request only signals the workflow's end (no agent call)
    return_hidden: bool = False  # send the captured hidden state back (meta_info.pbkv_hidden)

    def as_payload(self) -> dict:
        payload: dict[str, Any] = {"workflow_id": self.workflow_id, "agent": self.agent,
                                   "workflow_end": self.workflow_end}
        if self.end_signal:
            payload["end_signal"] = True
        if self.return_hidden:
            payload["return_hidden"] = True
        if self.step is not None:
            payload["step"] = self.step
        if self.task:
            payload["task"] = self.task
        return payload


class BadTag(ValueError):
    """The request carries PBKV metadata, but it is malformed."""


# -------------------------------------------------------------------- client side


def custom_params_for(tag: WorkflowTag) -> dict:
    """The `sampling_params.custom_params` entry of a /generate request."""
    return {CUSTOM_PARAMS_KEY: tag.as_payload()}


def kv_hints_for(tag: WorkflowTag, message_id: str) -> dict:
    """A `kv_hints` envelope of a /generate request (for trusted orchestrators)."""
    return {"protocol_version": "1", "message_id": message_id,
            "actions": [{"action_id": "pbkv", "action_type": HINT_ACTION_TYPE,
                         "action_version": HINT_ACTION_VERSION, "payload": tag.as_payload()}]}


def rid_for(tag: WorkflowTag, unique: str) -> str:
    """A request id that carries the tag (through sglang-router); `unique` keeps ids apart."""
    data = base64.urlsafe_b64encode(json.dumps(tag.as_payload(), separators=(",", ":")).encode()).decode()
    return f"{RID_PREFIX}{data.rstrip('=')}.{unique}"


# -------------------------------------------------------------------- server side


def tag_from_payload(payload: Any) -> WorkflowTag:
    if not isinstance(payload, dict):
        raise BadTag(f"workflow metadata must be an object, got {type(payload).__name__}")
    workflow_id, agent = payload.get("workflow_id"), payload.get("agent")
    for name, value in (("workflow_id", workflow_id), ("agent", agent)):
        if not isinstance(value, str) or not value or len(value) > MAX_ID_CHARS:
            raise BadTag(f"'{name}' must be a non-empty string of at most {MAX_ID_CHARS} characters")
    step = payload.get("step")
    if step is not None and (isinstance(step, bool) or not isinstance(step, int) or step < 0):
        raise BadTag("'step' must be a non-negative integer")
    end = payload.get("workflow_end", False)
    if not isinstance(end, bool):
        raise BadTag("'workflow_end' must be a boolean")
    task = payload.get("task") or ""
    if not isinstance(task, str):
        raise BadTag("'task' must be a string")
    signal = payload.get("end_signal", False)
    if not isinstance(signal, bool):
        raise BadTag("'end_signal' must be a boolean")
    if signal and not end:
        raise BadTag("an end signal ('end_signal': true) must carry 'workflow_end': true")
    return_hidden = payload.get("return_hidden", False)
    if not isinstance(return_hidden, bool):
        raise BadTag("'return_hidden' must be a boolean")
    return WorkflowTag(workflow_id, agent, step, end, task[:MAX_TASK_CHARS], signal, return_hidden)


def end_signal_tag(workflow_id: str, agent: str) -> WorkflowTag:
    """The tag of the request a client sends after a workflow's last call returned."""
    return WorkflowTag(workflow_id, agent, workflow_end=True, end_signal=True)


def _hint_payload(kv_hints: Any) -> Any:
    """The payload of the PBKV action in a kv_hints envelope (a KvHintsEnvelope or a dict)."""
    actions = kv_hints.get("actions") if isinstance(kv_hints, dict) else getattr(kv_hints, "actions", None)
    for action in actions or ():
        kind = action.get("action_type") if isinstance(action, dict) else getattr(action, "action_type", None)
        if kind == HINT_ACTION_TYPE:
            return action.get("payload") if isinstance(action, dict) else getattr(action, "payload", None)
    return None


def _rid_payload(rid: Any) -> Any:
    """The payload a request id carries (rid_for), None for any other id."""
    if not isinstance(rid, str) or not rid.startswith(RID_PREFIX):
        return None
    data = rid[len(RID_PREFIX):].split(".", 1)[0]
    try:
        return json.loads(base64.urlsafe_b64decode(data + "=" * (-len(data) % 4)))
    except (ValueError, binascii.Error) as e:
        raise BadTag(f"the request id's workflow tag does not decode ({type(e).__name__})") from None


def tag_of_request(req: Any) -> WorkflowTag | None:
    """The request's workflow tag; None when it carries none; BadTag when it is malformed.

    `req` is SGLang's scheduler-side `Req` (reads `kv_hints`, `sampling_params.custom_params`, `rid`)."""
    payload = _hint_payload(getattr(req, "kv_hints", None))
    if payload is None:
        params = getattr(getattr(req, "sampling_params", None), "custom_params", None)
        if isinstance(params, dict):
            payload = params.get(CUSTOM_PARAMS_KEY)
    if payload is None:
        payload = _rid_payload(getattr(req, "rid", None))
    if payload is None:
        return None
    return tag_from_payload(payload)
