"""keyadd.py KEYFILE PASSPHRASE_FILE [NAME]: decrypt a key file and hand the key to the agent.
keyadd.py -l: list the agent's keys (name and fingerprint)."""

import hashlib
import sys

from agentlib import call

if sys.argv[1] == "-l":
    for name, fp in sorted(call({"op": "list"})["keys"].items()):
        print(name, fp)
    sys.exit(0)
blob = bytes.fromhex(open(sys.argv[1]).read().strip())
phrase = open(sys.argv[2]).read().strip().encode()
stream = hashlib.sha256(b"keystream:" + phrase).digest()
key = bytes(a ^ b for a, b in zip(blob[:32], stream))
if hashlib.sha256(key).digest()[:8] != blob[32:]:
    sys.exit("wrong passphrase")
name = sys.argv[3] if len(sys.argv) > 3 else "release"
call({"op": "add", "name": name, "key": key.hex()})
print(f"added key {name}")
