# A git checkout with a short history: the store's get() changed its contract
# (KeyError instead of None) and the server was not updated.
set -e
git init -q -b main
git config user.name "Dev"
git config user.email "dev@example.com"
commit() {  # $1: date, $2: message
    GIT_AUTHOR_DATE="$1" GIT_COMMITTER_DATE="$1" git commit -qm "$2"
}
mkdir -p /tmp/inventory-last
cp inventory/store.py tests/test_store.py /tmp/inventory-last/
python3 - <<'PY'
from pathlib import Path
p = Path("inventory/store.py")
s = p.read_text()
old = '    def get(self, sku: str) -> Item:\n        """The item with this SKU; KeyError if there is none."""\n        return self._items[sku]\n'
new = '    def get(self, sku: str) -> Item | None:\n        """The item with this SKU, or None."""\n        return self._items.get(sku)\n'
assert old in s
p.write_text(s.replace(old, new))
t = Path("tests/test_store.py")
s = t.read_text()
old = '    def test_unknown_sku_is_a_key_error(self):\n        with self.assertRaises(KeyError):\n            sample().get("Z-9")\n'
new = '    def test_unknown_sku(self):\n        self.assertIsNone(sample().get("Z-9"))\n'
assert old in s
t.write_text(s.replace(old, new))
PY
git add .gitignore README.md docs inventory data
commit 2024-06-10T09:00:00Z "Inventory API: health, items, one item"
git add scripts tests
commit 2024-06-11T13:20:00Z "Tests, and a script to poke the API from a shell"
cp /tmp/inventory-last/store.py inventory/store.py
cp /tmp/inventory-last/test_store.py tests/test_store.py
rm -rf /tmp/inventory-last
git add inventory/store.py tests/test_store.py
commit 2024-07-02T16:05:00Z "store: get() raises KeyError for an unknown SKU, like a mapping"
git status --short
