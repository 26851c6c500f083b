"""keysign.py NAME FILE...: sign each FILE with the agent's key NAME; writes FILE.sig."""

import hashlib
import sys

from agentlib import call

name = sys.argv[1]
for f in sys.argv[2:]:
    digest = hashlib.sha256(open(f, "rb").read()).hexdigest()
    sig = call({"op": "sign", "name": name, "digest": digest})["sig"]
    with open(f + ".sig", "w") as out:
        out.write(sig + "\n")
    print(f"signed {f}")
