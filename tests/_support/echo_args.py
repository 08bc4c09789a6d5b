"""Print argv[1:] and the environment variables named in $ECHO_ENV as one JSON line (rank 0 only)."""

import json
import os
import sys

if os.environ["RANK"] == "0":
    names = os.environ.get("ECHO_ENV", "").split(",")
    print("ECHO " + json.dumps({"argv": sys.argv[1:], "env": {n: os.environ.get(n) for n in names if n}}),
          flush=True)
