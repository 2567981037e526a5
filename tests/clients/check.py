"""A Python client generated from openapi/openapi.json by
openapi-python-client, used as a user would against a live keygate
(scripts/check-clients)."""

import sys

from keygate_client import Client
from keygate_client.api.groups import get_group, put_group
from keygate_client.api.messages import publish_message
from keygate_client.api.pull import fetch_member, settle_member
from keygate_client.api.streams import get_stream, put_stream
from keygate_client.api.webhooks import put_webhook
from keygate_client.models import (
    AckAnswer,
    AckRequest,
    FetchAnswer,
    FetchRequest,
    GroupSpec,
    Problem,
    PublishAck,
    PublishRequest,
    StreamSpec,
    WebhookSpec,
    WebhookView,
)

base = sys.argv[1]
client = Client(base_url=base, raise_on_unexpected_status=True)

created = put_stream.sync_detailed(client=client, stream="PY", body=StreamSpec.from_dict({"subjects": ["py.*"], "partitions": 4}))
assert created.status_code == 201, created

for data in [1, "text", {"id": 7, "tags": ["a"]}, [1, 2]]:
    request = PublishRequest.from_dict({"key": "bob", "data": data, "headers": {"x-one": "1", "x-many": ["a", "b"]}})
    ack = publish_message.sync(client=client, stream="PY", body=request)
    assert isinstance(ack, PublishAck), ack
    assert ack.stream == "PY" and ack.key == "bob" and ack.seq >= 1, ack

spec = GroupSpec.from_dict({"kind": "static", "partitions": 4, "members": ["m1", "m2"]})
made = put_group.sync_detailed(client=client, stream="PY", group="g", body=spec)
assert made.status_code == 201, made
view = get_group.sync(client=client, stream="PY", group="g")
assert view is not None and view.partitions == 4 and sorted(view.members) == ["m1", "m2"], view

# Pull: fetch bob's four messages as whichever member owns his partition, ack them in one batch.
owner = next(a.member for a in view.assignment if ack.partition in a.partitions)
seen = []
for _ in range(20):
    answer = fetch_member.sync(client=client, stream="PY", group="g", member=owner,
                               body=FetchRequest.from_dict({"max_messages": 10, "wait_ms": 2000}))
    assert isinstance(answer, FetchAnswer), answer
    if not answer.messages:
        continue
    assert answer.pinned and ack.partition in answer.partitions, answer
    seen += [(m.stream_seq, m.attempt, m.key) for m in answer.messages]
    settled = settle_member.sync(client=client, stream="PY", group="g", member=owner,
                                 body=AckRequest.from_dict({"ack": [m.ack_id for m in answer.messages]}))
    assert isinstance(settled, AckAnswer) and settled.settled == len(answer.messages) and not settled.failed, settled
    if len(seen) == 4:
        break
assert [s[0] for s in seen] == sorted(s[0] for s in seen) and len(seen) == 4, seen
assert all(attempt == 1 and key == "bob" for _, attempt, key in seen), seen

# A batched webhook for m2: the batch options go in and come back.
hook = WebhookSpec.from_dict({"url": "http://127.0.0.1:9/hook", "batch": {"max_messages": 100, "max_wait_ms": 20}})
registered = put_webhook.sync_detailed(client=client, stream="PY", group="g", member="m2", body=hook)
assert registered.status_code == 201 and isinstance(registered.parsed, WebhookView), registered
assert registered.parsed.batch.max_messages == 100 and registered.parsed.batch.max_wait_ms == 20, registered.parsed

missing = get_stream.sync_detailed(client=client, stream="NOPE")
assert missing.status_code == 404, missing
problem = missing.parsed
assert isinstance(problem, Problem) and problem.status == 404 and problem.detail, problem
print("python client: published 4 payload kinds, created and read a group, fetched and acked as a pull member, registered a batched webhook, parsed a 404 problem")
