"""A Python client generated from openapi/openapi.json by
openapi-python-client, used as a user would against a live keygate
(scripts/check-clients)."""

import sys

from keygate_client import Client
from keygate_client.api.groups import get_group, put_group
from keygate_client.api.messages import publish_message
from keygate_client.api.streams import get_stream, put_stream
from keygate_client.models import GroupSpec, Problem, PublishAck, PublishRequest, StreamSpec

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

missing = get_stream.sync_detailed(client=client, stream="NOPE")
assert missing.status_code == 404, missing
problem = missing.parsed
assert isinstance(problem, Problem) and problem.status == 404 and problem.detail, problem
print("python client: published 4 payload kinds, created and read a group, parsed a 404 problem")
