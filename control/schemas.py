"""Response schemas that several API areas answer with: reviews, sessions, script results."""

from __future__ import annotations

from control.http import Field, Schema

TEXT = Field("string", True)
OPT_TEXT = Field("string", True, nullable=True)
STRINGS = Field("array", True, items="string")
OBJECT = Field("object", True)

PERSON = Schema("ReviewPerson", {"id": TEXT, "email": TEXT, "name": TEXT, "chat_id": TEXT})
REVIEW_GROUP = Schema("ReviewGroup", {
    "id": TEXT, "group": TEXT, "forced_review": Field("boolean", True), "review_date": TEXT, "status": TEXT,
    "reviewed_by": Field("object", True, schema=PERSON, nullable=True),
})
_REVIEW_FIELDS = {
    "id": TEXT, "type": Field("string", True, enum=("onetime", "jit")), "status": TEXT, "created_at": TEXT,
    "revoke_at": TEXT, "access_duration": Field("integer", True, minimum=0, description="nanoseconds (jit)"),
    "access_request_rule_name": OPT_TEXT, "min_approvals": Field("integer", True, minimum=0),
    "force_approval_groups": STRINGS, "review_groups_data": Field("array", True, items=REVIEW_GROUP),
    "time_window": Field("object", True, nullable=True),
}
REVIEW_OUT = Schema("Review", _REVIEW_FIELDS)
REVIEW_FULL_OUT = Schema("ReviewDetail", {
    **_REVIEW_FIELDS, "org_id": TEXT, "session": TEXT, "session_id": TEXT, "updated_at": TEXT,
    "review_connection": Field("object", True, schema=Schema("ReviewConnection", {"id": TEXT, "name": TEXT})),
    "review_owner": Field("object", True, schema=PERSON), "input": Field("string", description="the script (one-time)"),
    "reason": Field("string", description="why the requester asks, in their words"),
    "ai_analysis": Field("object", description="the AI verdict on the script"),
})
JIT_PENDING_OUT = Schema("ReviewPending", {
    "session_id": TEXT, "review_id": TEXT, "has_review": Field("boolean", True), "status": Field("string"),
    "connection_name": Field("string"), "connection_type": Field("string"), "connection_subtype": Field("string"),
    "review": Field("object", True, schema=REVIEW_OUT),
})
SESSION_OUT = Schema("Session", {
    "id": TEXT, "org_id": TEXT, "user": TEXT, "user_id": TEXT, "user_name": TEXT, "connection": TEXT,
    "role_name": TEXT, "resource_name": TEXT, "connection_subtype": TEXT, "connection_tags": OBJECT, "type": TEXT,
    "verb": TEXT, "status": TEXT, "script": OBJECT, "script_size": Field("integer", True, minimum=0),
    "start_date": TEXT, "end_date": OPT_TEXT, "event_size": Field("integer", True, minimum=0),
    "exit_code": Field("integer", True, nullable=True),
    "review": Field("object", True, schema=REVIEW_OUT, nullable=True),
    "session_batch_id": OPT_TEXT, "labels": OBJECT, "metadata": OBJECT, "metrics": OBJECT,
    "integrations_metadata": OBJECT, "ai_analysis": Field("object"),
    "event_stream": Field("array", description="[offset_ms, kind, base64] per event, or the output as one string"),
})
VERIFICATION_OUT = Schema("Verification", {
    "subject": TEXT, "verified": Field("boolean", True), "sealed": Field("boolean", True),
    "links": Field("integer", True, minimum=0), "entries": Field("integer", True, minimum=0), "chain_head": TEXT,
    "problems": STRINGS,
})
SCRIPT_RESULT_OUT = Schema("ScriptResult", {
    "session_id": TEXT, "has_review": Field("boolean", True), "output": TEXT, "output_status": TEXT,
    "exit_code": Field("integer", True, nullable=True), "execution_time": Field("integer", True, minimum=0),
    "truncated": Field("boolean"), "review_id": Field("string"), "review": Field("object", schema=REVIEW_OUT),
    "ai_analysis": Field("object", description="the AI verdict on the script"),
})
