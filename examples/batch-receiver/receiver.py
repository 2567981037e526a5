"""A receiver of keygate's batched webhook deliveries (docs/batched-deliveries.md).

It checks the Standard Webhooks signature once per request, handles each
message of the batch in order, and answers each one's result: "ack" when
handled, "retry" (with a delay) when it should come again, "dead" when it
never can be handled. After a "retry" or "dead", keygate sends that key's
later messages of the batch again after it, so this receiver stops handling
a key at its first failure and answers "retry" for the rest of that key.

    KEYGATE_SECRET=whsec_... python3 receiver.py 9000
"""

import json
import os
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from standardwebhooks import Webhook

webhook = Webhook(os.environ["KEYGATE_SECRET"])
# Requests are served on threads: one line at a time.
printing = threading.Lock()


def handle(message):
    """Your work. Return "ack", "retry" or "dead"."""
    data = message.get("data")
    if isinstance(data, dict) and data.get("poison"):
        return "dead"
    with printing:
        print(f"{message['key']} #{message['stream_seq']}: {json.dumps(data)}", flush=True)
    return "ack"


class Receiver(BaseHTTPRequestHandler):
    def do_POST(self):
        body = self.rfile.read(int(self.headers["content-length"]))
        try:
            webhook.verify(body, dict(self.headers))
        except Exception:
            self.send_response(401)
            self.end_headers()
            return
        results, failed_keys = [], set()
        for message in json.loads(body):
            if message.get("key") in failed_keys:
                # Comes again after the key's failed message: not handled now.
                results.append({"id": message["id"], "status": "retry"})
                continue
            status = handle(message)
            if status != "ack":
                failed_keys.add(message.get("key"))
            results.append({"id": message["id"], "status": status, "delay_ms": 1000})
        answer = json.dumps({"results": results}).encode()
        self.send_response(200)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(answer)))
        self.end_headers()
        self.wfile.write(answer)

    def log_message(self, *args):
        pass


if __name__ == "__main__":
    ThreadingHTTPServer(("127.0.0.1", int(sys.argv[1])), Receiver).serve_forever()
