"""Write a tiny pure-Python wheel without network or build tools (corpus helper)."""

import base64
import hashlib
import sys
import zipfile

name, version, out_dir = sys.argv[1], sys.argv[2], sys.argv[3]
dist = f"{name}-{version}.dist-info"
files = {
    f"{name}/__init__.py": f"VERSION = {version!r}\n\ndef greet(who):\n    return 'hello ' + who\n",
    f"{dist}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n",
    f"{dist}/WHEEL": "Wheel-Version: 1.0\nGenerator: crab-corpus\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
}
record = []
for path, text in files.items():
    digest = base64.urlsafe_b64encode(hashlib.sha256(text.encode()).digest()).rstrip(b"=").decode()
    record.append(f"{path},sha256={digest},{len(text.encode())}")
record.append(f"{dist}/RECORD,,")
files[f"{dist}/RECORD"] = "\n".join(record) + "\n"
with zipfile.ZipFile(f"{out_dir}/{name}-{version}-py3-none-any.whl", "w") as z:
    for path, text in files.items():
        z.writestr(path, text)
