"""Write what this rank sees of its environment to $CANARY_OUT/rank<RANK>.json: the sha256 of each
variable named in $CANARY_NAMES (never the value itself) and the plain values of those in
$PLAIN_NAMES; then, if $CANARY_WAIT names a file, wait (at most 120 s) until it exists."""

import hashlib
import json
import os
import time

out = os.environ["CANARY_OUT"]
hashed = {n: hashlib.sha256(os.environ[n].encode()).hexdigest() if n in os.environ else None
          for n in os.environ.get("CANARY_NAMES", "").split(",") if n}
plain = {n: os.environ.get(n) for n in os.environ.get("PLAIN_NAMES", "").split(",") if n}
name = f"rank{os.environ['RANK']}-attempt{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"
tmp = os.path.join(out, f".{name}.tmp")
with open(tmp, "w") as f:
    json.dump({"hashed": hashed, "plain": plain, "cluster": os.environ.get("CLUSTERRUN_JOB")}, f)
os.rename(tmp, os.path.join(out, f"rank{os.environ['RANK']}.{os.environ['CLUSTERRUN_JOB']}.json"))
print(f"rank {os.environ['RANK']} wrote its environment's hashes", flush=True)
wait = os.environ.get("CANARY_WAIT")
deadline = time.monotonic() + 120
while wait and not os.path.exists(wait) and time.monotonic() < deadline:
    time.sleep(0.1)
