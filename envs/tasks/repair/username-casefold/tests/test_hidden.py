import unittest

from accounts import InvalidName, NameTaken, Registry, canonical, validate


class HiddenUnicodeTest(unittest.TestCase):
    def test_same_names(self):
        groups = [
            ["Straße", "STRASSE", "strasse", "StraSSe"],
            ["ΟΔΟΣ", "οδος", "οδοσ", "Οδος"],
            ["ｍａｘｉｍｕｍ", "Maximum", "MAXIMUM"],
            ["oﬀice", "OFFICE", "office"],
            ["René", "RENE\u0301", "ｒｅｎé"],
            ["Ǆemal", "DŽEMAL", "džemal"],
            ["user①", "USER1"],
        ]
        for group in groups:
            keys = {canonical(n) for n in group}
            self.assertEqual(len(keys), 1, f"{group} -> {keys}")

    def test_different_names(self):
        for a, b in [("René", "Rene"), ("Masse", "Maße_"), ("anna", "anna."), ("ΟΔΟΣ", "odos")]:
            self.assertNotEqual(canonical(a), canonical(b), (a, b))

    def test_key_is_composed(self):
        self.assertEqual(canonical("RENE\u0301E"), "ren\u00e9e")
        self.assertEqual(canonical("Zoe\u0308"), "zo\u00eb")

    def test_register_accented(self):
        reg = Registry()
        reg.register("Renée", "r@example.org")
        reg.register("Ｚｏë", "z@example.org")
        self.assertEqual(reg.lookup("RENE\u0301E").name, "Renée")
        self.assertEqual(reg.lookup("ZOË").email, "z@example.org")
        with self.assertRaises(NameTaken):
            reg.register("zoe\u0308", "x@example.org")

    def test_sharp_s_rename(self):
        reg = Registry()
        reg.register("Gauss", "g@example.org")
        reg.register("Klaus", "k@example.org")
        with self.assertRaises(NameTaken):
            reg.rename("klaus", "GAUß")
        reg.rename("gauss", "Gauß")
        self.assertEqual(reg.lookup("GAUSS").name, "Gauß")

    def test_still_rejects(self):
        for bad in ("a b c", "ab", "x\u200by", "__x"):
            with self.assertRaises(InvalidName, msg=bad):
                validate(bad)


if __name__ == "__main__":
    unittest.main()
