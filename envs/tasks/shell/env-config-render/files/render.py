"""render.py TEMPLATE_DIR OUT_DIR: render every *.tmpl with the process environment.

${NAME} is replaced by $NAME; ${NAME:-default} falls back to the default when
NAME is unset or empty.  Nothing else is read: configure through the environment.
"""

import os
import re
import sys

src, out = sys.argv[1], sys.argv[2]
os.makedirs(out, exist_ok=True)
pat = re.compile(r"\$\{([A-Z_][A-Z0-9_]*)(?::-([^}]*))?\}")
for name in sorted(os.listdir(src)):
    if not name.endswith(".tmpl"):
        continue
    text = open(os.path.join(src, name)).read()
    text = pat.sub(lambda m: os.environ.get(m.group(1)) or (m.group(2) or ""), text)
    with open(os.path.join(out, name[: -len(".tmpl")]), "w") as f:
        f.write(text)
    print(f"rendered {name[:-len('.tmpl')]}")
