import unittest

from accounts import NameTaken, Registry, UnknownUser


class RegistryTest(unittest.TestCase):
    def setUp(self):
        self.reg = Registry()
        self.reg.register("Weiß", "w@example.org")
        self.reg.register("Chloé", "c@example.org")

    def test_lookup_any_case(self):
        self.assertEqual(self.reg.lookup("CHLOÉ").email, "c@example.org")
        self.assertEqual(self.reg.lookup("WEISS").name, "Weiß")

    def test_lookalike_names_are_taken(self):
        with self.assertRaises(NameTaken):
            self.reg.register("weiss", "other@example.org")
        with self.assertRaises(NameTaken):
            self.reg.register("ＣＨＬＯＥ\u0301", "other@example.org")
        self.assertEqual(len(self.reg), 2)

    def test_reserved(self):
        with self.assertRaises(NameTaken):
            self.reg.register("Admin", "a@example.org")
        with self.assertRaises(NameTaken):
            self.reg.register("ＲＯＯＴ", "a@example.org")

    def test_rename(self):
        self.reg.rename("chloé", "Chloe_B")
        self.assertIn("CHLOE_B", self.reg)
        with self.assertRaises(UnknownUser):
            self.reg.lookup("Chloé")


if __name__ == "__main__":
    unittest.main()
