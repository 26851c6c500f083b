import unittest

from vertools.__main__ import main
from vertools.constraints import satisfies
from vertools.semver import compare, parse


class HiddenPrecedenceTest(unittest.TestCase):
    def test_numeric_identifiers_compare_as_numbers(self):
        self.assertEqual(compare("1.0.0-alpha.2", "1.0.0-alpha.10"), -1)
        self.assertEqual(compare("1.0.0-11", "1.0.0-9"), 1)

    def test_numeric_is_lower_than_alphanumeric(self):
        self.assertEqual(compare("1.0.0-1", "1.0.0-alpha"), -1)
        self.assertEqual(compare("1.0.0-alpha.9", "1.0.0-alpha.x"), -1)

    def test_ascii_order_for_text(self):
        self.assertEqual(compare("1.0.0-RC", "1.0.0-rc"), -1)
        self.assertEqual(compare("1.0.0-x-y", "1.0.0-x"), 1)

    def test_longer_list_is_higher(self):
        self.assertEqual(compare("1.0.0-alpha", "1.0.0-alpha.0"), -1)
        self.assertEqual(compare("1.0.0-a.b.c", "1.0.0-a.b"), 1)

    def test_release_above_its_prereleases_only(self):
        self.assertEqual(compare("1.0.0", "1.0.0-zzz.99"), 1)
        self.assertEqual(compare("1.0.1-alpha", "1.0.0"), 1)
        self.assertTrue(parse("2.0.0-rc.1") < parse("2.0.0"))
        self.assertTrue(parse("1.0.0-beta.11") <= parse("1.0.0-rc.1"))

    def test_equal_prereleases(self):
        self.assertEqual(compare("1.0.0-rc.1+a", "1.0.0-rc.1+b"), 0)

    def test_constraints_see_prereleases_below_the_release(self):
        self.assertTrue(satisfies("2.0.0-rc.1", "<2.0.0"))
        self.assertFalse(satisfies("1.2.0-rc.1", ">=1.2.0"))

    def test_latest_with_prereleases(self):
        import contextlib
        import io

        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            self.assertEqual(main(["latest", "--pre", "<2.0.0", "1.9.0", "2.0.0-rc.2", "2.0.0-rc.10", "2.0.0"]), 0)
        self.assertEqual(out.getvalue().strip(), "2.0.0-rc.10")


if __name__ == "__main__":
    unittest.main()
