import unittest

from vertools.constraints import satisfies


class ConstraintTest(unittest.TestCase):
    def test_ranges(self):
        self.assertTrue(satisfies("1.4.2", ">=1.2.0, <2.0.0"))
        self.assertFalse(satisfies("2.0.0", ">=1.2.0, <2.0.0"))

    def test_caret(self):
        self.assertTrue(satisfies("1.9.9", "^1.4.0"))
        self.assertFalse(satisfies("2.0.0", "^1.4.0"))
        self.assertFalse(satisfies("0.3.0", "^0.2.1"))

    def test_exact(self):
        self.assertTrue(satisfies("1.0.0+local", "1.0.0"))


if __name__ == "__main__":
    unittest.main()
