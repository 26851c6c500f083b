import unittest

from accounts import InvalidName, canonical, validate


class CanonicalTest(unittest.TestCase):
    def test_case(self):
        self.assertEqual(canonical("  Ada.Lovelace "), "ada.lovelace")

    def test_composed_and_decomposed(self):
        self.assertEqual(canonical("Ren\u00e9e"), canonical("Rene\u0301e"))

    def test_sharp_s(self):
        self.assertEqual(canonical("Straße"), canonical("STRASSE"), "case folding turns ß into ss")

    def test_full_width(self):
        self.assertEqual(canonical("ｊｏｅ＿９"), canonical("joe_9"), "full-width forms are the same name")

    def test_ligature(self):
        self.assertEqual(canonical("ﬁnn"), "finn")


class ValidateTest(unittest.TestCase):
    def test_display_kept(self):
        self.assertEqual(validate("  Zoë "), "Zoë")

    def test_bad(self):
        for bad in ("ab", "x" * 30, "bad name", "-dash", "emoji🙂"):
            with self.assertRaises(InvalidName, msg=bad):
                validate(bad)


if __name__ == "__main__":
    unittest.main()
