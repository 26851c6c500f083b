import unittest

from svcconf.coerce import coerce


class CoerceTest(unittest.TestCase):
    def test_types_follow_the_default(self):
        self.assertEqual(coerce("port", " 9000 ", 8080), 9000)
        self.assertIs(coerce("debug", "Yes", False), True)
        self.assertIs(coerce("debug", "off", True), False)
        self.assertEqual(coerce("log_level", "debug", "info"), "debug")

    def test_errors_name_the_setting(self):
        with self.assertRaisesRegex(ValueError, "port"):
            coerce("port", "eighty", 8080)
        with self.assertRaisesRegex(ValueError, "debug"):
            coerce("debug", "maybe", False)


if __name__ == "__main__":
    unittest.main()
