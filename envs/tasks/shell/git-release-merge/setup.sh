# A small repository on main, and two patches to land through branches.
set -e
export GIT_AUTHOR_NAME="Ada Dev" GIT_AUTHOR_EMAIL="ada@shop.test"
export GIT_COMMITTER_NAME="Ada Dev" GIT_COMMITTER_EMAIL="ada@shop.test"
minor=$(python3 -c 'import random; print(random.Random(1221).randrange(3, 40))')
mkdir -p shop patches && cd shop
git init -q -b main
cat > pricing.py <<'PY'
"""Order pricing."""


def line_total(price_cents, qty):
    return price_cents * qty


def total(items):
    """items: (price_cents, qty) pairs; returns the order total in cents."""
    return sum(line_total(p, q) for p, q in items)


def with_tax(cents, rate):
    return int(cents * (1 + rate))
PY
cat > test_pricing.py <<'PY'
import unittest

from pricing import total, with_tax


class PricingTest(unittest.TestCase):
    def test_total(self):
        self.assertEqual(total([(250, 2), (99, 3)]), 797)

    def test_tax(self):
        self.assertEqual(with_tax(1000, 0.2), 1200)


if __name__ == "__main__":
    unittest.main()
PY
echo "1.$((minor - 1)).2" > VERSION
git add -A && git commit -q -m "Pricing module with tests"
echo "1.$minor.0" > VERSION
printf '__pycache__/\n' > .gitignore
git add -A && git commit -q -m "Start $(cat VERSION) development"
# The discount patch: a new module and its tests.
cat > discounts.py <<'PY'
"""Discount codes: percentage off an order total."""

CODES = {"SPRING10": 10, "VIP25": 25}


def apply_discount(cents, code):
    pct = CODES.get(code.upper(), 0)
    return cents - cents * pct // 100
PY
cat > test_discounts.py <<'PY'
import unittest

from discounts import apply_discount


class DiscountTest(unittest.TestCase):
    def test_codes(self):
        self.assertEqual(apply_discount(1000, "spring10"), 900)
        self.assertEqual(apply_discount(1000, "nope"), 1000)


if __name__ == "__main__":
    unittest.main()
PY
git add -N discounts.py test_discounts.py
git diff > ../patches/discounts.patch
git rm -q --cached discounts.py test_discounts.py && rm discounts.py test_discounts.py
# The rounding fix: with_tax rounds half up instead of truncating.
sed -i 's/    return int(cents \* (1 + rate))/    return int(cents * (1 + rate) + 0.5)/' pricing.py
python3 - <<'PY'
s = open("test_pricing.py").read()
s = s.replace("        self.assertEqual(with_tax(1000, 0.2), 1200)\n",
              "        self.assertEqual(with_tax(1000, 0.2), 1200)\n        self.assertEqual(with_tax(999, 0.07), 1069)\n")
open("test_pricing.py", "w").write(s)
PY
git diff > ../patches/rounding.patch
git checkout -q -- .
git status --short
