"""Write what this rank sees of its environment to $CANARY_OUT/rank<RANK>.json: the sha256 of each
variable named in $CANARY_NAMES (never the value itself) and the plain values of those in $PLAIN_NAMES."""

import hashlib
import json
import os

out = os.environ["CANARY_OUT"]
hashed = {n: hashlib.sha256(os.environ[n].encode()).hexdigest() if n in os.environ else None
          for n in os.environ.get("CANARY_NAMES", "").split(",") if n}
plain = {n: os.environ.get(n) for n in os.environ.get("PLAIN_NAMES", "").split(",") if n}
tmp = os.path.join(out, f".rank{os.environ['RANK']}.tmp")
with open(tmp, "w") as f:
    json.dump({"hashed": hashed, "plain": plain}, f)
os.rename(tmp, os.path.join(out, f"rank{os.environ['RANK']}.json"))
print(f"rank {os.environ['RANK']} wrote its environment's hashes", flush=True)
